"""Timeshare on a real GPU: driver-level memory, races, errors, training equivalence."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tidal
from tests.helpers import assert_same_state, is_out, snapshot_state
from tests.policies import SkipWaits
from tidal.device import use_sync_policy

pytestmark = pytest.mark.gpu

MiB = 1 << 20

SLEEP_CYCLES = int(4e8)  # ~0.2 s of queued GPU time: long enough for any copy here


class Blob(nn.Module):
    """Big parameters (direct copies) plus many small ones (bucketed copies)."""

    def __init__(self, big_mib: int = 256, n_big: int = 4, n_small: int = 300) -> None:
        super().__init__()
        self.big = nn.ParameterList(nn.Parameter(torch.randn(big_mib * MiB // 4)) for _ in range(n_big))
        self.small = nn.ParameterList(nn.Parameter(torch.randn(1000 + i)) for i in range(n_small))
        self.register_buffer("counts", torch.arange(4096, dtype=torch.int64))


def _with_adam(model: nn.Module, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_driver_free_memory_returns_to_baseline_every_cycle():
    ts = tidal.Timeshare("cuda")
    torch.cuda.empty_cache()
    baseline = _free()  # never-loaded baseline: context and streams exist, no state
    model = Blob().cuda()
    opt = _with_adam(model)
    before = snapshot_state(model, opt)
    ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
    state = ts.role_bytes("actor")
    assert state > 3 * 1024 * MiB
    rss = []
    for cycle in range(100):
        rec = ts.offload("actor")
        free = _free()
        assert baseline - free <= 256 * MiB, f"cycle {cycle}: {(baseline - free) / MiB:.0f} MiB not returned"
        assert rec.unreleased_bytes <= 256 * MiB
        ts.load("actor")
        assert baseline - _free() >= state - 256 * MiB, "the state must really be back on the GPU"
        rss.append(tidal.host_rss_bytes())
    assert rss[-1] - rss[9] <= 64 * MiB, f"host RSS grew by {(rss[-1] - rss[9]) / MiB:.0f} MiB"
    assert ts.store.host_reserved_bytes <= 1.05 * state
    assert_same_state(before, snapshot_state(model, opt))
    ts.close()


def test_round_trip_bit_exact_hf_model_with_fused_adam():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    opt = _with_adam(model, fused=True)  # fused Adam keeps a 4-byte `step` on the device
    before = snapshot_state(model, opt)
    ref = nn.Linear(1024, 1024, device="cuda")
    with tidal.Timeshare("cuda") as ts:
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        ts.add_role("reference", model=ref)
        for _ in range(3):
            with ts.use("reference"):
                assert is_out(model.model.embed_tokens.weight)
            with ts.use("actor"):
                assert_same_state(before, snapshot_state(model, opt))


def test_race_offload_waits_for_compute_stream():
    """A write queued behind a long GPU sleep must be in the offloaded copy."""

    def run(skip: frozenset) -> bool:
        model = Blob(big_mib=512, n_big=2, n_small=0).cuda()
        with tidal.Timeshare("cuda") as ts:
            ts.add_role("a", model=model)
            with use_sync_policy(SkipWaits(skip)) as policy:
                torch.cuda._sleep(SLEEP_CYCLES)
                with torch.no_grad():
                    for p in model.big:
                        p.fill_(7.0)
                ts.offload("a")
            assert set(policy.skipped) == skip  # the wait was there and was dropped
            ts.load("a")
            torch.cuda.synchronize()
            return all(bool((p == 7.0).all()) for p in model.big)

    assert run(frozenset())
    assert not run(frozenset({"d2h_after_compute"})), "the race test must detect a missing D2H wait"


@pytest.mark.parametrize("prefetch", [False, True])
def test_race_reload_waits_for_compute_stream(prefetch):
    """A reloaded (or prefetched) storage may reuse a block that a queued kernel still writes."""

    def run(skip: frozenset) -> bool:
        model = Blob(big_mib=512, n_big=1, n_small=0).cuda()
        with torch.no_grad():
            model.big[0].fill_(3.0)
        with tidal.Timeshare("cuda") as ts:
            ts.add_role("a", model=model)
            ts.offload("a")
            junk = torch.empty(512 * MiB // 4, device="cuda")
            torch.cuda._sleep(SLEEP_CYCLES)
            junk.fill_(float("nan"))  # queued behind the sleep
            del junk  # its block goes back to the cache, the fill still pending
            with use_sync_policy(SkipWaits(skip)) as policy:
                if prefetch:
                    ts.prefetch("a")  # the copy queued here, claimed by load() below
                else:
                    ts.load("a")
            assert set(policy.skipped) == skip
            ts.load("a")
            torch.cuda.synchronize()
            return bool((model.big[0] == 3.0).all())

    assert run(frozenset())
    assert not run(frozenset({"h2d_after_compute"})), "the race test must detect a missing H2D-after-compute wait"


def test_race_compute_waits_for_reload():
    """Kernels launched right after load() must see the reloaded bytes, not the old block."""

    def run(skip: frozenset) -> bool:
        model = Blob(big_mib=1024, n_big=1, n_small=0).cuda()
        with torch.no_grad():
            model.big[0].fill_(5.0)
        with tidal.Timeshare("cuda") as ts:
            ts.add_role("a", model=model)
            ts.offload("a")
            junk = torch.full((1024 * MiB // 4,), float("nan"), device="cuda")
            torch.cuda.synchronize()
            del junk  # cached block full of NaN: the reload will get it
            with use_sync_policy(SkipWaits(skip)) as policy:
                ts.load("a")
                seen = model.big[0].clone()  # queued on the compute stream at once
            assert set(policy.skipped) == skip
            torch.cuda.synchronize()
            return bool((seen == 5.0).all())

    assert run(frozenset())
    # The host also waits for the reload before load() returns; both orderings must go.
    assert not run(frozenset({"compute_after_h2d", "reload_done"})), (
        "the race test must detect a missing compute-after-H2D wait"
    )


def test_reload_that_cannot_fit_raises_and_keeps_state():
    model = Blob(big_mib=1024, n_big=2, n_small=10).cuda()
    before = snapshot_state(model)
    with tidal.Timeshare("cuda") as ts:
        ts.add_role("a", model=model)
        ts.offload("a")
        free = _free()
        filler = torch.empty(free - 1024 * MiB, dtype=torch.uint8, device="cuda")
        try:
            with pytest.raises(tidal.InsufficientMemoryError, match=r"bytes\) of device memory") as err:
                ts.load("a")
            assert err.value.needed_bytes >= ts.role_bytes("a")
            assert not ts.is_resident("a")
        finally:
            del filler
        ts.load("a")
        assert_same_state(before, snapshot_state(model))


def test_switch_moves_both_roles_and_frees_the_outgoing_one():
    a, b = Blob(n_small=50).cuda(), Blob(n_small=50).cuda()
    sa, sb = snapshot_state(a), snapshot_state(b)
    with tidal.Timeshare("cuda") as ts:
        ts.add_role("a", model=a)
        ts.add_role("b", model=b)
        with ts.use("a"):
            pass
        for _ in range(5):
            rec = ts.load("b")
            assert rec.kind == "switch" and rec.bytes_out == rec.bytes_in == ts.role_bytes("a")
            assert is_out(a.big[0])
            rec = ts.load("a")
            assert is_out(b.big[0])
        assert_same_state(sa, snapshot_state(a))
        ts.load("b")
        assert_same_state(sb, snapshot_state(b))


def test_training_with_switches_matches_training_without_tidal():
    def train(use_tidal: bool) -> list[float]:
        torch.manual_seed(0)
        actor = nn.Sequential(
            nn.Linear(512, 2048), nn.GELU(), nn.Dropout(0.1), nn.Linear(2048, 512), nn.LayerNorm(512)
        ).cuda()
        ref = nn.Sequential(nn.Linear(512, 512), nn.Tanh()).cuda()
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-3)
        ts = tidal.Timeshare("cuda") if use_tidal else None
        if ts:
            ts.add_role("actor", model=actor, optimizer=opt)  # step residency: the default
            ts.add_role("reference", model=ref)
        losses = []
        for step in range(8):
            x = torch.randn(64, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            if ts:
                ts.load("reference")
            with torch.no_grad():
                target = ref(x)
            if ts:
                ts.load("actor")
            loss = (actor(x) - target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if ts:
            ts.close()
        return losses

    assert train(True) == train(False)


def test_offload_optimizer_frees_driver_memory():
    model = Blob(n_small=20).cuda()
    opt = _with_adam(model)
    before = snapshot_state(model, opt)
    state_bytes = sum(v.untyped_storage().nbytes() for st in opt.state.values() for k, v in st.items() if k != "step")
    torch.cuda.empty_cache()  # setup's cached temporaries would be released by the offload
    free0 = _free()
    with tidal.offload_optimizer(opt) as info:
        assert _free() - free0 >= state_bytes - 256 * MiB
    assert info.out.bytes_out == state_bytes
    assert abs(_free() - free0) <= 256 * MiB
    assert_same_state(before, snapshot_state(model, opt))
