"""CPU Adam benchmark (issue 4): host optimizer-step throughput, then a full GPU train step.

    python benchmarks/bench_cpu_adam.py [--device cuda:0] [--throughput-params 1.5e9]
        [--batch 8 --seq 2048 --steps 5 --grad-ckpt] [--results PATH | --no-results]
        [--skip-train] [--skip-throughput]

Everything runs in one process, in this order, and every figure printed is measured here:

1. **Optimizer step throughput on the host** (params/s; no GPU involved). One set of fp32 CPU
   tensors with the shapes of a real model (``--shapes``, default the train preset's, taken
   greedily until ``--throughput-params``), each with a random fp32 gradient. Each optimizer
   gets its own copy of the same starting params and the same gradients, and keeps fp32 master
   weights / moments:

   - tidal ``CPUAdam.step()`` over those CPU params, its host gradients set directly
     (``opt._host[p].grad`` filled once, ``has_grad = True`` before every step): the whole
     update path, chunking and the copy of the new master weights into the params included;
   - tidal's update kernel alone: ``torch._fused_adamw_`` through CPUAdam's own helper (plus the step-count increment)
     called on CPUAdam's own host buffers the way ``CPUAdam._update`` calls it;
   - ``torch.optim.AdamW(fused=True).step()`` with ``p.grad`` set (torch's fused CPU kernel);
   - ``DeepSpeedCPUAdam.step()`` (``adamw_mode=True``) when ``deepspeed`` imports and its op
     builds; otherwise the reason it is not available is printed and recorded.

   Median of ``--throughput-steps`` steps after ``--throughput-warmup`` warm-up steps.

2. **A full train step on the GPU** (skipped with a message when no CUDA device is used):
   ``--preset`` (default qwen2-1.5b) from ``tidal_recipes.cli.models.build_model``, bf16 params, one
   batch of random token ids, ``loss = model(input_ids=x, labels=x).loss``. Each variant gets a
   fresh model built from the same seed (the previous one is freed and the cache emptied):

   - reference: forward + backward only, no optimizer (what the optimizer adds on top of);
   - (a) ``torch.optim.AdamW(fused=True)`` on the GPU params (bf16 moments, as the params);
   - (b) ``tidal.CPUAdam(overlap=True)``: ``with opt.step_in_backward(): loss.backward()``,
     then ``opt.step()``;
   - (c) ``tidal.CPUAdam(overlap=False)``: gradients copied to the host in ``step()``.

   Each step is timed with the device synchronized before and after; median of ``--steps``
   after ``--warmup`` warm-up steps. Also: peak ``torch.cuda.max_memory_allocated`` per variant
   (counter reset before its model is built), first/last loss (must be finite), ratios (b)/(a)
   (target <= 1.3) and (c)/(a), and the device memory a variant left allocated once freed.

With ``--results`` (default benchmarks/RESULTS.md) one row per run is added to the table of
the ``## CPU Adam (issue 4)`` section, which is created (with its column names) when missing.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # benchmark the checkout, not some installed copy

import torch  # noqa: E402

import tidal  # noqa: E402
from tidal.optim.cpu_adam import _fused_adamw  # noqa: E402
from tidal_recipes.measure import PRESETS, PlainQwen2Shape, build_model  # noqa: E402
from tidal.device import host_available_bytes  # noqa: E402

GIB = 1 << 30
SECTION = "## CPU Adam (issue 4)"
TARGET_OVERLAP_RATIO = 1.3
COLUMNS = [
    "date",
    "GPU",
    "torch",
    "transformers",
    "CPU cores / torch threads",
    "host step: G params (tensors)",
    "tidal step G/s",
    "tidal kernel G/s",
    "torch fused G/s",
    "tidal/fused",
    "DeepSpeed G/s",
    "train: preset, batch x seq, ckpt",
    "fwd+bwd s",
    "(a) GPU AdamW s (peak GiB)",
    "(b) CPUAdam overlap s (peak GiB)",
    "(c) CPUAdam no overlap s (peak GiB)",
    "(b)/(a)",
    "(c)/(a)",
    "loss finite",
]
INTRO = """\
Written by `python benchmarks/bench_cpu_adam.py --results ...`. Host step: one optimizer step
over fp32 CPU params with the tensor shapes of the named preset (fp32 grads, master weights and
moments), median after a warm-up; G/s = 1e9 params per second. "tidal step" is
`CPUAdam.step()` (update kernel + copy of the master weights into the params + bookkeeping),
"tidal kernel" the `torch._fused_adamw_` call it makes, "torch fused" `torch.optim.AdamW(fused=True)`.
Train: full step (forward + backward + optimizer) of a Qwen2-shape model with random weights,
bf16 params, random token ids, median of N after 2 warm-up steps, device synchronized around
each step; peak = `torch.cuda.max_memory_allocated` of that variant. (a) GPU
`AdamW(fused=True)`; (b) `tidal.CPUAdam(overlap=True)` with `step_in_backward()`; (c)
`tidal.CPUAdam(overlap=False)`. Target: (b)/(a) <= 1.3."""


# ---- helpers ---------------------------------------------------------------------------------
def log(msg: str = "") -> None:
    print(msg, flush=True)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def environment(device: torch.device | None) -> dict:
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    gpu = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": tf,
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch_threads": torch.get_num_threads(),
    }


def _median_times(
    fn: Callable[[], object],
    warmup: int,
    steps: int,
    before: Callable[[], None] | None = None,
    sync: Callable[[], None] | None = None,
) -> list[float]:
    """Wall seconds of ``steps`` calls of ``fn`` after ``warmup`` untimed ones; ``before`` runs
    untimed ahead of every call, ``sync`` right before each clock read."""
    times = []
    for i in range(warmup + steps):
        if before is not None:
            before()
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _f(x, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


# ---- 1. host optimizer-step throughput -----------------------------------------------------------
def tensor_shapes(preset: str, budget: int) -> list[tuple[int, ...]]:
    """Shapes of ``preset``'s parameters (tied ones once), taken in model order while they fit
    in ``budget`` elements; past the whole model, further copies of one layer's tensors."""
    with torch.device("meta"):
        m = PlainQwen2Shape(PRESETS[preset])
    model_shapes = [tuple(p.shape) for p in m.parameters()]
    layer_shapes = [tuple(p.shape) for p in m.model.layers[0].parameters()]
    out, left = [], budget
    for s in model_shapes:
        if math.prod(s) <= left:
            out.append(s)
            left -= math.prod(s)
    added = True
    while added:
        added = False
        for s in layer_shapes:
            if math.prod(s) <= left:
                out.append(s)
                left -= math.prod(s)
                added = True
    if not out:
        raise SystemExit(f"--throughput-params {budget} is smaller than every tensor of {preset}")
    return out


class HostTensors:
    """The starting params and the gradients every optimizer in part 1 gets (fp32, CPU)."""

    def __init__(self, shapes: list[tuple[int, ...]], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.randn(s, generator=gen).mul_(0.02) for s in shapes]
        self.grads = [torch.randn(s, generator=gen).mul_(1e-3) for s in shapes]
        self.numel = sum(p.numel() for p in self.params)

    def fresh_params(self) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(p.clone()) for p in self.params]


def _hyper(args) -> dict:
    return {"lr": args.lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def bench_tidal_bf16_moments(src: HostTensors, args) -> dict:
    """CPUAdam(state_dtype=torch.bfloat16).step() over the same params and gradients: the
    sliced fp32 update with moments rounded to bf16 (the option a 7B host plan needs)."""
    params = src.fresh_params()
    opt = tidal.CPUAdam(params, state_dtype=torch.bfloat16, **_hyper(args))
    hosts = [opt._host[p] for p in params]
    for hp, g in zip(hosts, src.grads):
        hp.grad.copy_(g)

    def give_grads() -> None:
        for hp in hosts:
            hp.has_grad = True

    out = {"seconds": _median_times(opt.step, args.throughput_warmup, args.throughput_steps, before=give_grads)}
    out["finite"] = all(bool(torch.isfinite(opt.state[p]["master"]).all()) for p in params)
    return out


def bench_tidal(src: HostTensors, args) -> tuple[dict, dict]:
    """CPUAdam.step() over CPU params, and the update kernel alone on its buffers."""
    params = src.fresh_params()
    t0 = time.perf_counter()
    opt = tidal.CPUAdam(params, **_hyper(args))
    setup_s = time.perf_counter() - t0
    hosts = [opt._host[p] for p in params]
    for hp, g in zip(hosts, src.grads):
        hp.grad.copy_(g)

    def give_grads() -> None:  # step() consumes the host gradients; the buffers keep their values
        for hp in hosts:
            hp.has_grad = True

    step_times = _median_times(opt.step, args.throughput_warmup, args.throughput_steps, before=give_grads)
    step = {"seconds": step_times, "setup_s": setup_s}

    g = opt.param_groups[0]
    sts = [opt.state[p] for p in params]
    masters, grads = [s["master"] for s in sts], [hp.grad for hp in hosts]
    exp_avgs, exp_avg_sqs, steps = [s["exp_avg"] for s in sts], [s["exp_avg_sq"] for s in sts], [s["step"] for s in sts]

    def kernel() -> None:  # what CPUAdam._adam runs for one group, through the same helper
        torch._foreach_add_(steps, 1)
        _fused_adamw(g, masters, grads, exp_avgs, exp_avg_sqs, [], steps)

    kern = {"seconds": _median_times(kernel, args.throughput_warmup, args.throughput_steps)}
    bad = sum(int(not torch.isfinite(m).all()) for m in masters)
    step["finite"] = kern["finite"] = bad == 0
    return step, kern  # the optimizer and its buffers die with this frame


def bench_torch_fused(src: HostTensors, args) -> dict:
    params = src.fresh_params()
    for p, g in zip(params, src.grads):
        p.grad = g  # the fused kernel only reads the gradient
    opt = torch.optim.AdamW(params, fused=True, **_hyper(args))
    return _time_host_step(opt, params, args)


def _time_host_step(opt, params: list, args, **extra) -> dict:
    """Median step time of ``opt`` over ``params`` (grads already set), then free both."""
    res = {"seconds": _median_times(opt.step, args.throughput_warmup, args.throughput_steps), **extra}
    res["finite"] = all(bool(torch.isfinite(p).all()) for p in params)
    for p in params:
        p.grad = None
    del opt, params
    gc.collect()
    return res


def bench_deepspeed(src: HostTensors, args) -> dict:
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 (ImportError, or a failing import-time check)
        return {"unavailable": f"not available: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    params = src.fresh_params()
    for p, g in zip(params, src.grads):
        p.grad = g
    try:
        opt = DeepSpeedCPUAdam(params, adamw_mode=True, fp32_optimizer_states=True, **_hyper(args))
    except Exception as e:  # noqa: BLE001 (the op is JIT-built and may fail to)
        return {"unavailable": f"not available: DeepSpeedCPUAdam failed to build: {type(e).__name__}: {e}"}
    return _time_host_step(opt, params, args, version=deepspeed.__version__)


def run_throughput(args) -> dict:
    shapes = tensor_shapes(args.shapes, int(args.throughput_params))
    n = sum(math.prod(s) for s in shapes)
    # Peak while tidal runs: source params + grads (8 B), its params (4 B), CPUAdam's master,
    # exp_avg, exp_avg_sq, grad and (unpinned, on cpu) staging (20 B).
    need = 32 * n
    avail = host_available_bytes()
    if need > avail:
        raise SystemExit(
            f"part 1 needs ~{need / GIB:.1f} GiB of host memory for {n / 1e9:.3f} G params, "
            f"{avail / GIB:.1f} GiB is available: lower --throughput-params"
        )
    log(
        f"[1] host optimizer step: {n / 1e9:.4f} G params in {len(shapes)} tensors ({args.shapes} shapes, largest "
        f"{max(math.prod(s) for s in shapes) / 1e6:.1f} M), making the tensors ..."
    )
    t0 = time.perf_counter()
    src = HostTensors(shapes, args.seed)
    res = {
        "params": n,
        "tensors": len(shapes),
        "shapes": args.shapes,
        "make_s": time.perf_counter() - t0,
        "warmup": args.throughput_warmup,
        "steps": args.throughput_steps,
    }
    log("    tidal CPUAdam.step() and its kernel ...")
    res["tidal_step"], res["tidal_kernel"] = bench_tidal(src, args)
    log("    tidal CPUAdam.step(), bf16 moments ...")
    res["tidal_step_bf16"] = bench_tidal_bf16_moments(src, args)
    log("    torch AdamW(fused=True) ...")
    res["torch_fused"] = bench_torch_fused(src, args)
    log("    DeepSpeedCPUAdam ...")
    res["deepspeed"] = bench_deepspeed(src, args)
    for k in ("tidal_step", "tidal_step_bf16", "tidal_kernel", "torch_fused", "deepspeed"):
        d = res[k]
        if "seconds" in d:
            d["median_s"] = statistics.median(d["seconds"])
            d["gparams_s"] = n / d["median_s"] / 1e9
    fused = res["torch_fused"]["gparams_s"]
    for k in ("tidal_step", "tidal_step_bf16", "tidal_kernel", "deepspeed"):
        if "gparams_s" in res[k]:
            res[k]["vs_fused"] = res[k]["gparams_s"] / fused
    del src
    gc.collect()
    return res


# ---- 2. full train step on the GPU -----------------------------------------------------------------
VARIANTS = {
    "fwd_bwd": "forward+backward only (no optimizer)",
    "gpu_adamw": "(a) GPU torch AdamW(fused=True)",
    "tidal_overlap": "(b) tidal CPUAdam(overlap=True) + step_in_backward",
    "tidal_plain": "(c) tidal CPUAdam(overlap=False)",
}
# (b) runs last: whatever it might leave behind (it starts a worker thread) cannot weigh on
# another variant's peak memory. The report keeps the (a), (b), (c) order.
RUN_ORDER = ("fwd_bwd", "gpu_adamw", "tidal_plain", "tidal_overlap")


def train_variant(kind: str, args, device: torch.device, batch: torch.Tensor) -> dict:
    """One variant on a fresh model; its model and optimizer are gone when this returns
    (``left_bytes``: device memory still allocated then, over what was before)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    res, opt_ref = _train_steps(kind, args, device, batch)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    res["left_bytes"] = torch.cuda.memory_allocated(device) - base
    res["opt_freed"] = None if opt_ref is None else opt_ref() is None
    return res


def _train_steps(kind: str, args, device: torch.device, batch: torch.Tensor) -> tuple[dict, weakref.ref | None]:
    model, desc = build_model(args.preset, device=device, dtype=torch.bfloat16, seed=args.seed)
    res: dict = {"model_impl": desc, "params": sum(p.numel() for p in model.parameters())}
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    t0 = time.perf_counter()
    opt = None
    if kind == "gpu_adamw":
        opt = torch.optim.AdamW(model.parameters(), fused=True, **_hyper(args))
    elif kind == "tidal_overlap":
        opt = tidal.CPUAdam(model.parameters(), overlap=True, **_hyper(args))
    elif kind == "tidal_plain":
        opt = tidal.CPUAdam(model.parameters(), overlap=False, **_hyper(args))
    res["opt_setup_s"] = time.perf_counter() - t0
    losses: list[torch.Tensor] = []

    def step() -> None:
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        if kind == "tidal_overlap":
            with opt.step_in_backward():
                loss.backward()
        else:
            loss.backward()
        if kind == "fwd_bwd":
            model.zero_grad(set_to_none=True)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    try:
        times = _median_times(step, args.warmup, args.steps, sync=lambda: torch.cuda.synchronize(device))
    except torch.cuda.OutOfMemoryError as e:
        res["error"] = f"out of memory: {str(e).splitlines()[0]}"
        times = []
    res["peak_bytes"] = torch.cuda.max_memory_allocated(device)
    if times:
        vals = [float(x) for x in losses]
        res.update(
            seconds=times,
            median_s=statistics.median(times),
            min_s=min(times),
            max_s=max(times),
            loss_first=vals[0],
            loss_last=vals[-1],
            finite=all(math.isfinite(v) for v in vals),
        )
    return res, (weakref.ref(opt) if opt is not None else None)


def run_train(args, device: torch.device) -> dict:
    p = PRESETS[args.preset]
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    batch = torch.randint(0, p.vocab, (args.batch, args.seq), device=device, generator=gen)
    res = {
        "preset": args.preset,
        "batch": args.batch,
        "seq": args.seq,
        "grad_ckpt": args.grad_ckpt,
        "steps": args.steps,
        "warmup": args.warmup,
        "variants": {},
    }
    for kind in RUN_ORDER:
        log(f"[2] {VARIANTS[kind]} ...")
        r = train_variant(kind, args, device, batch)
        res["variants"][kind] = r
        if r.get("model_impl", "").startswith("plain"):
            res["skipped"] = f"transformers is not importable: {r['model_impl']} has no forward"
            return res
        if "median_s" in r:
            log(
                f"    median {r['median_s']:.4f} s, peak {r['peak_bytes'] / GIB:.2f} GiB, "
                f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}"
            )
        else:
            log(f"    {r.get('error')}")
    v = res["variants"]
    ref = v["gpu_adamw"].get("median_s")
    for kind in ("tidal_overlap", "tidal_plain", "fwd_bwd"):
        if ref and "median_s" in v[kind]:
            v[kind]["vs_gpu_adamw"] = v[kind]["median_s"] / ref
    return res


# ---- output ------------------------------------------------------------------------------------------
def format_report(r: dict) -> str:
    e = r["env"]
    L = [
        (
            f"GPU     {e['gpu'] or 'none (' + r['device'] + ')'}   torch {e['torch']}  CUDA {e['cuda'] or '-'}  "
            f"transformers {e['transformers'] or 'not installed'}  python {e['python']}"
        ),
        f"CPU     {e['cpu']}: {e['cpu_count']} cores ({e['cpu_affinity']} usable), torch threads {e['torch_threads']}",
        "",
    ]
    t = r.get("throughput")
    if t is None:
        L.append("[1] host optimizer step: skipped (--skip-throughput)")
    else:
        L.append(
            f"[1] host optimizer step: {t['params'] / 1e9:.4f} G params in {t['tensors']} tensors ({t['shapes']} "
            f"shapes), fp32 params/grads/master/moments, median of {t['steps']} after {t['warmup']} warm-up"
        )
        L.append(f"    {'':<52}{'median s':>10}{'G params/s':>12}{'x torch fused':>15}")
        rows = [
            ("tidal CPUAdam.step()", t["tidal_step"]),
            ("tidal CPUAdam.step(), bf16 moments", t["tidal_step_bf16"]),
            ("tidal update kernel (torch._fused_adamw_ call)", t["tidal_kernel"]),
            ("torch AdamW(fused=True).step()", t["torch_fused"]),
            (
                "DeepSpeedCPUAdam.step()" + (f" {t['deepspeed']['version']}" if "version" in t["deepspeed"] else ""),
                t["deepspeed"],
            ),
        ]
        for label, d in rows:
            if "unavailable" in d:
                L.append(f"    {label:<52}{d['unavailable']}")
            else:
                L.append(
                    f"    {label:<52}{d['median_s']:>10.4f}{d['gparams_s']:>12.3f}{_f(d.get('vs_fused')):>15}"
                    + ("" if d.get("finite", True) else "   NON-FINITE RESULT")
                )
        L.append(
            f"    tidal/torch fused = {t['tidal_step']['vs_fused']:.3f}; CPUAdam construction (master copies, "
            f"state allocation) {t['tidal_step']['setup_s']:.2f} s, once"
        )
        big = r.get("args", {}).get("extrapolate_params")
        if big:
            L.append(
                f"    at these rates a step of {big / 1e9:.2f} G params takes "
                f"{big / 1e9 / t['tidal_step']['gparams_s']:.1f} s (fp32 moments) and "
                f"{big / 1e9 / t['tidal_step_bf16']['gparams_s']:.1f} s (bf16 moments) on the host, if the rate "
                f"holds at that size (memory-bound: it should)"
            )
    L.append("")
    tr = r.get("train")
    if tr is None or "not_run" in tr:
        L.append(f"[2] train step: skipped ({tr['not_run'] if tr else '?'})")
        return "\n".join(L)
    v = tr["variants"]
    impl = next(iter(v.values())).get("model_impl", "?")
    L.append(
        f"[2] train step on {r['device']}: {tr['preset']} ({impl}, {next(iter(v.values()))['params'] / 1e9:.3f} G "
        f"params, bf16), batch {tr['batch']} x {tr['seq']}, gradient checkpointing "
        f"{'on' if tr['grad_ckpt'] else 'off'}, median of {tr['steps']} after {tr['warmup']} warm-up"
    )
    if "skipped" in tr:
        L.append(f"    skipped: {tr['skipped']}")
        return "\n".join(L)
    L.append(
        f"    {'':<52}{'median s':>10}{'min':>8}{'max':>8}{'tokens/s':>10}{'peak GiB':>10}{'x (a)':>8}"
        f"{'loss first -> last':>22}"
    )
    tokens = tr["batch"] * tr["seq"]
    for kind in ("fwd_bwd", "gpu_adamw", "tidal_overlap", "tidal_plain"):
        d = v[kind]
        if "median_s" not in d:
            L.append(f"    {VARIANTS[kind]:<52}{d.get('error', 'not measured')}")
            continue
        ratio = 1.0 if kind == "gpu_adamw" else d.get("vs_gpu_adamw")
        loss = f"{d['loss_first']:.4f} -> {d['loss_last']:.4f}" + ("" if d["finite"] else " NOT FINITE")
        L.append(
            f"    {VARIANTS[kind]:<52}{d['median_s']:>10.4f}{d['min_s']:>8.3f}{d['max_s']:>8.3f}"
            f"{tokens / d['median_s']:>10.0f}{d['peak_bytes'] / GIB:>10.2f}{_f(ratio, '.3f'):>8}{loss:>22}"
        )
    b, c = v["tidal_overlap"].get("vs_gpu_adamw"), v["tidal_plain"].get("vs_gpu_adamw")
    verdict = "-" if b is None else ("ok" if b <= TARGET_OVERLAP_RATIO else "MISSED")
    L.append(f"    (b)/(a) = {_f(b)} (target <= {TARGET_OVERLAP_RATIO}: {verdict});  (c)/(a) = {_f(c)}")
    setup = ", ".join(f"{k} {v[k]['opt_setup_s']:.2f} s" for k in ("tidal_overlap", "tidal_plain"))
    L.append(f"    CPUAdam construction (host state, once): {setup}")
    for kind in RUN_ORDER:
        d = v[kind]
        if d["left_bytes"] > (256 << 20) or d["opt_freed"] is False:  # small: cuBLAS workspaces etc.
            L.append(
                f"    note: after {VARIANTS[kind]} was deleted, {d['left_bytes'] / 2**20:.0f} MiB stayed allocated "
                f"on the device; optimizer object freed: {d['opt_freed']}"
            )
    return "\n".join(L)


def result_cells(r: dict) -> list[str]:
    e, t, tr = r["env"], r.get("throughput"), r.get("train")

    def gs(d):
        return d["unavailable"] if "unavailable" in d else f"{d['gparams_s']:.3f}"

    cells = [
        r["date"][:16].replace("T", " "),
        e["gpu"] or f"none ({r['device']})",
        e["torch"],
        e["transformers"] or "-",
        f"{e['cpu_affinity']} / {e['torch_threads']}",
    ]
    if t is None:
        cells += ["-"] * 6
    else:
        cells += [
            f"{t['params'] / 1e9:.3f} ({t['tensors']}, {t['shapes']})",
            gs(t["tidal_step"]),
            gs(t["tidal_kernel"]),
            gs(t["torch_fused"]),
            f"{t['tidal_step']['vs_fused']:.3f}",
            gs(t["deepspeed"]),
        ]
    if tr is None or "not_run" in tr or "skipped" in tr:
        why = (tr or {}).get("not_run") or (tr or {}).get("skipped") or "-"
        cells += [f"skipped: {why}"] + ["-"] * 7
    else:
        v = tr["variants"]

        def st(kind):
            d = v[kind]
            return d.get("error", "-") if "median_s" not in d else f"{d['median_s']:.3f} ({d['peak_bytes'] / GIB:.1f})"

        finite = all(d.get("finite", False) for d in v.values())
        cells += [
            f"{tr['preset']}, {tr['batch']} x {tr['seq']}, {'ckpt' if tr['grad_ckpt'] else 'no ckpt'}",
            _f(v["fwd_bwd"].get("median_s")),
            st("gpu_adamw"),
            st("tidal_overlap"),
            st("tidal_plain"),
            _f(v["tidal_overlap"].get("vs_gpu_adamw")),
            _f(v["tidal_plain"].get("vs_gpu_adamw")),
            "yes" if finite else "NO",
        ]
    return [c.replace("|", "/").replace("\n", " ") for c in cells]


def append_results(path: str, r: dict) -> None:
    """Add one row to the table of the ``SECTION`` of ``path``; create the section (and the
    file) with its column names when missing."""
    header = "| " + " | ".join(COLUMNS) + " |\n"
    sep = "|" + "---|" * len(COLUMNS) + "\n"
    row = "| " + " | ".join(result_cells(r)) + " |\n"
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == SECTION), None)
    if start is None:
        if text and not text.endswith("\n"):
            text += "\n"
        text += ("\n" if text else "") + f"{SECTION}\n\n{INTRO}\n\n" + header + sep + row
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        hdr = next((j for j in range(start + 1, end) if lines[j].strip() == header.strip()), None)
        if hdr is None:  # the section exists without our table (or with other columns)
            at = end
            while at > start + 1 and not lines[at - 1].strip():
                at -= 1
            lines[at:at] = ["\n" if lines[at - 1].strip() else "", header, sep, row] + (
                ["\n"] if at < len(lines) and lines[at].strip() else []
            )
        else:
            last = hdr
            while last + 1 < end and lines[last + 1].startswith("|"):
                last += 1
            lines.insert(last + 1, row)
        text = "".join(lines)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


# ---- main -----------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="device of the train step (default: cuda when available)",
    )
    ap.add_argument("--preset", default="qwen2-1.5b", choices=sorted(PRESETS), help="model of the train step")
    ap.add_argument(
        "--shapes",
        default=None,
        choices=sorted(PRESETS),
        help="preset whose tensor shapes the host step uses (default: --preset)",
    )
    ap.add_argument("--throughput-params", type=float, default=1.5e9, help="params in the host step (default 1.5e9)")
    ap.add_argument("--throughput-steps", type=int, default=5, help="timed host steps (median)")
    ap.add_argument(
        "--extrapolate-params",
        type=float,
        default=7.6e9,
        help="also say how long a host step of this many params takes at the measured rates (default 7.6e9)",
    )
    ap.add_argument("--throughput-warmup", type=int, default=1, help="untimed host steps first")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5, help="timed train steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed train steps first")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing in the train step")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--results",
        default=os.path.join(ROOT, "benchmarks", "RESULTS.md"),
        help="markdown file to add a row to (default benchmarks/RESULTS.md)",
    )
    ap.add_argument("--no-results", action="store_true", help="write no row")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args(argv)
    args.shapes = args.shapes or args.preset
    if min(args.steps, args.throughput_steps) < 1 or min(args.warmup, args.throughput_warmup) < 0:
        ap.error("steps must be >= 1 and warm-up >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    if cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    r = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": str(device),
        "env": environment(device if cuda else None),
        "args": {"extrapolate_params": args.extrapolate_params},
    }
    r["throughput"] = None if args.skip_throughput else run_throughput(args)
    if args.skip_train:
        r["train"] = {"not_run": "--skip-train"}
    elif not cuda:
        r["train"] = {
            "not_run": f"needs a CUDA device; device is {args.device!r}"
            + ("" if torch.cuda.is_available() else " and torch sees no CUDA")
        }
    else:
        r["train"] = run_train(args, device)
    log("")
    log(format_report(r))
    if not args.no_results:
        append_results(args.results, r)
        log(f"\nadded a row to {args.results} ({SECTION})")
    tr = r["train"]
    bad = tr and "variants" in tr and not all(d.get("finite", False) for d in tr["variants"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
