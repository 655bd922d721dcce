"""Argument types shared by the ``tidal`` subcommands (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse

__all__ = ["device_arg", "nonneg_int", "positive_int", "positive_float"]


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
