"""The order of a move's copies and waits: a switch feeds both copy engines from its start, and a
reload's storages become resident segment by segment as their copies land."""

import torch

from tidal.device import SyncPolicy, use_sync_policy
from tidal.state import OffloadStore
from tidal.state.collect import collect_tensors
from tidal.transfer import TransferConfig
from tests.transfer.fakes import FakeAccelOps, assert_bits_equal

CPU = torch.device("cpu")
KiB = 1024


def _role(seed: int, n: int = 12, numel: int = 1024):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(numel, generator=gen) for _ in range(n)]  # 4 KiB each: one segment each
    return tensors, collect_tensors([(f"t{i}", t, "param") for i, t in enumerate(tensors)], CPU)


def _store():
    # Storages of 4 KiB are above small_tensor_bytes: each is a segment of its own.
    return OffloadStore(FakeAccelOps(), TransferConfig(bucket_bytes=8 * KiB, small_tensor_bytes=2 * KiB))


def _recorded(store, calls):
    out, inn = store.engine.copy_out, store.engine.copy_in

    def copy_out(seg):
        calls.append(("out", seg.nbytes))
        return out(seg)

    def copy_in(seg):
        calls.append(("in", seg.nbytes))
        return inn(seg)

    store.engine.copy_out, store.engine.copy_in = copy_out, copy_in


def test_a_switch_queues_its_outgoing_copies_in_step_with_the_incoming_ones():
    """Before: every out-going copy was queued before the first incoming one, so the H2D engine
    idled while the host queued (and paced) the whole D2H side (a switch of two 7 GB roles on an
    H200 started its first H2D copy 100-120 ms in)."""
    a, ea = _role(1)
    b, eb = _role(2, n=6)  # half the bytes of a
    clones = [t.clone() for t in a + b]
    store = _store()
    store.offload(eb)
    calls: list = []
    _recorded(store, calls)
    store.switch(ea, eb)
    kinds = [k for k, _ in calls]
    assert kinds.count("out") == 12 and kinds.count("in") == 6
    first_in = kinds.index("in")
    assert first_in <= 2, f"the first incoming copy waited for {first_in} out-going ones: {kinds}"
    # At each incoming copy, the share of out-going bytes queued is within one segment of the
    # share of incoming bytes queued.
    out_q = in_q = 0
    for k, n in calls:
        if k == "out":
            out_q += n
        else:
            in_q += n
            assert abs(out_q / (12 * 4 * KiB) - in_q / (6 * 4 * KiB)) <= 1 / 12 + 1e-9, calls
    store.reload(ea)
    for t, c in zip(a + b, clones):
        assert_bits_equal(t, c)


def test_a_reload_untracks_each_segment_once_its_copy_has_landed():
    """The storages of the first segment are resident before the host waits for the last
    segment's copy (the bookkeeping runs beside the later copies), and never before their own
    segment's wait."""
    a, ea = _role(3, n=5)
    clones = [t.clone() for t in a]
    store = _store()
    store.offload(ea)
    order: list = []

    class Watch(SyncPolicy):
        def wait_host(self, name, event):
            if name == "reload_done":
                order.append(("wait", sum(store.is_offloaded(e.key) for e in ea)))
            super().wait_host(name, event)

        def point(self, name):
            if name == "reload_untracked":
                order.append(("untracked", sum(store.is_offloaded(e.key) for e in ea)))

    with use_sync_policy(Watch()):
        store.reload(ea)
    # One wait per segment, each followed by that segment's storage leaving the offloaded set.
    assert order == [x for i in range(5) for x in (("wait", 5 - i), ("untracked", 4 - i))], order
    for t, c in zip(a, clones):
        assert_bits_equal(t, c)
