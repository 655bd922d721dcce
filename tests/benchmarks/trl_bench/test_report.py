"""trl_bench.report: each variant against TRL alone's runs (the first, its neighbours), pooled
over processes, against DeepSpeed's offload; the step's floor."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

report = pytest.importorskip("trl_bench.report")
stats = pytest.importorskip("trl_bench.stats")


def test_with_several_trl_processes_each_variant_is_also_set_against_the_one_before_it(capsys):
    pytest.importorskip("trl")
    import types

    args = types.SimpleNamespace(
        preset="tiny", dtype="float32", batch=4, completion=8, results=None, json=None, picture=None, line_rate=None
    )

    def result(variant, step_s):
        return dict(variant=variant, error=None, step_s=step_s, step_min_s=step_s, peak_bytes=1 << 30)

    runs = [result("trl", 8.0), result("stream", 9.0), result("trl", 10.0), result("stream", 9.5)]
    report.report(args, runs)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  stream")]
    assert "(1.12 TRL)" in lines[0] and "process before it" not in lines[0]  # its TRL is the first one
    assert "(0.90x the TRL process after it)" in lines[0]
    assert "(1.19 TRL)" in lines[1] and "(0.95x the TRL process before it)" in lines[1]
    assert "after it" not in lines[1]  # no TRL process after the last


def test_tidal_between_two_trl_processes_is_set_against_both(capsys):
    """Run h6's order, TRL, tidal, tidal, TRL: the second tidal process's neighbour is the TRL
    process after it."""
    pytest.importorskip("trl")
    import types

    args = types.SimpleNamespace(
        preset="tiny", dtype="float32", batch=4, completion=8, results=None, json=None, picture=None, line_rate=None
    )
    runs = [
        dict(variant=v, error=None, step_s=t, step_min_s=t, peak_bytes=1 << 30)
        for v, t in (("trl", 9.950), ("role+prefetch", 10.216), ("role+prefetch", 9.148), ("trl", 9.180))
    ]
    report.report(args, runs)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  role")]
    assert "(1.11x the TRL process after it)" in lines[0]
    assert "(1.00x the TRL process after it)" in lines[1]


def test_a_variant_run_in_several_processes_is_also_pooled_over_all_their_steps(capsys):
    """Run i3's 7B stress steps (trl, role+prefetch, trl, role+prefetch): the median of all ten
    measured steps of each variant, and the ratio of those medians."""
    pytest.importorskip("trl")
    import types

    args = types.SimpleNamespace(
        preset="tiny", dtype="float32", batch=4, completion=8, results=None, json=None, picture=None, line_rate=None
    )
    steps = {
        "trl": [[2.635, 1.259, 1.035, 1.344, 1.293], [3.599, 1.564, 1.37, 1.487, 1.267]],
        "role+prefetch": [[2.929, 1.206, 1.296, 1.695, 1.653], [4.096, 1.26, 1.243, 1.427, 1.476]],
    }
    runs = [
        dict(variant=v, error=None, step_s=sorted(t)[2], step_min_s=min(t), peak_bytes=1 << 30, step_times_s=t)
        for i in range(2)
        for v, t in ((name, steps[name][i]) for name in steps)
    ]
    report.report(args, runs)
    out = capsys.readouterr().out
    assert "trl 1.357 s (2 processes, 10 steps)" in out
    assert "role+prefetch 1.452 s (2 processes, 10 steps, 1.07x TRL's)" in out
    assert stats.pooled(runs[:2]) == {}  # nothing repeats: nothing pooled


def test_deepspeeds_offload_is_the_anchor_each_tidal_variant_is_set_against(capsys):
    """Run h1 (2x H100): the DeepSpeed ZeRO-3 offload variant has no timeshare and moves bytes
    the bench does not count (null): the report sets each tidal variant's step and peak against
    it, with no TRL-alone run (it runs out of memory at 7B on an H100)."""
    pytest.importorskip("trl")
    import types

    args = types.SimpleNamespace(
        preset="tiny", dtype="bfloat16", batch=4, completion=8, results=None, json=None, picture=None, line_rate=None
    )
    ds = dict(variant="ds-zero3-offload", error=None, step_s=16.0, step_min_s=15.7, peak_bytes=40 << 30)
    ds["moved_gb_per_step"] = None
    ours = dict(variant="stream+prefetch", error=None, step_s=9.6, step_min_s=9.3, peak_bytes=60 << 30)
    ours["moved_gb_per_step"] = 81.2
    report.report(args, [ds, ours])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("  stream+prefetch"))
    assert "against DeepSpeed ZeRO-3 offload: step 0.60x, peak 1.50x" in line
    ds_line = next(ln for ln in out.splitlines() if ln.startswith("  ds-zero3-offload"))
    assert "bytes moved not counted" in ds_line and "against DeepSpeed" not in ds_line


def test_the_floor_is_compute_plus_the_state_beyond_the_room_beside_the_gradients_at_the_line_rate():
    gb = 10**9
    r = {
        "phase_s": {"generate": 6.0, "reference": 1.0, "loss_forward": 1.0, "backward": 2.0},
        "exposed_s_per_step": 1.0,  # the compute stream waited on copies: not compute
        "workload": {
            "weights_bytes": 30 * gb,
            "grads_bytes": 30 * gb,
            "optimizer_state_bytes": 59 * gb,
            "device_total_bytes": 85 * gb,
        },
    }
    line = {"h2d_gbps": 50.0}
    got = report.step_floor(r, line)
    # 59 GB of state, 25 GB of room beside the weights and gradients: 34 GB cross at 50 GB/s.
    assert got["beyond_room_bytes"] == 34 * gb
    assert got["compute_s"] == pytest.approx(9.0)
    assert got["floor_s"] == pytest.approx(9.0 + 34 / 50)
    r["workload"]["optimizer_state_bytes"] = 20 * gb  # it all fits beside them: compute alone
    assert report.step_floor(r, line)["floor_s"] == pytest.approx(9.0)
    assert report.step_floor({**r, "workload": {}}, line) is None
    assert report.step_floor(r, None) is None
