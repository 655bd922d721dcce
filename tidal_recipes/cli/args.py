"""Argument types shared by the ``tidal`` subcommands (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse
import os

__all__ = ["device_arg", "nonneg_int", "output_problem", "positive_int", "positive_float"]


def device_arg(text: str) -> str:
    # Validate the spelling only; whether the device exists is checked when it is opened,
    # with a message that says what is visible.
    if text == "cpu" or text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def _int(text: str, lowest: int) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < lowest:
        raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {n}")
    return n


def nonneg_int(text: str) -> int:
    return _int(text, 0)


def positive_int(text: str) -> int:
    return _int(text, 1)


def positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return x


def output_problem(path: str, *, folder: bool = False) -> str | None:
    """Why the output ``path`` (a file, or with ``folder`` a folder to be created if needed)
    cannot be written, or None if it can: checked before a run starts, so a run never ends by
    losing its outputs to a typo."""
    full = os.path.abspath(path)
    if folder:
        if os.path.exists(full) and not os.path.isdir(full):
            return f"{path} exists and is not a folder; choose another --out"
        anchor = full
    else:
        if os.path.isdir(full):
            return f"{path} is a folder; give the path of a file to write"
        if os.path.exists(full) and not os.access(full, os.W_OK):
            return f"{path} exists and is not writable (permission denied); choose another path"
        anchor = os.path.dirname(full)
        if not os.path.isdir(anchor):
            return (
                f"the folder {os.path.dirname(path) or anchor} does not exist; create it first or choose another path"
            )
    while not os.path.exists(anchor):  # a folder still to be made: its nearest existing parent
        anchor = os.path.dirname(anchor)
    if not os.path.isdir(anchor):
        return f"{anchor} is a file, so {path} cannot be created under it; choose another path"
    if not os.access(anchor, os.W_OK | os.X_OK):
        return f"cannot write into {anchor} (permission denied); choose another path"
    return None
