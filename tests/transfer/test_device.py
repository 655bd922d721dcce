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
    with pytest.raises(ValueError, match="use device='cpu'"):
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
