"""The residency-backend seam: the store frees and restores device memory only through its
backend, so another backend (address-stable memory, issue 15) plugs in without touching it."""

from __future__ import annotations

import torch

from tests.state.test_store import _assert_state_equal, _clone_all, _entries, _make, _tensors
from tests.transfer.fakes import FakeAccelOps
from tidal.device import DeviceOps
from tidal.state import OffloadStore, collect_module_state
from tidal.state.backends import ResizeBackend
from tidal.transfer import TransferConfig


class Recording(ResizeBackend):
    def __init__(self, ops, **kw):
        super().__init__(ops, **kw)
        self.calls: list[tuple[str, int]] = []

    def reserve(self, items):
        self.calls.append(("reserve", sum(n for _, n in items)))
        super().reserve(items)

    def restore(self, storage, nbytes):
        self.calls.append(("restore", nbytes))
        super().restore(storage, nbytes)

    def release(self, storage):
        self.calls.append(("release", storage.nbytes()))
        super().release(storage)

    def settle(self, **kw):
        self.calls.append(("settle", 0))
        return super().settle(**kw)


def test_every_release_and_restore_goes_through_the_backend():
    model, opt = _make(seed=1)
    entries = _entries(model, opt)
    clones = _clone_all(_tensors(model, opt))
    ops = DeviceOps("cpu")
    backend = Recording(ops)
    store = OffloadStore(ops, backend=backend)
    store.offload(entries)
    released = [n for kind, n in backend.calls if kind == "release"]
    assert sorted(released) == sorted(e.nbytes for e in entries)
    assert backend.calls[-1] == ("settle", 0)  # once, after the releases
    backend.calls.clear()
    store.reload(entries)
    assert sorted(n for kind, n in backend.calls if kind == "restore") == sorted(e.nbytes for e in entries)
    assert not any(kind in ("release", "settle") for kind, _ in backend.calls)
    _assert_state_equal(_tensors(model, opt), clones)


def test_a_streamed_chunk_move_does_not_settle_and_the_resize_backend_reserves_large_runs():
    ops = FakeAccelOps()
    backend = Recording(ops, coalesce=True)
    store = OffloadStore(ops, TransferConfig(bucket_bytes=64 << 10, small_tensor_bytes=4 << 10), backend=backend)
    big = [torch.randn(1 << 20) for _ in range(6)]  # 4 MiB each: served from the large pool
    holder = torch.nn.Module()
    for i, t in enumerate(big):
        holder.register_buffer(f"b{i}", t)
    entries = collect_module_state([holder], torch.device("cpu"))
    store.offload(entries, release=False)
    assert ("settle", 0) not in backend.calls
    backend.calls.clear()
    store.reload(entries)
    reserves = [n for kind, n in backend.calls if kind == "reserve"]
    assert reserves and sum(reserves) == sum(e.nbytes for e in entries), "one reservation for the run"
    assert backend.calls.index(("reserve", reserves[0])) < [k for k, _ in backend.calls].index("restore")


def test_reserve_leaves_the_allocator_alone_when_its_cache_holds_the_bytes(monkeypatch):
    """Coalescing maps one new block for a run of storages; with that much free in the cache
    already (memory kept in-process) the storages take it from there instead."""

    class Cached(FakeAccelOps):
        cached = 0

        def reserved_bytes(self) -> int:
            return self.cached

    ops = Cached()
    backend = ResizeBackend(ops)
    made = []
    real_empty = torch.empty

    def empty(*args, **kw):
        made.append(args)
        return real_empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    items = [(torch.UntypedStorage(0), 64 << 20)]
    backend.reserve(items)
    assert made, "an empty cache: one block reserved for the run"
    made.clear()
    ops.cached = 64 << 20
    backend.reserve(items)
    assert not made, "the cache holds the bytes: nothing reserved"
