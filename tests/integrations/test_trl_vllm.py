"""TidalGRPOTrainer / TidalRLOOTrainer with TRL's colocated vLLM (``use_vllm=True``,
``vllm_mode="colocate"``) against TRL + the same engine alone, on a CPU with a test double of
vLLM's ``LLM`` (tests/integrations/fake_vllm.py: a real small model, real memory, sleep levels
that release it). The GPU runs use vLLM itself (benchmarks/gpu.sh vllm)."""

from __future__ import annotations

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from tests.helpers import held_bytes  # noqa: E402
from tests.integrations import fake_vllm  # noqa: E402
from tests.integrations.test_trl import _args, _data, _history, _weights, save_char_models  # noqa: E402
from tidal.integrations.seams import SeamError  # noqa: E402
from tidal.integrations.trl import TidalConfig, TidalGRPOTrainer, TidalRLOOTrainer  # noqa: E402
from tidal.integrations.vllm import VllmEngine  # noqa: E402
from tidal_recipes.grpo.char_task import reward_sevens  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_char_models(path)
    return str(path)


@pytest.fixture
def engine(monkeypatch):
    fake_vllm.install(monkeypatch)
    return fake_vllm.FakeLLM


def _vllm_run(cls, tiny, out, *, sleep=True, tidal_config=None, config=None, steps=3, vllm_mode="colocate", **kw):
    extra = {"tidal": tidal_config} if tidal_config is not None else {}
    args = _args(
        out,
        config=config,
        max_steps=steps,
        use_vllm=True,
        vllm_mode=vllm_mode,
        vllm_enable_sleep_mode=sleep,
        vllm_gpu_memory_utilization=0.3,
        **kw,
    )
    trainer = cls(model=tiny, reward_funcs=reward_sevens, args=args, train_dataset=_data(), **extra)
    trainer.train()
    return trainer


def _watched(*callbacks):
    """TidalGRPOTrainer that puts itself in the returned list as it is built (what a test's
    engine hooks read of it mid-run), with ``callbacks`` added."""
    box: list = []

    class Watched(TidalGRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            box.append(self)
            for cb in callbacks:
                self.add_callback(cb)

    return Watched, box


def _same(a, b) -> None:
    assert _history(a) == _history(b) and len(_history(a)) >= 3
    want, got = _weights(a), _weights(b)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("sleep", [True, False])
def test_grpo_with_vllm_is_bit_identical_to_trl_with_vllm_alone(tiny, tmp_path, engine, sleep):
    """The same logs and final weights; and not a no-op: while the engine generates, the policy
    (its weights in the engine) and the reference are on the host; with sleep mode the engine's
    memory is released between generations."""
    plain = _vllm_run(trl.GRPOTrainer, tiny, tmp_path / "plain", sleep=sleep)
    seen: list[tuple[bool, bool]] = []

    def at_generate(llm):
        ts = ours_box[0].timeshare
        seen.append((ts.is_resident("policy"), ts.is_resident("reference")))

    Watched, ours_box = _watched()
    engine.on_generate = at_generate
    ours = _vllm_run(Watched, tiny, tmp_path / "ours", sleep=sleep)
    _same(plain, ours)
    assert seen == 3 * [(False, False)]
    llm = ours.vllm_generation.llm
    assert isinstance(ours.tidal.engine, VllmEngine)
    # The policy left for each generation (its weights were in the engine) and came back.
    out = [r for r in ours.timeshare.records if r.kind == "offload" and "policy" in r.roles_out]
    assert len(out) == 3 and all(r.bytes_out > 0 for r in out)
    if sleep:
        assert llm.held_bytes() == 0  # asleep after the last generation: weights and KV cache released
        assert [c for c in llm.calls if c[0] == "sleep"] == 4 * [("sleep", 2)]
    else:
        assert llm.held_bytes() == llm.weights_bytes + llm.kv_cache_bytes


def test_rloo_with_vllm_is_bit_identical_to_trl_with_vllm_alone(tiny, tmp_path, engine):
    plain = _vllm_run(trl.RLOOTrainer, tiny, tmp_path / "plain", config=trl.RLOOConfig, beta=0.05)
    ours = _vllm_run(TidalRLOOTrainer, tiny, tmp_path / "ours", config=trl.RLOOConfig, beta=0.05)
    _same(plain, ours)


def test_the_kv_cache_is_sized_as_tidal_is_told_and_results_do_not_change(tiny, tmp_path, engine):
    plain = _vllm_run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    assert engine.instances[-1].kv_cache_bytes == int(0.3 * fake_vllm.DEVICE_BYTES) - engine.instances[-1].weights_bytes
    ours = _vllm_run(TidalGRPOTrainer, tiny, tmp_path / "ours", tidal_config=TidalConfig(vllm_kv_cache_bytes=3 << 20))
    assert ours.vllm_generation.llm.kv_cache_bytes == 3 << 20
    _same(plain, ours)


def test_an_auto_kv_cache_holds_every_sequence_of_a_generation_at_its_longest(tiny, tmp_path, engine):
    """``vllm_kv_cache_bytes="auto"``: the engine's cache is sized for its generation batch (TRL's
    ``max_num_seqs``) at ``vllm_max_model_length`` tokens in whole blocks, from the policy's
    shape; the results are TRL + vLLM alone's. Without that length it is refused first."""
    from tidal.integrations.vllm import kv_bytes_per_token, kv_cache_bytes_for

    plain = _vllm_run(trl.GRPOTrainer, tiny, tmp_path / "plain", vllm_max_model_length=100)
    cfg = TidalConfig(vllm_kv_cache_bytes="auto")
    ours = _vllm_run(TidalGRPOTrainer, tiny, tmp_path / "ours", tidal_config=cfg, vllm_max_model_length=100)
    _same(plain, ours)
    policy = ours.accelerator.unwrap_model(ours.model)
    sequences = ours.args.per_device_train_batch_size * ours.args.steps_per_generation
    want = kv_cache_bytes_for(policy.config, torch.float32, sequences=sequences, max_len=100)
    # 7 blocks of 16 tokens a sequence, and vLLM's null block
    assert want == (sequences * 7 + 1) * 16 * kv_bytes_per_token(policy.config, torch.float32)
    assert ours.vllm_generation.llm.preemptions == 0
    assert ours.vllm_generation.llm.kv_cache_bytes == want and ours.tidal.engine.kv_cache_bytes == want
    with pytest.raises(ValueError, match="vllm_kv_cache_bytes='auto'.*vllm_max_model_length"):
        _vllm_run(TidalGRPOTrainer, tiny, tmp_path / "bad", tidal_config=cfg)
    assert len(fake_vllm.FakeLLM.instances) == 2  # refused before TRL built an engine


def test_vllm_settings_tidal_cannot_manage_are_refused_before_any_work(tiny, tmp_path, engine):
    args = _args(tmp_path, use_vllm=True, vllm_mode="remote")
    with pytest.raises(ValueError, match="vllm_mode='colocate'.* or 'server'"):
        TidalGRPOTrainer(model=tiny, reward_funcs=reward_sevens, args=args, train_dataset=_data())
    assert engine.instances == []  # refused before the engine was built
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="vllm_kv_cache_bytes must be an int > 0, 'auto' or None"):
            TidalConfig(vllm_kv_cache_bytes=bad)


def test_an_engine_without_the_surfaces_tidal_uses_is_refused_naming_the_tested_version():
    import types

    import tidal

    ts = tidal.Timeshare(device="cpu")
    ts.add_role("policy", model=torch.nn.Linear(4, 4))

    class NoSleep:
        def generate(self, prompts): ...
        def wake_up(self, tags=None): ...
        def reset_prefix_cache(self): ...

    with pytest.raises(SeamError, match=r"NoSleep\.sleep is missing.*vllm 0\.25\.0"):
        VllmEngine(NoSleep(), ts)
    llm = NoSleep()
    llm.sleep = lambda level=1: None
    type(llm).sleep = lambda self, level=1: None
    llm.llm_engine = types.SimpleNamespace(model_executor=None)
    with pytest.raises(SeamError, match="load_weights is missing"):
        VllmEngine(llm, ts)
    ts.close()


POINTS = [
    ("wake_up", ("weights",)),
    ("map", ("weights",)),  # part-way through the weights' wake, some of them mapped
    ("load_weights", None),
    ("wake_up", ("kv_cache",)),
    ("map", ("kv_cache",)),
    ("generate", None),
    ("decode", None),  # part-way through a generation (the first step's), its requests unfinished
    ("sleep", None),
]


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [False, True], ids=["switch", "prefetch"])
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("point", POINTS, ids=lambda p: p[0] + ("/" + p[1][0] if p[1] else ""))
def test_a_fault_at_any_step_of_the_engines_turn_leaves_the_training_state_restorable(
    tiny, tmp_path, engine, point, exc, prefetch
):
    """An exception as the engine wakes, takes the weights, generates or sleeps (the second
    step's; KeyboardInterrupt too): the policy, its optimizer state and the reference come back
    with the values they had when that step began, and the timeshare still takes turns. With
    prefetch, a fault in the generation meets the reference's prefetch started behind it."""
    from transformers import TrainerCallback

    snaps: list = []

    class Snapshot(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            trainer = box[0]
            snaps.append(
                (
                    {k: v.clone() for k, v in trainer.model.state_dict().items()},
                    {k: v.clone() for k, v in trainer.ref_model.state_dict().items()},
                    _optim_state(trainer.optimizer),
                )
            )

    Faulty, box = _watched(Snapshot())

    method, tags = point
    # The engine's first sleep is at its construction, its first load_weights in the first step;
    # a map's count is of every allocation of that tag: the second weight of the second step.
    weights = len(list(fake_vllm.FakeLLM(tiny).model.parameters()))
    nth = {"sleep": 3, "map": weights + 2 if tags == ("weights",) else 2}.get(method, 2)
    engine.fail = (method, tags, exc, nth)
    with pytest.raises(exc, match="injected at"):
        _vllm_run(Faulty, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=prefetch))
    trainer = box[0]
    ts = trainer.timeshare
    policy, ref, optim = snaps[-1]
    with ts.use("policy"):
        assert all(torch.equal(v, policy[k]) for k, v in trainer.model.state_dict().items())
        got = _optim_state(trainer.optimizer)
        assert got.keys() == optim.keys() and all(torch.equal(got[k], optim[k]) for k in got)
    with ts.use("reference"):
        assert all(torch.equal(v, ref[k]) for k, v in trainer.ref_model.state_dict().items())
        assert held_bytes(next(trainer.ref_model.parameters())) > 0
    assert fake_vllm.FakePool.instance.consistent()  # the engine's memory as it counts it: it can wake
    assert trainer.vllm_generation.llm.request_states == {}  # no request left to come back in the next


def _optim_state(optimizer) -> dict:
    inner = getattr(optimizer, "optimizer", optimizer)
    sd = inner.state_dict()
    return {f"{i}.{k}": v.clone() for i, st in sd["state"].items() for k, v in st.items() if torch.is_tensor(v)}


def test_a_read_of_the_moved_out_policy_while_the_engine_generates_is_tidals_clear_error(tiny, tmp_path, engine):
    errors: list[str] = []

    def touch(llm):
        if errors:
            return
        try:
            next(box[0].model.parameters()).sum()
        except RuntimeError as e:
            errors.append(str(e))

    Watched, box = _watched()

    engine.on_generate = touch
    _vllm_run(Watched, tiny, tmp_path / "ours", steps=1)
    assert errors and "role 'policy'" in errors[0] and "tidal" in errors[0], errors


def _fake_capacity(monkeypatch, capacity: int, box: list) -> None:
    """The CPU read as a device of ``capacity`` bytes: free = it less what the trainer's roles
    (their storages holding memory now) and the engine hold."""
    from tidal import guard
    from tidal.device import DeviceOps

    def used() -> int:
        if not box:
            return 0
        tr, held = box[0], {}
        mods = [tr.model, tr.ref_model]
        inner = getattr(tr.optimizer, "optimizer", tr.optimizer)
        tensors = [t for m in mods if m is not None for t in [*m.parameters(), *m.buffers()]]
        tensors += [p.grad for p in tr.model.parameters() if p.grad is not None]
        if inner is not None:
            tensors += [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() and not guard.is_freed(st):
                held[st._cdata] = st.nbytes()
        engine = getattr(tr, "vllm_generation", None)
        return sum(held.values()) + (engine.llm.held_bytes() if engine is not None else 0)

    monkeypatch.setattr(DeviceOps, "driver_free_bytes", lambda self: (capacity - used(), capacity))


@pytest.mark.parametrize("room", ["all", "engine_only"])
def test_with_prefetch_the_engines_turns_keep_what_fits_beside_its_measured_memory(
    tiny, tmp_path, engine, monkeypatch, room
):
    """Once the engine's weights and cache have woken once (their bytes read at the device's
    free memory), a generation moves out only what it must: with room for everything nothing
    moves for the engine after the first; with room for the engine alone the policy goes each
    time. The same results as TRL + vLLM alone either way."""
    from tidal.integrations.trl import adapter as trl_adapter

    plain = _vllm_run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    Watched, box = _watched()

    # The generation's own room: small on this device (the engine's memory is a few MiB).
    monkeypatch.setattr(trl_adapter, "VLLM_GENERATION_BYTES", 1 << 20)
    capacity = (1 << 40) if room == "all" else (8 << 20) + fake_vllm.FakeLLM(tiny).weights_bytes * 3
    _fake_capacity(monkeypatch, capacity, box)
    ours = _vllm_run(Watched, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True))
    _same(plain, ours)
    eng = ours.tidal.engine
    assert set(eng.woken) == {"weights", "kv_cache"} and eng.woken["weights"] == ours.vllm_generation.llm.weights_bytes
    last = [h for h in ours.state.log_history if "loss" in h][-1]
    assert last["tidal/engine_gib/weights"] == eng.woken["weights"] / 2**30  # the log says it too
    policy_out = [r for r in eng.moves if "policy" in r.roles_out]
    if room == "all":
        assert len(policy_out) == 1  # the first generation only, before the engine was measured
    else:
        assert len(policy_out) == 3


def test_with_prefetch_the_role_that_scores_next_comes_in_behind_the_engines_generation(tiny, tmp_path, engine):
    """The engine's room made, the reference (which computes after the generation) is brought in
    while the engine generates, and no cache release waits for it; the results are TRL + vLLM
    alone's."""
    plain = _vllm_run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    Watched, box = _watched()
    seen: list = []
    fake_vllm.FakeLLM.on_generate = lambda llm: seen.append(
        [(r.kind, r.role_in) for r in box[0].timeshare.records][-1:]
    )
    ours = _vllm_run(Watched, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True))
    _same(plain, ours)
    assert len(seen) == 3 and all(last == [("prefetch", "reference")] for last in seen), seen


def test_a_wake_out_of_memory_beside_a_kept_role_wakes_again_with_it_out_and_results_do_not_change(
    tiny, tmp_path, engine, monkeypatch
):
    """With prefetch the engine's turns keep the policy beside the engine's KV cache where the
    driver read room for it; on a device that turns out shorter (the policy takes more of it
    than the reading said: what another process took since), the cache's wake runs out of
    memory. It goes back to sleep, the policy to the host, the engine wakes again (counted in
    tidal/engine_oom_retries), and the results are TRL + vLLM alone's; the next turn moves the
    policy out before the cache wakes (what the retry did), so its wake does not fail again."""
    plain = _vllm_run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    Watched, box = _watched()

    def free() -> int:
        llm, resident = engine.instances[-1], box[0].timeshare.resident_roles
        # The device: the engine's weights, the policy (taking a KV cache's worth) and half a cache.
        policy = llm.kv_cache_bytes if "policy" in resident else 0
        return llm.weights_bytes + llm.kv_cache_bytes * 3 // 2 - llm.held_bytes() - policy

    engine.device_free = free
    _fake_capacity(monkeypatch, 1 << 40, box)  # the driver reads room for every role beside the engine
    ours = _vllm_run(Watched, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=True))
    _same(plain, ours)
    retries = [h["tidal/engine_oom_retries"] for h in ours.state.log_history if "loss" in h]
    # The first turn moved every role (nothing measured yet); the second kept the policy and ran
    # short; the third moved it out first.
    assert retries == [0, 1, 0]
    assert fake_vllm.FakePool.instance.consistent()


@pytest.mark.parametrize("prefetch", [False, True], ids=["switch", "prefetch"])
def test_a_generation_out_of_memory_runs_again_and_results_do_not_change(tiny, tmp_path, engine, prefetch):
    """The engine runs out of memory part-way through the second step's generation (the
    reference coming in behind it, with prefetch): its requests are dropped, every role not in
    use leaves, and it generates again from the same random draws (counted in
    tidal/engine_oom_retries): the logs and weights are TRL + vLLM alone's."""
    # TRL + vLLM alone, the tokens each generation decodes counted (a failure never reached).
    engine.fail = ("decode", None, RuntimeError, 1 << 30)
    starts: list[int] = []
    engine.on_generate = lambda llm: starts.append(llm._seen.get(("decode", None), 0))
    plain = _vllm_run(trl.GRPOTrainer, tiny, tmp_path / "plain")
    engine.on_generate = None
    assert len(starts) == 3 and starts[1] > 0
    engine.fail = ("decode", None, torch.OutOfMemoryError, starts[1] + 3)  # in the second generation
    ours = _vllm_run(TidalGRPOTrainer, tiny, tmp_path / "ours", tidal_config=TidalConfig(prefetch=prefetch))
    _same(plain, ours)
    retries = [h["tidal/engine_oom_retries"] for h in ours.state.log_history if "loss" in h]
    assert sum(retries) == 1 and retries[0] == 0
    assert ours.vllm_generation.llm.request_states == {}


def test_a_trl_without_the_vllm_module_function_tidal_replaces_is_refused(tiny, tmp_path, engine, monkeypatch):
    import trl.generation.vllm_generation as vg

    monkeypatch.delattr(vg, "empty_cache")
    with pytest.raises(SeamError, match=r"vllm_generation\.empty_cache is missing.*trl 1\.16\.0"):
        _vllm_run(TidalGRPOTrainer, tiny, tmp_path / "ours", tidal_config=TidalConfig(), steps=1)


def test_the_logged_phase_peaks_leave_out_the_sleeping_engines_pool(tiny, tmp_path, engine, monkeypatch):
    """Torch's allocator keeps counting vLLM's pool as allocated while the engine sleeps, its
    memory back with the driver: each phase the engine slept through logs its peak less the
    engine's (as its wakes measured it), the generation as read."""
    from tidal.timeshare.phase_memory import PhaseMemory

    counted = 10 << 30  # what torch's counters read in every phase, the sleeping pool in it
    monkeypatch.setattr(
        PhaseMemory, "of", classmethod(lambda cls, device: cls(lambda: counted, lambda: counted, lambda: None))
    )
    Watched, box = _watched()
    _fake_capacity(monkeypatch, 1 << 40, box)
    ours = _vllm_run(Watched, tiny, tmp_path / "ours")
    eng = ours.tidal.engine
    asleep = eng.asleep_bytes()
    assert asleep == eng.woken["weights"] + eng.woken["kv_cache"] > 0
    last = [h for h in ours.state.log_history if "loss" in h][-1]
    assert last["tidal/peak_gib/generate"] == counted / 2**30
    for phase in ("reference", "loss", "backward"):
        assert last[f"tidal/peak_gib/{phase}"] == (counted - asleep) / 2**30, phase


def test_server_mode_is_bit_identical_to_trl_with_the_same_server_alone(tiny, tmp_path, engine, monkeypatch):
    """vLLM in server mode (the engine on other GPUs, a test double of TRL's client here): the
    training side's roles take turns as with HF generate, the policy on the device while TRL
    streams its weights to the server; the same logs and final weights as TRL alone."""
    monkeypatch.setattr(fake_vllm.FakeClient, "model_path", tiny)
    plain = _vllm_run(trl.GRPOTrainer, tiny, tmp_path / "plain", vllm_mode="server")
    ours = _vllm_run(
        TidalGRPOTrainer, tiny, tmp_path / "ours", vllm_mode="server", tidal_config=TidalConfig(prefetch=True)
    )
    _same(plain, ours)
    client = fake_vllm.FakeClient.instances[-1]
    assert [c[0] for c in client.calls].count("update_named_params") == 3  # the weights sent each step
    kinds = [(r.kind, r.roles_out, r.role_in) for r in ours.timeshare.records]
    assert kinds.count(("switch", ("policy",), "reference")) + kinds.count(("reload", (), "reference")) >= 3
    servers = [c.server for c in fake_vllm.FakeClient.instances]
    assert ours.tidal.engine is None and all(any(e is x for x in servers) for e in engine.instances)  # none here
