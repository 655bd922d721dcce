"""vLLM as a role of the timeshare (extra: an installed vLLM; CPU tests use a test double).

:class:`VllmEngine` puts an in-process ``vllm.LLM`` (colocated: its memory pool in this
process) beside a :class:`~tidal.Timeshare`'s roles: the room for its weights and KV cache is
made as they wake, the policy's weights are pushed into it, and its memory is the driver's
again once it sleeps. ``TidalGRPOTrainer(args=GRPOConfig(use_vllm=True, vllm_mode="colocate"))``
uses it for TRL's engine; a loop of its own uses :meth:`VllmEngine.generating`.

Importing this package imports no vLLM.
"""

from tidal.integrations.vllm.engine import VllmEngine, kv_bytes_per_token, kv_cache_bytes_for

__all__ = ["VllmEngine", "kv_bytes_per_token", "kv_cache_bytes_for"]
