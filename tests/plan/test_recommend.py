"""recommend(): the cheapest set of levers that fits, every lever needed, misses stated."""

import pytest

from tidal.plan import GIB, LEVER_COSTS, PlanConfig, build_plan, recommend
from tidal.plan.recommend import _apply

SEVEN_B = dict(shape="qwen2-7b", prompts=64, group=8, prompt_len=128, gen_len=1024, micro_batch=8)


def test_fits_as_configured_needs_nothing():
    r = recommend(PlanConfig(shape="qwen2-0.5b", timeshare=False), gpu_mem_bytes=80 * GIB)
    assert r.fits and r.levers == [] and r.miss_bytes == 0
    assert r.plan.device_peak_bytes <= r.usable_bytes
    assert r.summary()[0].startswith("Fits as configured")


def test_where_every_role_fits_at_once_it_says_no_timeshare_is_needed():
    """Qwen2-7B on a 141 GB GPU with the timeshare on (the planner's default): every role fits at
    once (85.65 of 132.05 GiB usable), so the answer is to turn the timeshare off, which holds
    nothing on the host; the planner had answered "Enable: lora" (the laptop's RAM as the host)
    or "Fits as configured" with 56.7 GiB pinned and 1.7 s of copies a step."""
    config = PlanConfig(shape="qwen2-7b")
    for host in (int(21.37 * GIB), 1000 * GIB):
        r = recommend(config, gpu_mem_bytes=139 * GIB, host_mem_bytes=host)
        assert r.fits and r.levers == ["no_timeshare"] and not r.plan.config.timeshare
        assert r.plan.node_host_bytes == 0 and "lora" not in r.levers
        assert r.summary()[0].startswith("No timeshare needed: every role fits at once")
        assert "the timeshare pins 56.74 GiB on the host" in r.reasons["no_timeshare"]
    # Where it does not fit at once (an 80 GB GPU), the timeshare stays and nothing is added.
    r = recommend(config, gpu_mem_bytes=80 * GIB, host_mem_bytes=1000 * GIB)
    assert r.fits and r.levers == [] and r.plan.config.timeshare


def test_levers_chosen_fit_and_each_is_needed():
    config = PlanConfig(**SEVEN_B, timeshare=False)
    r = recommend(config, gpu_mem_bytes=80 * GIB)
    assert r.fits and r.levers
    assert r.plan.device_peak_bytes <= r.usable_bytes
    assert r.baseline_device_peak_bytes > r.usable_bytes
    assert r.levers == sorted(r.levers, key=LEVER_COSTS.get)
    # Dropping any chosen lever no longer fits (else a cheaper set would have been chosen).
    for lever in r.levers:
        rest = tuple(x for x in r.levers if x != lever)
        assert build_plan(_apply(config, rest, 1)).device_peak_bytes > r.usable_bytes, lever
        assert "without it" in r.reasons[lever]
    # And the chosen set reproduces the reported plan.
    assert build_plan(_apply(config, tuple(r.levers), 1)).device_peak_bytes == r.plan.device_peak_bytes


def test_multi_gpu_uses_zero_when_one_gpu_cannot():
    # One micro-batch a GPU (8 of the 64 sequences on each of 8): FSDP2 holds accumulated
    # gradients unsharded between micro-batches, and CPU Adam (what let 2-sequence micro-batches
    # fit) is not a lever across GPUs.
    config = PlanConfig(shape="llama3-8b", prompts=16, group=4, prompt_len=256, gen_len=512, micro_batch=8)
    one = recommend(config, gpu_mem_bytes=16 * GIB, gpus=1, allow_lora=False)
    assert not one.fits and one.miss_bytes == one.plan.device_peak_bytes - one.usable_bytes > 0
    assert "Nothing fits" in one.summary()[0]
    eight = recommend(config, gpu_mem_bytes=16 * GIB, gpus=8, allow_lora=False)
    assert eight.fits and any(x.startswith("zero") for x in eight.levers)
    assert eight.plan.config.dp == 8


def test_lora_is_the_last_resort():
    # 7B bf16 weights (14.2 GiB) on an 18 GiB GPU: CPU Adam's in-flight copy of the untied LM
    # head's gradient (bf16 + its fp32 cast, 3 GiB) is what tips it over; adapters avoid
    # that gradient altogether.
    config = PlanConfig(shape="qwen2-7b", prompts=4, group=4, micro_batch=2)
    r = recommend(config, gpu_mem_bytes=18 * GIB)
    assert r.fits and "lora" in r.levers and r.plan.config.lora_rank > 0
    assert "changes what is trained" in r.reasons["lora"]
    without = recommend(config, gpu_mem_bytes=18 * GIB, allow_lora=False)
    assert not without.fits and "lora" not in without.levers
    assert without.miss_bytes == without.plan.device_peak_bytes - without.usable_bytes


def test_bad_arguments():
    with pytest.raises(ValueError):
        recommend(PlanConfig(shape="qwen2-0.5b"), gpu_mem_bytes=0)


def test_host_memory_is_planned_and_a_plan_that_does_not_fit_the_host_is_refused():
    """Full-parameter 7B with CPU Adam on one 80 GB GPU: every component of its host memory is
    counted, and on a 128 GiB machine the plan is refused naming the bytes (the levers that
    fit the GPU but not the host are not chosen)."""
    config = PlanConfig(**SEVEN_B, optimizer="cpu_adam", grad_ckpt=True, cpu_adam_grad_accumulation="host")
    plan = build_plan(config)
    t = config.shape.param_count()
    assert plan.host["CPU Adam fp32 master weights"] == 4 * t
    assert plan.host["CPU Adam moments (fp32 exp_avg, exp_avg_sq)"] == 8 * t
    assert plan.host["CPU Adam fp32 gradients"] == 4 * t
    assert plan.host["CPU Adam gradient staging (trainable dtype)"] == 2 * t  # bf16
    assert (
        plan.host["reference weights (timeshare host copy)"]
        == plan.host["actor weights (timeshare host copy)"]
        == 2 * t
    )
    assert plan.host_bytes == sum(plan.host.values()) == 22 * t  # 156 GiB for 7.6B
    assert plan.node_host_bytes == plan.host_bytes  # one GPU
    # (The timeshare stays on: without it the host holds no weights' copies; the test is of the host's other bytes.)
    small = recommend(
        config, gpu_mem_bytes=80 * GIB, allow_lora=False, host_mem_bytes=128 * GIB, exclude=("no_timeshare",)
    )
    assert not small.fits and small.plan.device_peak_bytes <= small.usable_bytes  # the GPU is not the limit
    assert small.host_miss_bytes == small.plan.node_host_bytes - small.host_usable_bytes > 0
    assert (
        "Nothing fits the host" in small.summary()[0]
        and f"{small.host_miss_bytes / GIB:.2f} GiB over" in small.summary()[0]
    )
    big = recommend(config, gpu_mem_bytes=80 * GIB, allow_lora=False, host_mem_bytes=512 * GIB)
    assert big.fits and big.plan.node_host_bytes <= big.host_usable_bytes and big.host_miss_bytes == 0
    unchecked = recommend(config, gpu_mem_bytes=80 * GIB, allow_lora=False)
    assert unchecked.fits and unchecked.host_usable_bytes is None and "not checked" in unchecked.summary()[1]
    # Data parallel on one machine: every process holds its own host state.
    two = build_plan(config.replace(dp=2))
    assert two.node_host_bytes == 2 * two.host_bytes
    with pytest.raises(ValueError, match="host_mem_bytes"):
        recommend(config, gpu_mem_bytes=80 * GIB, host_mem_bytes=0)
    # Gradients summed on the device (no host staging) and bf16 moments: 16 bytes per
    # parameter on the host, and the 7B plan fits the 128 GiB machine.
    lean = config.replace(cpu_adam_grad_accumulation="device", optim_state_dtype="bf16")
    assert build_plan(lean).host_bytes == 16 * t
    fit = recommend(lean, gpu_mem_bytes=80 * GIB, allow_lora=False, host_mem_bytes=128 * GIB)
    assert fit.fits and fit.plan.node_host_bytes <= fit.host_usable_bytes


def test_cpu_adam_bf16_moments_halve_their_host_memory():
    fp32 = build_plan(PlanConfig(**SEVEN_B, optimizer="cpu_adam"))
    bf16 = build_plan(PlanConfig(**SEVEN_B, optimizer="cpu_adam", optim_state_dtype="bf16"))
    t = fp32.config.shape.param_count()
    assert fp32.host["CPU Adam moments (fp32 exp_avg, exp_avg_sq)"] == 8 * t
    assert bf16.host["CPU Adam moments (bf16 exp_avg, exp_avg_sq)"] == 4 * t
    assert fp32.host_bytes - bf16.host_bytes == 4 * t
    assert any("bf16 on the host" in a for a in bf16.assumptions)
    with pytest.raises(ValueError, match="CPUAdam keeps its moments in fp32 or bf16"):
        PlanConfig(**SEVEN_B, optimizer="cpu_adam", optim_state_dtype="fp16")


def test_bf16_moments_is_chosen_when_the_host_is_the_limit_and_excluded_levers_are_not():
    """7B full-parameter with CPU Adam summing gradients on the GPU: fp32 moments hold 142 GiB
    of host memory, over a 128 GiB machine's 115 usable; bf16 moments bring it to 113 GiB, so
    that is the lever chosen, with its reason. Excluded, nothing fits the host."""
    config = PlanConfig(**SEVEN_B, optimizer="cpu_adam", grad_ckpt=True)
    r = recommend(config, gpu_mem_bytes=80 * GIB, allow_lora=False, host_mem_bytes=128 * GIB, exclude=("no_timeshare",))
    assert r.fits and r.levers == ["bf16_moments"]
    assert r.plan.config.optim_state_dtype == "bf16" and r.plan.host_bytes == 16 * config.shape.param_count()
    assert "moments kept in bf16" in r.reasons["bf16_moments"]
    no = recommend(
        config, gpu_mem_bytes=80 * GIB, host_mem_bytes=128 * GIB, exclude=("lora", "bf16_moments", "no_timeshare")
    )
    assert not no.fits and no.host_miss_bytes > 0 and "bf16_moments" not in no.levers
    with pytest.raises(ValueError, match="unknown levers \\['fp8'\\]"):
        recommend(config, gpu_mem_bytes=80 * GIB, exclude=("fp8",))


def test_a_lever_for_the_host_names_the_host_with_both_sides_bytes():
    """Issue 28: Qwen2-7B fits an 80 GB GPU as configured (71.46 GiB of 75.24 usable) but its
    56.74 GiB of host copies do not fit a host with 19.23 GiB usable: LoRA is recommended, and
    the reason names the host, not a GPU peak that fits."""
    config = PlanConfig(shape="qwen2-7b")
    r = recommend(config, gpu_mem_bytes=int(79.2 * GIB), host_mem_bytes=int(21.37 * GIB), exclude=("no_timeshare",))
    assert r.fits and r.levers == ["lora"]
    assert "host: 56.74 GiB to pin, 19.23 GiB usable" in r.reasons["lora"]
    assert "GPU:" not in r.reasons["lora"], "the GPU is not what binds"
    first = r.summary()[0]
    assert "As configured it does not fit: host: 56.74 GiB to pin, 19.23 GiB usable." in first
    assert r.to_dict()["baseline_host_bytes"] == build_plan(config).node_host_bytes


def test_a_lever_for_the_gpu_names_the_gpu_with_both_sides_bytes():
    r = recommend(PlanConfig(shape="qwen2-7b"), gpu_mem_bytes=40 * GIB, host_mem_bytes=500 * GIB)
    assert r.fits and "cpu_adam" in r.levers
    assert "without it GPU: 71.46 GiB peak (with context), 38.00 GiB usable" in r.reasons["cpu_adam"]
    assert "As configured it does not fit: GPU: 71.46 GiB peak (with context), 38.00 GiB usable." in r.summary()[0]


def test_each_recommended_lever_names_what_to_type():
    """The recommendation says which setting gives each lever, in a TRL script and in the demo."""
    from tidal.plan.recommend import SETTINGS

    assert set(SETTINGS) == set(LEVER_COSTS)
    r = recommend(PlanConfig(shape="qwen2.5-14b"), gpu_mem_bytes=80 * GIB, host_mem_bytes=1000 * GIB)
    assert r.fits and r.levers == ["cpu_adam"]
    text = "\n".join(r.summary())
    assert "cpu_adam: optimizers=(tidal.CPUAdam(model.parameters(), lr=...), None); demo: --optimizer cpu_adam" in text
    assert r.to_dict()["settings"] == {"cpu_adam": {"trl": SETTINGS["cpu_adam"][0], "demo": "--optimizer cpu_adam"}}
    fits = recommend(PlanConfig(shape="qwen2-0.5b", timeshare=False), gpu_mem_bytes=80 * GIB)
    assert fits.settings() == [] and "To type" not in "\n".join(fits.summary())


def test_lora_is_chosen_only_where_no_full_parameter_set_fits():
    """LoRA changes what is trained: it costs more than every full-parameter set of levers
    together, so a set with it is chosen only where none without it fits (GPU and host)."""
    from tidal.plan.recommend import _choices

    fams = _choices(PlanConfig(shape="qwen2-7b", timeshare=False), 4)
    full = sum(max(sum(LEVER_COSTS[x] for x in opt if x != "lora") for opt in fam) for fam in fams)
    assert full < LEVER_COSTS["lora"]
    cases = [
        (PlanConfig(shape="qwen2-7b", prompts=4, group=4, micro_batch=2), 18 * GIB, 1),
        # 32B under FSDP2, 2 micro-batches of 4 a GPU: the gradients held unsharded through them
        (PlanConfig(shape="qwen2.5-32b"), int(79.2 * GIB), 4),
        (PlanConfig(shape="qwen2.5-32b", zero3_rollout="whole"), int(79.2 * GIB), 4),
        (PlanConfig(shape="qwen2-7b", prompts=64, group=8, gen_len=1024, micro_batch=8), 40 * GIB, 1),
    ]
    for config, gpu, gpus in cases:
        r = recommend(config, gpu_mem_bytes=gpu, gpus=gpus, host_mem_bytes=1000 * GIB)
        full_only = recommend(config, gpu_mem_bytes=gpu, gpus=gpus, host_mem_bytes=1000 * GIB, allow_lora=False)
        assert ("lora" in r.levers) == (r.fits and not full_only.fits), config
    # The 32B run's workload under FSDP2 (one micro-batch of 64 a GPU, checkpointed): full-parameter.
    shape = dict(shape="qwen2.5-32b", prompts=32, group=8, prompt_len=8, gen_len=256, micro_batch=64)
    run = PlanConfig(**shape, grad_ckpt=True, logprob_span="completion", lm_head="fused", zero3_rollout="whole")
    r = recommend(run, gpu_mem_bytes=int(79.2 * GIB), gpus=4, host_mem_bytes=1000 * GIB)
    assert r.fits and "lora" not in r.levers and not r.plan.config.lora_rank


def test_the_streamed_state_is_the_cheaper_residency_and_offered_once():
    """AdamW's state streamed during step() holds less than brought in whole and measured the
    shorter step where both ran: it is the cheaper lever. Where optimizer_offload streams
    (``offload_chunk_bytes``) the two are one plan, offered once."""
    from tidal.plan.recommend import _choices

    assert LEVER_COSTS["optimizer_stream"] < LEVER_COSTS["optimizer_offload"]
    config = PlanConfig(shape="qwen2-7b")
    assert ("optimizer_stream",) in _choices(config, 1)[1]
    assert ("optimizer_stream",) not in _choices(config, 1, 256 << 20)[1]
    assert ("optimizer_offload",) in _choices(config, 1, 256 << 20)[1]


def test_cpu_adam_is_offered_on_one_gpu_only():
    """CPU Adam takes each gradient to the host as the backward makes it, before the ranks'
    gradients are reduced (tidal's trainers refuse it with several processes): across GPUs the
    planner looks for another set, here ZeRO over the 4 GPUs."""
    config = PlanConfig(shape="qwen2-7b", grad_ckpt=True)
    one = recommend(config, gpu_mem_bytes=40 * GIB, host_mem_bytes=500 * GIB)
    assert one.fits and "cpu_adam" in one.levers
    four = recommend(config.replace(dp=4), gpu_mem_bytes=40 * GIB, gpus=4, host_mem_bytes=500 * GIB)
    assert four.fits and "cpu_adam" not in four.levers and "lora" not in four.levers, four.levers
    assert any(lever.startswith("zero") for lever in four.levers), four.levers


def test_a_smaller_micro_batch_is_a_lever_the_largest_that_fits():
    """A micro-batch of fewer sequences, more of them accumulated (the same gradient): searched
    from the configured size halved down to one, the largest that fits taken, with what to type."""
    config = PlanConfig(
        shape="qwen2-7b", prompts=8, group=8, prompt_len=64, gen_len=2048, micro_batch=64, grad_ckpt=True,
        logprob_span="completion", lm_head="fused", adamw_foreach=False,
    )  # fmt: skip
    r = recommend(config, gpu_mem_bytes=int(79.2 * GIB), host_mem_bytes=500 * GIB, exclude=("no_timeshare",))
    assert r.fits and "micro_batch" in r.levers
    m = r.plan.config.micro_batch
    assert m < 64 and 64 % m == 0
    others = config.replace(**{k: getattr(r.plan.config, k) for k in ("optimizer", "optim_stream_chunk_bytes")})
    if m < 32:  # the next larger size with the same other levers does not fit
        assert build_plan(others.replace(micro_batch=2 * m)).device_peak_bytes > r.usable_bytes
    assert build_plan(others.replace(micro_batch=m)).device_peak_bytes <= r.usable_bytes
    steps = -(-64 // m)
    text = "\n".join(r.summary())
    assert f"per_device_train_batch_size={m}, gradient_accumulation_steps={steps}" in text
    assert f"demo: --micro-batch {m}" in text and f"{m} sequences, {steps} a step (from 64)" in text
    assert r.to_dict()["settings"]["micro_batch"]["demo"] == f"--micro-batch {m}"
    from tidal.plan.recommend import _choices

    assert not any("micro_batch" in opt for fam in _choices(config.replace(micro_batch=1), 1) for opt in fam)


def test_the_timeshare_off_with_tidal_s_own_levers_names_tidal_s_trainer():
    config = PlanConfig(
        shape="qwen2-7b", prompts=8, group=8, prompt_len=64, gen_len=1024, micro_batch=64, grad_ckpt=True,
        logprob_span="completion", lm_head="fused", adamw_foreach=False,
    )  # fmt: skip
    r = recommend(config, gpu_mem_bytes=int(79.2 * GIB), host_mem_bytes=500 * GIB)
    assert r.levers == ["no_timeshare", "optimizer_stream"]
    assert "no_timeshare: TidalGRPOTrainer(..., tidal=TidalConfig(prefetch=True))" in "\n".join(r.summary())


def test_prefetch_is_offered_with_the_timeshare_only_where_there_is_something_to_keep():
    """Prefetch costs no room beyond the usable bytes (each turn keeps only what fits), so a
    timeshared plan that fits names it with its kept peak; without the timeshare or with LoRA
    there is nothing to keep."""
    seven = PlanConfig(shape="qwen2-7b", prompts=8, group=8, prompt_len=8, gen_len=256, micro_batch=16)
    r = recommend(seven, gpu_mem_bytes=int(79.2 * GIB), host_mem_bytes=500 * GIB, exclude=("no_timeshare",))
    assert r.fits and r.plan.config.timeshare
    (line,) = r.prefetch_lines()
    assert "prefetch=True" in line and line in r.summary()
    alone = recommend(seven, gpu_mem_bytes=int(139.8 * GIB), host_mem_bytes=500 * GIB)
    assert alone.levers == ["no_timeshare"] and alone.prefetch_lines() == []
    lora = recommend(seven.replace(lora_rank=16), gpu_mem_bytes=int(79.2 * GIB), exclude=("no_timeshare",))
    assert lora.fits and lora.prefetch_lines() == []
