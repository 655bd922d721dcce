"""tidal.integrations.vllm.VllmEngine on its own, in a loop that drives the engine itself (not
TRL's), against the test double of vLLM's ``LLM`` (tests/integrations/fake_vllm.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tidal  # noqa: E402
from tests.integrations import fake_vllm  # noqa: E402
from tests.integrations.test_trl import save_char_models  # noqa: E402
from tidal.integrations.vllm import VllmEngine, kv_bytes_per_token  # noqa: E402


@pytest.fixture(autouse=True)
def pool(monkeypatch):
    """The double's sleep-mode pool for the process, as vLLM's is (one a process)."""
    return fake_vllm.install_pool(monkeypatch)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_char_models(path)
    return str(path)


def _setup(tiny):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    for m in (policy, reference):
        for t in m.parameters():
            t.data = t.data.clone()  # memory of its own: a load may map the checkpoint file
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ts = tidal.Timeshare(device="cpu")
    ts.add_role("policy", model=policy, optimizer=opt)
    ts.add_role("reference", model=reference, frozen=True)
    llm = fake_vllm.FakeLLM(tiny, enable_sleep_mode=True, kv_cache_memory_bytes=1 << 20, seed=3)
    return policy, opt, ts, llm


def _train_a_little(policy, opt):
    loss = sum(p.float().pow(2).sum() for p in policy.parameters()) * 1e-3
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_a_loop_of_its_own_generates_with_the_policys_new_weights_its_roles_out_of_the_way(tiny):
    policy, opt, ts, llm = _setup(tiny)
    engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20)
    prompts = [{"prompt_token_ids": [1, 2, 3]}]
    sp = fake_vllm.SamplingParams(max_tokens=4, temperature=1.0, logprobs=0)
    seen = []

    def at_generate(running):
        seen.append(
            (ts.resident_roles, running.held_bytes(), {n: p.clone() for n, p in running.model.named_parameters()})
        )

    fake_vllm.FakeLLM.on_generate = at_generate
    trained = []
    try:
        for _ in range(3):
            with ts.use("policy"):
                _train_a_little(policy, opt)
                trained.append({n: p.detach().clone() for n, p in policy.named_parameters()})
            with engine.generating(policy) as running:
                assert running.generate(prompts, sp)[0].outputs[0].token_ids
            assert llm.held_bytes() == 0  # asleep: weights and KV cache released
    finally:
        fake_vllm.FakeLLM.on_generate = None
    # Every generation ran with no role on the device, the engine awake in full, and the
    # policy's weights of that step in it, bit for bit.
    assert [(roles, held) for roles, held, _ in seen] == 3 * [([], llm.weights_bytes + llm.kv_cache_bytes)]
    for (_, _, engine_w), want in zip(seen, trained):
        assert engine_w.keys() == want.keys() and all(torch.equal(engine_w[n], want[n]) for n in want)
    assert not torch.equal(trained[0]["lm_head.weight"], trained[2]["lm_head.weight"])  # it did train
    ts.close()


def test_without_a_push_after_a_level_two_sleep_the_engines_weights_are_garbage(tiny):
    """The trap tidal's hand-over closes (vLLM's issue 29341): level 2 drops the weights; woken
    without a push, they are not the model's."""
    llm = fake_vllm.FakeLLM(tiny, enable_sleep_mode=True, kv_cache_memory_bytes=1 << 20)
    llm.sleep(level=2)
    llm.wake_up()
    assert all(torch.isnan(p).all() for p in llm.model.parameters())


def test_the_room_kept_beside_the_cache_keeps_a_role_that_fits(tiny):
    policy, opt, ts, llm = _setup(tiny)
    engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20, keep_free_bytes=1 << 20)
    with engine.generating(policy):
        assert "policy" in ts.resident_roles  # a CPU "device" has the room: nothing moved for the cache
    ts.close()


def test_bad_engine_settings_are_refused_before_any_work(tiny):
    policy, opt, ts, llm = _setup(tiny)
    with pytest.raises(ValueError, match="'actor' is not a role"):
        VllmEngine(llm, ts, policy="actor")
    with pytest.raises(ValueError, match="kv_cache_bytes must be an int >= 0"):
        VllmEngine(llm, ts, kv_cache_bytes=-1)
    with pytest.raises(ValueError, match="sleep_level must be 1 or 2"):
        VllmEngine(llm, ts, sleep_level=3)
    ts.close()


def test_a_kv_cache_for_a_generation_holds_each_sequence_in_whole_blocks():
    from transformers import Qwen2Config

    from tidal.integrations.vllm import kv_cache_bytes_for

    cfg = Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)
    # 64 sequences of 64 blocks, and vLLM's null block, which no request gets: 3.5 GiB.
    assert kv_cache_bytes_for(cfg, torch.bfloat16, sequences=64, max_len=1024) == (64 * 64 + 1) * 16 * 57344
    assert kv_cache_bytes_for(cfg, torch.bfloat16, sequences=1, max_len=17) == 3 * 16 * 57344  # two blocks, and null
    for bad in (dict(sequences=0, max_len=8), dict(sequences=2, max_len=None)):
        with pytest.raises(ValueError, match="must be an int > 0"):
            kv_cache_bytes_for(cfg, torch.bfloat16, **bad)


def test_kv_bytes_per_token_reads_the_decoders_shape():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 28 * 4 * 128 * 2  # Qwen2-7B: 56 KiB a token


def test_an_engine_that_sleeps_moves_every_role_until_its_memory_was_measured_then_keeps_what_fits(tiny):
    """Built asleep (TRL puts its engine to sleep as it builds it), the engine's first turn knows
    nothing of its memory: every role goes, and the wakes are measured; the next turns keep
    what fits beside that (all of it, on this device)."""
    policy, opt, ts, llm = _setup(tiny)
    llm.sleep(level=2)
    engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20, keep_free_bytes=1 << 20, asleep=True)
    with engine.generating(policy):
        assert ts.resident_roles == []  # nothing known yet: every role went
    assert set(engine.woken) == {"weights", "kv_cache"}
    moved = len(engine.moves)
    with engine.generating(policy):
        assert "policy" in ts.resident_roles
    # Measured: the policy came back for the push (its source) and nothing went out for the engine.
    assert [(r.roles_out, r.role_in) for r in engine.moves[moved:]] == [((), "policy")]
    ts.close()


def _driver(monkeypatch, ts, free: list[int], total: int = 1 << 40) -> list[int]:
    """The timeshare's device read as having ``free[0]`` bytes free at driver level (of
    ``total``); returns the list its cache releases are counted in."""
    released: list[int] = []
    monkeypatch.setattr(ts.ops, "driver_free_bytes", lambda: (free[0], total))
    monkeypatch.setattr(ts.ops, "empty_cache", lambda: released.append(1))
    return released


def test_the_cache_goes_back_to_the_driver_only_where_the_driver_lacks_the_room_for_a_wake(tiny, monkeypatch):
    """A release waits for every copy out of the device still queued (an optimizer state going
    to the host behind the step): once the wakes were measured, the engine releases torch's
    cache before one only where the driver's own free memory is short of it."""
    policy, opt, ts, llm = _setup(tiny)
    llm.sleep(level=2)
    free = [1 << 40]
    released = _driver(monkeypatch, ts, free)
    engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20, keep_free_bytes=1 << 20, asleep=True)
    with engine.generating(policy):
        pass
    assert released  # not measured yet: released before each wake
    released.clear()
    with engine.generating(policy):
        assert "policy" in ts.resident_roles
    assert released == []  # the driver has the room: nothing released, no copy waited for
    assert engine.release_for_wake() is None and released == []
    free[0] = 0  # the driver has none: the room is in torch's cache
    engine.release_for_wake()
    assert released == [1]
    free[0] = 1 << 40
    ts.close()


def test_under_peak_bytes_the_engines_turn_keeps_only_what_fits_below_it(tiny, monkeypatch):
    """Room on the device for every role beside the engine, but a bound on the device's used
    memory below what they and the engine would take: the roles go, the policy last."""
    for peak, kept in ((None, True), (1 << 20, False)):
        policy, opt, ts, llm = _setup(tiny)
        llm.sleep(level=2)
        _driver(monkeypatch, ts, [1 << 40])
        engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20, keep_free_bytes=1 << 20, asleep=True, peak_bytes=peak)
        with engine.generating(policy):
            pass
        with engine.generating(policy):
            assert ("policy" in ts.resident_roles) is kept, peak
        ts.close()
    with pytest.raises(ValueError, match="peak_bytes must be an int >= 0"):
        VllmEngine(llm, ts, peak_bytes=-1)


def _sleep_level_one_and_a_wake_out_of_memory_part_way(tiny, pool):
    """A level-1 sleep, then a weights wake on a device with room for half the weights: it
    raises vLLM's out-of-memory error with the first weights mapped, the rest not."""
    llm = fake_vllm.FakeLLM(tiny, enable_sleep_mode=True, kv_cache_memory_bytes=1 << 20)
    want = {n: p.detach().clone() for n, p in llm.model.named_parameters()}
    llm.sleep(level=1)
    fake_vllm.FakeLLM.device_free = lambda: llm.weights_bytes // 2 - pool.mapped_bytes()
    sleeping = set(llm._allocations[:-1])
    with pytest.raises(RuntimeError, match="CUDA Error: out of memory"):
        llm.wake_up(tags=["weights"])
    awake = [p for p in sleeping if not pool.pointer_to_data[p].is_asleep]
    assert awake and len(awake) < len(sleeping)  # part-way
    return llm, want, sleeping


def test_after_a_wake_that_ran_out_of_memory_part_way_a_second_wake_fails_as_vllms_does(tiny, pool):
    """What the double keeps of vLLM's pool (its wake maps every allocation of the tags again):
    woken again as it is, the engine fails even with all the room it needs."""
    llm, _, _ = _sleep_level_one_and_a_wake_out_of_memory_part_way(tiny, pool)
    fake_vllm.FakeLLM.device_free = None
    with pytest.raises(RuntimeError, match="invalid argument"):
        llm.wake_up(tags=["weights"])


def test_a_wake_put_back_to_sleep_wakes_again_with_its_level_one_backup_bit_for_bit(tiny, pool):
    from tidal.integrations.vllm.pool import allocation_bytes, put_back_to_sleep

    llm, want, sleeping = _sleep_level_one_and_a_wake_out_of_memory_part_way(tiny, pool)
    freed = put_back_to_sleep(sleeping, backed_up=("weights",))
    assert freed > 0 and pool.consistent() and llm.held_bytes() == 0
    assert allocation_bytes(sleeping) == llm.weights_bytes
    fake_vllm.FakeLLM.device_free = None
    llm.wake_up(tags=["weights"])
    assert all(torch.equal(p, want[n]) for n, p in llm.model.named_parameters())


@pytest.mark.parametrize("level", [1, 2])
def test_a_wake_out_of_memory_beside_a_role_is_put_back_to_sleep_and_woken_with_the_role_out(tiny, pool, level):
    """A device with room for the engine beside the policy but not beside the reference too,
    though the driver reads it so (what another process took since): once the wakes were
    measured (the first turn, every role out), a turn keeps the reference beside the engine, the
    weights' wake runs out of memory part-way, goes back to sleep, the reference goes to the
    host, and the engine wakes and generates with the policy's weights (counted once). The turns
    after it move the reference out before the wake: no wake runs out of memory again."""
    policy, opt, ts, llm = _setup(tiny)
    # The device: the engine's memory and half its weights again; the reference, while on it,
    # takes all but that half.
    limit = llm.weights_bytes + llm.kv_cache_bytes + llm.weights_bytes // 2
    reference = llm.weights_bytes + llm.kv_cache_bytes
    fake_vllm.FakeLLM.device_free = lambda: (
        limit - pool.mapped_bytes() - (reference if "reference" in ts.resident_roles else 0)
    )
    engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20, keep_free_bytes=1 << 20, sleep_level=level)
    engine.sleep()
    prompts = [{"prompt_token_ids": [1, 2, 3]}]
    sp = fake_vllm.SamplingParams(max_tokens=3, logprobs=0)
    seen = []
    fake_vllm.FakeLLM.on_generate = lambda running: seen.append(
        (pool.consistent(), {n: p.clone() for n, p in running.model.named_parameters()})
    )
    try:
        for turn in range(3):
            with ts.use("policy"):
                _train_a_little(policy, opt)
                trained = {n: p.detach().clone() for n, p in policy.named_parameters()}
            with ts.use("reference"):
                pass  # the reference on the device, where the engine's turn finds it
            with engine.generating(policy) as running:
                running.generate(prompts, sp)
            assert engine.oom_retries == min(turn, 1) and engine.out_first == ({"weights"} if turn else set())
            consistent, engine_w = seen[-1]
            assert consistent and all(torch.equal(engine_w[n], trained[n]) for n in trained)
            assert llm.held_bytes() == 0 and pool.consistent()
    finally:
        fake_vllm.FakeLLM.on_generate = None
    ts.close()


def test_a_wake_out_of_memory_with_every_role_out_is_tidals_error_and_the_engine_sleeps(tiny, pool):
    """No room for the engine's weights even with every other role out: tidal's
    InsufficientMemoryError (what the wake needs, what is free), the engine asleep as it
    counts itself, and a later turn with the room wakes it."""
    from tidal.errors import InsufficientMemoryError

    policy, opt, ts, llm = _setup(tiny)
    fake_vllm.FakeLLM.device_free = lambda: llm.weights_bytes // 2 - pool.mapped_bytes()
    engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20)
    engine.sleep()
    with pytest.raises(InsufficientMemoryError, match="waking the engine's weights needs") as caught:
        with engine.generating(policy):
            pass
    assert caught.value.needed_bytes == llm.weights_bytes
    assert "CUDA Error: out of memory" in str(caught.value.__cause__)
    assert engine.oom_retries == 1 and llm.held_bytes() == 0 and pool.consistent()
    assert ts.resident_roles == ["policy"]  # the reference went for the second try; the policy is intact
    fake_vllm.FakeLLM.device_free = None
    with ts.use("policy"):
        trained = {n: p.detach().clone() for n, p in policy.named_parameters()}
    with engine.generating(policy) as running:
        assert all(torch.equal(p, trained[n]) for n, p in running.model.named_parameters())
    ts.close()


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_fault_part_way_through_a_wake_puts_it_back_to_sleep(tiny, pool, exc):
    """Any exception as the pool maps the engine's weights (not only running out of memory)
    leaves the engine asleep as it counts itself, nothing run again; the next turn wakes it."""
    policy, opt, ts, llm = _setup(tiny)
    engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20)
    engine.sleep()
    fake_vllm.FakeLLM.fail = ("map", ("weights",), exc, 3)
    try:
        with pytest.raises(exc, match="injected at map"):
            with engine.generating(policy):
                pass
    finally:
        fake_vllm.FakeLLM.fail = None
    assert engine.oom_retries == 0 and llm.held_bytes() == 0 and pool.consistent()
    with engine.generating(policy) as running:
        assert running.generate([{"prompt_token_ids": [1]}], fake_vllm.SamplingParams(max_tokens=2))
    ts.close()


def test_a_generation_that_raised_leaves_its_requests_and_the_next_returns_them_as_vllms_does(tiny, pool):
    """What the double keeps of vLLM's engine: a generation that raised part-way leaves its
    requests unfinished, and the next generation returns their outputs beside its own."""
    llm = fake_vllm.FakeLLM(tiny, kv_cache_memory_bytes=1 << 20)
    sp = fake_vllm.SamplingParams(max_tokens=3)
    fake_vllm.FakeLLM.fail = ("decode", None, KeyboardInterrupt, 2)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": [1, 2]}], sp)
    finally:
        fake_vllm.FakeLLM.fail = None
    assert len(llm.generate([{"prompt_token_ids": [3]}], sp)) == 2


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_a_generation_that_raises_in_a_turn_leaves_no_request_behind(tiny, pool, exc):
    policy, opt, ts, llm = _setup(tiny)
    engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20)
    sp = fake_vllm.SamplingParams(max_tokens=3)
    fake_vllm.FakeLLM.fail = ("decode", None, exc, 2)
    try:
        with pytest.raises(exc, match="injected at decode"):
            with engine.generating(policy) as running:
                running.generate([{"prompt_token_ids": [1, 2]}], sp)
    finally:
        fake_vllm.FakeLLM.fail = None
    assert llm.request_states == {} and engine.oom_retries == 0
    with engine.generating(policy) as running:
        assert len(running.generate([{"prompt_token_ids": [3]}], sp)) == 1
    ts.close()


def test_a_generation_out_of_memory_runs_again_with_the_roles_out_from_the_same_draws(tiny, pool):
    """Out of memory part-way through a generation beside a kept role: its requests dropped,
    the role out, and the generation run again from the same random draws: the tokens of a
    turn that never kept the role."""
    import torch

    prompts, sp = [{"prompt_token_ids": [1, 2, 3]}], fake_vllm.SamplingParams(n=2, max_tokens=4, logprobs=0)
    runs = {}
    for fail in (False, True):
        policy, opt, ts, llm = _setup(tiny)
        llm.sleep(level=2)
        engine = VllmEngine(llm, ts, kv_cache_bytes=1 << 20, keep_free_bytes=1 << 20, asleep=True)
        with engine.generating(policy):
            pass  # measured: the next turn keeps the policy beside the engine
        torch.manual_seed(7)
        if fail:
            fake_vllm.FakeLLM.fail = ("decode", None, torch.OutOfMemoryError, 3)
        try:
            with engine.generating(policy) as running:
                outs = running.generate(prompts, sp)
                resident = ts.resident_roles
        finally:
            fake_vllm.FakeLLM.fail = None
        runs[fail] = ([c.token_ids for c in outs[0].outputs], engine.oom_retries, resident)
        ts.close()
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) == 2
    assert runs[False][1] == 0 and "policy" in runs[False][2]
    assert runs[True][1:] == (1, [])
