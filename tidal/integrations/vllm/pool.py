"""vLLM's sleep-mode pool as tidal reads it: which of the engine's allocations sleep, and a wake
that ran out of memory part-way put back to sleep.

vLLM's ``wake_up`` maps the pool's allocations of the tags asked for one by one (a weight, a
layer's KV cache) and stops at the first the driver has no room for, with ``RuntimeError: CUDA
Error: out of memory``: those before it stay mapped, the rest do not, and the engine counts
itself asleep still (its executor's sleeping tags change only after a wake that returned). A
second ``wake_up`` would map the first ones again. :func:`put_back_to_sleep` makes the pool as
the engine counts it, every allocation of the failed wake unmapped again, so that once more
room is made the engine wakes as it would have the first time.

The private surfaces it uses are :data:`tidal.integrations.seams.VLLM_POOL_SEAMS`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tidal.integrations.seams import engine_pool

__all__ = ["allocation_bytes", "asleep_allocations", "is_out_of_memory", "put_back_to_sleep"]


def is_out_of_memory(exc: BaseException) -> bool:
    """``exc`` is the device running out of memory: torch's ``OutOfMemoryError``, or the
    ``RuntimeError`` vLLM's pool raises naming ``CUDA Error: out of memory``."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc)


def asleep_allocations(tags: Iterable[str]) -> set[int]:
    """The pool's allocations (their addresses) of ``tags`` that sleep now."""
    pool, _, _ = engine_pool()
    tags = set(tags)
    return {ptr for ptr, data in pool.pointer_to_data.items() if data.tag in tags and data.is_asleep}


def allocation_bytes(pointers: Iterable[int]) -> int:
    """The device bytes the pool's allocations at ``pointers`` take mapped."""
    pool, _, _ = engine_pool()
    return sum(pool.pointer_to_data[ptr].handle[1] for ptr in pointers if ptr in pool.pointer_to_data)


def put_back_to_sleep(pointers: Iterable[int], *, backed_up: Iterable[str] = ()) -> int:
    """Of ``pointers`` (allocations that slept before a wake), each awake now unmapped again, its
    bytes first copied to a host tensor where its tag is in ``backed_up`` (the weights after a
    level-1 sleep: the wake consumed their host copy). Returns the bytes unmapped.

    Memory cost: for ``backed_up`` allocations, host memory of their size (what the sleep had).
    """
    pool, unmap_and_release, libcudart = engine_pool()
    backed_up = set(backed_up)
    freed = 0
    for ptr in pointers:
        data = pool.pointer_to_data.get(ptr)
        if data is None or data.is_asleep:
            continue
        size = data.handle[1]
        if data.tag in backed_up and data.cpu_backup_tensor is None:
            backup = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            libcudart.cudaMemcpy(backup.data_ptr(), ptr, size)
            data.cpu_backup_tensor = backup
        unmap_and_release(data.handle)
        data.is_asleep = True
        freed += size
    return freed
