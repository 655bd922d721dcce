"""Issue 16, item 3: the store's two ends of a hand-over between holders that cannot see each
other's allocations. The giver offloads in chunks and reports the memory it has given back
after each; the taker loads against a room source and waits for that memory instead of
failing. On the CPU, one "device pool" (what the driver has free) stands for the GPU the two
processes share: a restore takes from it and fails past it, a settle gives back."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.faults import sweep
from tests.state.test_store import _assert_state_equal, _clone_all, _entries, _make, _tensors
from tests.transfer.fakes import FakeAccelOps
from tidal.errors import InsufficientMemoryError
from tidal.state import OffloadStore
from tidal.state.backends import ResizeBackend
from tidal.state.moves import SwitchOptions
from tidal.transfer import TransferConfig
from tests.helpers import is_out

KiB = 1024


class Pool:
    """The device memory two holders share, as the driver counts it."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.lock = threading.Lock()
        self.low = free  # the lowest the free memory went: below 0 would be an OOM


class PoolOps(FakeAccelOps):
    def __init__(self, pool: Pool) -> None:
        super().__init__()
        self.pool = pool

    def driver_free_bytes(self) -> tuple[int, int]:
        return self.pool.free, 1 << 30


class PoolBackend(ResizeBackend):
    """Resize, with the pool's accounting: a restore takes memory (an OOM past the free
    memory), a release holds it until the settle gives it back to the pool."""

    def __init__(self, ops: PoolOps) -> None:
        super().__init__(ops, coalesce=False, release_to_driver=True)
        self.pool = ops.pool
        self.pending = 0
        self.log: list[tuple[str, int]] = []

    def restore(self, storage, nbytes):
        with self.pool.lock:
            if nbytes > self.pool.free:
                raise torch.OutOfMemoryError(f"pool: {nbytes} bytes asked, {self.pool.free} free")
            self.pool.free -= nbytes
            self.pool.low = min(self.pool.low, self.pool.free)
        self.log.append(("restore", nbytes))
        super().restore(storage, nbytes)

    def release(self, storage):
        self.pending += storage.nbytes()
        self.log.append(("release", storage.nbytes()))
        super().release(storage)

    def settle(self, *, final: bool = True) -> int:
        given, self.pending = self.pending, 0
        with self.pool.lock:
            self.pool.free += given
        self.log.append(("settle", given))
        return given


def _store(pool: Pool) -> OffloadStore:
    ops = PoolOps(pool)
    cfg = TransferConfig(bucket_bytes=2 * KiB, small_tensor_bytes=512, coalesce_allocations=False)
    return OffloadStore(ops, cfg, backend=PoolBackend(ops))


def _offloaded(free: float):
    """A store holding role 1 offloaded, the pool with ``free`` of its size free."""
    pool = Pool(1 << 20)
    store = _store(pool)
    entries, tensors, clones = _role(1)
    store.offload(entries)
    size = sum(e.nbytes for e in entries)
    pool.free = int(size * free)
    return pool, store, entries, tensors, clones, size


def _role(seed: int):
    model, opt = _make(seed=seed)
    entries = _entries(model, opt)
    tensors = _tensors(model, opt)
    return entries, tensors, _clone_all(tensors)


class Credits:
    """A room source fed by a giver's progress reports (what the lease carries between processes)."""

    def __init__(self, total: int | None = None) -> None:
        self.cond = threading.Condition()
        self.returned, self.total, self.done, self.waits = 0, total, False, 0
        self.blocked = threading.Event()  # a load has waited for more

    def report(self, returned: int, total: int) -> None:
        with self.cond:
            self.returned, self.total = returned, total
            self.cond.notify_all()

    def finish(self) -> None:
        with self.cond:
            self.done = True
            self.cond.notify_all()

    def pending_bytes(self) -> int:
        with self.cond:
            return 0 if self.done or self.total is None else max(0, self.total - self.returned)

    def wait(self) -> bool:
        with self.cond:
            if self.done:
                return False
            seen = self.returned
            self.waits += 1
            self.blocked.set()
            assert self.cond.wait_for(lambda: self.done or self.returned > seen, timeout=30), "no credit came"
            return True


def test_an_offload_in_chunks_gives_memory_back_after_each_and_reports_it():
    pool = Pool(1 << 20)
    store = _store(pool)
    entries, tensors, clones = _role(1)
    total = sum(e.nbytes for e in entries)
    reports = []
    store.offload(entries, on_released=lambda r, t: reports.append((r, t, pool.free)), release_chunk_bytes=4 * KiB)
    assert len(reports) >= 3, reports  # 14 KiB in 4 KiB chunks
    assert [t for _, t, _ in reports] == [total] * len(reports)
    returned = [r for r, _, _ in reports]
    assert returned == sorted(returned) and returned[0] > 0 and returned[-1] == total
    # Each report comes after its memory is back with the driver, not at the end.
    assert all(free == (1 << 20) + r for r, _, free in reports)
    assert all(store.is_offloaded(e.key) for e in entries)
    store.reload(entries)
    _assert_state_equal(tensors, clones)


def test_the_next_chunks_copies_are_queued_before_a_chunk_is_given_back():
    """The settle synchronises the device: had the next chunk's D2H not been queued first, the
    copy engine would idle during every settle; had every chunk been queued first, the first
    settle would wait for all of them and the memory would only come back at the end."""
    pool = Pool(1 << 20)
    store = _store(pool)
    entries, _, _ = _role(1)
    order = []
    copy_out = store.engine.copy_out
    store.engine.copy_out = lambda seg: (order.append(("copy", seg.nbytes)), copy_out(seg))[1]
    backend = store.backend
    settle, release = backend.settle, backend.release
    backend.settle = lambda **kw: (order.append(("settle", 0)), settle(**kw))[1]
    backend.release = lambda st: (order.append(("release", st.nbytes())), release(st))[1]
    store.offload(entries, on_released=lambda r, t: None, release_chunk_bytes=4 * KiB)
    settles = [i for i, (k, _) in enumerate(order) if k == "settle"]
    assert len(settles) >= 3
    copied = [sum(n for k, n in order[:i] if k == "copy") for i in settles]
    released = [sum(n for k, n in order[:i] if k == "release") for i in settles]
    total = sum(e.nbytes for e in entries)
    # At every settle after the first copy until all is queued, more was queued than released:
    # the next chunk's copies. (The first settle, of the cache, comes before any copy.)
    assert copied[0] == 0
    assert all(c > r for c, r in zip(copied, released) if 0 < c < total), (copied, released)
    assert sum(0 < c < total for c in copied) >= 1, "everything was queued before the first chunk's settle"
    assert copied[-1] == released[-1] == total


def test_a_load_waits_for_the_memory_a_giver_hands_over_and_overlaps_with_it():
    """Two holders, one pool with room for one role: the taker starts loading on the giver's
    first chunk and never takes more than the pool has; both roles end exact."""
    a_entries, a_tensors, a_clones = _role(1)
    b_entries, b_tensors, b_clones = _role(2)
    size = sum(e.nbytes for e in a_entries)
    pool = Pool(1 << 20)
    giver, taker = _store(pool), _store(pool)
    taker.offload(b_entries)
    pool.free = 4 * KiB  # the giver's role fills the device but a staging buffer's room
    credits = Credits()
    taker_started = threading.Event()
    overlapped: list[bool] = []

    def give():
        reports = []

        def progress(returned, total):
            reports.append(returned)
            if len(reports) == 2:
                # The taker has loaded what the first chunk made room for and waits for more.
                assert credits.blocked.wait(timeout=30)
            credits.report(returned, total)
            if len(reports) == 1:
                # The taker gets going on the first chunk, while this side still has chunks to give.
                overlapped.append(taker_started.wait(timeout=30))

        giver.offload(a_entries, on_released=progress, release_chunk_bytes=4 * KiB)
        credits.finish()

    t = threading.Thread(target=give)
    t.start()
    original = taker.backend.restore

    def restore(storage, nbytes):
        original(storage, nbytes)
        taker_started.set()

    taker.backend.restore = restore
    credits.total = size  # announced by the giver's first report; the up-front check counts it
    taker.reload(b_entries, room_source=credits)
    t.join()
    assert pool.low >= 0
    assert credits.waits >= 1, "the load never waited for memory"
    assert overlapped == [True], "the taker did not start before the giver's last chunk"
    assert all(giver.is_offloaded(e.key) for e in a_entries)
    _assert_state_equal(b_tensors, b_clones)
    taker.offload(b_entries)
    giver.reload(a_entries)
    _assert_state_equal(a_tensors, a_clones)


def test_a_load_that_cannot_fit_even_with_what_is_coming_is_refused_before_any_work():
    pool, store, entries, tensors, clones, size = _offloaded(0.25)
    credits = Credits(total=size // 4)  # a quarter free, a quarter coming: half of it
    with pytest.raises(InsufficientMemoryError):
        store.reload(entries, room_source=credits)
    assert credits.waits == 0 and not store.backend.log[-1][0] == "restore"
    assert all(store.is_offloaded(e.key) for e in entries)
    pool.free = 1 << 20
    store.reload(entries)
    _assert_state_equal(tensors, clones)


def test_memory_announced_but_never_given_ends_the_load_with_a_clear_error_and_loses_nothing():
    pool, store, entries, tensors, clones, size = _offloaded(0.5)

    class Stops(Credits):
        def wait(self):  # the giver's turn ends (it crashed, or kept the rest): nothing more
            if self.done:
                return False
            self.finish()
            self.waits += 1
            return True

    credits = Stops(total=size)  # announced, then never given
    with pytest.raises(InsufficientMemoryError, match="gave back less than it announced"):
        store.reload(entries, room_source=credits)
    assert all(store.is_offloaded(e.key) for e in entries)  # the part that came in went out again
    assert not store.interrupted
    # ... and back to the driver: the next holder counts on it.
    assert store.backend.pending == 0 and pool.free == int(size * 0.5)
    pool.free = 1 << 20
    store.reload(entries)
    _assert_state_equal(tensors, clones)


def test_misused_hand_over_arguments_are_refused_before_anything_moves():
    pool = Pool(1 << 20)
    store = _store(pool)
    a, _, _ = _role(1)
    b, _, _ = _role(2)
    store.offload(b)
    with pytest.raises(ValueError, match="no incoming entries"):
        store.switch(a, b, SwitchOptions(on_released=lambda r, t: None))
    with pytest.raises(ValueError, match="release on"):
        store.switch(a, [], SwitchOptions(on_released=print, release=False))
    with pytest.raises(ValueError, match="release_chunk_bytes"):
        store.offload(a, on_released=print, release_chunk_bytes=0)
    assert not any(store.is_offloaded(e.key) for e in a)


@pytest.mark.parametrize("end", ["giver", "taker"])
@pytest.mark.slow
def test_fault_at_every_point_of_a_hand_over_keeps_every_storage_resident_or_tracked(end):
    def make():
        entries, tensors, clones = _role(1)
        pool = Pool(1 << 20)
        store = _store(pool)
        if end == "taker":
            store.offload(entries)
            pool.free = sum(e.nbytes for e in entries) // 3

            class Feed(Credits):
                def wait(self):  # each wait: the giver's next chunk arrives
                    if pool.free >= 1 << 20:
                        return False
                    pool.free += sum(e.nbytes for e in entries) // 3 + 1
                    self.waits += 1
                    return True

            credits = Feed(total=sum(e.nbytes for e in entries))
        else:
            credits = None
        return {"store": store, "pool": pool, "entries": entries, "tensors": tensors, "clones": clones, "c": credits}

    def act(s):
        if end == "giver":
            s["store"].offload(s["entries"], on_released=lambda r, t: None, release_chunk_bytes=4 * KiB)
        else:
            s["store"].reload(s["entries"], room_source=s["c"])

    def check(s, fired):
        store = s["store"]
        for e in s["entries"]:
            if is_out(e.storage):
                assert store.is_offloaded(e.key), f"{e.name}: freed and untracked (fault at {fired})"
            else:
                assert not store.is_offloaded(e.key), f"{e.name}: tracked but still on the device ({fired})"
        assert not store.interrupted
        s["pool"].free = 1 << 30
        store.reload(s["entries"])
        _assert_state_equal(s["tensors"], s["clones"])

    points = sweep(make, act, check)
    want = "offload_chunk_returned" if end == "giver" else "reload_room_arrived"
    assert points.count(want) >= 2, points


def test_a_hand_over_load_allocates_in_runs_no_larger_than_a_chunk():
    """The allocator gives back only whole runs, so a role that will be handed over in chunks
    must be allocated in runs no larger than a chunk (else its next release returns nothing
    until the end of a run)."""
    from tidal.state.handover import NOTHING_COMING

    _, store, entries, tensors, clones, _ = _offloaded(16)
    runs = []
    reserve = store.backend.reserve
    store.backend.reserve = lambda items: (runs.append(sum(n for _, n in items)), reserve(items))[1]
    store.reload(entries, room_source=NOTHING_COMING, reserve_max_bytes=4 * KiB)
    largest_storage = max(e.nbytes for e in entries)
    assert len(runs) >= 3 and sum(runs) == sum(e.nbytes for e in entries)
    assert all(r <= max(4 * KiB, largest_storage) for r in runs), runs
    _assert_state_equal(tensors, clones)


def test_memory_the_giver_held_beyond_its_state_is_announced_with_it():
    """A giver's allocator may hold more than its state (a phase's cached activations): it goes
    back first and counts in the announced total. Were it counted as credit against the state's
    total only, the taker would see nothing more coming while half the state was still out, and
    refuse a load that fits."""
    a_entries, _, _ = _role(1)
    b_entries, b_tensors, b_clones = _role(2)
    pool = Pool(1 << 20)
    giver, taker = _store(pool), _store(pool)
    taker.offload(b_entries)
    cached = 6 * KiB
    giver.backend.pending = cached  # released earlier, still in the giver's cache
    pool.free = 4 * KiB
    credits = Credits()
    first = threading.Event()
    go_on = threading.Event()
    reports = []

    def progress(returned, total):
        reports.append((returned, total))
        credits.report(returned, total)
        if len(reports) == 1:
            first.set()
            go_on.wait(timeout=30)

    t = threading.Thread(
        target=lambda: (giver.offload(a_entries, on_released=progress, release_chunk_bytes=4 * KiB), credits.finish())
    )
    t.start()
    assert first.wait(timeout=30)
    total = sum(e.nbytes for e in a_entries) + cached
    assert reports[0][1] == total and credits.pending_bytes() == total - reports[0][0] > 0
    go = threading.Timer(0.2, go_on.set)
    go.start()
    taker.reload(b_entries, room_source=credits)
    t.join()
    assert reports[-1] == (total, total)
    _assert_state_equal(b_tensors, b_clones)
