"""The ``tidal`` command line: ``tidal demo``, ``tidal bench``, ``tidal plan``.

The library reads no argv and no environment variables; only this package does.
"""

from tidal_recipes.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
