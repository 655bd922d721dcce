"""Argument types shared by the ``tidal`` subcommands (argparse ``type=`` callables).

Each refuses, with a one-line reason, what parses but makes no sense: a number that is not
finite, an index torch cannot hold, a size no machine has. argparse turns the reason into
``tidal <command>: error: argument --flag: <reason>`` and exit code 2, before any work.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

__all__ = [
    "MAX_GIB",
    "MAX_MIB",
    "MAX_SEED",
    "bounded_int",
    "device_arg",
    "finite_float",
    "gib_arg",
    "mib_arg",
    "nonneg_int",
    "output_problem",
    "positive_float",
    "positive_int",
    "rate_arg",
    "seed_arg",
]

# torch keeps a device index in 8 signed bits: "cuda:128" would silently become cuda:-128.
MAX_DEVICE_INDEX = 127
# Memory sizes above a pebibyte are no machine's: refused rather than planned or allocated.
MAX_GIB = 1 << 20
MAX_MIB = 1 << 30
# The trainer seeds generators with seed and seed + 1, which torch holds in 64 unsigned bits.
MAX_SEED = (1 << 63) - 1


def device_arg(text: str) -> str:
    # Validate the spelling only; whether the device exists is checked when it is opened,
    # with a message that says what is visible.
    if text == "cpu" or text == "cuda":
        return text
    if text.startswith("cuda:") and text[5:].isdigit():
        if int(text[5:]) > MAX_DEVICE_INDEX:
            raise argparse.ArgumentTypeError(
                f"{text}: torch numbers devices 0-{MAX_DEVICE_INDEX}; give the index of a visible GPU"
            )
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def bounded_int(lowest: int, highest: int | None = None, *, why: str = ""):
    """An ``int`` type accepting ``lowest <= n <= highest``; ``why`` says what the upper bound is."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < lowest:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {n}")
        if highest is not None and n > highest:
            raise argparse.ArgumentTypeError(
                f"expected an integer <= {highest:,}{f' ({why})' if why else ''}, got {n:,}"
            )
        return n

    return parse


nonneg_int = bounded_int(0)
positive_int = bounded_int(1)
seed_arg = bounded_int(0, MAX_SEED, why="a 63-bit seed")
mib_arg = bounded_int(0, MAX_MIB, why="1 PiB: more than any machine has")


def finite_float(
    lowest: float, *, inclusive: bool = True, highest: float | None = None, why: str = "", least: float | None = None
):
    """A ``float`` type accepting finite numbers ``>= lowest`` (``> lowest`` unless
    ``inclusive``) and ``<= highest``; with ``least``, also refusing positive numbers below it
    (a size or rate too small to mean anything: ``why`` of the bounds in the message)."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
        if x < lowest or (x == lowest and not inclusive):
            raise argparse.ArgumentTypeError(f"expected a number {'>=' if inclusive else '>'} {lowest:g}, got {text}")
        if highest is not None and x > highest:
            raise argparse.ArgumentTypeError(
                f"expected a number <= {highest:,.0f}{f' ({why})' if why else ''}, got {text}"
            )
        if least is not None and x < least:
            raise argparse.ArgumentTypeError(f"expected a number >= {least:g}{f' ({why})' if why else ''}, got {text}")
        return x

    return parse


positive_float = finite_float(0.0, inclusive=False)
gib_arg = finite_float(0.0, inclusive=False, highest=MAX_GIB, least=1e-3, why="1 MiB to 1 PiB: what a machine can have")
rate_arg = finite_float(0.0, inclusive=False, highest=1e6, least=1e-3, why="1 MB/s to 1 PB/s: what a link can do")


def _cannot_create_in(folder: str) -> str | None:
    """Why nothing can be created in the existing ``folder``, or None: a probe folder is made
    and removed at once (permission bits alone say yes to root even where the file system,
    /proc for one, refuses every new name)."""
    try:
        probe = tempfile.mkdtemp(prefix=".tidal-probe-", dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    os.rmdir(probe)
    return None


def output_problem(path: str, *, folder: bool = False) -> str | None:
    """Why the output ``path`` (a file, or with ``folder`` a folder to be created if needed)
    cannot be written, or None if it can: checked before a run starts, so a run never ends by
    losing its outputs to a typo. Nothing is left behind by the check."""
    if not path:
        return "an empty path; give a folder" if folder else "an empty path; give a file"
    full = os.path.abspath(path)
    if folder:
        if os.path.exists(full) and not os.path.isdir(full):
            return f"{path} exists and is not a folder; choose another --out"
        parent = os.path.dirname(full)
        if not os.path.exists(parent):
            # The folder is made, not its parents: a typo never builds a tree at the root.
            return (
                f"the folder {os.path.dirname(path) or parent} does not exist; create it first or choose another --out"
            )
        anchor = full
    else:
        if os.path.isdir(full):
            return f"{path} is a folder; give the path of a file to write"
        if os.path.exists(full):
            try:  # opened for update and closed: nothing is truncated or written
                with open(full, "r+b"):
                    pass
            except OSError as e:
                return f"{path} exists and cannot be written ({e.strerror or e}); choose another path"
        anchor = os.path.dirname(full)
        if not os.path.isdir(anchor):
            return (
                f"the folder {os.path.dirname(path) or anchor} does not exist; create it first or choose another path"
            )
    while not os.path.exists(anchor):  # a folder still to be made: its nearest existing parent
        anchor = os.path.dirname(anchor)
    if not os.path.isdir(anchor):
        return f"{anchor} is a file, so {path} cannot be created under it; choose another path"
    why = _cannot_create_in(anchor)
    if why is not None:
        return f"cannot create anything in {anchor} ({why}); choose another path"
    return None
