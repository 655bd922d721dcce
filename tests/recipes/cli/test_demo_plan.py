"""The demo's levers from the planner: what it chooses for a GPU and a host, what the user set
stays, and the demo's plan configuration matches its trainer's settings."""

import dataclasses

import pytest

from tidal.plan import GIB, build_plan
from tidal_recipes.cli.demo import DemoSettings, defaults_for
from tidal_recipes.cli.demo_plan import choose_levers, plan_config


def _gpu_demo(**kw) -> DemoSettings:
    d = defaults_for("cuda")
    d["device"] = "cpu"  # the settings only: nothing runs
    return DemoSettings(**{**d, **kw})


def test_a_model_whose_optimizer_state_fits_gets_adamw_and_no_checkpointing():
    """The 0.5B demo on an 80 GB GPU: everything fits as configured, so no lever (CPU Adam and
    checkpointing, the old hard-coded default, would only slow it down)."""
    s, rec = choose_levers(_gpu_demo(), gpu_mem_bytes=80 * GIB, host_mem_bytes=128 * GIB)
    assert rec.fits and rec.levers == []
    assert (s.optimizer, s.grad_ckpt, s.optim_state_dtype) == ("adamw", False, "fp32")
    assert "Fits as configured" in rec.summary()[0]
    # Every role fits at once: they stay resident (AdamW's state with the training role), the
    # timeshare evicting only if memory runs short, with a phase's largest transient need as headroom.
    assert (s.optimizer_residency, s.evict) == ("role", "as_needed")
    resident = build_plan(dataclasses.replace(plan_config(s), timeshare=False))
    assert resident.all_resident_peak_bytes + resident.config.cuda_context_bytes <= rec.usable_bytes
    assert s.headroom_mib << 20 >= max(p.transient_bytes for p in resident.all_resident.values()) > 0
    # The micro-batch grows to the largest that fits with those settings: here the whole batch
    # of 1024 sequences in one forward and backward (its plan fits the GPU), unless the user set it.
    assert s.micro_batch == 1024 and build_plan(plan_config(s)).device_peak_bytes <= rec.usable_bytes
    mine, _ = choose_levers(
        _gpu_demo(micro_batch=32), fixed=("micro_batch",), gpu_mem_bytes=80 * GIB, host_mem_bytes=128 * GIB
    )
    assert mine.micro_batch == 32
    # On a GPU too small for the whole batch, the largest halving that fits.
    small, rec_small = choose_levers(_gpu_demo(), gpu_mem_bytes=16 * GIB, host_mem_bytes=128 * GIB)
    assert 64 < small.micro_batch < 1024
    assert build_plan(plan_config(small)).device_peak_bytes <= rec_small.usable_bytes
    bigger = dataclasses.replace(small, micro_batch=2 * small.micro_batch)
    assert build_plan(plan_config(bigger)).device_peak_bytes > rec_small.usable_bytes


def test_a_small_gpu_gets_the_cheapest_levers_that_fit_and_they_are_needed():
    s, rec = choose_levers(_gpu_demo(), gpu_mem_bytes=4 * GIB, host_mem_bytes=128 * GIB)
    assert rec.fits and rec.levers
    assert rec.plan.device_peak_bytes <= rec.usable_bytes
    assert s.optimizer == ("cpu_adam" if "cpu_adam" in rec.levers else "adamw")
    assert s.grad_ckpt == ("grad_ckpt" in rec.levers)
    # The plan of the settings it returns is the plan it chose.
    assert build_plan(plan_config(s)).device_peak_bytes == rec.plan.device_peak_bytes
    # What the user set stays, and the planner works around it.
    s2, rec2 = choose_levers(
        _gpu_demo(optimizer="adamw"), fixed=("optimizer",), gpu_mem_bytes=4 * GIB, host_mem_bytes=128 * GIB
    )
    assert s2.optimizer == "adamw" and "cpu_adam" not in rec2.levers


def test_seven_b_levers_follow_the_gpu_and_the_host():
    """Qwen2-7B, the demo's short sequences: on an 80 GB GPU AdamW with its (bf16) state
    streamed in during step() fits as configured, with a micro-batch of 256; with the state
    moving with the training role (the user's choice, or prefetch's) it still fits, at 128; on a 32 GiB GPU
    only CPU Adam with gradients summed on the host fits the GPU, and with bf16 moments it
    holds 127.7 GiB of host memory: over a 128 GiB machine's 115 usable (refused), under a
    256 GiB one's."""
    s, rec = choose_levers(_gpu_demo(preset="qwen2-7b"), gpu_mem_bytes=80 * GIB, host_mem_bytes=128 * GIB)
    assert rec.fits and rec.levers == [] and (s.optimizer, s.optimizer_residency) == ("adamw", "stream")
    assert rec.plan.config.optim_stream_chunk_bytes == 256 << 20  # what the trainer's stream residency does
    assert s.micro_batch == 256
    role = _gpu_demo(preset="qwen2-7b", optimizer_residency="role")
    s, rec = choose_levers(role, fixed=("optimizer_residency",), gpu_mem_bytes=80 * GIB, host_mem_bytes=128 * GIB)
    assert rec.fits and s.optimizer_residency == "role" and s.micro_batch == 128
    # With prefetch the state starts with the training role (each turn keeps it where it fits,
    # and its moves run behind the rollout and the scoring): the same choice, at 128; and on a
    # GPU where that does not fit (40 GiB), streamed in during step() as without prefetch.
    pf, rec = choose_levers(
        _gpu_demo(preset="qwen2-7b", prefetch=True), gpu_mem_bytes=80 * GIB, host_mem_bytes=128 * GIB
    )
    assert rec.fits and rec.levers == [] and (pf.optimizer_residency, pf.micro_batch) == ("role", 128)
    assert dataclasses.replace(pf, prefetch=False) == s
    pf, rec = choose_levers(
        _gpu_demo(preset="qwen2-7b", prefetch=True), gpu_mem_bytes=40 * GIB, host_mem_bytes=128 * GIB
    )
    assert rec.fits and "optimizer_offload" in rec.levers and pf.optimizer_residency == "stream"
    _, small = choose_levers(_gpu_demo(preset="qwen2-7b"), gpu_mem_bytes=32 * GIB, host_mem_bytes=128 * GIB)
    assert not small.fits and small.host_miss_bytes > 0
    assert small.plan.device_peak_bytes <= small.usable_bytes
    s2, big = choose_levers(_gpu_demo(preset="qwen2-7b"), gpu_mem_bytes=32 * GIB, host_mem_bytes=256 * GIB)
    assert big.fits and big.levers == ["cpu_adam", "host_grads"]
    assert (s2.optimizer, s2.grad_accumulation, s2.optim_state_dtype) == ("cpu_adam", "host", "fp32")


def test_plan_config_follows_the_settings():
    s = _gpu_demo(optimizer="cpu_adam", optim_state_dtype="bf16", grad_accumulation="host")
    c = plan_config(s)
    assert (c.optimizer, c.optim_state_dtype, c.cpu_adam_grad_accumulation) == ("cpu_adam", "bf16", "host")
    a = plan_config(dataclasses.replace(s, optimizer="adamw"))
    assert a.optimizer == "adamw_offload" and a.optim_state_dtype is None and a.optim_stream_chunk_bytes == 256 << 20
    r = plan_config(dataclasses.replace(s, optimizer="adamw", optimizer_residency="role"))
    assert r.optimizer == "adamw" and r.optim_stream_chunk_bytes is None
    st = plan_config(dataclasses.replace(s, optimizer="adamw", optimizer_residency="step"))
    assert st.optimizer == "adamw_offload" and st.optim_stream_chunk_bytes is None
    with pytest.raises(ValueError, match="unknown settings"):
        choose_levers(s, fixed=("lr",), gpu_mem_bytes=80 * GIB, host_mem_bytes=None)


def test_the_cli_prints_the_levers_and_why_or_refuses_before_any_work(capsys, monkeypatch):
    """tidal demo's planning step (run on a GPU; here with the device's and the host's sizes
    faked): it prints the planner's lines and what it applies; when nothing fits it says why
    on stderr and returns None (the demo then exits before building anything)."""
    import tidal.device
    import tidal.memory
    from tidal_recipes.cli.main import _plan_levers

    total = [80 * GIB]
    monkeypatch.setattr(tidal.device.DeviceOps, "driver_free_bytes", lambda self: (total[0], total[0]))
    host = tidal.memory.HostMemory(total_bytes=128 * GIB, available_bytes=125 * GIB, cgroup_limit_bytes=None)
    monkeypatch.setattr(tidal.memory, "host_memory", lambda: host)
    chosen = _plan_levers(_gpu_demo(), ())
    out = capsys.readouterr().out
    assert chosen.optimizer == "adamw" and chosen.micro_batch == 1024
    assert "levers from the planner for this GPU (80.0 GiB)" in out and "Fits as configured" in out
    assert "-> optimizer adamw (state residency role), gradient checkpointing off, micro-batch 1024" in out
    assert "-> every role fits at once" in out and f"evict as_needed, {chosen.headroom_mib} MiB headroom" in out
    # --evict given: the user's choice stays, and the planner leaves AdamW's state where it was.
    mine = _plan_levers(_gpu_demo(evict="others"), ("evict",))
    assert (mine.evict, mine.optimizer_residency) == ("others", "stream")
    assert "every role fits at once" not in capsys.readouterr().out
    total[0] = 2 * GIB
    assert _plan_levers(_gpu_demo(preset="qwen2-7b"), ()) is None
    err = capsys.readouterr().err
    assert "finds no way to fit" in err and "Nothing was run" in err


# ---- the GPU's default workload: one it cannot hold with every role resident -----------------
def test_the_gpu_default_is_the_smallest_shape_the_gpu_cannot_hold_with_every_role_resident():
    """An 80 GB GPU holds the 7B loop with every role resident at a micro-batch of one, not the
    14B shape's, which runs with the roles taking turns on a large host; a small host fits
    neither and says why; nothing is built."""
    from tidal_recipes.cli.demo_plan import BEYOND_RESIDENT_PRESETS, workload_beyond_resident

    work = workload_beyond_resident(_gpu_demo(), gpu_mem_bytes=80 * GIB, host_mem_bytes=1000 * GIB)
    assert work.preset == "qwen2.5-14b" and work.all_resident_bytes > work.usable_bytes
    assert "more than the 76.00 GiB usable here" in work.why
    smaller = BEYOND_RESIDENT_PRESETS[: BEYOND_RESIDENT_PRESETS.index(work.preset)]
    for preset in smaller:  # each fits with every role resident, at its least
        least = _gpu_demo(preset=preset, optimizer="adamw", optimizer_residency="role", micro_batch=1, grad_ckpt=True)
        assert build_plan(plan_config(least).replace(timeshare=False)).device_peak_bytes <= work.usable_bytes
    s, rec = choose_levers(_gpu_demo(preset=work.preset), gpu_mem_bytes=80 * GIB, host_mem_bytes=1000 * GIB)
    assert rec.fits
    none = workload_beyond_resident(_gpu_demo(), gpu_mem_bytes=80 * GIB, host_mem_bytes=64 * GIB)
    assert none.preset is None and "qwen2.5-14b: host: 110.05 GiB to pin, 57.60 GiB usable" in none.why


def test_the_loop_that_does_not_fit_is_drawn_to_where_it_ran_out_of_memory(monkeypatch):
    """The all-resident loop beside a workload beyond it: built and stepped until the device runs
    out of memory, the phase it failed in named, its timeline kept for the picture."""
    import torch

    from tidal_recipes.cli import demo

    class Failing:
        def __init__(self, timeline):
            self.timeline, self.closed = timeline, False

        def step(self):
            with self.timeline.phase("train", step=0):
                self.timeline.sample()
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.45 GiB")

        def close(self):
            self.closed = True

    made = []
    monkeypatch.setattr(
        demo, "_trainer", lambda s, *, timeshare, timeline=None: made.append(Failing(timeline)) or made[-1]
    )
    lines = []
    s = DemoSettings(**{**defaults_for("cpu"), "baseline_steps": 1})
    title, timeline = demo._resident_to_failure(s, lines.append)
    assert made[0].closed and timeline is made[0].timeline
    assert title == "the same loop, all roles resident (GPU AdamW): out of memory in train"
    assert timeline.marks[-1]["kind"] == "oom" and timeline.capacity_bytes > 0
    assert lines == [
        "all roles resident (GPU AdamW, no timeshare): out of device memory in train: CUDA out of memory. Tried to allocate 1.45 GiB"
    ]
    with pytest.raises(ValueError, match="a GPU's"):
        DemoSettings(**{**defaults_for("cpu"), "beyond_resident": True})
