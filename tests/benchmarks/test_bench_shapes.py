"""benchmarks/bench_shapes.py: where a move's time went, read off a profiler trace, and a toy run
of a shape on the CPU."""

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "..", "..", "benchmarks", "bench_shapes.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_shapes", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _copy(ts, dur, nbytes, direction="HtoD"):
    return {
        "cat": "gpu_memcpy",
        "name": f"Memcpy {direction} (Pinned -> Device)",
        "ts": ts,
        "dur": dur,
        "args": {"bytes": nbytes},
    }


def test_a_trace_splits_a_move_into_host_before_copies_gaps_and_host_after(bench):
    # A window of 0..1000 us: copies at 100-300, 350-550 (a 50 us gap holding a 20 us kernel),
    # 550-750; host calls before the first copy; a D2H copy that is not this direction's.
    events = [
        _copy(100, 200, 2_000_000),
        _copy(350, 200, 2_000_000),
        _copy(550, 200, 4_000_000),
        _copy(120, 500, 9_999, direction="DtoH"),
        {"cat": "kernel", "name": "scatter", "ts": 310, "dur": 20},
        {"cat": "cuda_runtime", "name": "cudaMalloc", "ts": 10, "dur": 40},
        {"cat": "cuda_runtime", "name": "cudaMalloc", "ts": 400, "dur": 10},
        {"cat": "cpu_op", "name": "aten::empty", "ts": 60, "dur": 5},
        _copy(2000, 100, 1),  # outside the window
    ]
    s = bench.summarize_trace(events, (0, 1000), "HtoD")
    assert s["copies"] == 3 and s["bytes"] == 8_000_000
    assert s["lead_ms"] == pytest.approx(0.1) and s["tail_ms"] == pytest.approx(0.25)
    assert s["span_ms"] == pytest.approx(0.65) and s["copy_busy_ms"] == pytest.approx(0.6)
    assert s["gaps_ms"] == pytest.approx(0.05) and s["gaps_over_20us"] == 1
    assert s["kernels_in_gaps_ms"] == pytest.approx(0.02)
    assert s["cuda_malloc"] == {"count": 2, "ms": pytest.approx(0.05)}
    assert s["copy_gbps"] == pytest.approx(8_000_000 / 600 / 1e3)
    assert s["lead_calls_ms"] == {"cudaMalloc": 0.04, "aten::empty": 0.005}
    assert s["copy_bytes_median"] == 2_000_000 and s["copy_bytes_min"] == 2_000_000


def test_host_points_are_read_relative_to_the_window(bench):
    marks = [
        (0.5, "early"),
        (1.001, "planned"),
        (1.002, "wait:reload_done"),
        (1.005, "waited:reload_done"),
        (1.006, "reload_untracked"),
        (1.007, "reload_untracked"),
        (3.0, "late"),
    ]
    s = bench.summarize_points(marks, 1.0, 1.01)
    assert s["counts"] == {"planned": 1, "wait:reload_done": 1, "waited:reload_done": 1, "reload_untracked": 2}
    assert s["first_ms"]["planned"] == pytest.approx(1.0) and s["last_ms"]["reload_untracked"] == pytest.approx(7.0)
    assert s["waiting_ms"] == pytest.approx(3.0)


def test_a_toy_shape_runs_on_the_cpu_and_comes_back_bit_exact(bench):
    pytest.importorskip("transformers")
    lines = []
    res = bench.run_shape("llama-tied", device="cpu", warm=1, trace=True, toy=True, log=lines.append)
    assert res["bit_exact"] and not res["mismatches"]
    assert set(res["roles"]) == {"actor", "critic", "reference"}
    actor = res["roles"]["actor"]
    # Everything moves but storages below the timeshare's min_offload_bytes (a few bytes each).
    assert actor["bytes"] - 1024 <= actor["bytes_in"] <= actor["bytes"] and actor["plain"]["bytes"] == actor["bytes"]
    # The frozen reference's warm offload copies nothing; its reload moves all of it.
    ref = res["roles"]["reference"]
    assert ref["offload_warm_bytes"] == 0 and ref["bytes"] - 1024 <= ref["bytes_in"] <= ref["bytes"]
    assert set(res["switch"]) == {"actor<-critic", "critic<-actor"}
    sw = res["switch"]["actor<-critic"]
    assert sw["bytes_in"] == actor["bytes_in"] and sw["bytes_out"] == res["roles"]["critic"]["bytes_out"]
    assert "reload" in res["host_profile"] and res["host_points"]
    assert any(line.startswith("== llama-tied (toy)") for line in lines)


def test_unknown_shapes_and_bad_counts_are_refused_before_any_work(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "llama-tied,nope"])
    assert "unknown shape(s) nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--warm", "0"])
    assert "--warm must be >= 1" in capsys.readouterr().err
