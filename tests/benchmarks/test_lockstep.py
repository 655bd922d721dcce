"""benchmarks/lockstep.py and ``pool_paired.py --lockstep``: two bench processes that start each
step together, one running TRL alone while the other runs tidal, and the pairing of those steps."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
sys.path.insert(0, BENCH)

lockstep = pytest.importorskip("lockstep")
pool_paired = pytest.importorskip("pool_paired")
pytest.importorskip("torch.distributed")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_both_leave_the_barrier_only_once_both_came():
    address = f"127.0.0.1:{_port()}"
    first = lockstep.Lockstep(address, 0, timeout_s=30)
    got = {}

    def partner():
        second = lockstep.Lockstep(address, 1, timeout_s=30)
        time.sleep(0.5)  # comes late: rank 0 must wait for it
        got[1] = second.barrier("0/1")
        got["left_1"] = time.perf_counter()

    t = threading.Thread(target=partner)
    t.start()
    got[0] = first.barrier("0/1")
    left_0 = time.perf_counter()
    t.join()
    assert got[0][0] and got[1][0]  # both met
    assert got[0][1] >= 0.4 > got[1][1]  # rank 0 waited for the late one, which did not wait
    assert abs(left_0 - got["left_1"]) < 0.2


def test_with_turns_no_two_steps_overlap_and_the_first_of_each_pair_alternates():
    address = f"127.0.0.1:{_port()}"
    spans: list[tuple[int, int, float, float]] = []  # (rank, n, start, end)
    orders: dict[int, list[int]] = {0: [], 1: []}
    lock = threading.Lock()

    def process(rank: int, ls=None):
        ls = ls or lockstep.Lockstep(address, rank, timeout_s=30)
        for n in range(6):
            met, _, order = ls.turn(n)
            assert met
            t0 = time.perf_counter()
            time.sleep(0.05 if rank == 0 else 0.02)  # the step
            with lock:
                spans.append((rank, n, t0, time.perf_counter()))
                orders[rank].append(order)
            ls.end_turn()

    first = lockstep.Lockstep(address, 0, timeout_s=30)
    t = threading.Thread(target=process, args=(1,))
    t.start()
    process(0, first)
    t.join()
    spans.sort(key=lambda x: x[2])
    assert all(a[3] <= b[2] for a, b in zip(spans, spans[1:]))  # one step at a time
    # Pair n: rank n % 2 first, then the other; the pairs in order.
    assert [(r, n) for r, n, _, _ in spans] == [(n % 2 if i == 0 else 1 - n % 2, n) for n in range(6) for i in (0, 1)]
    assert orders[0] == [0, 1, 0, 1, 0, 1] and orders[1] == [1, 0, 1, 0, 1, 0]


def test_a_turn_the_partner_never_gives_leaves_this_process_on_its_own():
    ls = lockstep.Lockstep(f"127.0.0.1:{_port()}", 0, timeout_s=0.3)
    met, waited, order = ls.turn(1)  # rank 1 goes first in pair 1: it never comes
    assert not met and waited >= 0.3 and order == 1
    t0 = time.perf_counter()
    assert ls.turn(2) == (False, 0.0, 0)  # no later turn waits
    assert time.perf_counter() - t0 < 0.1


def test_when_the_process_hosting_the_store_has_ended_the_other_goes_on_alone():
    """Rank 0 hosts the rendezvous; where it ends first (its deadline came while its partner was
    inside a step), the partner's next calls neither raise nor wait: it is on its own."""
    address = f"127.0.0.1:{_port()}"
    host = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {BENCH!r}); import lockstep; "
            f"ls = lockstep.Lockstep({address!r}, 0, timeout_s=30); ls.store.wait(['here']); "
            "ls.turn(0); ls.end_turn(); ls.store.wait(['got'])",
        ]
    )
    ls = lockstep.Lockstep(address, 1, timeout_s=30)
    ls.store.set("here", "1")
    assert ls.turn(0)[0]  # rank 1 goes second in pair 0: after rank 0's step
    ls.store.set("got", "1")
    assert host.wait(timeout=60) == 0  # the store's host has ended
    t0 = time.perf_counter()
    ls.end_turn()
    assert ls.agree("end/0/1", False, timeout_s=5) is False
    assert ls.lost and ls.barrier("run-end/0") == (False, 0.0)
    assert time.perf_counter() - t0 < 5


def test_a_partner_that_never_comes_leaves_this_process_on_its_own():
    ls = lockstep.Lockstep(f"127.0.0.1:{_port()}", 0, timeout_s=0.3)
    met, waited = ls.barrier("0/1")
    assert not met and waited >= 0.3
    t0 = time.perf_counter()
    assert ls.barrier("0/2") == (False, 0.0)  # no later step waits again
    assert time.perf_counter() - t0 < 0.1


def test_a_step_the_partner_gave_up_on_is_no_pair_on_either_side():
    address = f"127.0.0.1:{_port()}"
    early = lockstep.Lockstep(address, 0, timeout_s=0.2)
    late = lockstep.Lockstep(address, 1, timeout_s=5)
    assert early.barrier("3/2")[0] is False  # gave up before the partner came
    assert late.barrier("3/2")[0] is False  # came to a count of two, but the other had left


@pytest.mark.parametrize("bad", ["29611", "host:", ":29611", "host:port", "host:70000"])
def test_an_address_not_host_colon_port_is_refused(bad):
    with pytest.raises(ValueError, match="HOST:PORT"):
        lockstep.parse_address(bad)
    with pytest.raises(ValueError, match="ranks 0 and 1"):
        lockstep.Lockstep("127.0.0.1:1", 2)


def _run(variants, steps, *, started=0.0, gen_share=0.8, error=None):
    """One process's JSON: per run its variant, step times, phases and rendezvous keys."""
    out = []
    for i, (v, times) in enumerate(zip(variants, steps)):
        out.append(
            {
                "variant": v,
                "error": error if i == 1 else None,
                "step_s": sorted(times)[len(times) // 2],
                "step_times_s": times,
                "phase_s_steps": [{"generate": gen_share * t} for t in times],
                "lockstep_steps": [
                    {"key": f"{i}/{k + 2}", "met": True, "wait_s": 0.0, "started_at": started + 100 * i + 10 * k}
                    for k in range(len(times))
                ],
            }
        )
    return {"preset": "qwen2-1.5b", "dtype": "float32", "batch": 64, "completion": 256, "variants": out}


def test_each_tidal_step_pairs_with_the_trl_step_that_started_beside_it():
    # Run by run the host slows 1.5x for both (what pairing in time could not take out);
    # tidal is 1.04x on rank 0's GPU and 1.02x on rank 1's.
    host = [1.0, 1.5, 2.25, 1.5]
    a = _run(
        ["trl", "stream", "stream", "trl"],
        [[10 * h, 11 * h] for h in host[:1]]
        + [[10 * host[1] * 1.04, 11 * host[1] * 1.04], [10 * host[2] * 1.04, 11 * host[2] * 1.04]]
        + [[10 * host[3], 11 * host[3]]],
    )
    b = _run(
        ["stream", "trl", "trl", "stream"],
        [[10 * host[0] * 1.02, 11 * host[0] * 1.02]]
        + [[10 * h, 11 * h] for h in host[1:3]]
        + [[10 * host[3] * 1.02, 11 * host[3] * 1.02]],
        started=0.004,
    )
    got = pool_paired.lockstep_pairs(a, b)["stream"]
    assert got["n"] == 8
    assert sorted(got["ratios"]) == pytest.approx([1.02] * 4 + [1.04] * 4)
    assert got["ratio_median"] == pytest.approx(1.03)
    assert got["ratio_ci95"] == pytest.approx((1.02, 1.04))
    assert got["generate_ratio_median"] == pytest.approx(1.03)
    assert got["ratio_median_by_gpu"] == pytest.approx({"tidal on rank 0's GPU": 1.04, "tidal on rank 1's GPU": 1.02})
    assert got["start_skew_s_max"] == pytest.approx(0.004)
    # A run is the independent unit: four runs, each its median.
    assert got["runs"] == 4 and sorted(got["run_ratios"]) == pytest.approx([1.02, 1.02, 1.04, 1.04])
    assert got["run_ratio_median"] == pytest.approx(1.03) and got["run_ratio_ci95"] is None  # < 6 runs


def test_with_main_cores_the_ratios_are_split_by_the_core_tidal_had():
    # Core 5 runs Python 1.1x slower than core 3; the main threads swap cores step by step, so
    # tidal's step (1.0x TRL's on equal cores) is 1.1x on core 5 and 1/1.1x on core 3.
    a = _run(["trl", "stream"], [[10.0, 10.0], [10.0, 10.0]])
    b = _run(["stream", "trl"], [[10.0, 10.0], [10.0, 10.0]])
    for rank, proc in ((0, a), (1, b)):
        for i, v in enumerate(proc["variants"]):
            for k, step in enumerate(v["lockstep_steps"]):
                step["core"] = (3, 5)[(k + 1 + i + rank) % 2]
                v["step_times_s"][k] *= 1.1 if step["core"] == 5 else 1.0
    got = pool_paired.lockstep_pairs(a, b)["stream"]
    assert got["n"] == 4
    assert got["ratio_median_by_core"] == pytest.approx(
        {"tidal's main thread on core 3": 1 / 1.1, "tidal's main thread on core 5": 1.1}
    )
    assert got["ratio_median"] == pytest.approx((1 / 1.1 + 1.1) / 2)  # the swaps balance: 2 steps on each
    # Without cores recorded there is no split.
    assert (
        "ratio_median_by_core"
        not in pool_paired.lockstep_pairs(_run(["trl"], [[1.0]]), _run(["stream"], [[1.0]]))["stream"]
    )


def test_with_turns_the_ratios_are_split_by_whether_tidal_went_first():
    # The host slows through each pair of steps (turns: tidal's step and TRL's are neighbours):
    # the second step of a pair takes 1.05x; which side goes first alternates step by step.
    a = _run(["trl", "stream"], [[10.0, 10.0], [10.0, 10.0]])
    b = _run(["stream", "trl"], [[10.0, 10.0], [10.0, 10.0]])
    for rank, proc in ((0, a), (1, b)):
        for i, v in enumerate(proc["variants"]):
            for k, step in enumerate(v["lockstep_steps"]):
                step["order"] = 0 if rank == (3 * i + k + 1) % 2 else 1
                v["step_times_s"][k] *= 1.05 if step["order"] else 1.0
    got = pool_paired.lockstep_pairs(a, b)["stream"]
    assert got["ratio_median_by_order"] == pytest.approx({"tidal first": 1 / 1.05, "tidal second": 1.05})
    # One GPU: the split by rank is by process; paired steps start a step apart by design.
    assert set(got["ratio_median_by_gpu"]) == {"tidal in rank 0's process", "tidal in rank 1's process"}
    assert got["start_skew_s_max"] is None
    # Calls of the two methods are not pooled together.
    c, d = _run(["trl", "stream"], [[10.0, 10.0], [10.0, 10.0]]), _run(["stream", "trl"], [[10.0, 10.0], [10.0, 10.0]])
    with pytest.raises(ValueError, match="pool the calls of one method"):
        pool_paired.lockstep_pairs(a, b, c, d)
    assert (
        "ratio_median_by_order"
        not in pool_paired.lockstep_pairs(_run(["trl"], [[1.0]]), _run(["stream"], [[1.0]]))["stream"]
    )


def test_steps_that_did_not_start_together_or_runs_that_failed_are_not_paired():
    a = _run(["trl", "stream", "trl"], [[10.0, 10.0], [10.5, 10.5], [10.0, 10.0]], error="out of memory")
    b = _run(["stream", "trl", "stream"], [[10.2, 10.2], [10.0, 10.0], [10.3, 10.3]])
    b["variants"][0]["lockstep_steps"][1]["met"] = False  # its partner gave up on that step
    got = pool_paired.lockstep_pairs(a, b)["stream"]
    # Run 0: one step met on both sides; run 1: rank 0's run failed; run 2: both steps.
    assert got["keys"] == ["0/2", "2/2", "2/3"]
    assert got["ratios"] == pytest.approx([1.02, 1.03, 1.03])
    with pytest.raises(ValueError, match="no step of tidal started together"):
        pool_paired.lockstep_pairs(a, _run(["trl", "trl", "trl"], [[1.0]] * 3))
    with pytest.raises(ValueError, match="different workloads"):
        pool_paired.lockstep_pairs(a, {**b, "batch": 32})


def test_the_command_line_pairs_two_lockstep_processes_and_refuses_one(tmp_path, capsys):
    files = []
    for i, (vs, r) in enumerate([(["trl", "stream"] * 3, 1.0), (["stream", "trl"] * 3, 1.0)]):
        steps = [[10.0 * (1.03 if v == "stream" else 1.0)] * 2 for v in vs]
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps(_run(vs, steps)))
        files.append(str(f))
    out = tmp_path / "pooled.json"
    assert pool_paired.main([*files, "--lockstep", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["lockstep"]["stream"]["n"] == 12 and data["lockstep"]["stream"]["ratio_median"] == pytest.approx(1.03)
    assert "steps started together on two GPUs" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        pool_paired.main([files[0], "--lockstep", "--json", str(out)])
    assert e.value.code == 2 and "two by two" in capsys.readouterr().err
    # Two lockstep calls pooled: their runs stay apart (a run is the unit).
    assert pool_paired.main([*files, *files, "--lockstep", "--json", str(out)]) == 0
    twice = json.loads(out.read_text())["lockstep"]["stream"]
    assert twice["n"] == 24 and twice["runs"] == 12 and twice["run_ratio_ci95"] == pytest.approx((1.03, 1.03))


def test_the_bench_refuses_lockstep_without_one_variant_in_turn_before_any_work(tmp_path, capsys):
    launch = pytest.importorskip("trl_bench.launch")
    cache = tmp_path / "models"
    for extra in (
        ["--variants", "trl,stream", "--paired", "2"],  # not --in-process
        ["--variants", "trl,stream,role", "--paired", "2", "--in-process"],  # two tidal variants
    ):
        with pytest.raises(SystemExit) as e:
            launch.main([*extra, "--lockstep", "127.0.0.1:29611", "--model-cache", str(cache)])
        assert e.value.code == 2 and "--lockstep pairs TRL alone with one tidal variant" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(
            [
                "--variants",
                "trl,stream",
                "--paired",
                "2",
                "--in-process",
                "--lockstep",
                "nohost",
                "--model-cache",
                str(cache),
            ]
        )
    assert "HOST:PORT" in capsys.readouterr().err
    lock = ["--variants", "trl,stream", "--paired", "2", "--in-process", "--lockstep", "127.0.0.1:29611"]
    for extra, says in (
        (["--variants", "trl,stream", "--main-cores", "0,1"], "it needs --lockstep"),
        ([*lock, "--main-cores", "0"], "give two different cores"),
        ([*lock, "--main-cores", "0,0"], "give two different cores"),
        ([*lock, "--main-cores", "a,b"], "give two different cores"),
        ([*lock, "--main-cores", f"0,{max(os.sched_getaffinity(0)) + 1}"], "give two different cores"),
    ):
        with pytest.raises(SystemExit) as e:
            launch.main([*extra, "--model-cache", str(cache)])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert not cache.exists()  # no model saved, no process launched


@pytest.mark.slow
def test_two_tiny_bench_processes_step_together_and_pool(tmp_path):
    """End to end on a CPU: two bench processes (the tiny preset), complementary orders, every
    measured step started with the partner's, pooled by ``pool_paired.py --lockstep``."""
    pytest.importorskip("trl")
    address = f"127.0.0.1:{_port()}"
    cores = sorted(os.sched_getaffinity(0))[:2]
    procs = []
    for r in (0, 1):
        cmd = [sys.executable, os.path.join(BENCH, "bench_trl.py"), "--preset", "tiny", "--dtype", "float32"]
        cmd += ["--batch", "8", "--completion", "8", "--steps", "3", "--variants", "trl,stream+prefetch"]
        cmd += ["--paired", "2", "--in-process", "--lockstep", address, "--lockstep-rank", str(r)]
        cmd += ["--json", str(tmp_path / f"r{r}.json"), "--results", str(tmp_path / f"R{r}.md")]
        if len(cores) == 2:
            cmd += ["--main-cores", f"{cores[0]},{cores[1]}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-3000:]
    runs = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1)]
    assert [v["variant"] for v in runs[0]["variants"]] == ["trl", "stream+prefetch", "stream+prefetch", "trl"]
    assert [v["variant"] for v in runs[1]["variants"]] == ["stream+prefetch", "trl", "trl", "stream+prefetch"]
    for run in runs:
        for i, v in enumerate(run["variants"]):
            assert v["error"] is None
            assert [s["key"] for s in v["lockstep_steps"]] == [f"{i}/2", f"{i}/3"]  # the measured steps
            assert all(s["met"] for s in v["lockstep_steps"])
    if len(cores) == 2:
        # Each step's main thread on the core its partner's was not on, swapped step by step.
        for i in range(4):
            mine, theirs = (runs[r]["variants"][i]["lockstep_steps"] for r in (0, 1))
            assert [s["core"] for s in mine] == [cores[(k + i) % 2] for k in (1, 2)]
            assert [a["core"] for a in mine] == [cores[1 - cores.index(b["core"])] for b in theirs]
    got = pool_paired.lockstep_pairs(*runs)["stream+prefetch"]
    assert got["n"] == 8 and got["start_skew_s_max"] < 0.5


@pytest.mark.slow
def test_two_tiny_bench_processes_take_turns_step_by_step_and_pool(tmp_path):
    """End to end on a CPU, ``--turns``: two bench processes (the tiny preset), complementary
    orders, one step at a time, the one that goes first in each pair of steps alternating."""
    pytest.importorskip("trl")
    address = f"127.0.0.1:{_port()}"
    procs = []
    for r in (0, 1):
        cmd = [sys.executable, os.path.join(BENCH, "bench_trl.py"), "--preset", "tiny", "--dtype", "float32"]
        cmd += ["--batch", "8", "--completion", "8", "--steps", "3", "--variants", "trl,stream+prefetch"]
        cmd += ["--paired", "2", "--in-process", "--lockstep", address, "--lockstep-rank", str(r), "--turns"]
        cmd += ["--json", str(tmp_path / f"r{r}.json"), "--results", str(tmp_path / f"R{r}.md")]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-3000:]
    runs = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1)]
    steps = []
    for rank, run in enumerate(runs):
        for i, v in enumerate(run["variants"]):
            assert v["error"] is None
            got = v["lockstep_steps"]
            assert [s["key"] for s in got] == [f"{i}/2", f"{i}/3"] and all(s["met"] for s in got)
            # The n-th step of a process (3 a run, the first not measured): rank n % 2 goes first.
            assert [s["order"] for s in got] == [0 if rank == n % 2 else 1 for n in (3 * i + 1, 3 * i + 2)]
            steps += [(s["started_at"], s["ended_at"]) for s in got]
    steps.sort()
    assert all(a[1] <= b[0] for a, b in zip(steps, steps[1:]))  # never two steps at once
    got = pool_paired.lockstep_pairs(*runs)["stream+prefetch"]
    assert got["n"] == 8 and got["start_skew_s_max"] is None


def test_both_processes_take_the_flag_either_raised():
    address = f"127.0.0.1:{_port()}"
    a = lockstep.Lockstep(address, 0, timeout_s=30)
    got = {}
    t = threading.Thread(
        target=lambda: got.update(b=lockstep.Lockstep(address, 1, timeout_s=30).agree("end/0/1", True))
    )
    t.start()
    got["a"] = a.agree("end/0/1", False)
    t.join()
    assert got == {"a": True, "b": True}
    alone = lockstep.Lockstep(f"127.0.0.1:{_port()}", 0, timeout_s=0.2)
    assert alone.agree("end/0/1", False) is False and alone.agree("end/0/2", True) is True  # its own flag
