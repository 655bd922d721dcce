"""Does tidal slow a policy's decoding? One process, the same model, token by token.

    python benchmarks/bench_decode.py [--preset qwen2-7b] [--batch 16] [--new-tokens 32] [--reps 6] [--json out.json]

Inside TRL the generation of tidal's variants took longer than TRL alone's in other processes
(bench_trl.py runs each variant in a process of its own), by more than the transitions that run
beside it, and generation's own time also varied between processes of the same code and between
steps of one process (benchmarks/RESULTS.md, issue 26). This measures the host's time between
generated tokens (a forward pre-hook on the policy, as bench_trl's ``token_gap_s``) of one
policy with the same inputs under each state tidal puts it in, in one process, so that the
process's own speed cancels:

* ``untouched``: the policy and a reference of the same shape, both as built (TRL alone);
* ``registered``: both registered with a timeshare as TidalGRPOTrainer does, the reference
  moved out (its storages guarded), the policy's storages never moved;
* ``reloaded``: the policy moved out and back in (its storages re-allocated by tidal);
* ``reloaded+prefetch``: the same, with the reference's prefetch queued at the first forward
  (15 GB host-to-device at 7B, as TidalGRPOTrainer's generation does), dropped after;
* ``closed``: the timeshare closed (every hook removed), the policy as tidal left it.

``reloaded`` and ``reloaded+prefetch`` alternate rep by rep; the others run their reps in a
row. Each rep is one ``generate`` of ``--new-tokens`` tokens from the same prompts (greedy,
no early stop). Printed: per state the median over reps of each rep's median token gap, the
generate call's wall time, and both against ``untouched``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_bench.workload import PRESETS, qwen2_config  # noqa: E402  (the same model shapes)


def build(preset: str, device, seed: int):
    import torch
    from transformers import AutoModelForCausalLM

    cfg = qwen2_config(preset, pad_id=0, eos_id=1)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


class Gaps:
    """perf_counter at each forward of the policy while armed: one per generated token."""

    def __init__(self, model) -> None:
        self.times: list[float] | None = None
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        if self.times is not None:
            self.times.append(time.perf_counter())


def decode(model, gaps: Gaps, ids, new_tokens: int, on_first_forward=None) -> dict:
    import torch

    gaps.times = []
    handle = None
    if on_first_forward is not None:

        def first(module, args):
            handle.remove()
            on_first_forward()

        handle = model.register_forward_pre_hook(first)
    t0 = time.perf_counter()
    generate_greedy(model, ids, new_tokens)
    if ids.is_cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    times, gaps.times = gaps.times, None
    return {"wall_s": wall, **gap_stats(times), "tokens": len(times)}


def generate_greedy(model, ids, new_tokens: int, **kwargs):
    """``new_tokens`` tokens after ``ids`` (greedy, no early stop, no grad); ``kwargs`` go to
    ``generate`` (``synced_gpus``). Returns the sequences."""
    import torch

    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            **kwargs,
        )
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return out


def gap_stats(times: list[float]) -> dict:
    """The median and longest gap between consecutive forward times (one per token)."""
    steps = [b - a for a, b in zip(times, times[1:])]
    return {"median_gap_s": statistics.median(steps), "longest_gap_s": max(steps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen2-7b", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if min(args.batch, args.prompt_tokens, args.new_tokens, args.reps) < 1:
        p.error("--batch, --prompt-tokens, --new-tokens and --reps must be >= 1")

    import torch

    import tidal
    from tidal.timeshare import Timeshare, TimeshareConfig

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    policy, reference = build(args.preset, device, 0), build(args.preset, device, 1)
    gaps = Gaps(policy)
    g = torch.Generator().manual_seed(2)
    vocab = policy.config.vocab_size
    ids = torch.randint(2, vocab, (args.batch, args.prompt_tokens), generator=g).to(device)
    decode(policy, gaps, ids, args.new_tokens)  # warm-up: kernels, cuBLAS handles, allocator
    runs: dict[str, list[dict]] = {}

    def rep(state: str, **kw) -> None:
        runs.setdefault(state, []).append(decode(policy, gaps, ids, args.new_tokens, **kw))

    for _ in range(args.reps):
        rep("untouched")
    # As TidalGRPOTrainer builds its timeshare: freed memory kept in-process, transitions
    # returning once their copies are queued.
    ts = Timeshare(device, config=TimeshareConfig(release_to_driver=False, wait_for_copies=False))
    ts.add_role("reference", model=reference, grads="drop", frozen=True)
    ts.offload("reference")
    ts.add_role("policy", model=policy)
    for _ in range(args.reps):
        rep("registered")
    ts.offload("policy")
    ts.load("policy")
    for _ in range(args.reps):
        rep("reloaded")
        rep("reloaded+prefetch", on_first_forward=lambda: ts.prefetch("reference"))
        ts.offload("reference")  # frozen: dropped, no copy (TidalGRPOTrainer's loss turn)
    ts.close()
    for _ in range(args.reps):
        rep("closed")

    base = statistics.median(r["median_gap_s"] for r in runs["untouched"])
    base_wall = statistics.median(r["wall_s"] for r in runs["untouched"])
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    print(
        f"\n{gpu}, torch {torch.__version__}; {args.preset} bf16, batch {args.batch}, "
        f"{args.prompt_tokens} prompt + {args.new_tokens} new tokens, {args.reps} reps a state"
    )
    print(f"{'state':20s} {'token gap ms (median of reps)':>30s} {'x untouched':>12s} {'generate s':>11s} {'x':>6s}")
    summary = {}
    for state, rs in runs.items():
        gap = statistics.median(r["median_gap_s"] for r in rs)
        wall = statistics.median(r["wall_s"] for r in rs)
        summary[state] = {
            "median_gap_s": gap,
            "wall_s": wall,
            "gap_x_untouched": gap / base,
            "wall_x_untouched": wall / base_wall,
            "rep_median_gaps_s": [r["median_gap_s"] for r in rs],
            "rep_longest_gaps_s": [r["longest_gap_s"] for r in rs],
            "rep_walls_s": [r["wall_s"] for r in rs],
        }
        print(f"{state:20s} {gap * 1e3:30.2f} {gap / base:12.3f} {wall:11.3f} {wall / base_wall:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "batch": args.batch,
                    "prompt_tokens": args.prompt_tokens,
                    "new_tokens": args.new_tokens,
                    "reps": args.reps,
                    "gpu": gpu,
                    "torch": torch.__version__,
                    "commit": os.environ.get("TIDAL_COMMIT"),
                    "tidal": tidal.__file__,
                    "states": summary,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
