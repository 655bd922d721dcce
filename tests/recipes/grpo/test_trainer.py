import pytest
import torch

transformers = pytest.importorskip("transformers")

from tidal.timeshare import TimeshareConfig  # noqa: E402
from tidal.timeshare.schedule import PhaseSchedule  # noqa: E402
from tidal_recipes.grpo import DigitTask, GRPOConfig, GRPOTrainer, LossConfig  # noqa: E402
from tidal_recipes.grpo.tasks import TASK_VOCAB  # noqa: E402
from tests.helpers import held_bytes  # noqa: E402


def tiny_policy(seed: int = 0, vocab: int = 16):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def run(steps: int, **kw):
    cfg = GRPOConfig(task=DigitTask(name="copy", num_digits=3), prompts_per_step=4, group_size=4, micro_batch=6, **kw)
    tr = GRPOTrainer(tiny_policy(), config=cfg)
    results = [tr.step() for _ in range(steps)]
    tr.close()
    return tr, results


@pytest.mark.parametrize("kw", [{}, {"mini_batches": 2}, {"grad_ckpt": True}, {"optimizer": "cpu_adam"}])
@pytest.mark.slow
def test_timeshare_does_not_change_training(kw):
    """Same seed with and without the timeshare: every statistic and every weight bit-exact."""
    a, ra = run(4, timeshare=True, **kw)
    b, rb = run(4, timeshare=False, **kw)
    assert [r.reward_mean for r in ra] == [r.reward_mean for r in rb]
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa, pb), n
    # every phase reports the process's peak resident host memory (Linux resets it per phase)
    assert all(ph["host_peak_rss_bytes"] > 0 for r in ra for ph in r.phases.values())
    # the timeshare really moved state: the reference and optimizer state went out and came back
    moved = sum(ph["moved_bytes"] for r in ra for ph in r.phases.values())
    assert moved > 0
    assert all(ph["moved_bytes"] == 0 for r in rb for ph in r.phases.values())


@pytest.mark.slow
def test_transitions_without_host_waits_do_not_change_training():
    """``tidal demo --async-transitions``: transitions return once their copies are queued and
    freed memory stays in the process (TidalGRPOTrainer's settings), with prefetch; bit-exact
    against the default timeshare."""
    cfg = TimeshareConfig(wait_for_copies=False, release_to_driver=False)
    a, ra = run(3, timeshare_config=cfg, prefetch=True)
    b, rb = run(3)
    assert [r.reward_mean for r in ra] == [r.reward_mean for r in rb]
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa, pb), n
    assert a.ts.config.wait_for_copies is False and any(rec.queued for rec in a.ts.records)


def fake_device(monkeypatch, capacity_bytes: int, trainers: list) -> None:
    """The CPU read as a device of ``capacity_bytes``: free = the capacity less the bytes of the
    trainers' storages (weights, buffers, optimizer state) that hold memory now (a prefetch
    allocates them in place). What the timeshare's keep and prefetch decisions read."""
    from tidal import guard
    from tidal.device import DeviceOps

    def used() -> int:
        held = {}
        for tr in trainers:
            tensors = [t for m in tr._modules() for t in [*m.parameters(), *m.buffers()]]
            tensors += [v for st in tr.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
            for t in tensors:
                st = t.untyped_storage()
                if st.nbytes() and not guard.is_freed(st):
                    held[st._cdata] = st.nbytes()
        return sum(held.values())

    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (capacity_bytes - used(), capacity_bytes))


def role_moves(tr) -> list:
    """The transitions that moved roles (switches, loads, prefetches), not the optimizer state
    streamed inside ``step()``."""
    return [rec for rec in tr.ts.records if not rec.kind.startswith("optim")]


def run_role_state_on_fake_device(monkeypatch, capacity_in_w: float, train_needs_w: float = 0.0):
    """4 steps of AdamW's state with the training role and prefetch on a device of
    ``capacity_in_w`` times the policy's weights (W) plus 256 MiB, the training phase read as
    needing ``train_needs_w`` W more than the others; returns (that trainer, W), checked
    bit-exact against the same run without prefetch."""
    kw = dict(optimizer_residency="role")
    w = sum(p.numel() * p.element_size() for p in tiny_policy().parameters())
    cfg = GRPOConfig(
        task=DigitTask(name="copy", num_digits=3), prompts_per_step=4, group_size=4, micro_batch=6, prefetch=True, **kw
    )
    a = GRPOTrainer(tiny_policy(), config=cfg)
    fake_device(monkeypatch, (256 << 20) + int(capacity_in_w * w), [a])
    if train_needs_w:
        extra = int(train_needs_w * w)
        monkeypatch.setattr(
            PhaseSchedule, "keep_free", lambda self, role, phase: (256 << 20) + (extra if phase == "train" else 0)
        )
    ra = [a.step() for _ in range(4)]
    monkeypatch.undo()
    b, rb = run(4, **kw)
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa, pb), n
    return a, w


@pytest.mark.parametrize("kw", [{}, {"optimizer": "cpu_adam"}, {"optimizer_residency": "role"}])
@pytest.mark.slow
def test_prefetch_with_room_for_every_role_moves_none_and_trains_the_same(kw):
    """Each turn keeps free what its phase needs (on the CPU 256 MiB) and moves out only what
    that takes: with room for every role nothing ever moves (issue 26: where the device has the
    room, memory for free costs no copy). Bit-exact against the timeshare without prefetch,
    which moves the reference and the optimizer state every step."""
    a, ra = run(3, prefetch=True, **kw)
    b, rb = run(3, **kw)
    assert [r.reward_mean for r in ra] == [r.reward_mean for r in rb]
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa, pb), n
    assert all(rec.bytes_in == rec.bytes_out == 0 and rec.roles_out == () for rec in role_moves(a))
    assert sum(rec.bytes_in + rec.bytes_out for rec in role_moves(b)) > 0
    assert all("prefetched_bytes" in ph for r in ra for ph in r.phases.values())
    with pytest.raises(ValueError, match="timeshare=True"):
        GRPOConfig(prefetch=True, timeshare=False)


@pytest.mark.slow
def test_prefetch_keeps_the_optimizer_state_where_it_fits_and_moves_it_behind_compute(monkeypatch):
    """AdamW's state with the training role, prefetch on, on a device with room for the policy
    (W), its state (2W) and 256 MiB beside, but not for the reference too (3.5W + 256 MiB): the
    rollout's turn keeps the state; its prefetch brings the reference in and writes the state
    back behind the rollout, so the reference's turn moves nothing; the scoring's prefetch
    brings the state back, so the training's turn drops the frozen reference and copies
    nothing. The policy's weights never move. Bit-exact against the timeshare without
    prefetch (in the helper)."""
    a, w = run_role_state_on_fake_device(monkeypatch, 3.5)
    recs = role_moves(a)
    # Step 0 moves nothing (AdamW's state does not exist before its first step()); the next
    # rollout's turn has no room for all three and copies the reference out once (its first
    # host copy): the only time it is written.
    first = recs[0]
    assert first.kind == "offload" and first.roles_out == ("reference",) and w <= first.bytes_out < 2 * w
    rest = recs[1:]
    # No turn of the rollout moves anything: the state stays through it, the weights never move.
    assert [(rec.kind, rec.role_in) for rec in rest] == 3 * [
        ("prefetch", "reference"),  # behind the rollout: the reference in, the state written back
        ("switch", "reference"),
        ("prefetch", "actor_train"),  # behind the scoring: the state back in
        ("switch", "actor_train"),
    ]
    for ahead_ref, to_ref, ahead_state, to_train in zip(*[iter(rest)] * 4):
        assert ahead_ref.bytes_in >= w and 2 * w <= ahead_ref.bytes_out < 3 * w  # the state, not the weights
        assert to_ref.roles_out == ("actor_train",) and to_ref.bytes_in == to_ref.bytes_out == 0
        assert 2 * w <= ahead_state.bytes_in < 3 * w
        # The frozen reference dropped without a copy, the state claimed from the prefetch.
        assert to_train.roles_out == ("reference",) and to_train.bytes_in == to_train.bytes_out == 0
    a.close()


@pytest.mark.slow
def test_prefetch_keeps_the_optimizer_state_through_every_phase_where_only_training_needs_more(monkeypatch):
    """The 7B demo on an H100: room for the policy (W), AdamW's state (2W) and the reference (W)
    with 256 MiB beside (4.5W + 256 MiB), but not for the training's need too (read here as W
    more than the other phases', as its gradients and activations are). The state never moves;
    the training's turn drops the frozen reference (copied out once, the first time), the
    rollout's prefetch brings it back, claimed by the scoring's turn. Bit-exact (in the helper)."""
    a, w = run_role_state_on_fake_device(monkeypatch, 4.5, train_needs_w=1.0)
    recs = role_moves(a)
    # Step 0 moves nothing (no state yet); step 1's training turn writes the reference out once.
    assert (recs[0].kind, recs[0].roles_out) == ("offload", ("reference",)) and w <= recs[0].bytes_out < 2 * w
    assert [(rec.kind, rec.role_in, rec.roles_out) for rec in recs[1:]] == 2 * [
        ("prefetch", "reference", ()),  # behind the rollout, nothing written back
        ("reload", "reference", ()),  # the scoring's turn claims it: nothing moves out
        ("offload", None, ("reference",)),  # the training's turn drops it
    ]
    assert all(rec.bytes_out == 0 for rec in recs[1:])
    assert all(rec.bytes_in == 0 for rec in recs[1:] if rec.kind != "prefetch")
    a.close()


@pytest.mark.slow
def test_cpu_adam_gradients_summed_on_the_device_equal_summed_on_the_host(monkeypatch):
    """3 micro-batches per step (6, 6, 4 sequences), fp32: autograd's sums in p.grad sent once
    per step equal the host's fp32 sums of each micro-batch's copy, bit for bit; the device
    mode builds CPUAdam without host staging and runs all but the last backward of each step
    in accumulate()."""
    from tidal import CPUAdam

    entered = []
    accumulate = CPUAdam.accumulate
    monkeypatch.setattr(CPUAdam, "accumulate", lambda self: (entered.append(1), accumulate(self))[1])
    a, ra = run(3, optimizer="cpu_adam", grad_accumulation="device")
    assert len(entered) == 3 * 2
    monkeypatch.setattr(CPUAdam, "accumulate", accumulate)
    b, rb = run(3, optimizer="cpu_adam", grad_accumulation="host")
    assert a.optimizer.host_accumulation is False and b.optimizer.host_accumulation is True
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa, pb), n
    with pytest.warns(UserWarning, match="grad_accumulation='host' is ignored"):
        GRPOConfig(grad_accumulation="host")
    with pytest.raises(ValueError, match="grad_accumulation must be"):
        GRPOConfig(optimizer="cpu_adam", grad_accumulation="gpu")


@pytest.mark.parametrize("residency", ["step", "role"])
@pytest.mark.slow
def test_optimizer_residency_does_not_change_training(residency):
    """AdamW's state streamed in during step() (the default), all in for step(), or moving with
    the training role: the same run bit for bit; only the role residency moves it at switches."""
    a, ra = run(3, optimizer_residency=residency)
    b, rb = run(3)
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa, pb), n
    optim_moves = [rec for rec in a.ts.records if rec.kind.startswith("optim")]
    assert (optim_moves == []) == (residency == "role")
    with pytest.raises(ValueError, match="optimizer_residency must be"):
        GRPOConfig(optimizer_residency="gpu")


def test_cpu_adam_bf16_moments_from_the_config():
    tr, _ = run(1, optimizer="cpu_adam", cpu_adam_state_dtype="bf16")
    assert tr.optimizer.state_dtype == torch.bfloat16
    assert all(st["exp_avg"].dtype == torch.bfloat16 for st in tr.optimizer.state.values())
    with pytest.warns(UserWarning, match="cpu_adam_state_dtype='bf16' is ignored"):
        GRPOConfig(cpu_adam_state_dtype="bf16")


def test_roles_take_turns_on_the_device():
    """During the reference phase the policy's weights are off the device (storage size 0),
    during training the reference's are, and the policy's weights exist once (rollout and
    training share them)."""
    cfg = GRPOConfig(task=DigitTask(name="copy", num_digits=3), prompts_per_step=2, group_size=4, micro_batch=8)
    tr = GRPOTrainer(tiny_policy(), config=cfg)
    seen = {}
    policy_w = tr.policy.model.embed_tokens.weight
    ref_w = tr.reference.model.embed_tokens.weight

    def fwd_hook(name):
        def hook(module, args):
            seen.setdefault(name, (held_bytes(policy_w), held_bytes(ref_w)))

        return hook

    tr.reference.register_forward_pre_hook(fwd_hook("reference"))
    tr.policy.register_forward_pre_hook(fwd_hook("policy"))
    tr.step()
    full = policy_w.numel() * policy_w.element_size()
    assert seen["policy"] == (full, 0)  # rollout: reference out
    assert seen["reference"] == (0, full)  # reference: policy out
    assert tr.all_resident_state_bytes() > tr.state_bytes_on_device()
    tr.close()
    assert policy_w.untyped_storage().nbytes() == full and ref_w.untyped_storage().nbytes() == full


def test_kl_zero_skips_the_reference_role():
    tr, res = run(2, loss=LossConfig(kl_coef=0.0))
    assert tr.reference is None
    assert all("reference" not in r.phases for r in res)
    assert all("kl" not in r.stats for r in res)


def test_lora_policy_is_its_own_reference():
    peft = pytest.importorskip("peft")
    policy = peft.get_peft_model(tiny_policy(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    cfg = GRPOConfig(task=DigitTask(name="copy", num_digits=3), prompts_per_step=2, group_size=4, micro_batch=8)
    tr = GRPOTrainer(policy, config=cfg)
    assert tr.reference is None and tr.lora
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    res = [tr.step() for _ in range(3)]
    tr.close()
    assert all("reference" in r.phases for r in res)
    assert res[-1].stats["kl"] > 0  # the adapters moved the policy away from the base
    for n, p in policy.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base[n]), f"{n}: a frozen base weight changed"
    with pytest.raises(ValueError, match="reference= is not used"):
        GRPOTrainer(policy, config=cfg, reference=tiny_policy())


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="mini_batches"):
        GRPOConfig(prompts_per_step=3, group_size=3, mini_batches=2)
    with pytest.raises(ValueError, match="optimizer"):
        GRPOConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=0)
    with pytest.raises(ValueError, match=f"at least {TASK_VOCAB}"):
        GRPOTrainer(tiny_policy(vocab=8))
    with pytest.raises(ValueError, match="rollout_graph=True .* CUDA device"):
        GRPOTrainer(tiny_policy(), config=GRPOConfig(rollout_graph=True))


@pytest.mark.slow
def test_evict_as_needed_keeps_the_roles_resident_and_trains_the_same():
    """TimeshareConfig(evict="as_needed") where every role fits (the CPU here): bit-exact against
    the usual timeshare, and after the first step nothing moves between phases (AdamW's state
    with the training role)."""
    from tidal.timeshare import TimeshareConfig

    a, ra = run(3, timeshare_config=TimeshareConfig(evict="as_needed"), optimizer_residency="role")
    b, rb = run(3, optimizer_residency="role")
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa, pb), n
    assert sum(ph["moved_bytes"] for ph in rb[-1].phases.values()) > 0
    assert [ph["moved_bytes"] for r in ra[1:] for ph in r.phases.values()] == [0] * 2 * len(ra[0].phases)


def test_the_training_turn_keeps_a_role_only_outside_the_allocators_fragments(monkeypatch):
    """On an accelerator each turn keeps free what its phase allocated the step before (+10%,
    256 MiB); the training's turn adds the free pieces of the allocator's partly used segments,
    so that only the driver's free memory and whole free segments count as room to keep the
    reference beside the backward (its large blocks may not fit the pieces: TidalGRPOTrainer ran
    out of memory so, run i5)."""
    from tests.helpers import FakeAllocator
    from tidal.timeshare.phase_memory import PhaseMemory

    tr = GRPOTrainer(tiny_policy(), config=GRPOConfig(prefetch=True, micro_batch=6))
    dev = FakeAllocator()
    tr.schedule.memory = memory = PhaseMemory(lambda: dev.now, lambda: dev.high, dev.reset)
    monkeypatch.setattr(tr.ts.ops, "fragmented_free_bytes", lambda: 3 << 30)
    keep = tr.schedule.keep_free
    assert keep("actor_train", "train") is None  # not measured yet
    memory.growth.update(rollout=1 << 30, reference=2 << 30, train=10 << 30)
    assert keep("rollout", "rollout") == int(1.1 * (1 << 30)) + (256 << 20)
    assert keep("reference", "reference") == int(1.1 * (2 << 30)) + (256 << 20)
    assert keep("actor_train", "train") == int(1.1 * (10 << 30)) + (256 << 20) + (3 << 30)
    monkeypatch.undo()
    tr.close()
