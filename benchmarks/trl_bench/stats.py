"""Statistics of bench runs: the median's distribution-free 95% interval, each tidal run paired
with TRL alone's run of its round, and a variant's steps pooled over its processes.

A run here is one variant's result dict as :mod:`trl_bench.run` writes it (``variant``,
``error``, ``step_s``, and where measured ``peak_bytes``, ``phase_s``, ``token_gap_s``,
``step_times_s``). Pure Python: no torch.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["median_ci95", "paired", "pooled"]


def median_ci95(values: list[float]) -> tuple[float, float] | None:
    """A distribution-free 95% interval for the median of ``values`` (independent draws): the
    order statistics ``x(k)`` and ``x(n+1-k)`` for the largest ``k`` whose two tails of the
    binomial(n, 1/2) hold at most 2.5% each. None below 6 values (no such ``k``)."""
    x, n = sorted(values), len(values)
    k = 0
    while k < n // 2 and sum(math.comb(n, i) for i in range(k + 1)) / 2**n <= 0.025:
        k += 1
    return (x[k - 1], x[n - k]) if k >= 1 else None


def _round_trl_index(results: list, i: int) -> int | None:
    """The index of the TRL run of run ``i``'s round: the nearest TRL run before it with no run
    of the same variant between them, else the nearest after it so (rounds run trl A B, then B A
    trl); None if neither exists."""
    variant = results[i]["variant"]
    j = next((k for k in range(i - 1, -1, -1) if results[k]["variant"] == "trl"), None)
    if j is not None and not any(x["variant"] == variant for x in results[j + 1 : i]):
        return j
    j = next((k for k in range(i + 1, len(results)) if results[k]["variant"] == "trl"), None)
    if j is not None and not any(x["variant"] == variant for x in results[i + 1 : j]):
        return j
    return None


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ci_or_none(values: list[float]) -> tuple[float, float] | None:
    return median_ci95(values) if values else None


def paired(results: list) -> dict:
    """Per tidal variant run in rounds with TRL alone (``--paired``): each of its runs against
    the TRL run of its round, the ratio of their median steps (and of their generation phases,
    their peaks, their token-gap parts, their generation per unit of the host probe): the median
    ratio, its 95% interval (:func:`median_ci95`) and n. A run that failed, or whose round's TRL
    run failed, is left out. Keys per variant: ``ratio_median``, ``ratio_ci95``, ``n``,
    ``ratios``, ``peak_ratios``, ``generate_ratios``, ``generate_ratio_median``,
    ``generate_ratio_ci95``, ``token_ratio_medians``, ``token_ratios``,
    ``generate_per_probe_ratio_median``, ``generate_per_probe_ratio_ci95``,
    ``generate_per_probe_ratios``."""
    out: dict = {}
    for i, r in enumerate(results):
        if r["variant"] == "trl" or r.get("error"):
            continue
        j = _round_trl_index(results, i)
        if j is None or results[j].get("error"):
            continue
        base = results[j]
        row = out.setdefault(
            r["variant"], {"step": [], "generate": [], "tokens": {}, "generate_per_probe": [], "peak": []}
        )
        row["step"].append(r["step_s"] / base["step_s"])
        if r.get("peak_bytes") and base.get("peak_bytes"):
            row["peak"].append(r["peak_bytes"] / base["peak_bytes"])
        gen, gen0 = r.get("phase_s", {}).get("generate"), base.get("phase_s", {}).get("generate")
        if gen and gen0:
            row["generate"].append(gen / gen0)
        # The token's time split (TokenGaps): which part of it differs from TRL alone's.
        tok, tok0 = r.get("token_gap_s") or {}, base.get("token_gap_s") or {}
        for k in ("median", "launch", "device", "device_forward"):
            if tok.get(k) and tok0.get(k):
                row["tokens"].setdefault(k, []).append(tok[k] / tok0[k])
        if gen and gen0 and tok.get("probe") and tok0.get("probe"):
            # Generation per unit of the host's speed (HostProbe) beside it: a host-bound
            # decode's ratio with the host's drift between the two runs taken out.
            row["generate_per_probe"].append((gen / tok["probe"]) / (gen0 / tok0["probe"]))
    return {
        name: {
            "ratio_median": statistics.median(row["step"]),
            "ratio_ci95": median_ci95(row["step"]),
            "n": len(row["step"]),
            "ratios": row["step"],
            "peak_ratios": row["peak"],
            "generate_ratios": row["generate"],
            "generate_ratio_median": _median_or_none(row["generate"]),
            "generate_ratio_ci95": _ci_or_none(row["generate"]),
            "token_ratio_medians": {k: statistics.median(v) for k, v in row["tokens"].items()},
            "token_ratios": row["tokens"],
            "generate_per_probe_ratio_median": _median_or_none(row["generate_per_probe"]),
            "generate_per_probe_ratio_ci95": _ci_or_none(row["generate_per_probe"]),
            "generate_per_probe_ratios": row["generate_per_probe"],
        }
        for name, row in out.items()
    }


def pooled(results: list) -> dict:
    """Per variant run in more than one process: the median of every measured step of all its
    processes (``median_s``), and how many ``processes`` and ``steps`` that is. Empty where no
    variant repeats."""
    by: dict[str, list] = {}
    for r in results:
        if not r.get("error") and r.get("step_times_s"):
            by.setdefault(r["variant"], []).append(r["step_times_s"])
    return {
        name: {
            "median_s": statistics.median(t for steps in runs for t in steps),
            "processes": len(runs),
            "steps": sum(len(steps) for steps in runs),
        }
        for name, runs in by.items()
        if len(runs) > 1
    }
