"""The report of the variants measured so far: the printed table (a line per variant and what
it measured, each tidal variant against TRL alone's run, the pairs and pools of
:mod:`trl_bench.stats`), the profiled steps, the RESULTS.md rows and the JSON.

``args`` is the launch's namespace: the flags (``preset``, ``dtype``, ``batch``, ``completion``,
``results``, ``json``, ``picture``, and for the JSON ``micro_batch``, ``nproc``, ``launch``,
``trl_loading``, ``host_floor_gib``, ``profile_step``), what the preparing process measured
(``gpu_name``, ``line_rate``), the comparisons read from other JSONs (``one_gpu``,
``one_gpu_generate``, ``anchor``) and ``commit``; attributes that a report does not reach may
be missing. ``results``: the variants' result dicts (:mod:`trl_bench.run`), in run order; the
report adds to them what it computes (``bound_s``, ``floor_s``, ``compute_s``,
``beyond_room_bytes``, ``anchor``, ``one_gpu_completions_per_s``, ``one_gpu_generate_s``).
"""

from __future__ import annotations

import datetime
import json

from trl_bench import stats
from trl_bench.workload import NUM_GENERATIONS

__all__ = ["TARGETS", "report", "step_bound", "step_floor"]

TARGETS = (
    "targets (64 x 256): 1.5B fp32 step <= 1.05x TRL (paired, the 95% interval's upper end) at peak <= 0.5x, "
    "generation <= 1.02x; 7B bf16 exposed <= 3% of the step; prefetch never slower than without"
)
"""The line of targets printed under every report."""

_GIB = 2**30


def step_bound(r: dict, base: dict | None, line: dict | None) -> float | None:
    """max(TRL alone's step, bytes moved per step / the bidirectional line rate); None without
    TRL alone's run ``base``."""
    if base is None:
        return None
    copy_s = (r.get("moved_gb_per_step") or 0.0) / line["bidir_gbps"] if line else 0.0
    return max(base["step_s"], copy_s)


def step_floor(r: dict, line: dict | None) -> dict | None:
    """The step's floor (``floor_s``): the phases' compute (``compute_s``: their device seconds
    less the compute stream's waits on tidal's copies) plus the optimizer state that cannot be
    on the device beside the weights and gradients while the backward runs
    (``beyond_room_bytes``: it must cross between the clipped backward and the step, no
    schedule overlaps it with compute), at the host-to-device line rate measured in this run.
    The room counted is all the device's memory less the weights and gradients: an upper bound,
    so the floor is a lower one. None without the phases, the workload's sizes or a line rate."""
    w, phases = r.get("workload") or {}, r.get("phase_s")
    if not phases or not w or not line:
        return None
    compute = max(0.0, sum(phases.values()) - (r.get("exposed_s_per_step") or 0.0))
    room = w["device_total_bytes"] - w["weights_bytes"] - w["grads_bytes"]
    beyond = max(0, w["optimizer_state_bytes"] - room)
    return {"floor_s": compute + beyond / (line["h2d_gbps"] * 1e9), "compute_s": compute, "beyond_room_bytes": beyond}


def _x(ratio: float | None) -> str:
    return f"{ratio:.2f}" if ratio is not None else "-"


def _ok(r: dict | None) -> bool:
    return r is not None and not r.get("error")


class _Context:
    """What every line of one report shares: the versions, the workload's words, the anchors."""

    def __init__(self, args, results: list) -> None:
        import torch
        import transformers
        import trl

        self.args, self.results = args, results
        self.torch, self.transformers, self.trl = torch.__version__, transformers.__version__, trl.__version__
        self.gpu = getattr(args, "gpu_name", None) or "CPU"  # read by the preparing process
        self.reward_model = bool(getattr(args, "reward_model", False))
        self.what = f"{args.preset} {args.dtype}" + (" + reward model" if self.reward_model else "")
        self.date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        self.base = next((r for r in results if r["variant"] == "trl" and _ok(r)), None)
        self.trl_runs = [r for r in results if r["variant"] == "trl" and _ok(r)]
        # DeepSpeed ZeRO-3 offload, the anchor a TRL user reaches for when the model does not fit
        self.ds = next((r for r in results if r["variant"] == "ds-zero3-offload" and _ok(r)), None)
        self.line_rate = getattr(args, "line_rate", None)

    def row_head(self, variant: str) -> str:
        a = self.args
        return (
            f"| {self.date} | {self.gpu} | {self.torch} | {self.trl} | {self.what} | {a.batch}x{a.completion} | "
            f"{variant} |"
        )


def _header(c: _Context) -> None:
    a = c.args
    print(f"\n{c.gpu}, torch {c.torch}, transformers {c.transformers}, trl {c.trl}")
    print(
        f"{c.what}, {a.batch} completions x {a.completion} tokens per step, beta 0.04, weights {a.dtype}"
        + (", bf16 autocast" if c.gpu != "CPU" and not (a.nproc > 1 and a.launch == "fsdp2") else "")
    )


def _error_line(c: _Context, r: dict) -> tuple[str, str]:
    """A failed run's printed line (and where each rank ran out of memory) and its row."""
    line = f"  {r['variant']:8s} {r['error'][:120]}"
    for at in [r.get("oom_at")] + [x.get("oom_at") for x in r.get("ranks", [])]:
        if at:
            line += (
                f"\n    out of memory at step {at.get('step')}, phase {at.get('phase')}, resident "
                f"{at.get('resident_roles')}, prefetched {(at.get('prefetched_bytes') or 0) / _GIB:.2f} GiB, "
                f"allocated {(at.get('allocated_bytes') or 0) / _GIB:.2f} GiB; "
                + " <- ".join(reversed(at.get("frames", [])[-4:]))
            )
    return line, f"{c.row_head(r['variant'])} {r['error'][:80]} | - | - | - | - | - |"


def _measured_line(c: _Context, n: int, r: dict) -> tuple[str, str]:
    """A measured run's printed line (against TRL alone's first run, its neighbouring TRL runs
    where there are several, and DeepSpeed's offload) and its row; sets ``r["bound_s"]``."""
    base, results = c.base, c.results
    # With several TRL-alone processes (variants "trl,X,trl,X" or "trl,X,X,trl"), each variant
    # against the one run just before it and the one just after it too: steps vary between
    # processes more than between neighbours.
    before = next((b for b in reversed(results[:n]) if b["variant"] == "trl" and _ok(b)), None)
    after = next((b for b in results[n + 1 :] if b["variant"] == "trl" and _ok(b)), None)
    pr = r["peak_bytes"] / base["peak_bytes"] if base else None
    sr = r["step_s"] / base["step_s"] if base else None
    share = r.get("exposed_s_per_step", 0.0) / r["step_s"]
    bound = step_bound(r, base, c.line_rate)
    fastest = r["step_min_s"] / base["step_min_s"] if base and "step_min_s" in base else None
    r["bound_s"] = bound
    several = len(c.trl_runs) > 1
    line = (
        f"  {r['variant']:8s} step {r['step_s']:.3f} s ({_x(sr)} TRL)  peak {r['peak_bytes'] / _GIB:.2f} GiB "
        f"({_x(pr)} TRL)  exposed {share:.1%} of the step (host+stall "
        f"{r.get('host_stall_s_per_step', 0.0) / r['step_s']:.1%}), "
        + (
            f"{r['moved_gb_per_step']:.1f} GB/step at {r.get('transition_gbps', 0):.1f} GB/s"
            if r.get("moved_gb_per_step") is not None
            else "bytes moved not counted"
        )
        + (f"  bound {bound:.3f} s ({r['step_s'] / bound:.2f}x)" if bound else "")
        + (f"  fastest step {r['step_min_s']:.3f} s ({_x(fastest)} TRL's)" if "step_min_s" in r else "")
        + (
            f"  ({r['step_s'] / before['step_s']:.2f}x the TRL process before it)"
            if several and before is not None and before is not base
            else ""
        )
        + (
            f"  ({r['step_s'] / after['step_s']:.2f}x the TRL process after it)"
            if several and after is not None and r["variant"] != "trl"
            else ""
        )
        + (
            f"  against DeepSpeed ZeRO-3 offload: step {r['step_s'] / c.ds['step_s']:.2f}x, "
            f"peak {r['peak_bytes'] / c.ds['peak_bytes']:.2f}x"
            if c.ds is not None and r is not c.ds
            else ""
        )
    )
    row = (
        f"{c.row_head(r['variant'])} {r['step_s']:.3f} | {_x(sr)} | {r['peak_bytes'] / _GIB:.2f} | {_x(pr)} | "
        f"{share:.3f} | {r.get('transition_gbps', 0):.1f} |"
    )
    return line, row


def _against_other_calls(c: _Context, r: dict) -> None:
    """A measured run against the same workload on one GPU (``--one-gpu-json``) and an anchor
    run (``--anchor-json``), and its ranks' figures with several processes."""
    a = c.args
    one = getattr(a, "one_gpu", {}).get(r["variant"])
    if one is not None:
        r["one_gpu_completions_per_s"] = one
        print(
            f"    throughput: {r['completions_per_s']:.2f} completions/s on {r['nproc']} GPUs against {one:.2f} on one "
            f"in the same call: {r['completions_per_s'] / one:.2f}x (target >= {0.9 * r['nproc']:.1f}x)"
        )
    anchor = getattr(a, "anchor", None)
    if anchor is not None:
        r["anchor"] = {k: anchor.get(k) for k in ("variant", "launch_name", "step_s", "peak_bytes")}
        print(
            f"    against {anchor['variant']} under {anchor.get('launch_name')} (--anchor-json): step "
            f"{r['step_s'] / anchor['step_s']:.2f}x ({anchor['step_s']:.3f} s), peak "
            f"{r['peak_bytes'] / anchor['peak_bytes']:.2f}x ({anchor['peak_bytes'] / _GIB:.2f} GiB)"
        )
    gen_one = getattr(a, "one_gpu_generate", {}).get(r["variant"])
    gen = (r.get("phase_s") or {}).get("generate")
    if gen_one and gen:
        r["one_gpu_generate_s"] = gen_one
        print(
            f"    generation: {gen:.3f} s a step on each of {r['nproc']} GPUs ({r.get('launch')}) against {gen_one:.3f} s "
            f"on one GPU in the same call: {gen / gen_one:.2f}x (target <= 1.15x under FSDP2)"
        )
    if r.get("nproc", 1) > 1:
        print(
            f"    {r['nproc']} processes ({r.get('launch')}): {a.batch * r['nproc'] / r['step_s']:.2f} "
            f"completions/s; per rank: "
            + "; ".join(
                f"rank {x['rank']} step {x['step_s']:.3f} s, peak {x['peak_bytes'] / _GIB:.1f} GiB, host held "
                f"{(x.get('host_held_bytes') or 0) / _GIB:.1f} GiB, RSS {max(x.get('host_rss_bytes_steps') or [0]) / _GIB:.1f} GiB"
                for x in r["ranks"]
                if not x.get("error")
            )
        )
    floor = step_floor(r, c.line_rate)
    if floor is not None:
        r.update(floor)
        print(
            f"    floor {floor['floor_s']:.3f} s (compute {floor['compute_s']:.3f} s + "
            f"{floor['beyond_room_bytes'] / 1e9:.1f} GB of optimizer state beyond the room beside the gradients at "
            f"the line rate): step {r['step_s'] / floor['floor_s']:.2f}x the floor (target <= 1.10x); exposed "
            f"{r.get('exposed_s_per_step', 0.0) / r['step_s']:.1%}"
        )


def _host_rss_line(r: dict) -> None:
    """A measured run's peak resident set against what tidal held on the host plus the process
    before any trainer (every rank's, for a process tree)."""
    held, base_rss = r.get("host_held_bytes"), r.get("host_baseline_rss_bytes")
    peak_rss = r.get("host_peak_rss_bytes") or max(r.get("host_rss_bytes_steps") or [0])
    if r.get("ranks"):
        held = sum(x.get("host_held_bytes") or 0 for x in r["ranks"])
        base_rss = sum(x.get("host_baseline_rss_bytes") or 0 for x in r["ranks"])
    if held and base_rss and peak_rss:
        allowed = 1.10 * held + base_rss
        print(
            f"    host: peak RSS {peak_rss / _GIB:.1f} GiB against 1.10 x held {held / _GIB:.1f} GiB + the process "
            f"before any trainer {base_rss / _GIB:.1f} GiB = {allowed / _GIB:.1f} GiB: {peak_rss / allowed:.2f}x"
        )


def _step_parts(r: dict) -> None:
    """A run's phases, token gaps, copies' tail, host memory and sampled host stacks."""
    if r.get("phase_s"):
        print(
            "    phases (s, median; device time on a GPU): "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["phase_s"].items())
        )
    if r.get("token_gap_s"):
        g = r["token_gap_s"]
        print(
            f"    between generated tokens (host, median of steps): longest {g['longest'] * 1e3:.1f} ms, "
            f"median {g['median'] * 1e3:.1f} ms ("
            + (f"host inside the forward {g['launch'] * 1e3:.1f} ms" if "launch" in g else "")
            + (
                f"; device {g['device'] * 1e3:.1f} ms a token, {g['device_forward'] * 1e3:.1f} ms inside the forward"
                if "device" in g
                else ""
            )
            + f"), beyond twice the median {g['excess']:.3f} s a step"
            + (f"; the host probe beside it {g['probe'] * 1e6:.2f} us an op" if g.get("probe") else "")
        )
    if r.get("copy_tail_s"):
        print(
            "    tidal's copies still running as the step began (s, median): "
            + ", ".join(f"{k.upper()} {v:.3f}" for k, v in r["copy_tail_s"].items())
        )
    if r.get("host_peak_rss_bytes"):
        avail = r.get("host_min_available_bytes")
        print(
            f"    host memory: the variant's processes peaked at {r['host_peak_rss_bytes'] / _GIB:.1f} GiB resident"
            + (
                f" ({r['host_peak_rss_at_s']:.0f} s after the launch)"
                if r.get("host_peak_rss_at_s") is not None
                else ""
            )
            + (f"; the host's available memory fell to {avail / _GIB:.1f} GiB" if avail is not None else "")
            + (f" of {r['host_total_bytes'] / _GIB:.1f} GiB" if r.get("host_total_bytes") else "")
        )
    samples = r.get("host_samples")
    if samples:
        per = samples["steps"] or 1
        print(f"    host time in verbs per step (sampled): {samples['by_verb']} / {per} steps")
        for t in samples["top"][:6]:
            print(f"      {t['seconds'] / per:7.3f} s  {t['verb']:<20} {t['tidal_frame']}  <- {t['frame']}")


def _variant(c: _Context, n: int, r: dict) -> str:
    """Print run ``n``'s lines; return its RESULTS.md row."""
    line, row = _error_line(c, r) if r.get("error") else _measured_line(c, n, r)
    if r.get("stopped_by_deadline"):
        d = r["stopped_by_deadline"]
        line += f"\n    ended by the bench's deadline after step {d['after_steps']} of {d['of_steps']}"
    print(line)
    if not r.get("error"):
        _against_other_calls(c, r)
        _host_rss_line(r)
    _step_parts(r)
    return row


def _pooled_line(pooled: dict) -> None:
    if not pooled:
        return
    ref = pooled.get("trl")
    print(
        "  pooled over the processes of a variant (the median of every measured step of all of them; steps "
        "vary between processes of the same code more than between neighbours): "
        + "; ".join(
            f"{name} {p['median_s']:.3f} s ({p['processes']} processes, {p['steps']} steps"
            + (f", {p['median_s'] / ref['median_s']:.2f}x TRL's" if ref and name != "trl" else "")
            + ")"
            for name, p in pooled.items()
        )
    )


def _paired_lines(paired: dict) -> None:
    for name, pr in paired.items():
        ci, gci, pci = pr["ratio_ci95"], pr["generate_ratio_ci95"], pr.get("generate_per_probe_ratio_ci95")
        print(
            f"  paired against the TRL run of each round: {name} step {pr['ratio_median']:.3f}x TRL's (median of "
            f"{pr['n']} pairs; 95% interval "
            + (f"{ci[0]:.3f}-{ci[1]:.3f}" if ci else "needs >= 6 pairs")
            + ")"
            + (
                f", generation {pr['generate_ratio_median']:.3f}x" + (f" ({gci[0]:.3f}-{gci[1]:.3f})" if gci else "")
                if pr["generate_ratio_median"] is not None
                else ""
            )
            + (
                f"; generation over the host probe beside it {pr['generate_per_probe_ratio_median']:.3f}x"
                + (f" ({pci[0]:.3f}-{pci[1]:.3f})" if pci else "")
                if pr.get("generate_per_probe_ratio_median") is not None
                else ""
            )
            + (
                "; a token (median ratios: gap, host in the forward, device a token, device in the forward): "
                + ", ".join(f"{k} {v:.3f}x" for k, v in pr["token_ratio_medians"].items())
                if pr.get("token_ratio_medians")
                else ""
            )
        )


def _profiles(c: _Context, final: bool) -> None:
    """The profiled steps' summaries (``final``: all; else the last run's) and their picture."""
    a, results = c.args, c.results
    profiled = [(r["variant"], r["profile"]) for r in results if r.get("profile", {}).get("summary")]
    if not profiled:
        return
    import step_trace

    for name, prof in profiled if final else [p for p in profiled if p[0] == results[-1]["variant"]]:
        print(step_trace.format_summary(f"{name} (profiled step {a.profile_step})", prof["summary"]))
    if a.picture:
        step_trace.draw(
            [(f"{name}: step {prof['summary']['step_s']:.2f} s (profiled)", prof["lanes"]) for name, prof in profiled],
            a.picture,
            title=f"{c.gpu}: {c.what}, {a.batch} x {a.completion}, one steady step",
        )
        print(f"picture: {a.picture}")


def _write_json(c: _Context, pooled: dict, paired: dict) -> None:
    a = c.args
    with open(a.json, "w") as f:
        json.dump(
            {
                "preset": a.preset,
                "dtype": a.dtype,
                "batch": a.batch,
                "micro_batch": a.micro_batch,
                "completion": a.completion,
                "num_generations": NUM_GENERATIONS,
                "reward_model": c.reward_model,
                "gpu": c.gpu,
                "torch": c.torch,
                "transformers": c.transformers,
                "trl": c.trl,
                "commit": a.commit,
                "date": c.date,
                "line_rate": c.line_rate,
                "nproc": a.nproc,
                "launch": a.launch if a.nproc > 1 else "single",
                "trl_loading": a.trl_loading if a.nproc > 1 and a.launch == "fsdp2" else None,
                "host_floor_gib": a.host_floor_gib,
                "pooled": pooled,
                "paired": paired,
                "variants": c.results,
            },
            f,
        )


def report(args, results: list, *, final: bool = False) -> None:
    """Print the variants measured so far, and write ``args.json`` (when set) with every
    result; ``final``: also every profiled step's summary (else the last run's only) and the
    RESULTS.md rows appended to ``args.results`` (when set). Called after each run (a run cut
    short keeps what it measured) and once at the end."""
    c = _Context(args, results)
    _header(c)
    rows = [_variant(c, n, r) for n, r in enumerate(results)]
    pooled, paired = stats.pooled(results), stats.paired(results)
    _pooled_line(pooled)
    _paired_lines(paired)
    print(TARGETS)
    _profiles(c, final)
    if args.results and final:
        with open(args.results, "a") as f:
            f.write("\n".join(rows) + "\n")
    if args.json:
        _write_json(c, pooled, paired)
