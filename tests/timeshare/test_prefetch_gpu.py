"""Prefetch on a real GPU: the claim's wait, a write landing while a write-back copies,
driver-level memory, and training unchanged. (The prefetch's own wait for compute is raced in
test_timeshare_gpu.py, beside the reload's.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tidal
from tests.activations.models import tiny_qwen2
from tests.policies import SkipWaits
from tests.timeshare.test_timeshare_gpu import Blob
from tidal.device import use_sync_policy
from tests.helpers import held_bytes

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SLEEP_CYCLES = int(4e8)  # ~0.2 s of queued GPU time: longer than any copy here


def _nbytes(m: nn.Module) -> int:
    return sum(held_bytes(t) for t in list(m.parameters()) + list(m.buffers()))


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_race_compute_waits_for_the_prefetched_copy():
    """Kernels queued right after use() of a prefetched role read the arrived bytes: the
    prefetch's copy starts only after a queued sleep, the read is queued right behind it."""

    def run(skip: frozenset) -> bool:
        model = Blob(1024, 1, n_small=0).cuda()
        with torch.no_grad():
            model.big[0].fill_(5.0)
        with tidal.Timeshare("cuda") as ts:
            ts.add_role("a", model=model)
            ts.offload("a")  # nothing else resident: use("a") only claims (no host wait anywhere)
            junk = torch.full((1024 * MiB // 4,), float("nan"), device="cuda")
            torch.cuda.synchronize()
            del junk  # a cached block full of NaN: the prefetch gets it
            with use_sync_policy(SkipWaits(skip)) as policy:
                torch.cuda._sleep(SLEEP_CYCLES)  # the copy waits for it (it may reuse blocks)
                ts.prefetch("a")
                with ts.use("a"):
                    seen = model.big[0].clone()  # queued behind the sleep only
            assert set(policy.skipped) == skip
            torch.cuda.synchronize()
            return bool((seen == 5.0).all())

    assert run(frozenset())
    assert not run(frozenset({"compute_after_prefetch"})), "the race test must detect a missing claim wait"


def test_a_write_while_the_write_back_copies_is_caught():
    """The current role is written back while it is written on the compute stream (the copy
    and the write overlap on the GPU): the switch must copy it again, not trust the host copy."""
    model = Blob(1024, 2, n_small=0).cuda()
    size, written = _nbytes(model), sum(p.untyped_storage().nbytes() for p in model.big)
    with tidal.Timeshare("cuda") as ts:
        ts.add_role("a", model=model)
        ts.add_role("b", model=nn.Linear(8, 8).cuda())
        with ts.use("b"):
            pass
        with ts.use("a"):
            rec = ts.prefetch("b")
            assert rec.bytes_out == size
            with torch.no_grad():
                for p in model.big:
                    p.fill_(9.0)  # runs while the D2H copy of the write-back reads these bytes
        with ts.use("b"):
            # the written storages are copied again; only the untouched buffer is not
            assert ts.records[-1].bytes_out == written and ts.records[-1].bytes_skipped == size - written
        with ts.use("a"):
            assert all(bool((p == 9.0).all()) for p in model.big)


def test_unchanged_written_back_role_goes_out_without_a_copy_and_memory_comes_back():
    model = Blob(1024, 2, n_small=0).cuda()
    ts = tidal.Timeshare("cuda")
    ref = Blob(512, 2, n_small=0).cuda()
    size_a, size_b = _nbytes(model), _nbytes(ref)
    ts.add_role("a", model=model)
    ts.add_role("b", model=ref, frozen=True)
    with ts.use("b"):
        pass
    with ts.use("a"):
        pass  # b's first offload copies (later ones do not: it is frozen)
    torch.cuda.empty_cache()
    base = _free()  # a resident, b out
    with ts.use("a"):
        ts.prefetch("b")
        torch.cuda._sleep(SLEEP_CYCLES)  # the phase's compute, behind which both copies run
        assert base - _free() >= 1024 * MiB - 64 * MiB, "the prefetched role must take its device memory"
    with ts.use("b"):
        rec = ts.records[-1]
        assert rec.bytes_out == 0 and rec.bytes_skipped == size_a and rec.bytes_prefetched == size_b
    with ts.use("a"):
        pass
    assert base - _free() <= 256 * MiB, "the driver must get the prefetched role's memory back"
    ts.add_role("c", model=nn.Linear(8, 8).cuda())
    with ts.use("a"):
        ts.prefetch("b")
    ts.load("c")  # not b: its prefetch is given back
    assert ts.store.prefetched_bytes == 0
    ts.close()


def test_training_with_prefetch_matches_training_without():
    pytest.importorskip("transformers")
    shape = dict(hidden=256, intermediate=704, vocab=4096, device="cuda", attn="sdpa")

    def run(prefetch: bool):
        actor = tiny_qwen2(4, seed=0, **shape)
        ref = tiny_qwen2(4, seed=1, **shape).eval()
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-3, fused=True)
        ts = tidal.Timeshare("cuda")
        ts.add_role("actor", model=actor, optimizer=opt)
        ts.add_role("ref", model=ref, frozen=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        losses = []
        for _ in range(4):
            ids = torch.randint(0, 4096, (4, 64), device="cuda", generator=g)
            with ts.use("ref"):
                if prefetch:
                    ts.prefetch("actor")
                with torch.no_grad():
                    ref_logits = ref(ids).logits.float()
            with ts.use("actor"):
                if prefetch:
                    ts.prefetch("ref")
                logits = actor(ids).logits.float()
                loss = (logits.log_softmax(-1) - ref_logits.log_softmax(-1)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        ts.close()
        return losses, [p.detach().clone() for p in actor.parameters()], ts.records

    base, w_base, _ = run(False)
    got, w_got, records = run(True)
    assert base == got
    assert all(torch.equal(a, b) for a, b in zip(w_base, w_got))
    assert sum(r.bytes_prefetched for r in records) > 0
