"""Activation offload benchmark on the GPU, every variant side by side in one process.

    python benchmarks/bench_activations.py [--configs qwen2-1.5b-16L,qwen2-7b-slice]
        [--steps 3] [--results PATH] [--json PATH] [--budget-frac 0.5]

Per config (a Qwen2-shape causal LM from a config, random bf16 weights, random token ids;
one step = forward + backward with grads set to None first), the variants:

* none:        plain autograd.
* save_on_cpu: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward (anchor).
* ckpt:        Hugging Face gradient checkpointing, non-reentrant.
* tidal:       ``tidal.activations`` offload, every layer but the last.
* tidal+ckpt:  the same with checkpointing: the checkpointed layer inputs are offloaded.
* planner:     tidal with ``budget_bytes`` halfway (``--budget-frac``) between the peaks of
               ``none`` and ``tidal``; one measured reference step, then the plan.

Step time is the median of ``--steps`` after warm-up steps, device-synchronised; peak is
``torch.cuda.max_memory_allocated`` over the measured steps. The line rate is measured in the
same run with tidal's pinned arena and copy streams (1 GiB each way). "vs bound" is step time
over max(compute time, offloaded bytes / line rate), where compute time is the ``none`` step
(``ckpt`` for tidal+ckpt; for the planner, ``none`` plus the forward time of the layers it
recomputes, as measured in its reference step). Rows go to ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tidal.activations import ActivationOffloadConfig, ActivationOffloader  # noqa: E402

CONFIGS = {
    # name: (hidden, intermediate, heads, kv heads, layers, batch, seq)
    "qwen2-1.5b-16L": (1536, 8960, 12, 2, 16, 4, 4096),
    "qwen2-7b-slice": (3584, 18944, 28, 4, 4, 1, 16384),
}


def build(name: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, inter, heads, kv, layers, _, seq = CONFIGS[name]
    cfg = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        vocab_size=151936,
        max_position_embeddings=max(seq, 32768),
        tie_word_embeddings=hidden < 2048,
        use_cache=False,
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    return model


def empty_host_cache() -> None:
    for name in ("_accelerator_emptyHostCache", "_host_emptyCache", "_cuda_hostEmptyCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


@dataclasses.dataclass
class Row:
    variant: str
    step_s: float | None = None
    peak_bytes: int | None = None
    bytes_offloaded: int = 0
    exposed_s: float | None = None
    first_step_s: float | None = None
    note: str = ""
    steps_s: list | None = None


def run_variant(model, ids, variant: str, steps: int, warmup: int, ctx_factory) -> tuple[Row, object]:
    row = Row(variant)
    times: list[float] = []
    peak = 0
    off = None
    reports = []
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i == warmup:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        ctx = ctx_factory()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i == 0:
            row.first_step_s = dt
        if i >= warmup:
            times.append(dt)
            peak = max(peak, torch.cuda.max_memory_allocated())
            if isinstance(ctx, ActivationOffloader):
                off = ctx
                reports.append(ctx.report())
        if not torch.isfinite(loss):
            row.note = "loss not finite"
        del loss
    row.step_s = statistics.median(times)
    row.steps_s = times
    row.peak_bytes = peak
    if reports:
        row.bytes_offloaded = int(statistics.median(r.bytes_offloaded for r in reports))
        row.exposed_s = statistics.median(r.exposed_copy_s or 0.0 for r in reports)
    model.zero_grad(set_to_none=True)
    return row, off


def bench_config(name: str, steps: int, budget_frac: float) -> dict:
    torch.manual_seed(0)
    hidden, inter, heads, kv, layers, batch, seq = CONFIGS[name]
    model = build(name)
    layers_list = model.model.layers
    ids = torch.randint(0, 151936, (batch, seq), device="cuda")
    rows: dict[str, Row] = {}
    extra: dict = {}
    nullctx = __import__("contextlib").nullcontext

    def safe(variant, fn):
        try:
            rows[variant] = fn()
        except torch.OutOfMemoryError as e:
            rows[variant] = Row(variant, note=f"OOM: {str(e).splitlines()[0][:80]}")
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        r = rows[variant]
        print(
            f"  {name} {variant:<12} step {r.step_s or float('nan'):.3f}s peak "
            f"{(r.peak_bytes or 0) / 2**30:.2f} GiB offloaded {r.bytes_offloaded / 2**30:.2f} GiB "
            f"exposed {r.exposed_s if r.exposed_s is not None else float('nan'):.3f}s "
            f"first {r.first_step_s or float('nan'):.2f}s {r.note}",
            flush=True,
        )

    safe("none", lambda: run_variant(model, ids, "none", steps, 2, nullctx)[0])
    safe(
        "save_on_cpu",
        lambda: run_variant(
            model, ids, "save_on_cpu", max(1, steps - 1), 1, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)
        )[0],
    )
    empty_host_cache()

    line = {}

    def tidal_variant(variant, ckpt, config):
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        off = ActivationOffloader(model, layers=layers_list, config=config)
        try:
            if not line:
                rate = off._mover.measure_line_rate(1 << 30)
                line["d2h"], line["h2d"] = rate
            warm = 2  # with a budget: the measured reference step, then a planned warm-up step
            row, _ = run_variant(model, ids, variant, steps, warm, lambda: off)
            row.note = (row.note + f" host {off.host_reserved_bytes / 2**30:.2f} GiB").strip()
            if off.plan is not None:
                extra["plan"] = {
                    "modes": [m.value for m in off.plan.modes],
                    "summary": off.plan.summary(),
                    "predicted_peak": off.plan.predicted_peak_bytes,
                    "predicted_step_s": off.plan.predicted_step_s,
                }
                ref = off._reference
                extra["plan_recompute_s"] = sum(f for f, m in zip(ref.layer_forward_s, off.plan.modes) if m.recomputes)
            return row
        finally:
            if ckpt:
                model.gradient_checkpointing_disable()
            off.close()
            empty_host_cache()

    def ckpt_variant():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            return run_variant(model, ids, "ckpt", steps, 2, nullctx)[0]
        finally:
            model.gradient_checkpointing_disable()

    safe("ckpt", ckpt_variant)
    safe("tidal", lambda: tidal_variant("tidal", False, ActivationOffloadConfig()))
    safe("tidal+ckpt", lambda: tidal_variant("tidal+ckpt", True, ActivationOffloadConfig()))
    none, tid = rows["none"], rows["tidal"]
    if none.peak_bytes and tid.peak_bytes:
        budget = int(tid.peak_bytes + budget_frac * (none.peak_bytes - tid.peak_bytes))
        extra["budget_bytes"] = budget
        rate = min(line.values()) if line else None
        safe(
            "planner",
            lambda: tidal_variant(
                "planner", False, ActivationOffloadConfig(budget_bytes=budget, line_rate_bytes_per_s=rate)
            ),
        )
    return {
        "config": name,
        "shape": CONFIGS[name],
        "rows": {k: dataclasses.asdict(v) for k, v in rows.items()},
        "line": line,
        **extra,
    }


def summarize(res: dict) -> list[dict]:
    rows = res["rows"]
    rate = min(res["line"].values()) if res["line"] else None
    soc = rows.get("save_on_cpu", {})
    out = []
    for k, r in rows.items():
        d = {"variant": k, **r}
        ref = {"tidal+ckpt": "ckpt"}.get(k, "none")
        compute = rows.get(ref, {}).get("step_s")
        if k == "planner" and compute is not None:
            compute += res.get("plan_recompute_s", 0.0)
        if r.get("step_s") and compute and rate and k.startswith(("tidal", "planner")):
            d["bound_s"] = max(compute, r["bytes_offloaded"] / rate)
            d["vs_bound"] = r["step_s"] / d["bound_s"]
        if r.get("step_s") and soc.get("step_s"):
            d["soc_speedup"] = soc["step_s"] / r["step_s"]
            d["peak_le_soc"] = (r["peak_bytes"] or 0) <= (soc.get("peak_bytes") or 0)
        out.append(d)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-frac", type=float, default=0.5)
    p.add_argument("--results", default=None, help="append rows to this RESULTS.md")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import transformers

    gpu = torch.cuda.get_device_name()
    print(f"GPU {gpu}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    results = []
    for name in args.configs.split(","):
        res = bench_config(name, args.steps, args.budget_frac)
        gc.collect()  # the model of this config is gone with bench_config's frame
        torch.cuda.empty_cache()
        res["summary"] = summarize(res)
        results.append(res)
        if args.json:  # after every config, so a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "gpu": gpu,
                        "torch": torch.__version__,
                        "transformers": transformers.__version__,
                        "results": results,
                    },
                    f,
                    indent=1,
                    default=str,
                )
        ln = res["line"]
        print(
            f"\n{name}: line rate D2H {ln.get('d2h', 0) / 1e9:.1f} GB/s, H2D {ln.get('h2d', 0) / 1e9:.1f} GB/s"
            + (f", budget {res['budget_bytes'] / 2**30:.2f} GiB" if "budget_bytes" in res else "")
        )
        if "plan" in res:
            print(f"  plan: {res['plan']['summary']}")
        print(
            f"  {'variant':<12} {'step s':>8} {'peak GiB':>9} {'offl GiB':>9} {'exposed s':>9} "
            f"{'vs bound':>8} {'x faster than save_on_cpu':>26}"
        )
        for d in res["summary"]:
            print(
                f"  {d['variant']:<12} {d['step_s'] or float('nan'):8.3f} {(d['peak_bytes'] or 0) / 2**30:9.2f} "
                f"{d['bytes_offloaded'] / 2**30:9.2f} "
                f"{d['exposed_s'] if d['exposed_s'] is not None else float('nan'):9.3f} "
                f"{d.get('vs_bound', float('nan')):8.3f} {d.get('soc_speedup', float('nan')):26.2f} {d['note']}"
            )
    if args.results:
        append_rows(args.results, gpu, transformers.__version__, results)
    return 0


def append_rows(path: str, gpu: str, tf_version: str, results: list[dict]) -> None:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = []
    for res in results:
        ln = res["line"]
        rate = f"{ln.get('d2h', 0) / 1e9:.1f}/{ln.get('h2d', 0) / 1e9:.1f}"
        for d in res["summary"]:
            fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
            lines.append(
                f"| {stamp} | {gpu} | {torch.__version__} | {tf_version} | {res['config']} | {rate} | {d['variant']} | "
                f"{fmt(d['step_s'], '.3f')} | {fmt((d['peak_bytes'] or 0) / 2**30, '.2f')} | "
                f"{d['bytes_offloaded'] / 2**30:.2f} | {fmt(d['exposed_s'], '.3f')} | {fmt(d.get('vs_bound'), '.3f')} | "
                f"{fmt(d.get('soc_speedup'), '.2f')} | {d['note'] or ''} |"
            )
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
