"""Host overhead of the timeshare: what tidal's bookkeeping costs beside the copies.

    python benchmarks/bench_overhead.py [--device cuda|cpu] [--results PATH] [--note TEXT]

Roles: two Qwen2-1.5B-shape models (28 layers, the same 1,354 storages per role with grads
and AdamW state as the real 1.5B) and a reference, with small hidden sizes on the CPU (the
bookkeeping depends on the number of storages, not their bytes) and the real shape on a GPU.

Measured, medians of repeated runs:
- ``use()`` of the resident role that moves nothing: host milliseconds per call (issue 13's
  target: < 0.5 ms for a 1.5B role with AdamW);
- a switch ``load("b")`` with ``a`` resident: wall time, the store's copy window (first copy
  queued to last finished), and the host time outside it, as a fraction of the copy window
  (target: < 5%).
Appends a row to ``--results``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import tidal  # noqa: E402


def build(device: str, small: bool):
    from transformers import AutoModelForCausalLM, Qwen2Config

    kw = dict(hidden_size=1536, num_attention_heads=12, intermediate_size=8960, vocab_size=151936)
    if small:
        kw = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=1000)
    cfg = Qwen2Config(num_hidden_layers=28, num_key_value_heads=2, tie_word_embeddings=True, **kw)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if not small else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    p.add_argument("--note", default="")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    small = args.device == "cpu"
    a, oa = build(args.device, small)
    b, ob = build(args.device, small)
    ts = tidal.Timeshare(args.device)
    ts.add_role("a", model=a, optimizer=oa)  # the default: optimizer state on the host between steps
    ts.add_role("b", model=b, optimizer=ob)
    storages = len(ts._entries(ts.role("a")))
    ts.load("a")

    def noop():
        with ts.use("a"):
            pass

    noop()
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        noop()
        times.append(time.perf_counter() - t0)
    use_ms = statistics.median(times) * 1e3

    walls, copies = [], []
    for i in range(2 * args.reps + 1):
        name = "b" if i % 2 == 0 else "a"
        _sync(args.device)
        t0 = time.perf_counter()
        rec = ts.load(name)
        _sync(args.device)
        wall = time.perf_counter() - t0
        if i:  # the first switch warms the allocator and the arena's reuse
            walls.append(wall)
            copies.append(rec.seconds + rec.release_seconds)
    wall, copy = statistics.median(walls), statistics.median(copies)
    outside = wall - copy
    ts.close()
    name = torch.cuda.get_device_name() if args.device != "cpu" else "CPU (small hidden sizes)"
    print(f"bench_overhead on {name}: {storages} storages per role")
    print(f"  use() moving nothing: {use_ms:.3f} ms (target < 0.5 ms)")
    print(
        f"  switch: wall {wall * 1e3:.1f} ms, copy window {copy * 1e3:.1f} ms, host outside it "
        f"{outside * 1e3:.1f} ms = {outside / copy:.1%} of the copy window (target < 5%)"
    )
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    row = (
        f"| {date} | {name} | torch {torch.__version__} | {storages} | {use_ms:.3f} | {wall * 1e3:.1f} | "
        f"{copy * 1e3:.1f} | {outside * 1e3:.1f} | {outside / copy:.3f} | {args.note} |\n"
    )
    with open(args.results, "a") as f:
        f.write(row)
    print(f"row appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
