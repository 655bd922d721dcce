import pytest
import torch

from tidal.device import DeviceOps, host_available_bytes
from tidal.errors import InsufficientMemoryError
from tidal.units import format_bytes
from tidal.memory import host_rss_bytes, nvml_used_bytes, snapshot


@pytest.mark.parametrize("spelling", ["cpu", "cpu:0", torch.device("cpu")])
def test_cpu_ops(spelling):
    ops = DeviceOps(spelling)
    assert ops.device == torch.device("cpu") and ops.device == torch.zeros(1).device
    assert not ops.is_accelerator and ops.module is None
    assert ops.new_stream() is None and ops.current_stream() is None and ops.new_event() is None
    with ops.on_stream(None):
        pass
    ops.synchronize()
    ops.empty_cache()
    assert ops.allocated_bytes() == 0 and ops.reserved_bytes() == 0 and ops.cached_free_bytes() == 0
    assert ops.fragmented_free_bytes() == 0
    free, total = ops.driver_free_bytes()
    assert 0 < free <= total
    assert "cpu" in repr(ops)


def test_cpu_host_buffers_are_exact_and_unpinned():
    ops = DeviceOps("cpu")
    for n in (0, 1, 4097):
        buf = ops.new_host_buffer(n, pin=True)
        assert buf.dtype == torch.uint8 and buf.numel() == n and not buf.is_pinned()
        ops.free_host_buffer(buf, pinned=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_missing_accelerator_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"ask for the CPU on a machine without one \(device='cpu'; the CLI's --device cpu\)"
    ):
        DeviceOps("cuda")


def test_memory_snapshot_on_cpu():
    ops = DeviceOps("cpu")
    s = snapshot(ops, with_nvml=True)
    assert 0 < s.driver_free_bytes <= s.driver_total_bytes
    assert s.allocated_bytes == 0 and s.reserved_bytes == 0 and s.cached_free_bytes == 0
    assert s.nvml_used_bytes is None and nvml_used_bytes(ops) is None
    assert host_rss_bytes() > 0 and host_available_bytes() > 0


def test_insufficient_memory_error_names_both_numbers():
    err = InsufficientMemoryError("reload", needed_bytes=3 << 30, free_bytes=512, hint="Do X.")
    msg = str(err)
    assert "3.00 GiB (3221225472 bytes)" in msg and "512 B (512 bytes) is free" in msg
    assert msg.endswith("Do X.") and isinstance(err, RuntimeError)
    assert (err.needed_bytes, err.free_bytes) == (3 << 30, 512)
    assert (
        format_bytes(1536) == "1.50 KiB"
        and format_bytes(5 << 50) == "5.00 PiB"
        and format_bytes(5 << 60) == "5120.00 PiB"
    )


class _FakePool:
    """A stand-in for ``torch.cuda.MemPool``: its id and the allocator's segment records."""

    def __init__(self, pool_id, segments, *, old_torch=False):
        self.id = pool_id
        self._segments = segments
        self._old_torch = old_torch

    def snapshot(self, **kwargs):
        if self._old_torch and kwargs:
            raise TypeError("snapshot() got an unexpected keyword argument 'include_traces'")
        return self._segments


def _seg(device, pool_id, total, allocated):
    return {"device": device, "segment_pool_id": pool_id, "total_size": total, "allocated_size": allocated}


def test_private_pools_free_blocks_are_counted_per_device_and_pool_and_forgotten_with_the_pool():
    import gc

    from tidal import device as dev

    before = dict(dev._private_pools)
    dev._private_pools.clear()
    try:
        pool = _FakePool(
            (0, 1),
            [
                _seg(0, (0, 1), 1000, 300),  # 700 free in this pool on device 0
                _seg(1, (0, 1), 500, 0),  # another device
                _seg(0, (0, 0), 4000, 0),  # the default pool (a torch listing every pool)
            ],
        )
        old = _FakePool((0, 2), [_seg(0, (0, 2), 64, 0)], old_torch=True)
        dev.register_private_pool(pool)
        dev.register_private_pool(old)
        assert dev._private_free_bytes(0) == 700 + 64
        assert dev._private_free_bytes(1) == 500
        del pool
        gc.collect()
        assert dev._private_free_bytes(0) == 64  # a pool that is gone stops counting
        assert len(dev._private_pools) == 1
    finally:
        dev._private_pools.clear()
        dev._private_pools.update(before)


def test_a_snapshots_cached_free_leaves_out_the_private_pools_free_blocks():
    from tidal.memory import MemorySnapshot

    s = MemorySnapshot(
        time_s=0.0,
        driver_free_bytes=1 << 30,
        driver_total_bytes=2 << 30,
        allocated_bytes=100,
        reserved_bytes=1100,
        nvml_used_bytes=None,
        private_free_bytes=700,
    )
    assert s.cached_free_bytes == 300
    # CPU: nothing is reserved, nothing private, whatever is registered.
    assert DeviceOps("cpu").private_free_bytes() == 0
