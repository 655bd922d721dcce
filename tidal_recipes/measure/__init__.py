"""Measuring tools the command line's ``tidal bench`` and the benchmarks share: causal LMs of the
planner's shapes with random weights and optimizer state (:mod:`.models`), the line rate and the
machine's description (:mod:`.copies`). Built on the library, below the command line."""

from tidal_recipes.measure.copies import empty_host_cache, environment, measure_line_rate, timed
from tidal_recipes.measure.models import (
    PRESETS,
    PlainQwen2Shape,
    StateReference,
    build_model,
    make_adamw_state,
    named_state,
)

__all__ = [
    "PRESETS",
    "PlainQwen2Shape",
    "StateReference",
    "build_model",
    "empty_host_cache",
    "environment",
    "make_adamw_state",
    "measure_line_rate",
    "named_state",
    "timed",
]
