"""TidalGRPOTrainer and TidalRLOOTrainer under the launches TRL's users run on several GPUs,
here on a CPU (gloo, 2 processes): ``torchrun`` and ``accelerate launch`` with TRL's
``multi_gpu`` config (DDP). Each launch runs TRL's trainer alone, then tidal's, in the same
processes (``trl_launch.py``); logs and final weights must be the same, bit for bit, and the
same on both ranks. What stays refused is refused before any work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from tests.integrations.test_trl import save_char_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("trl_launch.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_char_models(path)
    return str(path)


def _launch(launcher: str, tiny: str, out: Path, *flags: str, config: str = "multi_gpu") -> dict:
    """Run the child under ``launcher`` with 2 processes (``accelerate``: TRL's ``config``);
    return each run's per-rank reports, by run name (trl, trl2, tidal, ...)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    else:
        path = Path(trl.__file__).parent / "accelerate_configs" / f"{config}.yaml"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path)]
        cmd += ["--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "0"]
        if config == "fsdp2":
            # Every rank loads the weights (TRL shards its reference as loaded: with only the first
            # loading them, the others' would be empty).
            cmd += ["--fsdp_cpu_ram_efficient_loading", "false"]
    proc = subprocess.run(
        cmd + [str(CHILD), tiny, str(out), *flags], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{launcher} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {
        run.name: [json.loads((run / f"rank{r}.json").read_text()) for r in (0, 1)]
        for run in sorted(out.iterdir())
        if (run / "rank0.json").is_file()
    }


def _check_same_as_trl(runs: dict, *, algo_steps: int = 3) -> list:
    plain, ours = runs["trl"], runs["tidal"]
    assert [r["world"] for r in plain + ours] == [2, 2, 2, 2]
    # Bit for bit: the log history on rank 0, the final weights on every rank (and the ranks
    # agree with each other: DDP kept the replicas equal).
    assert ours[0]["history"] == plain[0]["history"] and len(plain[0]["history"]) == algo_steps
    assert {r["digest"] for r in plain + ours} == {plain[0]["digest"]}
    return ours


@pytest.mark.parametrize("launcher", ["torchrun", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_ddp_launch_is_bit_identical_to_trl_alone_and_each_rank_takes_turns(launcher, tiny, tmp_path):
    ours = _check_same_as_trl(_launch(launcher, tiny, tmp_path))
    for rank in ours:
        moves = [tuple(m[:3]) for m in rank["moves"]]
        # Each rank's roles take turns on its own device: the policy and the reference switch
        # every step, the optimizer state goes out after every step.
        assert moves.count(("switch", ["policy"], "reference")) == 3, moves
        assert moves.count(("switch", ["reference"], "policy")) == 3, moves
        assert sum(m[0] == "optim-out" for m in moves) == 3, moves
        # DDP's buckets (all of the gradients' bytes) were freed between steps, from the
        # second step on (the first step's are noted at its optimizer step).
        assert rank["buckets_freed"] == [rank["param_bytes"]] * 2, rank["buckets_freed"]
        # The log carries each rank's host memory: what tidal holds, pinned, and the RSS.
        last = rank["tidal_logs"][-1]
        for r in (0, 1):
            assert last[f"tidal/host_held_gib/rank{r}"] > 0 and last[f"tidal/host_rss_gib/rank{r}"] > 0.1
            assert last[f"tidal/host_pinned_gib/rank{r}"] == 0  # nothing is page-locked on a CPU


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ("--prefetch", "--residency", "role", "--sync-ref"),
        ("--prefetch", "--residency", "stream", "--accumulation", "2"),
        ("--algo", "rloo", "--prefetch"),
    ],
    ids=["grpo-role-prefetch-sync-ref", "grpo-stream-accumulation", "rloo-prefetch"],
)
def test_ddp_launch_with_prefetch_accumulation_and_rloo_is_bit_identical(flags, tiny, tmp_path):
    ours = _check_same_as_trl(_launch("torchrun", tiny, tmp_path, *flags))
    for rank in ours:
        assert any(m[0] == "prefetch" for m in rank["moves"]), rank["moves"]
        assert len(rank["buckets_freed"]) == 2 and all(n == rank["param_bytes"] for n in rank["buckets_freed"])


@pytest.mark.parametrize(
    "flags",
    [
        (),
        pytest.param(("--prefetch", "--residency", "role", "--sync-ref"), marks=pytest.mark.slow),
        pytest.param(("--algo", "rloo", "--residency", "stream", "--accumulation", "2"), marks=pytest.mark.slow),
    ],
    ids=["grpo", "grpo-role-prefetch-sync-ref", "rloo-stream-accumulation"],
)
def test_fsdp2_launch_is_bit_identical_to_trl_alone_moving_each_ranks_shards(flags, tiny, tmp_path):
    """accelerate's FSDP2 (TRL's fsdp2.yaml), on a CPU: the child gives the CPU launch the FSDP2
    plugin a GPU launch gets (accelerate turns FSDP on only for GPU launches). The logs and
    the final (gathered) weights are TRL alone's under the same launch; each rank's roles move
    their shards (half of what a replica moves); the policy generates gathered once per step;
    the reference is sharded per block, as the policy."""
    runs = _launch("torchrun", tiny, tmp_path, "--fsdp2", *flags)
    steps = 3
    ours = _check_same_as_trl(runs, algo_steps=steps)
    assert {r["launch"] for r in runs["trl"] + ours} == {"DistributedType.FSDP"}
    replica = ours[0]["param_bytes"]  # the policy's parameters whole; a rank holds half as shards
    # Its shards, and under `role` residency its AdamW moments' shards with them: copied by the
    # switch, or ahead of it by a prefetch's write-back (the shards, also while the generation
    # holds the policy gathered).
    moved = (3 if "role" in flags else 1) * (replica // 2 + 1024)
    for rank in ours:
        outs, ahead = [], 0
        for m in rank["moves"]:
            if m[1] == ["policy"] and m[0] == "prefetch":
                ahead += m[3]
            elif m[1] == ["policy"] and m[0] == "switch":
                outs.append(ahead + m[3])
                ahead = 0
        assert len(outs) == steps and all(0 < o <= moved for o in outs), (outs, moved, rank["moves"])
        assert rank["gathered_generations"] == steps
        assert rank["hooks_off"] == [True] * steps  # each generation without FSDP2's hooks
        assert rank["reference_units"] > 2  # its blocks and the root, not the root alone
        assert rank["buckets_freed"] == []  # no DDP here


def test_fsdp2_policy_lending_its_shards_for_the_gathered_generation_trains_as_trl_alone(tiny, tmp_path):
    """Where a full copy of the policy fits only once its own shards are out (forced here): each
    generation gathers unit by unit, lending each unit's shards to the host as it goes, and
    gets them back after the reshard; logs and weights are TRL alone's. With prefetch, what
    comes in behind the gathered generation writes back no more of the policy than its shards
    (its modules hold the gathered copy then: a write-back once copied all of it to new host
    slots, 2026-11-27)."""
    ours = _check_same_as_trl(_launch("torchrun", tiny, tmp_path, "--fsdp2", "--lend", "--prefetch"))
    replica = ours[0]["param_bytes"]
    for rank in ours:
        shards = max(m[3] for m in rank["moves"] if m[0] == "switch" and m[1] == ["policy"])
        prefetches = [m for m in rank["moves"] if m[0] == "prefetch"]
        assert prefetches and all(m[3] <= shards + 1024 for m in prefetches), (prefetches, shards)
        lent = [m for m in rank["moves"] if "lent" in m[5]]
        back = [m for m in lent if m[0] == "reload"]
        assert len(back) == 3 and rank["gathered_generations"] == 3 and rank["hooks_off"] == [True] * 3
        # Each step the rank's shards (about half the policy on each of 2 ranks) out, and back.
        assert all(0 < m[4] == back[0][4] <= 0.6 * replica for m in back), (back, replica)
        assert sum(m[3] for m in lent if m[0] == "offload") == 3 * back[0][4]


def test_a_gathered_generation_out_of_memory_on_one_rank_runs_again_there_and_trains_as_trl_alone(tiny, tmp_path):
    """Gathered whole for generation, a rank's forwards run no collective: where one rank's
    generation runs out of memory beside what its turn kept or a prefetch brought in (a
    Qwen2.5-32B shape's second step on 4 H100s, 2026-11-28), that rank moves those out and
    generates again from the same random draws, alone; the other waits for it in the next
    collective. Logs and weights are TRL alone's; the rank's log counts the run again."""
    ours = _check_same_as_trl(
        _launch("torchrun", tiny, tmp_path, "--fsdp2", "--lend", "--prefetch", "--oom-generation-on", "1")
    )
    retries = [sum(h.get("tidal/oom_retries", 0) for h in rank["tidal_logs"]) for rank in ours]
    assert retries == [0, 1], retries
    assert all(rank["gathered_generations"] == 3 for rank in ours)


def test_fsdp2_with_only_rank_0_loading_the_weights_trains_as_trl_alone_does_with_every_rank_loading(tiny, tmp_path):
    """fsdp_cpu_ram_efficient_loading: only the first rank's weights count (the other ranks'
    models stand empty: here loaded and filled with NaN); the reference's shards reach them as
    the policy's do, so tidal's run gives the logs and weights of TRL alone with every rank
    loading the weights. Sharded as TRL shards it (as loaded), the reference would hold NaN on
    the other rank."""
    ours = _check_same_as_trl(_launch("torchrun", tiny, tmp_path, "--fsdp2", "--ram-efficient"))
    for rank in ours:
        assert rank["gathered_generations"] == 3 and rank["reference_units"] > 2


def _accelerator(num_processes: int, distributed_type: str, **plugins) -> types.SimpleNamespace:
    state = types.SimpleNamespace(
        distributed_type=distributed_type,
        deepspeed_plugin=plugins.get("deepspeed"),
        fsdp_plugin=plugins.get("fsdp"),
    )
    return types.SimpleNamespace(num_processes=num_processes, state=state)


def test_launches_tidal_cannot_work_with_are_refused_naming_the_one_that_works():
    from tidal.integrations.trl.launch import check_launch

    assert check_launch(_accelerator(1, "NO"), "T") == "single"
    assert check_launch(_accelerator(2, "MULTI_GPU"), "T") == "ddp"
    assert check_launch(_accelerator(2, "MULTI_CPU"), "T") == "ddp"
    with pytest.raises(ValueError, match=r"T does not work with DeepSpeed through accelerate.*multi_gpu config"):
        check_launch(_accelerator(2, "DEEPSPEED", deepspeed=object()), "T")
    with pytest.raises(ValueError, match=r"T does not work with accelerate's XLA launch \(2 processes\)"):
        check_launch(_accelerator(2, "XLA"), "T")
    fsdp = lambda **kw: types.SimpleNamespace(**{"fsdp_version": 2, "cpu_offload": None, **kw})  # noqa: E731
    assert check_launch(_accelerator(2, "FSDP", fsdp=fsdp()), "T") == "fsdp2"
    with pytest.raises(ValueError, match=r"T does not work with FSDP1 .*fsdp_version: 2"):
        check_launch(_accelerator(2, "FSDP", fsdp=fsdp(fsdp_version=1)), "T")
    from torch.distributed.fsdp import CPUOffloadPolicy

    with pytest.raises(ValueError, match=r"FSDP2's CPU offload .*fsdp_offload_params: false"):
        check_launch(_accelerator(2, "FSDP", fsdp=fsdp(cpu_offload=CPUOffloadPolicy())), "T")


def _mode_decided_alike(rank: int, world: int) -> None:
    from tidal.integrations.trl.launch import gather_mode

    cpu = torch.device("cpu")
    # Rank 1 alone lacks the room: no rank gathers (a gather it ran out of memory in would
    # leave the other waiting); with room everywhere, every rank does.
    assert gather_mode(100, 50 if rank == 1 else 1000, 0, cpu) == "per-unit"
    assert gather_mode(100, 100, 0, cpu) == "whole"
    # Where a rank has the room only once its shards are out, every rank lends them.
    assert gather_mode(100, 60 if rank == 0 else 1000, 40, cpu) == "lending"
    assert gather_mode(100, 60 if rank == 0 else 1000, 39, cpu) == "per-unit"


def test_the_gather_for_generation_is_decided_by_every_rank_alike():
    from tests.distributed.multiproc import run_distributed

    run_distributed(_mode_decided_alike)


def test_under_fsdp_the_models_trl_loads_are_placed_whole_unless_the_arguments_say_otherwise():
    """TRL loads the models it builds with device_map="auto" under FSDP (None only for DDP and
    DeepSpeed), spreading each over every GPU the process sees; tidal asks for None there."""
    from tidal.integrations.trl.checks import place_models_whole

    def args(kind, kwargs):
        return types.SimpleNamespace(
            distributed_state=types.SimpleNamespace(distributed_type=kind), model_init_kwargs=kwargs
        )

    fsdp = args("FSDP", {"dtype": "bfloat16"})
    place_models_whole(fsdp)
    assert fsdp.model_init_kwargs == {"dtype": "bfloat16", "device_map": None}
    chosen = args("FSDP", {"device_map": {"": 0}})
    place_models_whole(chosen)
    assert chosen.model_init_kwargs == {"device_map": {"": 0}}  # the user's choice stays
    ddp = args("MULTI_GPU", None)
    place_models_whole(ddp)
    assert ddp.model_init_kwargs is None  # TRL sets it there itself


def test_cpu_adam_with_several_processes_is_refused_naming_what_works():
    """CPU Adam takes each gradient to the host as the backward produces it, before DDP's
    all-reduce (FSDP2's reduce-scatter): every rank would step on its own gradients."""
    from tidal import CPUAdam
    from tidal.integrations.trl.checks import refuse_host_optimizer

    opt = CPUAdam(torch.nn.Linear(2, 2).parameters())
    refuse_host_optimizer(opt, "single", "T")  # one process: its use
    refuse_host_optimizer(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()), "ddp", "T")
    for launch in ("ddp", "fsdp2"):
        with pytest.raises(
            ValueError, match=rf"T cannot use tidal.CPUAdam with several processes \({launch}\).*'stream'"
        ):
            refuse_host_optimizer(opt, launch, "T")
        wrapped = types.SimpleNamespace(optimizer=opt)  # accelerate's wrapper
        with pytest.raises(ValueError, match="cannot use tidal.CPUAdam"):
            refuse_host_optimizer(wrapped, launch, "T")


def test_a_gathered_policy_generates_without_transformers_synced_gpus():
    """Gathered for generation, no forward runs a collective: the ranks need not decode in step
    (transformers' synced_gpus, on for any sharded model: an all-reduce and a host read a
    token). The caller's own choice stays; the instance is left as it was."""
    from tidal.integrations.trl.launch import _unsynced_generate

    seen = []

    class Policy(torch.nn.Module):
        def generate(self, *args, **kwargs):
            seen.append(kwargs.get("synced_gpus", "unset"))
            return args

    policy = Policy()
    with _unsynced_generate(policy):
        assert policy.generate(1) == (1,)
        policy.generate(synced_gpus=True)
    policy.generate()
    assert seen == [False, True, "unset"]
    assert "generate" not in vars(policy)
    own = lambda **kw: seen.append(("own", kw.get("synced_gpus")))  # noqa: E731
    policy.generate = own  # an instance attribute already (another wrapper): put back after
    with pytest.raises(KeyboardInterrupt), _unsynced_generate(policy):
        policy.generate()
        raise KeyboardInterrupt
    assert policy.generate is own and seen[-1] == ("own", False)
