"""benchmarks/bench_shared_copies.py: tidal's moves against plain copies, every GPU at once, pair
by pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, BENCH)

bench_shared_copies = pytest.importorskip("bench_shared_copies")


def test_paired_summary_takes_the_ratio_pair_by_pair_not_of_the_medians():
    plain = {"d2h": [10.0, 40.0, 20.0], "h2d": [50.0, 50.0, 50.0], "both": [80.0, 60.0, 100.0]}
    tidal_ = {"d2h": [9.0, 36.0, 20.0], "h2d": [45.0, 55.0, 40.0], "both": [40.0, 60.0, 100.0]}
    out = bench_shared_copies.paired_summary(plain, tidal_)
    assert out["d2h"]["ratios"] == pytest.approx([0.9, 0.9, 1.0])
    assert out["d2h"]["ratio_median"] == pytest.approx(0.9)
    # The medians' ratio would be 20 / 20 = 1.0: the pairs say 0.9.
    assert out["d2h"]["tidal_gbps"] / out["d2h"]["plain_gbps"] == pytest.approx(1.0)
    assert (out["h2d"]["ratio_min"], out["h2d"]["ratio_max"]) == pytest.approx((0.8, 1.1))
    assert out["both"]["ratio_median"] == pytest.approx(1.0)
    assert out["both"]["ratio_min"] == pytest.approx(0.5)


def _rank(rank: int) -> dict:
    rates = {"d2h": 30.0, "h2d": 40.0, "both": 40.0}
    spans = {"both_d2h_s": 0.09, "both_h2d_s": 0.11, "both_s": 0.11}
    paired = bench_shared_copies.paired_summary(
        {d: [v, v] for d, v in rates.items()}, {d: [v * 0.95, v * 0.85] for d, v in rates.items()}
    )
    return {
        "rank": rank,
        "alone": {"d2h": 55.0, "h2d": 54.0, "both": 90.0},
        "shared": rates,
        "shared_both_spans": {"d2h": 0.09, "h2d": 0.11},
        "tidal": {"paired": paired, "spans": spans},
        "tidal_unpaced": {"paired": paired, "spans": spans},
        "tidal_alone": {**rates, **spans},
        "tidal_unpaced_alone": {**rates, **spans},
    }


def test_rank_lines_print_each_direction_s_pairs():
    text = bench_shared_copies._rank_lines(_rank(1))
    assert text.startswith("  rank 1:")
    for d in ("d2h", "h2d", "both"):
        assert f"\n    {d}: plain alone" in text
    assert "ratio median 0.90x (pairs 0.85-0.95x)" in text


@pytest.mark.gpu
def test_one_rank_runs_and_writes_its_pairs(tmp_path):
    out = tmp_path / "copies.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            os.path.join(BENCH, "bench_shared_copies.py"),
            "--gib",
            "0.25",
            "--reps",
            "2",
            "--json",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    got = json.loads(out.read_text())
    (r,) = got["ranks"]
    for key in ("tidal", "tidal_unpaced"):
        for d in ("d2h", "h2d", "both"):
            pair = r[key]["paired"][d]
            assert len(pair["ratios"]) == 2
            assert pair["plain_gbps"] > 1 and pair["tidal_gbps"] > 1
    assert r["tidal_bytes"] == 1 << 28
