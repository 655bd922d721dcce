"""One variant's training run in this process, its measurements written to a JSON file.

The result's fields (the JSON's ``variants[i]``) are what :mod:`trl_bench.report`,
``pool_paired.py`` and RESULTS.md read: ``variant``, ``error``, ``wall_s``, ``step_s`` (the
median measured step), ``step_min_s``, ``peak_bytes``, ``steps_measured``, the per-step lists
(``step_times_s``, ``phase_s_steps``, ...) and their medians, tidal's transitions, and the
host's memory.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

from trl_bench import probes, workload
from trl_bench.variants import Variant

__all__ = ["run_variant"]


def _trainer_kwargs(variant: Variant, model_path: str, args, callbacks: list, cuda: bool) -> dict:
    """What TRL's trainer is given for ``variant``: the policy (and its reference) loaded from
    ``model_path``, the char task's reward (and the reward model at ``args.reward_model_path``,
    if given) and prompts, the run's ``GRPOConfig``."""
    reward_sevens = workload.char_task().reward_sevens
    return dict(
        model=model_path,
        reward_funcs=[reward_sevens, args.reward_model_path] if args.reward_model_path else reward_sevens,
        args=workload.grpo_config(args, deepspeed=variant.trainer == "ds-zero3-offload", cuda=cuda),
        train_dataset=workload.prompts(),
        callbacks=callbacks,
    )


def _trainer_classes() -> tuple:
    """TRL's ``GRPOTrainer`` and tidal's ``TidalGRPOTrainer`` (and with them the modules
    ``datasets``, ``transformers``, ``trl`` and ``tidal.integrations.trl``), imported before
    the run's baseline resident set is read: the baseline is the process with every import
    done."""
    import datasets  # noqa: F401  (workload.prompts)
    from trl import GRPOTrainer

    from tidal.integrations.trl import TidalGRPOTrainer

    return GRPOTrainer, TidalGRPOTrainer


def _trainer(variant: Variant, kwargs: dict, classes: tuple):
    """The trainer ``variant`` names (``classes``: :func:`_trainer_classes`): ``GRPOTrainer``,
    or ``TidalGRPOTrainer`` with its ``TidalConfig``."""
    grpo, tidal_grpo = classes
    if not variant.is_tidal:
        return grpo(**kwargs)
    return tidal_grpo(**kwargs, tidal=variant.tidal_config())


def _medians(res: dict, m: probes.StepProbes) -> None:
    """The medians of a run's per-step lists, and the lists, into ``res``."""
    res["exposed_s_per_step"] = statistics.median(m.exposed) if m.exposed else 0.0
    res["workload"] = m.workload
    res["step_times_s"] = m.times
    if m.lockstep_steps:
        res["lockstep_steps"] = m.lockstep_steps
    res["exposed_s_steps"] = m.exposed
    res["host_stall_s_per_step"] = statistics.median(m.host_stall) if m.host_stall else 0.0
    # Each phase's device seconds per measured step (benchmarks/phase_clock.py), and medians.
    res["phase_s_steps"] = m.phase_steps
    names = sorted({k for p in m.phase_steps for k in p})
    res["phase_s"] = {k: statistics.median(p.get(k, 0.0) for p in m.phase_steps) for k in names}
    if any(m.token_steps):
        res["token_gap_s_steps"] = m.token_steps
        got = [t for t in m.token_steps if t]
        res["token_gap_s"] = {k: statistics.median(t[k] for t in got if k in t) for k in got[0] if k != "count"}
    if m.copy_tail:
        res["copy_tail_s_steps"] = m.copy_tail
        res["copy_tail_s"] = {d: statistics.median(t[d] for t in m.copy_tail) for d in m.copy_tail[0]}
    if m.sampler is not None:
        res["host_samples"] = {
            "interval_s": m.sampler.interval_s,
            "steps": len(m.times),
            "by_verb": m.sampler.by_verb(),
            "top": m.sampler.top(15),
        }
    res["transitions_by_kind"] = m.by_kind
    res["transitions_steps"] = m.moves
    res["allocator_steps"] = m.allocator


def _measured(res: dict, trainer, m: probes.StepProbes, variant: Variant, args) -> None:
    """A run that trained: its step, peak and throughput, the per-step lists, and tidal's
    transitions, into ``res``."""
    # tidal's trainer restarts the device's peak counter at each phase (its per-phase peaks,
    # logged as tidal/peak_gib/<phase>): the step's peak is the highest of those too.
    phase_peaks = probes.logged_per_step(trainer.state.log_history, "tidal/peak_gib/")
    if phase_peaks:
        res["phase_peak_bytes_steps"] = phase_peaks
        m.peaks.append(int(max(max(p.values()) for p in phase_peaks)))
    # The allocator's fragments each phase reached (the last time it ran, as of the step's log
    # line): what the schedule's prefetches and keeps leave free for them.
    fragments = probes.logged_per_step(trainer.state.log_history, "tidal/fragments_gib/")
    if fragments:
        res["fragments_bytes_steps"] = fragments
    res.update(step_s=statistics.median(m.times), peak_bytes=max(m.peaks), steps_measured=len(m.times))
    # Interference from outside the run (the host, the machine) only ever slows a step: the
    # fastest step is the least disturbed reading of the step's own cost.
    res["step_min_s"] = min(m.times)
    res["completions_per_s"] = args.batch * max(1, args.nproc) / res["step_s"]
    res["loss"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    _medians(res, m)
    # TRL alone moves nothing; DeepSpeed's offload moves bytes this bench does not count (null).
    offloading = variant.trainer == "ds-zero3-offload" or (args.nproc > 1 and args.launch == "zero3-offload")
    res["moved_gb_per_step"] = None if offloading else 0.0
    ts = getattr(trainer, "timeshare", None)
    if ts is not None:
        recs, done = ts.records, max(trainer.state.global_step, 1)
        moved = sum(r.bytes_out + r.bytes_in for r in recs)
        res["transition_s_per_step"] = sum(r.seconds + r.release_seconds for r in recs) / done
        res["moved_gb_per_step"] = moved / 1e9 / done
        res["transition_gbps"] = moved / max(sum(r.seconds for r in recs), 1e-9) / 1e9


def _end_partner_turns(args, m: probes.StepProbes) -> None:
    """``--turns``: a step that ended in an error gives the partner its turn; what follows
    (tidal's close() brings its roles back, the next run loads its models) waits for the
    partner's last step, which shares this GPU."""
    if args.turns and args._lockstep is not None:
        args._lockstep.end_turn()
        args._lockstep.barrier(f"run-end/{args._run_index}", timeout_s=m.lockstep_patience())


def run_variant(name: str, model_path: str, out_json: str, args) -> None:
    """Train variant ``name`` (:class:`~trl_bench.variants.Variant`) for ``args.steps`` steps
    in this process and write its result to ``out_json`` (``<out_json>.rank<r>`` with
    ``args.nproc`` > 1: the parent merges them). A run that runs out of device memory records
    the error and where (``oom_at``); one the deadline ended early says so
    (``stopped_by_deadline``). With several processes the process ends here (its exit status
    1 after an error); otherwise the trainer and its memory are freed, for the next run of an
    in-process sequence."""
    import torch

    import tidal
    from tidal.memory import host_rss_bytes

    variant = Variant.parse(name)
    classes = _trainer_classes()
    cuda = torch.cuda.is_available()
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        # This rank's GPU before the first CUDA call below (the host probe's tensor): made on
        # the default device, each rank's CUDA context and tensor would sit on GPU 0.
        # accelerate sets the same device later.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.nproc > 1:
        out_json = f"{out_json}.rank{rank}"
    m = probes.StepProbes(name, args, cuda=cuda, rank=rank)
    kwargs = _trainer_kwargs(variant, model_path, args, m.callbacks(), cuda)
    # The process's resident set before any trainer exists (imports done, no model loaded):
    # what the host holds beyond it is the models' loading and what tidal keeps.
    baseline_rss = host_rss_bytes()
    trainer = _trainer(variant, kwargs, classes)
    print(f"[bench_trl] {name} rank {rank}: trainer ready{m.since_launch()}", flush=True)
    sync_policy = probes.annotate_for_profile(trainer) if args.profile_step else None
    m.attach(trainer)
    t0 = time.perf_counter()
    error = oom_at = None
    try:
        if sync_policy is not None:
            with sync_policy:
                trainer.train()
        else:
            trainer.train()
    except torch.OutOfMemoryError as e:
        error = f"out of memory: {str(e).splitlines()[0]}"
        oom_at = probes.where_out_of_memory(trainer, e)
    finally:
        m.given_clock.close()
    _end_partner_turns(args, m)
    oom = error is not None
    if not error and not m.times:
        error = "no measured step: the deadline came before the second step ended"
    res = {"variant": name, "error": error, "wall_s": time.perf_counter() - t0, "tidal": tidal.__file__}
    if m.stopped:
        res["stopped_by_deadline"] = m.stopped
    if oom:
        res["oom_at"] = oom_at
    res.update(rank=rank, launch=str(trainer.accelerator.distributed_type), nproc=trainer.accelerator.num_processes)
    res["host_baseline_rss_bytes"] = baseline_rss
    if m.rss_steps:
        res["host_rss_bytes_steps"] = m.rss_steps
    if m.host_given:
        res["host_given_steps"] = m.host_given
    ts = getattr(trainer, "timeshare", None)
    if ts is not None:
        res["host_held_bytes"] = sum(ts.store.context.host_bytes().values())
        res["host_pinned_bytes"] = ts.store.context.pinned_bytes()
    if not error:
        _measured(res, trainer, m, variant, args)
    if m.profiled:
        res["profile"] = m.profiled
    with open(out_json, "w") as f:
        json.dump(res, f)
    if args.nproc > 1:
        # After an error the other ranks wait for this one in a collective: ending it lets the
        # launcher end them (at once, where they would wait out NCCL's timeout). Without one,
        # nothing follows in this process: bringing a large policy's roles back only to free
        # them would spend the call's time after the results are written.
        sys.stdout.flush()
        os._exit(1 if error else 0)
    # This run's trainer goes, with its device memory and tidal's pinned host memory (close()
    # brings the roles back, then frees the host copies): an in-process sequence's next run
    # follows in this process.
    if ts is not None:
        ts.close()
    trainer = ts = m.trainer = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
