"""CPU Adam with bf16 moments against fp32 AdamW: the effect on training, and the update's cost.

    python benchmarks/bench_cpu_adam_precision.py [--steps 400] [--results PATH]

``CPUAdam(state_dtype=torch.bfloat16)`` halves the host memory of Adam's moments (the fp32
master weights stay); a full-parameter 7B role then needs 28 GiB less host RAM. Its cost in
results is measured here on a small Qwen2 shape (random weights, built from a config) learning
a synthetic language (sequences from a fixed random Markov chain), trained the same way three
times from the same start on the same batches:

* ``torch.optim.AdamW`` in fp32 (the anchor);
* ``tidal.CPUAdam`` with fp32 moments (AdamW exactly, up to fused-kernel rounding);
* ``tidal.CPUAdam`` with bf16 moments.

Printed: the training loss every ``--every`` steps (mean of the last ``--every``), the largest
gap to the anchor's loss over those windows, the evaluation loss at the end, and how far each
run's weights ended from the anchor's relative to how far the anchor moved from the start.
Then the host update's time per step for both state dtypes on this machine's CPU (a ratio: the
GPU machine's 16 cores give other absolute figures). On the CPU: the figures are about results,
not device speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tidal  # noqa: E402


def _model(seed: int):
    from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: PLC0415

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def _language(vocab: int = 256, branching: int = 4, seed: int = 7) -> torch.Tensor:
    """A Markov chain: every token is followed by one of ``branching`` tokens (fixed at random)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (vocab, branching), generator=g)


def _batch(chain: torch.Tensor, g: torch.Generator, batch: int = 16, length: int = 64) -> torch.Tensor:
    seq = torch.empty(batch, length, dtype=torch.long)
    seq[:, 0] = torch.randint(0, chain.shape[0], (batch,), generator=g)
    for i in range(1, length):
        pick = torch.randint(0, chain.shape[1], (batch,), generator=g)
        seq[:, i] = chain[seq[:, i - 1], pick]
    return seq


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def train(kind: str, steps: int, lr: float) -> tuple[list[float], float, list[torch.Tensor], float]:
    """(per-step losses, eval loss, final weights, host seconds per optimizer step)."""
    model = _model(0).train()
    params = list(model.parameters())
    if kind == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    else:
        dtype = torch.bfloat16 if kind == "cpu_adam_bf16" else torch.float32
        opt = tidal.CPUAdam(params, lr=lr, weight_decay=0.01, state_dtype=dtype)
    chain = _language()
    g = torch.Generator().manual_seed(11)
    losses, step_s = [], []
    for _ in range(steps):
        loss = _loss(model, _batch(chain, g))
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        step_s.append(time.perf_counter() - t0)
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    ge = torch.Generator().manual_seed(99)
    with torch.no_grad():
        ev = statistics.fmean(float(_loss(model, _batch(chain, ge))) for _ in range(8))
    if isinstance(opt, tidal.CPUAdam):
        opt.close()
    return losses, ev, [p.detach().clone() for p in params], statistics.median(step_s)


def update_cost(nparams: int, repeats: int = 5) -> dict[str, float]:
    """Host seconds of one CPUAdam update of ``nparams`` fp32 parameters, per state dtype."""
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        p = torch.nn.Parameter(torch.randn(nparams))
        opt = tidal.CPUAdam([p], lr=1e-3, state_dtype=dtype)
        times = []
        for _ in range(repeats):
            p.grad = torch.randn(nparams)
            # The gradient reaches the host buffers through the hooks only in a backward; here
            # it is put there directly, so that only the update is timed.
            opt._host[p].grad.copy_(p.grad)
            opt._host[p].has_grad = True
            p.grad = None
            t0 = time.perf_counter()
            opt._adam([p])
            times.append(time.perf_counter() - t0)
            opt._host[p].reset()
        opt.close()
        out[name] = statistics.median(times)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--update-params", type=int, default=64 << 20, help="parameters in the update-cost measurement")
    ap.add_argument("--results", default=None, help="append the table to this RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    runs = {kind: train(kind, args.steps, args.lr) for kind in ("adamw", "cpu_adam_fp32", "cpu_adam_bf16")}
    init = [p.detach() for p in _model(0).parameters()]
    ref_losses, ref_eval, ref_w, _ = runs["adamw"]
    moved = sum(float((w - w0).float().pow(2).sum()) for w, w0 in zip(ref_w, init)) ** 0.5
    windows = range(args.every, args.steps + 1, args.every)
    lines = [
        "| run | " + " | ".join(f"loss @{s}" for s in windows) + " | max gap to AdamW | eval loss | weights vs AdamW |",
        "|---|" + "---|" * (len(windows) + 3),
    ]
    for kind, (losses, ev, w, _) in runs.items():
        means = [statistics.fmean(losses[s - args.every : s]) for s in windows]
        ref_means = [statistics.fmean(ref_losses[s - args.every : s]) for s in windows]
        gap = max(abs(a - b) for a, b in zip(means, ref_means))
        dist = sum(float((a - b).float().pow(2).sum()) for a, b in zip(w, ref_w)) ** 0.5
        lines.append(
            f"| {kind} | " + " | ".join(f"{m:.4f}" for m in means) + f" | {gap:.4f} | {ev:.4f} | {dist / moved:.4f} |"
        )
    cost = update_cost(args.update_params)
    n = sum(p.numel() for p in _model(0).parameters())
    text = "\n".join(
        [
            f"### CPU ({os.cpu_count()} cores), {datetime.datetime.now():%Y-%m-%d %H:%M}, torch {torch.__version__}",
            f"`python benchmarks/bench_cpu_adam_precision.py --steps {args.steps}`: a Qwen2 shape of {n / 1e6:.2f} M "
            f"parameters learning a 4-way Markov language of 256 tokens, batch 16 x 64, lr {args.lr}, weight decay "
            f"0.01; anchor: torch AdamW fp32. 'weights vs AdamW': distance of the final weights to the anchor's, over "
            f"the anchor's distance from the start.",
            "",
            *lines,
            "",
            f"Host update of {args.update_params / 2**20:.0f} Mi fp32 parameters on this CPU, median of 5: fp32 moments "
            f"{cost['fp32'] * 1e3:.1f} ms ({args.update_params / cost['fp32'] / 1e9:.2f} G params/s), bf16 moments "
            f"{cost['bf16'] * 1e3:.1f} ms ({args.update_params / cost['bf16'] / 1e9:.2f} G params/s): "
            f"{cost['bf16'] / cost['fp32']:.2f}x the time.",
        ]
    )
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
