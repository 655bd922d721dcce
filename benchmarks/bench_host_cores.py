"""How fast each of the host's cores runs Python, and how far its memory is: one thread pinned
to each core in turn, several rounds.

    python benchmarks/bench_host_cores.py [--rounds 3] [--json PATH]

A host-bound decode (Hugging Face generation: tens of milliseconds of Python and kernel
launches a token, the GPU waiting) runs as fast as the core its thread is on. On the lent
virtual machines a process's decode kept its own pace for a whole run, between 36 and 63 ms a
token on one machine, beside another process started at the same moment (benchmarks/RESULTS.md,
"TRL alone beside tidal, step by step, on two GPUs"), whatever it was. This measures what a
core gives a thread, per core, twice over:

* ``calls``: Python calls, attribute reads and small dict writes (a module's ``__call__`` is
  made of them), in a loop that fits in the core's caches: the core's own speed, and that of
  whatever shares it (another thread on its sibling hyperthread, another guest's);
* ``chase``: a random walk through a list of 4 M integers (about 150 MB with the objects),
  each step a cache miss: the memory's latency from this core. The list is built twice, by a
  thread pinned to the first core and by one pinned to the last (Linux places a page on the
  node of the core that first touches it); where the machine has memory nodes it does not
  show its guests, the cores near each list's memory walk it faster, and the pattern flips
  between the two lists.

Printed: per core the median over rounds of each, the spread over cores (slowest over
fastest), and whether a core slow in one round is slow in the next (Spearman's rank
correlation between rounds: near 1, the cores differ; near 0, the time varies and the cores
do not). The guest's view of its topology (``/sys`` siblings and packages) is printed beside.

With ``--decode PRESET`` (a GPU): then a model of that shape (bench_trl's presets, bf16,
random weights) decodes with its thread pinned in turn to the two fastest and the two slowest
cores of ``calls``, ``--decode-reps`` times each, alternating: whether a token's host time
follows the core's speed (the ratio of the slow cores' median token to the fast cores',
printed beside that of ``calls``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

__all__ = ["spearman"]


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (ties get their mean rank);
    None for fewer than 3 values or a constant list."""
    if len(a) != len(b):
        raise ValueError(f"spearman needs equally long lists, got {len(a)} and {len(b)}")
    if len(a) < 3:
        return None

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    if va == 0 or vb == 0:
        return None
    return cov / (va * vb) ** 0.5


class _Node:
    def __init__(self) -> None:
        self.weight = 1
        self.cache: dict[str, int] = {}

    def __call__(self, x: int) -> int:
        self.cache["last"] = x
        return x + self.weight


def _calls(n: int) -> int:
    nodes = [_Node() for _ in range(28)]
    x = 0
    for _ in range(n):
        for node in nodes:
            x = node(x) & 0xFFFF
    return x


def _chase(perm: list[int], steps: int) -> int:
    i = 0
    for _ in range(steps):
        i = perm[i]
    return i


def _built_on(cpu: int, n: int, seed: int) -> list[int]:
    """A single-cycle random permutation of ``n``, built (first touched) by a thread pinned to
    ``cpu``."""
    out: list[list[int]] = []

    def build() -> None:
        os.sched_setaffinity(0, {cpu})
        order = list(range(n))
        random.Random(seed).shuffle(order)
        perm = [0] * n
        for a, b in zip(order, order[1:] + order[:1]):
            perm[a] = b
        out.append(perm)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    return out[0]


def _topology(cpus: list[int]) -> dict:
    def read(cpu: int, name: str) -> str | None:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/{name}") as f:
                return f.read().strip()
        except OSError:
            return None

    nodes = (
        [d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]
        if os.path.isdir("/sys/devices/system/node")
        else []
    )
    model = None
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    return {
        "cpu_model": model,
        "numa_nodes": len(nodes),
        "siblings": {c: read(c, "thread_siblings_list") for c in cpus},
        "package": {c: read(c, "physical_package_id") for c in cpus},
    }


def _time(fn, *args) -> tuple[float, float]:
    """(wall seconds, the thread's CPU seconds over wall) of one call."""
    w, c = time.perf_counter(), time.thread_time()
    fn(*args)
    wall = time.perf_counter() - w
    return wall, (time.thread_time() - c) / wall if wall else 0.0


def _decode_by_core(a: argparse.Namespace, calls: dict[int, float]) -> dict:
    """A model of preset ``a.decode`` decoding with this thread pinned to the two fastest and the
    two slowest cores of ``calls`` in turn (see the module docstring)."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decode import Gaps, build, decode

    order = sorted(calls, key=calls.get)
    fast, slow = order[:2], order[-2:]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(a.decode, device, 0)
    gaps = Gaps(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, model.config.vocab_size, (a.decode_batch, 16), generator=g).to(device)
    decode(model, gaps, ids, 8)  # warm-up: kernels, cuBLAS handles, allocator
    gap: dict[int, list[float]] = {c: [] for c in fast + slow}
    for _ in range(a.decode_reps):
        for cpu in (fast[0], slow[0], fast[1], slow[1]):
            os.sched_setaffinity(0, {cpu})
            gap[cpu].append(decode(model, gaps, ids, a.decode_tokens)["median_gap_s"])
    os.sched_setaffinity(0, set(calls))
    med = {c: statistics.median(v) for c, v in gap.items()}
    fast_tok = statistics.median([med[c] for c in fast])
    slow_tok = statistics.median([med[c] for c in slow])
    calls_ratio = statistics.median([calls[c] for c in slow]) / statistics.median([calls[c] for c in fast])
    print(
        f"  decode ({a.decode}, {a.decode_batch} x {a.decode_tokens}): a token {fast_tok * 1e3:.1f} ms on the fastest "
        f"cores {fast}, {slow_tok * 1e3:.1f} ms on the slowest {slow}: {slow_tok / fast_tok:.2f}x "
        f"(calls there {calls_ratio:.2f}x); per core "
        + ", ".join(f"{c}: " + "/".join(f"{x * 1e3:.1f}" for x in gap[c]) for c in fast + slow)
    )
    return {"fast": fast, "slow": slow, "token_s": gap, "ratio": slow_tok / fast_tok, "calls_ratio": calls_ratio}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=20000, help="loops of 28 calls per measurement")
    p.add_argument("--chase-steps", type=int, default=400_000)
    p.add_argument("--list-len", type=int, default=4_000_000)
    p.add_argument("--decode", default=None, metavar="PRESET", help="then decode on the fastest and slowest cores")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-reps", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.rounds < 2:
        p.error("--rounds must be >= 2 (the rounds are compared)")
    cpus = sorted(os.sched_getaffinity(0))
    lists = {f"built_on_{c}": _built_on(c, a.list_len, seed=c) for c in {cpus[0], cpus[-1]}}
    rounds: list[dict] = []
    for r in range(a.rounds):
        row: dict[str, dict[int, float]] = {"calls": {}, "calls_cpu_share": {}}
        row.update({f"chase_{k}": {} for k in lists})
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})
            _calls(50)  # the thread now on this core, its caches warm
            row["calls"][cpu], row["calls_cpu_share"][cpu] = _time(_calls, a.calls)
            for k, perm in lists.items():
                _chase(perm, 1000)
                row[f"chase_{k}"][cpu] = _time(_chase, perm, a.chase_steps)[0]
        rounds.append(row)
        print(f"round {r + 1}: calls {statistics.median(row['calls'].values()) * 1e3:.1f} ms median", flush=True)
    os.sched_setaffinity(0, set(cpus))
    topo = _topology(cpus)
    out: dict = {"cpus": cpus, "topology": topo, "rounds": rounds, "summary": {}}
    print(f"{len(cpus)} cores ({topo['cpu_model']}), {topo['numa_nodes']} memory node(s) shown to the guest")
    for key in ["calls"] + [f"chase_{k}" for k in lists]:
        per_cpu = {c: statistics.median(r[key][c] for r in rounds) for c in cpus}
        vals = sorted(per_cpu.values())
        corr = [
            spearman([rounds[i][key][c] for c in cpus], [rounds[i + 1][key][c] for c in cpus])
            for i in range(a.rounds - 1)
        ]
        dec = vals[len(vals) // 10], vals[(len(vals) * 9) // 10]
        out["summary"][key] = {
            "per_cpu_s": per_cpu,
            "slowest_over_fastest": vals[-1] / vals[0],
            "p90_over_p10": dec[1] / dec[0],
            "round_to_round_spearman": corr,
        }
        print(
            f"  {key:22s} median {statistics.median(vals) * 1e3:7.1f} ms; slowest/fastest {vals[-1] / vals[0]:.2f}x, "
            f"p90/p10 {dec[1] / dec[0]:.2f}x; rank correlation round to round "
            + ", ".join("-" if x is None else f"{x:.2f}" for x in corr)
        )
        slow = sorted(per_cpu, key=per_cpu.get)
        print(f"    fastest cores {slow[:6]}, slowest {slow[-6:]}")
    if len(lists) == 2:
        k0, k1 = (f"chase_{k}" for k in lists)
        s = spearman(
            [out["summary"][k0]["per_cpu_s"][c] for c in cpus], [out["summary"][k1]["per_cpu_s"][c] for c in cpus]
        )
        out["summary"]["chase_lists_spearman"] = s
        print(
            "  the two lists' walks, core by core: rank correlation "
            + ("-" if s is None else f"{s:.2f}")
            + " (negative: each list is nearer some cores, memory nodes the guest is not shown)"
        )
    if a.decode:
        out["decode"] = _decode_by_core(a, out["summary"]["calls"]["per_cpu_s"])
    share = [v for r in rounds for v in r["calls_cpu_share"].values()]
    print(f"  the thread had its core {min(share):.1%}-{max(share):.1%} of each measurement's wall time")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
