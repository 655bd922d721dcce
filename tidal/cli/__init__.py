"""The ``tidal`` command line: ``tidal bench`` (more subcommands to come).

The core library reads no argv and no environment variables; only this package does.
"""

from tidal.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
