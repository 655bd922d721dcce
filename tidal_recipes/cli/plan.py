"""``tidal plan``: the per-phase peak-memory model of a colocated RL step, and what to enable.

Usage::

    tidal plan (--preset qwen2-0.5b|qwen2-1.5b|qwen2-7b|qwen2.5-14b|qwen2.5-32b|llama3-8b | --config PATH)
               [--gpu-mem-gib G] [--gpus N] [--launch ddp|fsdp2 | --zero-stage S] [--prompts P] [--group G]
               [--prompt-len L] [--gen-len L] [--micro-batch B] [--grad-ckpt | --no-grad-ckpt]
               [--optimizer adamw|adamw_offload|cpu_adam] [--lora-rank R] [--json [PATH]]
               [--sampling own --action-vocab N --completion-logits --step-in-train] ...

Prints the per-phase table (GiB), the components of each phase, the predicted transition
times, the recommendation (with ``--gpu-mem-gib``) and the assumptions. ``--json`` prints the
same as JSON instead (or writes it to PATH). Nothing touches a GPU: it is arithmetic.

Wiring (in ``tidal_recipes/cli/main.py``): ``from tidal_recipes.cli.plan import add_parser`` and add it to the
subcommand list; ``add_parser`` sets ``run`` as the handler. Exit codes: 0 done (fitting or
not: the report says), 2 usage error (a config that cannot be read, an invalid value, a --json
path that cannot be written: all found before any work), 4 the --json file could not be
written after all (the plan is printed to stdout instead).
"""

from __future__ import annotations

import argparse
import json
import sys

from tidal.plan.shapes import PRESETS
from tidal_recipes.cli.args import (
    MAX_GIB,
    bounded_int,
    finite_float,
    gib_arg,
    mib_arg,
    nonneg_int,
    positive_int,
    rate_arg,
)

__all__ = ["add_parser", "run"]

EXIT_OK, EXIT_USAGE, EXIT_OUTPUT = 0, 2, 4
_PRESETS = tuple(PRESETS)  # the released checkpoints' shapes (tidal.plan.shapes)
_OPTIMIZERS = ("adamw", "adamw_offload", "cpu_adam")  # mirrors tidal.plan.model.OPTIMIZERS
_DTYPES = ("bf16", "fp16", "fp32")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``plan`` on ``sub`` (the ``add_subparsers`` object of ``tidal``)."""
    p = sub.add_parser(
        "plan",
        help="per-phase peak-memory model of an RL step; which offloads to enable",
        description="Predict the peak GPU memory of each phase of a colocated GRPO step (rollout, "
        "reference, train, optimizer step) with and without timesharing, the transition times, and "
        "the cheapest set of memory levers that fits a GPU. Every assumption is printed.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=_PRESETS, default=None, help="model shape (default qwen2-1.5b)")
    src.add_argument(
        "--config", metavar="PATH", default=None, help="a Hugging Face config.json, or a model folder holding one"
    )
    p.add_argument(
        "--gpu-mem-gib",
        type=gib_arg,
        default=None,
        help="memory of one GPU in GiB; with it, a recommendation is made (80 GB H100: 79.2)",
    )
    p.add_argument(
        "--host-mem-gib",
        type=gib_arg,
        default=None,
        help="host RAM the job may use, in GiB, for the recommendation's host check (default: on a machine "
        "with a GPU of --gpu-mem-gib, what it has available now, memory cgroup included; elsewhere the host "
        "is not checked)",
    )
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs (data-parallel degree; default 1)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (default 0)")
    p.add_argument(
        "--launch",
        choices=("ddp", "fsdp2"),
        default=None,
        help="how the GPUs train together: ddp (every GPU holds the whole state: ZeRO 0; DDP's buckets are the "
        "gradients, as tidal's TRL trainer makes them) or fsdp2 (full sharding: ZeRO 3)",
    )
    p.add_argument("--prompts", type=positive_int, default=8, help="prompts per step, all GPUs (default 8)")
    p.add_argument("--group", type=positive_int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--gen-len", type=positive_int, default=256, help="max new tokens (default 256)")
    p.add_argument("--micro-batch", type=positive_int, default=4, help="train micro-batch, sequences (default 4)")
    p.add_argument(
        "--grad-ckpt", action=argparse.BooleanOptionalAction, default=False, help="gradient checkpointing (default off)"
    )
    p.add_argument(
        "--act-offload", action=argparse.BooleanOptionalAction, default=False, help="activation offload (default off)"
    )
    p.add_argument(
        "--timeshare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="roles take turns on the GPU (default on)",
    )
    p.add_argument("--optimizer", choices=_OPTIMIZERS, default="adamw", help="default adamw (states on the GPU)")
    p.add_argument(
        "--fused-adamw",
        action="store_true",
        help="AdamW's fused step (transformers' default optimizer, adamw_torch_fused): no state-sized temporary "
        "(default: torch's foreach step)",
    )
    p.add_argument(
        "--optim-stream-mib",
        type=mib_arg,
        default=None,
        help="with --optimizer adamw_offload: step() brings the states in chunks of this many MiB (tidal's "
        'optimizer_residency="stream": 256); default: all at once',
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="with --gpu-mem-gib: each phase with what TidalConfig(prefetch=True) keeps beside it in TRL where "
        "it fits (the reference behind generation and through the loss, the policy through the scoring)",
    )
    p.add_argument(
        "--fused-lm-head",
        action="store_true",
        help="log-probs through TRL's fused LM head (GRPOTrainer / RLOOTrainer, TRL 1.x: the completion's positions "
        "in logit tiles, never the whole logits); needs --logprob-span completion",
    )
    p.add_argument(
        "--gathered-rollout",
        action="store_true",
        help="with --launch fsdp2: the whole policy gathered once for generation, as tidal's TRL trainer does where "
        "each GPU has the room (default: FSDP2's per-unit gathers for every token)",
    )
    p.add_argument(
        "--sync-each-micro-batch",
        action="store_true",
        help="with --launch fsdp2 and several micro-batches: the gradients reduce-scattered after each one "
        "(GRPOConfig(accelerator_config={'gradient_accumulation_kwargs': {'sync_each_batch': True}})); default: held "
        "unsharded, whole, until the last, as FSDP2 does under Trainer's gradient accumulation",
    )
    p.add_argument("--lora-rank", type=nonneg_int, default=0, help="LoRA rank; 0 trains the full model (default)")
    p.add_argument("--dtype", choices=_DTYPES, default="bf16", help="param/activation dtype (default bf16)")
    p.add_argument(
        "--optim-state-dtype",
        choices=_DTYPES,
        default=None,
        help="AdamW state dtype (default: the param dtype, as torch.optim.AdamW allocates); with "
        "--optimizer cpu_adam, CPU Adam's moments on the host: fp32 (default) or bf16",
    )
    p.add_argument("--master-weights", action="store_true", help="fp32 master weights next to the optimizer states")
    p.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa", help="attention implementation (default sdpa)")
    p.add_argument(
        "--no-padding-mask",
        dest="padding_mask",
        action="store_false",
        help="batches carry no attention mask (default: padded batches with a mask)",
    )
    p.add_argument(
        "--logprob-span",
        choices=("sequence", "completion"),
        default="sequence",
        help="positions whose log-probs are taken in fp32 (default sequence)",
    )
    p.add_argument(
        "--completion-logits",
        action="store_true",
        help="logits of the completion only (transformers' logits_to_keep); needs --logprob-span completion",
    )
    p.add_argument(
        "--action-vocab",
        type=positive_int,
        default=None,
        help="log-probs and sampling over this many token ids only (default: the vocabulary)",
    )
    p.add_argument(
        "--sampling",
        choices=("generate", "own"),
        default="generate",
        help="rollout by HF generate (default) or a loop of one's own like tidal_recipes.grpo's",
    )
    p.add_argument(
        "--rollout-engine",
        choices=("hf", "vllm"),
        default="hf",
        help="generate with the policy itself (hf, default) or with TRL's colocated vLLM engine (vllm: use_vllm=True, "
        'vllm_mode="colocate", sleep mode; one GPU)',
    )
    p.add_argument(
        "--vllm-max-model-len",
        type=positive_int,
        default=None,
        help="with --rollout-engine vllm: the engine's max_model_len (GRPOConfig(vllm_max_model_length)); "
        "default prompt + completion",
    )
    p.add_argument(
        "--vllm-kv-cache-gib",
        type=gib_arg,
        default=None,
        help='with --rollout-engine vllm under the timeshare: the KV cache (TidalConfig(vllm_kv_cache_bytes)); default "auto", '
        "sized for the rollout batch",
    )
    p.add_argument(
        "--vllm-gpu-memory-utilization",
        type=finite_float(0.0, inclusive=False, highest=1.0, why="a share of the device"),
        default=0.3,
        help="with --rollout-engine vllm: TRL's share of the device for its engine alone (default 0.3, TRL's)",
    )
    p.add_argument(
        "--cpu-adam-inflight-mib", type=mib_arg, default=512, help="CPUAdam(max_inflight_bytes) in MiB (default 512)"
    )
    p.add_argument(
        "--cpu-adam-grad-accumulation",
        choices=("device", "host"),
        default="device",
        help="with cpu_adam, sum micro-batch gradients on the GPU (default: one copy per step, no host "
        "staging) or on the host (no gradient stays on the GPU)",
    )
    p.add_argument(
        "--step-in-train",
        action="store_true",
        help="the optimizer step runs inside the train phase (its peak counts there)",
    )
    p.add_argument(
        "--context-mib",
        type=bounded_int(0, 1 << 16, why="64 GiB: larger than any CUDA context"),
        default=500,
        help="CUDA context, MiB (default 500, assumed; at most 65536)",
    )
    p.add_argument(
        "--bench-json", metavar="PATH", default=None, help="take the line rate from a `tidal bench --json PATH` file"
    )
    p.add_argument("--d2h-gbps", type=rate_arg, default=None, help="device->host GB/s (default 55)")
    p.add_argument("--h2d-gbps", type=rate_arg, default=None, help="host->device GB/s (default 55)")
    p.add_argument("--bidir-gbps", type=rate_arg, default=None, help="both directions at once, GB/s (default 100)")
    p.add_argument(
        "--json",
        metavar="PATH",
        nargs="?",
        const="-",
        default=None,
        help="print JSON instead of the report (or write it to PATH)",
    )
    p.set_defaults(run=run)
    return p


def _is_the_gpu_host(gpu_mem_bytes: int) -> bool:
    """This machine has a CUDA GPU of about ``gpu_mem_bytes`` (within 5%): a plan for that GPU is
    a plan for this machine, whose RAM is then the host's. False without torch or a GPU."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    total = torch.cuda.get_device_properties(0).total_memory
    return abs(total - gpu_mem_bytes) <= 0.05 * gpu_mem_bytes


def _format_kept(kept: dict, host: dict, gpu_mem_gib: float) -> str:
    """The phases with what TRL's prefetching schedule keeps beside them (tidal.plan.kept_phases)
    and the host memory it holds then (tidal.plan.kept_host)."""
    gib = 1 << 30
    lines = [
        f"with prefetch (TidalConfig(prefetch=True) in TRL), on {gpu_mem_gib:.2f} GiB: what each phase keeps "
        "beside it where it fits with the phase's need (+10%, 256 MiB)"
    ]
    for name, k in kept.items():
        what = ", ".join(f"+ {role} {b / gib:.2f}" for role, b in k.kept.items()) or "nothing kept"
        lines.append(f"  {name:<16} {k.peak_bytes / gib:8.2f} GiB  ({what})")
    parts = ", ".join(f"{n} {b / gib:.2f}" for n, b in host.items())
    lines.append(f"  host held per GPU {sum(host.values()) / gib:.2f} GiB ({parts or 'nothing'})")
    return "\n".join(lines)


def _as_the_trainer_gathers(config, usable: int, bw):
    """With --gathered-rollout: the config as tidal's trainer would hold the policy for
    generation (tidal.plan.gathered_rollout), with a note where that is not the whole policy
    beside its shards, and a warning where the generation's own need then leaves less than
    the trainer's 10% and 256 MiB."""
    import dataclasses  # noqa: PLC0415

    from tidal.memory import phase_need_bytes  # noqa: PLC0415
    from tidal.plan import GIB, build_plan, gathered_rollout  # noqa: PLC0415

    mode = gathered_rollout(config, usable, bandwidth=bw)
    whole = build_plan(dataclasses.replace(config, zero3_rollout="whole"), bandwidth=bw).timeshared["rollout"]
    gathered = whole.transient.get("zero3 whole policy gathered", 0)
    if mode == "layers":
        print(
            f"tidal plan: note: --gathered-rollout: the whole policy ({gathered / GIB:.2f} GiB) does not fit with the "
            f"10% and 256 MiB the trainer leaves ({usable / GIB:.2f} GiB usable), even with the policy's shards lent "
            f"to the host: tidal's trainer then gathers per unit, as planned here",
            file=sys.stderr,
        )
    elif mode == "lent":
        print(
            f"tidal plan: note: --gathered-rollout: the whole policy ({gathered / GIB:.2f} GiB) fits only without its "
            f"shards ({whole.resident.get('actor params', 0) / GIB:.2f} GiB): tidal's trainer lends them to the host "
            f"for the generation, as planned here",
            file=sys.stderr,
        )
    config = dataclasses.replace(config, zero3_rollout=mode)
    rollout = build_plan(config, bandwidth=bw).timeshared["rollout"]
    if mode != "layers" and rollout.resident_bytes + phase_need_bytes(rollout.transient_bytes) > usable:
        print(
            f"tidal plan: warning: --gathered-rollout: tidal's trainer gathers the whole policy here, and the "
            f"generation's {rollout.peak_bytes / GIB:.2f} GiB peak (its KV cache beside it) leaves less than 10% and "
            f"256 MiB of the {usable / GIB:.2f} GiB usable: it may run out of memory; fewer sequences a GPU or more "
            f"GPUs make room",
            file=sys.stderr,
        )
    return config


def _line_rate_of(path: str, gpus: int) -> str | dict:
    """What ``--bench-json PATH`` gives the plan: a ``tidal bench --json`` file as it is; a
    ``benchmarks/bench_shared_copies.py --json`` file (every rank of a host copying at once) as
    the rates its slowest rank got with all copying, which each rank of a multi-GPU run can count
    on (a note says so). A one-GPU rate planning several GPUs gets a note: the ranks of one host
    share its memory and PCIe fabric (4 H100s: 0.55x of one GPU's device-to-host rate each, 0.75x
    host-to-device, 2026-11-27)."""
    import json  # noqa: PLC0415

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return path  # Bandwidth.from_bench_json says what is wrong with it
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if isinstance(ranks, list) and ranks and all(isinstance(r, dict) and "shared" in r for r in ranks):
        try:
            line = {
                f"{name}_gbps": min(float(r["shared"][key]) for r in ranks)
                for name, key in (("d2h", "d2h"), ("h2d", "h2d"), ("bidir", "both"))
            }
        except (KeyError, TypeError, ValueError):
            return {"line_rate": None}  # refused below, with what a usable file holds
        print(
            f"tidal plan: note: --bench-json: the rates the slowest of {len(ranks)} ranks got with every rank "
            f"copying at once: device to host {line['d2h_gbps']:.1f}, host to device {line['h2d_gbps']:.1f}, both "
            f"{line['bidir_gbps']:.1f} GB/s"
            + (f" (measured on {len(ranks)} GPUs, planned for {gpus})" if gpus != len(ranks) else ""),
            file=sys.stderr,
        )
        return {"line_rate": line}
    if gpus > 1:
        print(
            f"tidal plan: note: --bench-json holds one GPU's line rate; {gpus} ranks of one host copying at once each "
            "get less (benchmarks/bench_shared_copies.py --json measures it; pass its file here)",
            file=sys.stderr,
        )
    return path  # read by Bandwidth.from_bench_json, which names the file in any error


def _bandwidth(args: argparse.Namespace):
    import dataclasses  # noqa: PLC0415

    from tidal.plan import Bandwidth  # noqa: PLC0415

    bw = Bandwidth.from_bench_json(_line_rate_of(args.bench_json, args.gpus)) if args.bench_json else Bandwidth()
    over = {
        k: v
        for k, v in (("d2h_gbps", args.d2h_gbps), ("h2d_gbps", args.h2d_gbps), ("bidir_gbps", args.bidir_gbps))
        if v is not None
    }
    return dataclasses.replace(bw, **over)


def run(args: argparse.Namespace) -> int:
    """Build the plan (and the recommendation) for ``args``; print it. Returns the exit code."""
    from tidal_recipes.cli.args import output_problem  # noqa: PLC0415
    from tidal.memory import host_memory  # noqa: PLC0415
    from tidal.plan import (  # noqa: PLC0415
        GIB,
        PlanConfig,
        build_plan,
        format_plan,
        kept_host,
        kept_phases,
        load_shape,
        recommend,
        trl_vllm_kv_cache_bytes,
    )
    from tidal.plan.recommend import RESERVE_FRACTION  # noqa: PLC0415

    problem = output_problem(args.json) if args.json not in (None, "-") else None
    if problem is not None:
        print(f"tidal plan: error: --json {args.json}: {problem}. Nothing was run", file=sys.stderr)
        return EXIT_USAGE
    stage_of = {"ddp": 0, "fsdp2": 3}
    if args.launch is not None and args.zero_stage is not None and args.zero_stage != stage_of[args.launch]:
        print(
            f"tidal plan: error: --launch {args.launch} is ZeRO stage {stage_of[args.launch]}, but --zero-stage "
            f"{args.zero_stage} was given too; give one of them. Nothing was run",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.prefetch and args.gpu_mem_gib is None:
        print(
            "tidal plan: error: --prefetch keeps what fits beside each phase: it needs --gpu-mem-gib (80 GB H100: "
            "79.2). Nothing was run",
            file=sys.stderr,
        )
        return EXIT_USAGE
    vllm_flags = [
        flag
        for flag, given in (
            ("--vllm-max-model-len", args.vllm_max_model_len is not None),
            ("--vllm-kv-cache-gib", args.vllm_kv_cache_gib is not None),
            ("--vllm-gpu-memory-utilization", args.vllm_gpu_memory_utilization != 0.3),
        )
        if given
    ]
    if args.rollout_engine != "vllm" and vllm_flags:
        print(
            f"tidal plan: error: {', '.join(vllm_flags)} size the vLLM engine: add --rollout-engine vllm. Nothing was run",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.rollout_engine == "vllm" and not args.timeshare and args.gpu_mem_gib is None:
        print(
            "tidal plan: error: --rollout-engine vllm --no-timeshare is TRL's engine alone, whose KV cache is "
            "--vllm-gpu-memory-utilization of the GPU: it needs --gpu-mem-gib. Nothing was run",
            file=sys.stderr,
        )
        return EXIT_USAGE
    zero_stage = stage_of[args.launch] if args.launch is not None else (args.zero_stage or 0)
    if args.gathered_rollout and args.gpus == 1:
        print(
            "tidal plan: note: --gathered-rollout is ignored: only a sharded policy (--launch fsdp2 with --gpus > 1) "
            "is gathered for generation",
            file=sys.stderr,
        )
    elif args.gathered_rollout and zero_stage < 3:
        print(
            "tidal plan: note: --gathered-rollout applies only where ZeRO 3 (FSDP2) shards the policy: not to this "
            "plan, to the recommendation's zero3 lever if it takes it",
            file=sys.stderr,
        )
    sequences = args.prompts * args.group
    if args.gpus > sequences:
        print(
            f"tidal plan: error: --gpus {args.gpus:,} is more than the {sequences} sequences of a step (--prompts "
            f"{args.prompts} x --group {args.group}): every GPU needs at least one; lower --gpus or raise --prompts. "
            "Nothing was run",
            file=sys.stderr,
        )
        return EXIT_USAGE
    per_gpu = -(-sequences // args.gpus)
    micro_batch = args.micro_batch
    if micro_batch > per_gpu:  # a micro-batch cannot hold more sequences than there are
        micro_batch = per_gpu
        print(
            f"tidal plan: note: --micro-batch {args.micro_batch:,} is more than the {per_gpu} sequences each GPU "
            f"trains on per step; planning with a micro-batch of {per_gpu}",
            file=sys.stderr,
        )
    try:
        shape = load_shape(args.config if args.config else (args.preset or "qwen2-1.5b"))
        bw = _bandwidth(args)
        config = PlanConfig(
            shape=shape,
            param_dtype=args.dtype,
            optim_state_dtype=args.optim_state_dtype,
            master_weights=args.master_weights,
            optimizer=args.optimizer,
            cpu_adam_grad_accumulation=args.cpu_adam_grad_accumulation,
            zero_stage=zero_stage,
            dp=args.gpus,
            lora_rank=args.lora_rank,
            prompts=args.prompts,
            group=args.group,
            prompt_len=args.prompt_len,
            gen_len=args.gen_len,
            micro_batch=micro_batch,
            padding_mask=args.padding_mask,
            attn=args.attn,
            logprob_span=args.logprob_span,
            completion_logits=args.completion_logits,
            lm_head="fused" if args.fused_lm_head else "logits",
            zero3_rollout="whole" if args.gathered_rollout else "layers",
            sync_each_micro_batch=args.sync_each_micro_batch,
            action_vocab=args.action_vocab,
            sampling=args.sampling,
            cpu_adam_inflight_bytes=args.cpu_adam_inflight_mib << 20,
            adamw_foreach=not args.fused_adamw,
            optim_stream_chunk_bytes=args.optim_stream_mib << 20 if args.optim_stream_mib is not None else None,
            step_in_train=args.step_in_train,
            grad_ckpt=args.grad_ckpt,
            act_offload=args.act_offload,
            timeshare=args.timeshare,
            cuda_context_bytes=args.context_mib << 20,
            rollout_engine=args.rollout_engine,
            vllm_max_model_len=args.vllm_max_model_len,
            vllm_kv_cache_bytes=int(args.vllm_kv_cache_gib * GIB) if args.vllm_kv_cache_gib else None,
            vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        )
        shown = config
        if config.rollout_engine == "vllm" and not config.timeshare:  # TRL's engine alone sizes its own cache
            cache = trl_vllm_kv_cache_bytes(config, int(args.gpu_mem_gib * GIB))
            shown = config.replace(vllm_kv_cache_bytes=max(1, cache))
    except (ValueError, OSError) as e:
        print(f"tidal plan: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.gpu_mem_gib is not None and config.zero3_rollout == "whole" and config.zero_stage >= 3 and config.dp > 1:
        usable = int(args.gpu_mem_gib * GIB * (1 - RESERVE_FRACTION)) - config.cuda_context_bytes
        config = _as_the_trainer_gathers(config, usable, bw)
        shown = config
    plan = build_plan(shown, bandwidth=bw)
    if plan.device_peak_bytes > MAX_GIB * GIB:  # what no GPU holds: the numbers are a typo
        print(
            f"tidal plan: error: this step would peak at {plan.device_peak_bytes / GIB / MAX_GIB:,.0f} PiB on one GPU "
            f"({plan.peak_phase}), more than any machine has; lower --prompts, --group, --prompt-len or --gen-len. "
            "Nothing was printed",
            file=sys.stderr,
        )
        return EXIT_USAGE
    rec, host_source = None, None
    if args.gpu_mem_gib is not None:
        host = None  # not checked (the summary says so)
        if args.host_mem_gib is not None:
            host, host_source = int(args.host_mem_gib * GIB), "--host-mem-gib"
        elif _is_the_gpu_host(int(args.gpu_mem_gib * GIB)):
            try:
                host = host_memory().available_bytes  # this machine's, now (a cgroup's limit included)
                host_source = "this machine's available memory"
            except OSError:
                pass  # no /proc/meminfo
        rec = recommend(
            config, gpu_mem_bytes=int(args.gpu_mem_gib * GIB), gpus=args.gpus, bandwidth=bw, host_mem_bytes=host
        )
    kept = None
    if args.prefetch:
        usable = int(args.gpu_mem_gib * GIB * (1 - RESERVE_FRACTION)) - config.cuda_context_bytes
        try:
            kept = kept_phases(plan, usable)
        except ValueError as e:
            print(f"tidal plan: error: --prefetch: {e}. Nothing was printed", file=sys.stderr)
            return EXIT_USAGE
    if args.json is None:
        print(format_plan(plan, rec), flush=True)
        if host_source == "this machine's available memory":
            print(
                f"(the host's memory above is this machine's available memory, {host / GIB:.2f} GiB: it has "
                f"a GPU of {args.gpu_mem_gib:g} GiB; plan for another machine's with --host-mem-gib)",
                flush=True,
            )
        elif rec is not None and host_source is None:
            # Planning for another machine: its RAM is not this one's.
            print(
                f"(host memory not checked: this machine has no GPU of {args.gpu_mem_gib:g} GiB, so its RAM is "
                "not the GPU host's; give the GPU host's available RAM with --host-mem-gib)",
                flush=True,
            )
        if kept is not None:
            print(_format_kept(kept, kept_host(plan, kept), args.gpu_mem_gib), flush=True)
        return EXIT_OK
    data = {"plan": plan.to_dict(), "recommendation": rec.to_dict() if rec else None, "host_memory_from": host_source}
    if kept is not None:
        data["prefetch"] = {p: k.to_dict() for p, k in kept.items()}
        data["prefetch_host"] = kept_host(plan, kept)
    text = json.dumps(data, indent=2)
    if args.json == "-":
        print(text)
    else:
        try:
            with open(args.json, "w") as f:
                f.write(text + "\n")
        except OSError as e:
            print(text)  # not lost: the plan goes to stdout instead
            print(
                f"tidal plan: error: could not write --json {args.json} ({e}); the plan is printed above",
                file=sys.stderr,
            )
            return EXIT_OUTPUT
        print(f"wrote {args.json}")
    return EXIT_OK
