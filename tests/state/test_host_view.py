"""OffloadStore.host_view: the host bytes of an offloaded storage, with no copy."""

from __future__ import annotations

import pytest
import torch

from tidal.device import DeviceOps
from tidal.state import OffloadStore, collect_module_state, storage_key
from tidal.transfer import TransferConfig
from tests.transfer.fakes import FakeAccelOps

CPU = torch.device("cpu")
KiB = 1024


def _store(kind: str) -> OffloadStore:
    if kind == "cpu":
        return OffloadStore(DeviceOps("cpu"))
    # Small buckets: several storages share one host chunk, so the views start mid-chunk.
    return OffloadStore(FakeAccelOps(), TransferConfig(bucket_bytes=16 * KiB, small_tensor_bytes=2 * KiB))


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.randn(37, 5))  # odd sizes: slots at unaligned-looking offsets
    m.b = torch.nn.Parameter(torch.randn(3).to(torch.float64))
    m.register_buffer("bf16", torch.randn(1001).to(torch.bfloat16))
    m.register_buffer("ids", torch.arange(-7, 300, dtype=torch.int64))
    return m


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A copy of every byte of ``t``'s storage."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


@pytest.mark.parametrize("kind", ["cpu", "fake-accel"])
def test_host_view_is_the_offloaded_bytes_and_none_otherwise(kind):
    m = _module()
    store = _store(kind)
    entries = collect_module_state([m], CPU)
    tensors = {"w": m.w, "b": m.b, "bf16": m.bf16, "ids": m.ids}
    before = {n: _bytes_of(t) for n, t in tensors.items()}
    keys = {n: storage_key(t.untyped_storage()) for n, t in tensors.items()}
    assert all(store.host_view(k) is None for k in keys.values()), "resident storages have no host view"

    store.offload(entries)
    for n, key in keys.items():
        view = store.host_view(key)
        assert view is not None and view.dtype == torch.uint8 and view.dim() == 1 and view.device.type == "cpu"
        assert view.numel() == before[n].numel(), n  # exactly the storage's bytes, no padding
        assert torch.equal(view, before[n]), f"{n}: host view differs from the bytes offloaded"
        # A typed view of the same bytes reads the values back (what a checkpoint save does).
        itemsize = tensors[n].element_size()
        assert view.storage_offset() % itemsize == 0
        typed = torch.empty(0, dtype=tensors[n].dtype).set_(
            view.untyped_storage(), view.storage_offset() // itemsize, tensors[n].shape, tensors[n].stride()
        )
        assert torch.equal(typed.view(torch.uint8).reshape(-1), before[n]), n

    # The sanctioned write: same layout, in place, while offloaded; reload brings it back.
    store.host_view(keys["w"]).zero_()
    store.reload(entries)
    assert all(store.host_view(k) is None for k in keys.values()), "a reloaded storage has no host view"
    assert torch.equal(m.w, torch.zeros(37, 5))
    for n in ("b", "bf16", "ids"):
        assert torch.equal(_bytes_of(tensors[n]), before[n]), n


def test_host_view_of_unknown_key_is_none():
    store = _store("cpu")
    assert store.host_view(storage_key(torch.randn(4).untyped_storage())) is None
