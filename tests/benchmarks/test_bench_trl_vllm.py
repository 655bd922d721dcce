"""bench_trl_vllm's pairing: each round's tidal run against that round's TRL + vLLM run."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_trl_vllm  # noqa: E402


def _row(variant, rnd, step):
    return {"variant": variant, "round": rnd, "summary": {"step_s": step}}


def test_each_round_is_paired_with_its_own_anchor_and_a_failed_run_is_left_out():
    rows = [_row("trl", r, 4.0 + r) for r in range(6)] + [_row("tidal", r, 1.1 * (4.0 + r)) for r in range(6)]
    rows.append(_row("tidal+kv=4", 0, None))  # ran out of memory: no step
    paired = bench_trl_vllm._paired_rounds(rows)
    assert list(paired) == ["tidal"]
    st = paired["tidal"]
    assert st["n"] == 6 and all(abs(x - 1.1) < 1e-12 for x in st["ratios"])
    assert abs(st["ratio_median"] - 1.1) < 1e-12 and st["ratio_ci95"] is not None
    few = bench_trl_vllm._paired_rounds(rows[:3] + rows[6:9])
    assert few["tidal"]["n"] == 3 and few["tidal"]["ratio_ci95"] is None  # too few rounds for an interval


def _run(variant, rnd, logs, digest, ok=True):
    return {"variant": variant, "round": rnd, "ok": ok, "trl_logs": logs, "weights_sha256": digest}


def test_each_run_is_set_against_the_first_trl_run_line_by_line_and_by_its_weights():
    logs = [{"loss": 0.5, "reward": 1.0}, {"loss": 0.25, "reward": 2.0}]
    off = [{"loss": 0.5, "reward": 1.0}, {"loss": 0.25 + 1e-3, "reward": 2.0}]
    rows = [
        _run("tidal", 0, logs, "a", ok=False),  # failed: neither anchor nor compared
        _run("trl", 0, logs, "a"),
        _run("trl", 0, off, "b"),
        _run("tidal+prefetch", 0, logs, "a"),
        _run("tidal+role", 0, logs[:1], "a"),
    ]
    got = {i["variant"]: i for i in bench_trl_vllm.identity(rows)}
    assert set(got) == {"trl", "tidal+prefetch", "tidal+role"}
    assert got["tidal+prefetch"]["logs_equal"] and got["tidal+prefetch"]["weights_equal"]
    assert got["tidal+prefetch"]["max_log_diff"] == 0
    assert not got["trl"]["logs_equal"] and not got["trl"]["weights_equal"]
    assert abs(got["trl"]["max_log_diff"] - 1e-3) < 1e-12
    assert not got["tidal+role"]["logs_equal"]  # a step short: not the same run
    assert bench_trl_vllm.identity([_run("tidal", 0, logs, "a")]) == []  # no anchor, nothing to say


def _turn_run(variant, rnd, seconds, gens, *, met=None, warm=1, ok=True):
    met = met or [True] * len(seconds)
    steps = [
        {"seconds": s, "turn": {"n": n, "met": m, "first": n % 2 == 0}} for n, (s, m) in enumerate(zip(seconds, met))
    ]
    return {"variant": variant, "round": rnd, "ok": ok, "steps": steps, "generate_s": gens}


def test_turns_pair_each_tidal_step_with_the_trl_step_of_its_turn_and_leave_lost_turns_out():
    trl0 = _turn_run("trl", 0, [9.0, 2.0, 2.2, 2.4, 2.0], [5.0, 1.0, 1.1, 1.2, 1.0])
    tid0 = _turn_run("tidal+role", 0, [9.0, 2.1, 2.2, 2.64, 4.0], [5.0, 1.0, 1.1, 1.32, 3.0], met=[True] * 4 + [False])
    trl1 = _turn_run("trl", 1, [9.0, 3.0, 3.0], [5.0, 2.0, 2.0])
    tid1 = _turn_run("tidal+role", 1, [9.0, 3.3, 2.7], [5.0, 2.0, 1.8])
    got = bench_trl_vllm.turn_pairs([trl0, tid0, trl1, tid1], warmup=1)
    st = got["tidal+role"]
    # the warm-up step and the lost turn (n=4 of round 0) pair with nothing
    want = [2.1 / 2.0, 1.0, 1.1, 1.1, 0.9]
    assert st["n"] == 5 and all(abs(a - b) < 1e-12 for a, b in zip(st["ratios"], want))
    assert abs(st["ratio_median"] - 1.05) < 1e-12  # the median of the five
    assert st["ratio_ci95"] is None  # 5 pairs: too few for an interval
    assert [round(x, 3) for x in st["round_medians"]] == [1.05, 1.0]
    assert abs(st["generate_ratio_median"] - 1.0) < 1e-12
    many = bench_trl_vllm.turn_pairs(
        [_turn_run("trl", 0, [1.0] * 9, [0.5] * 9), _turn_run("tidal", 0, [1.02] * 9, [0.5] * 9)], warmup=1
    )
    lo, hi = many["tidal"]["ratio_ci95"]
    assert many["tidal"]["n"] == 8 and abs(lo - 1.02) < 1e-12 and abs(hi - 1.02) < 1e-12
    # a round whose TRL run failed before its first step: nothing to pair with
    assert bench_trl_vllm.turn_pairs([{"variant": "trl", "round": 0, "steps": []}, tid1], warmup=1) == {}


def test_turns_swap_the_processes_every_round_and_refuse_what_they_cannot_pair():
    assert bench_trl_vllm.turn_ranks(["trl", "tidal"], 0) == ["trl", "tidal"]
    assert bench_trl_vllm.turn_ranks(["trl", "tidal"], 1) == ["tidal", "trl"]
    assert bench_trl_vllm.turns_problem(["trl", "tidal", "tidal+role"], False, None) is None
    assert "two variants, one trl and one tidal" in bench_trl_vllm.turns_problem(
        ["trl", "tidal", "tidal+x"], True, None
    )
    assert "two variants" in bench_trl_vllm.turns_problem(["trl", "trl"], True, None)
    assert "--cap-gib" in bench_trl_vllm.turns_problem(["trl", "tidal"], True, 80.0)
    assert bench_trl_vllm.turns_problem(["tidal+role", "trl"], True, None) is None


def test_turns_with_three_variants_stop_before_any_work(capsys):
    import pytest

    with pytest.raises(SystemExit):
        bench_trl_vllm.main(["--turns", "--variants", "trl,tidal,tidal+role"])
    assert "two variants, one trl and one tidal" in capsys.readouterr().err
