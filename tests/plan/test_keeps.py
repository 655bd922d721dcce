"""What each phase holds when tidal's TRL trainer prefetches (tidal.plan.kept_phases): the
role kept beside a phase where its state and the phase's need (+10%, 256 MiB) fit."""

import pytest

from tidal.memory import phase_need_bytes
from tidal.plan import PlanConfig, build_plan, kept_host, kept_phases
from tidal.plan.keeps import ENGINE_GENERATION_BYTES, ENGINE_KEPT_STATE, KeptPhase

from tests.plan.test_model import TOY


def _plan(**kw):
    base = dict(shape=TOY, prompts=2, group=2, prompt_len=8, gen_len=8, micro_batch=2, padding_mask=False, misc_bytes=0)
    return build_plan(PlanConfig(**{**base, **kw}))


def test_with_room_for_everything_each_phase_keeps_the_role_the_schedule_keeps():
    plan = _plan()
    got = kept_phases(plan, 1 << 40)
    ref = plan.timeshared["reference"].resident["reference params"]
    policy = plan.timeshared["rollout"].resident["actor params"] + plan.timeshared["train"].resident["optimizer states"]
    assert {p: k.kept for p, k in got.items()} == {
        "rollout": {"reference": ref},
        "reference": {"policy": policy},  # its weights and, moving with it ("adamw"), its AdamW state
        "train": {"reference": ref},
        "optimizer_step": {"reference": ref},
    }
    assert all(k.peak_bytes == plan.timeshared[p].peak_bytes + sum(k.kept.values()) for p, k in got.items())


def test_a_role_is_kept_only_where_it_fits_beside_the_phases_need():
    plan = _plan()
    rollout = plan.timeshared["rollout"]
    ref = plan.timeshared["reference"].resident["reference params"]
    edge = rollout.resident_bytes + phase_need_bytes(rollout.transient_bytes) + ref
    assert kept_phases(plan, edge)["rollout"].kept == {"reference": ref}
    assert kept_phases(plan, edge - 1)["rollout"].kept == {}
    # Not kept through the loss and its backward: not kept at the step either.
    train = plan.timeshared["train"]
    tight = train.resident_bytes + phase_need_bytes(train.transient_bytes) + ref - 1
    got = kept_phases(plan, tight)
    assert got["train"].kept == {} and got["optimizer_step"].kept == {}


def test_the_policy_kept_through_the_scoring_holds_its_optimizer_state_only_where_it_moves_with_it():
    offloaded = _plan(optimizer="adamw_offload")
    got = kept_phases(offloaded, 1 << 40)["reference"].kept
    assert got == {"policy": offloaded.timeshared["rollout"].resident["actor params"]}


def test_plans_with_nothing_to_keep_are_refused():
    with pytest.raises(ValueError, match="timeshared plan"):
        kept_phases(_plan(timeshare=False), 1 << 40)
    with pytest.raises(ValueError, match="LoRA"):
        kept_phases(_plan(lora_rank=4), 1 << 40)
    with pytest.raises(ValueError, match="usable_bytes"):
        kept_phases(_plan(), 0)
    assert isinstance(kept_phases(_plan(), 1 << 40)["train"], KeptPhase)


def test_the_host_holds_adamws_state_only_where_a_scoring_does_not_keep_the_policy():
    from tidal.plan import kept_host

    plan = _plan()
    roomy = kept_phases(plan, 1 << 40)
    assert "policy" in roomy["reference"].kept
    held = kept_host(plan, roomy)
    assert "optimizer states (timeshare host copy)" not in held
    assert held["actor weights (timeshare host copy)"] == plan.host["actor weights (timeshare host copy)"]
    assert held["reference weights (timeshare host copy)"] == plan.host["reference weights (timeshare host copy)"]
    ref = plan.timeshared["reference"]
    policy = roomy["reference"].kept["policy"]
    tight = kept_phases(plan, ref.resident_bytes + phase_need_bytes(ref.transient_bytes) + policy - 1)
    assert tight["reference"].kept == {}
    assert kept_host(plan, tight) == plan.host  # the state leaves at the scoring: its host copy is made
    # Streamed or offloaded, the state lives on the host whatever is kept.
    offloaded = _plan(optimizer="adamw_offload")
    assert kept_host(offloaded, kept_phases(offloaded, 1 << 40)) == offloaded.host


def test_an_optimizer_state_on_the_host_comes_in_behind_the_backward_where_it_fits_whole():
    from tidal.plan.keeps import PREFETCHED_STATE

    plan = _plan(optimizer="adamw_offload", optim_stream_chunk_bytes=1 << 10)
    state = plan.host["optimizer states (timeshare host copy)"]
    ref = plan.timeshared["reference"].resident["reference params"]
    train, step = plan.timeshared["train"], plan.timeshared["optimizer_step"]
    roomy = kept_phases(plan, 1 << 40)
    assert roomy["train"].kept == {"reference": ref, PREFETCHED_STATE: state}
    # The step finds the whole state there, where alone it would hold its streamed chunks.
    chunks = step.resident["optimizer states"]
    assert 0 < chunks < state
    assert roomy["optimizer_step"].kept == {"reference": ref, PREFETCHED_STATE: state - chunks}
    assert roomy["optimizer_step"].peak_bytes == step.peak_bytes - chunks + state + ref
    # Whole or not at all: one byte short of the state beside the reference and the need.
    edge = train.resident_bytes + phase_need_bytes(train.transient_bytes) + ref + state
    assert PREFETCHED_STATE in kept_phases(plan, edge)["train"].kept
    short = kept_phases(plan, edge - 1)
    assert short["train"].kept == {"reference": ref} and PREFETCHED_STATE not in short["optimizer_step"].kept
    # Not streamed, the step brings the whole state in anyway: nothing beyond it at the step.
    whole = _plan(optimizer="adamw_offload")
    got = kept_phases(whole, 1 << 40)
    assert PREFETCHED_STATE in got["train"].kept and PREFETCHED_STATE not in got["optimizer_step"].kept
    # Moving with the policy ("adamw"), the state is on the device through the backward already.
    assert all(PREFETCHED_STATE not in k.kept for k in kept_phases(_plan(), 1 << 40).values())


# ---- beside a vLLM engine ---------------------------------------------------------------------
def _engine_plan(**kw):
    return _plan(rollout_engine="vllm", **kw)


def _engine_edge(plan, kept_bytes):
    """The room at which the engine's turn keeps exactly ``kept_bytes`` beside it."""
    rollout = plan.timeshared["rollout"]
    engine = rollout.resident["engine weights"] + rollout.transient["engine kv cache"]
    return phase_need_bytes(engine) + ENGINE_GENERATION_BYTES + kept_bytes


def test_the_engine_keeps_the_policy_then_its_state_with_room_for_the_gradients_then_the_reference():
    plan = _engine_plan()
    ts = plan.timeshared
    policy, state = ts["train"].resident["actor params"], ts["train"].resident["optimizer states"]
    grads, ref = ts["optimizer_step"].resident["grads"], ts["reference"].resident["reference params"]
    # (the reference, behind the generation, needs only what is free once the cache woke: the
    # engine's margin of 10% and 256 MiB is the toy's room for it)
    assert "policy" not in kept_phases(plan, _engine_edge(plan, policy) - 1)["rollout"].kept
    assert kept_phases(plan, _engine_edge(plan, policy))["rollout"].kept["policy"] == policy
    # the state stays only with the gradients' memory beside it (torch's cache keeps it after the step)
    short = kept_phases(plan, _engine_edge(plan, policy + state + grads) - 1)["rollout"].kept
    assert short["policy"] == policy and ENGINE_KEPT_STATE not in short
    assert kept_phases(plan, _engine_edge(plan, policy + state + grads))["rollout"].kept[ENGINE_KEPT_STATE] == state
    roomy = kept_phases(plan, 1 << 40)
    assert roomy["rollout"].kept == {"policy": policy, ENGINE_KEPT_STATE: state, "reference": ref}
    # the policy kept: the push's moment (both weights at once) is not beyond what is kept
    assert roomy["rollout"].peak_bytes == (
        ts["rollout"].resident["engine weights"]
        + ts["rollout"].transient["engine kv cache"]
        + ts["rollout"].transient["engine generation workspace"]
        + policy
        + state
        + ref
        + plan.config.misc_bytes
    )


def test_a_state_that_left_for_the_engine_comes_back_behind_the_backward_not_for_the_scoring():
    plan = _engine_plan()
    ts = plan.timeshared
    policy, state = ts["train"].resident["actor params"], ts["train"].resident["optimizer states"]
    # room for the policy beside the engine, not its state; the reference's scoring keeps the weights only
    got = kept_phases(plan, _engine_edge(plan, policy + state))
    assert ENGINE_KEPT_STATE not in got["rollout"].kept
    assert got["reference"].kept == {"policy": policy}
    assert kept_phases(plan, 1 << 40)["reference"].kept == {"policy": policy + state}


def test_the_host_holds_every_role_beside_an_engine():
    """An upper bound: the engine's first turns follow first measurements (the 7B run in 80 GiB
    moved AdamW's state out once, in its second step, though the steady state keeps it)."""
    plan = _engine_plan()
    assert kept_host(plan, kept_phases(plan, 1 << 40)) == plan.host
    hf = _plan()
    assert "optimizer states (timeshare host copy)" not in kept_host(hf, kept_phases(hf, 1 << 40))


def test_the_room_the_engine_keeps_free_is_the_trainer_s():
    pytest.importorskip("trl")
    from tidal.integrations.trl.adapter import VLLM_GENERATION_BYTES

    assert ENGINE_GENERATION_BYTES == VLLM_GENERATION_BYTES
