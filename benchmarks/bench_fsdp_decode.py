"""Does FSDP2's gathered generation decode as fast as one GPU holding the model? One process a
GPU, the same model twice in each, token by token, alternating.

    torchrun --nproc_per_node N benchmarks/bench_fsdp_decode.py [--preset qwen2.5-14b] [--batch 64]
        [--new-tokens 64] [--reps 6] [--json PATH]

TidalGRPOTrainer under FSDP2 gathers the policy once for the rollout, takes FSDP2's per-unit
hooks off and decodes without transformers' ``synced_gpus``
(:func:`tidal.integrations.trl.launch`'s gathered generation: :func:`tidal.distributed.fsdp.gathered`
and :func:`~tidal.distributed.fsdp.hooks_off_while_gathered`). Its generation was compared with
one GPU's in other processes beside it (bench_trl.py, gpu.sh ``multi:fsdp14b``), where a
host-bound decode's pace varies with the host of the moment more than the target allows (1.06x
to 1.54x from step to step in one call, 14B shape on 2 of 4 H200s, 2026-11-28). Here each rank
holds, built from the same seed:

* ``plain``: the model whole, unsharded, as one GPU holding it runs it (no FSDP);
* ``sharded``: the same weights under ``fully_shard`` as accelerate's FSDP2 applies it (each
  decoder layer a unit, the final norm and LM head one unit of two modules, the root), and the
  states timed:
  - ``gathered``: ``gathered`` + ``hooks_off_while_gathered``, ``synced_gpus=False`` (tidal's);
  - ``gathered+hooks``: gathered, FSDP2's hooks left on (where a mixed-precision policy
    casts, tidal leaves them);
  - ``per-unit`` (with ``--per-unit``): FSDP2's own way, each forward gathering per unit and
    ``synced_gpus=True`` (TRL alone's);

``plain`` and each state alternate rep by rep, so the host's drift touches both alike. Each
rep is one ``generate`` of ``--new-tokens`` tokens from the same prompts (greedy, no early
stop); every state must give ``plain``'s tokens (checked). Printed per state: the median
over reps of each rep's median gap between tokens, the generation's wall time (the gather
included), and their ratios to the ``plain`` rep beside them (median and range). Target for
``gathered``: generation <= 1.15x one GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_decode import Gaps, build, gap_stats, generate_greedy  # noqa: E402
from trl_bench.workload import PRESETS  # noqa: E402


def shard_as_accelerate(model) -> None:
    """``fully_shard`` as accelerate's FSDP2 applies it to a Hugging Face causal LM (its
    ``transformer_layer_cls_to_wrap``: the decoder layers; the final norm grouped with the
    head; then the root), no mixed-precision policy (accelerate's ``--mixed_precision no``)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard([model.model.norm, model.lm_head])
    fully_shard(model)


def _rep(state: str, plain, sharded, gaps: dict, ids, new_tokens: int) -> tuple[dict, object]:
    """One generation in ``state``: its wall (the gather included), median and longest gap
    between tokens, and the tokens."""
    import torch

    from tidal.distributed.fsdp import gathered, hooks_off_while_gathered

    model = plain if state == "plain" else sharded
    g = gaps["plain" if state == "plain" else "sharded"]
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        hooks_off = None
        if state.startswith("gathered"):
            stack.enter_context(gathered(model))
            if state == "gathered":
                hooks_off = stack.enter_context(hooks_off_while_gathered(model))
        g.times = []
        out = generate_greedy(model, ids, new_tokens, synced_gpus=state == "per-unit")
        if ids.is_cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    times, g.times = g.times, None
    if state == "gathered" and not hooks_off:
        raise RuntimeError("hooks_off_while_gathered() left FSDP2's hooks on: a unit casts, so this is no measure")
    return {"wall_s": wall, **gap_stats(times)}, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2.5-14b", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--per-unit", action="store_true", help="also FSDP2's own per-unit gathering (TRL alone's way)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if min(args.batch, args.prompt_tokens, args.new_tokens, args.reps) < 1:
        p.error("--batch, --prompt-tokens, --new-tokens and --reps must be >= 1")
    if "RANK" not in os.environ:
        p.error(
            "run it under torchrun (one process a GPU): torchrun --nproc_per_node N benchmarks/bench_fsdp_decode.py"
        )

    import torch
    import torch.distributed as dist

    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    # The sharded model first: its full weights are freed as fully_shard keeps this rank's shards.
    sharded = build(args.preset, device, 0)
    shard_as_accelerate(sharded)
    plain = build(args.preset, device, 0)  # the same seed: the same weights, whole
    gaps = {"plain": Gaps(plain), "sharded": Gaps(sharded)}
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, plain.config.vocab_size, (args.batch, args.prompt_tokens), generator=g).to(device)
    states = ["gathered", "gathered+hooks"] + (["per-unit"] if args.per_unit else [])
    for state in ["plain", *states]:  # warm-up: kernels, cuBLAS handles, the allocator's blocks
        # at full length (a warm-up of 4 tokens left the first timed plain rep 2.3x the
        # others at 14B on 2 H200s, 2026-11-28: its KV cache's growth was still to come).
        _rep(state, plain, sharded, gaps, ids, args.new_tokens)
    runs: dict[str, list[dict]] = {s: [] for s in ["plain", *states]}
    pairs: dict[str, list[tuple[dict, dict]]] = {s: [] for s in states}
    for r in range(args.reps):
        for state in states:
            order = ("plain", state) if r % 2 == 0 else (state, "plain")  # each first as often
            got = {}
            for s in order:
                dist.barrier()  # the ranks start each generation together (a collective gather needs it)
                got[s] = _rep(s, plain, sharded, gaps, ids, args.new_tokens)
            if not torch.equal(got["plain"][1], got[state][1]):
                raise RuntimeError(f"rank {rank}: {state} generated other tokens than the plain model: not comparable")
            runs["plain"].append(got["plain"][0])
            runs[state].append(got[state][0])
            pairs[state].append((got[state][0], got["plain"][0]))
    summary: dict = {}
    for state in states:
        gap = [a["median_gap_s"] / b["median_gap_s"] for a, b in pairs[state]]
        wall = [a["wall_s"] / b["wall_s"] for a, b in pairs[state]]
        summary[state] = {
            "median_gap_s": statistics.median(x["median_gap_s"] for x in runs[state]),
            "wall_s": statistics.median(x["wall_s"] for x in runs[state]),
            "gap_ratio_median": statistics.median(gap),
            "gap_ratios": gap,
            "wall_ratio_median": statistics.median(wall),
            "wall_ratios": wall,
            "reps": runs[state],
        }
    summary["plain"] = {
        "median_gap_s": statistics.median(x["median_gap_s"] for x in runs["plain"]),
        "wall_s": statistics.median(x["wall_s"] for x in runs["plain"]),
        "reps": runs["plain"],
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "states": summary})
    if rank == 0:
        name = torch.cuda.get_device_name() if cuda else "CPU"
        print(
            f"{name} x {world}, torch {torch.__version__}; {args.preset} bf16, batch {args.batch} a rank, "
            f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, {args.reps} reps a state, each beside a "
            f"plain rep; the same tokens in every state"
        )
        for r in everyone:
            s = r["states"]
            print(
                f"  rank {r['rank']}: plain (one GPU's way) a token {s['plain']['median_gap_s'] * 1e3:.2f} ms, "
                f"generation {s['plain']['wall_s']:.2f} s"
            )
            for state in states:
                x = s[state]
                print(
                    f"    {state:15s} a token {x['median_gap_s'] * 1e3:.2f} ms ({x['gap_ratio_median']:.3f}x the plain rep "
                    f"beside it; {min(x['gap_ratios']):.3f}-{max(x['gap_ratios']):.3f}), generation {x['wall_s']:.2f} s "
                    f"({x['wall_ratio_median']:.3f}x; {min(x['wall_ratios']):.3f}-{max(x['wall_ratios']):.3f})"
                )
        print("target: gathered generation <= 1.15x one GPU's")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                        "commit": os.environ.get("TIDAL_COMMIT", ""),
                        "gpu": name,
                        "world": world,
                        "torch": torch.__version__,
                        "preset": args.preset,
                        "batch": args.batch,
                        "prompt_tokens": args.prompt_tokens,
                        "new_tokens": args.new_tokens,
                        "reps": args.reps,
                        "ranks": everyone,
                    },
                    f,
                )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
