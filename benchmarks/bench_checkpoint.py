"""Checkpoint and sharded-role benchmark on 2 GPUs: tidal's save/load vs plain DCP, and the
per-rank timeshare transitions of an FSDP2 stage-3 role.

    python benchmarks/bench_checkpoint.py [--preset qwen2-0.5b] [--dir /tmp] [--cycles 8]
        [--repeats 3] [--world 2] [--results PATH] [--json PATH] [--budget-s 150]

Two processes, one GPU each, NCCL. Each builds the same Qwen2-shape causal LM from a config
(random fp32 weights, transformers' ``Qwen2ForCausalLM``), shards it with
``tidal.distributed.shard_model(zero_stage=3, layers=model.model.layers)`` (bf16 compute,
fp32 reduce), takes one AdamW step on random tokens, and drops the grads: the state is the
fp32 params and both Adam moments, half of each on each rank.

Measured, in this order (every figure is the slowest rank's, barriers around each case):

* the line rate on each rank with the other ranks copying at the same time (1 GiB, pinned).
* transitions: ``ts.offload`` / ``ts.load`` of the role (params + moments) ``--cycles`` times;
  GB/s per rank = the role's bytes on that rank / the copy time tidal records (both ranks move
  at once, so they share the host's memory bandwidth), beside that line rate; the driver's
  used memory after each offload, and any collection by Python's cyclic GC inside a
  transition (its milliseconds count in the transition's).
* save, role resident: ``tidal.checkpoint.save`` (DCP through a gloo group, atomic commit).
* save, plain: ``get_state_dict`` + ``torch.distributed.checkpoint.save`` of the GPU state
  dict (default ``FileSystemWriter``: one thread, 10 MB copy-ahead, fsync), default group.
* save, role offloaded: ``tidal.checkpoint.save`` reading the timeshare's host copies (plain
  DCP cannot save an offloaded role without reloading it first).
* load, role offloaded (into the host copies), load resident (into the GPU tensors), and the
  plain ``dcp.load`` + ``set_state_dict``; the page cache is dropped before each load when
  the process may (root), and every load is checked bit for bit against the saved state
  (kept on the host: a device copy would share allocator segments with the role).
  Each save and load runs ``--repeats`` times: the median, with the range as its noise.

GB/s = bytes of the checkpoint's files (both ranks) / seconds; peak extra = the largest
``torch.cuda.max_memory_allocated`` growth over the case on any rank. Checkpoints go to a
fresh directory under ``--dir`` (local disk), removed at the end. With ``--results`` rows are
appended to the section "## Sharded roles and checkpoints (issue 6)" (created at the end of
the file if missing). ``--device cpu`` runs the same code on 2 CPU processes (gloo), a smoke
test only.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sys
import tempfile
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

SECTION = "## Sharded roles and checkpoints (issue 6)"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MiB = 1 << 20


def _drop_caches() -> bool:
    """Write dirty pages and drop the page cache, so a load reads the disk. False if not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


class Case:
    """Times ``fn`` between barriers and measures the device memory it adds."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, fn) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()
        seconds = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - base if self.cuda else 0
        return {"seconds": seconds, "peak_extra": peak}


class _GCLog:
    """Seconds the interpreter's cyclic garbage collector ran, by generation, between
    ``start`` and ``stop`` (a collection inside a transition counts in its seconds)."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.spans: list | None = None
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if self.spans is None:
            return
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            self.spans.append((info["generation"], time.perf_counter() - self.t0))

    def start(self) -> None:
        self.spans = []

    def stop(self) -> list:
        spans, self.spans = self.spans, None
        return spans


def _driver_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(model, opt) -> dict[str, torch.Tensor]:
    from tests.distributed.test_fsdp import state_tensors  # params, grads, moments by name

    return state_tensors(model, opt)


def _run(rank: int, world: int, args, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tidal
    from tidal.checkpoint import TrainState, load, save
    from tidal_recipes.measure import build_model
    from tidal.distributed import shard_model

    cuda = args.device == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    t_start = time.monotonic()
    out: dict = {"rank": rank, "cases": {}, "transitions": []}

    model, desc = build_model(args.preset, device=device, dtype=torch.float32, seed=0)
    out["model"] = desc
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    shard_model(model, zero_stage=3, layers=model.model.layers, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=g).to(device)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del ids
    # The state to compare against lives on the host: clones kept on the device would share
    # caching-allocator segments with the role's storages (a reload fills their free space),
    # so later offloads could not give those segments back to the driver (the 73 MiB per rank
    # that earlier runs of this benchmark left; the probe at git show c91961b:scripts/probe_fsdp_release.py showed it).
    reference = {k: _local(v).to("cpu", copy=True) for k, v in _tensors(model, opt).items()}

    def zero_state() -> None:
        with torch.no_grad():
            for k, t in _tensors(model, opt).items():
                if not k.endswith(".step"):
                    t.zero_()

    def check(what: str) -> None:
        now = _tensors(model, opt)
        bad = [k for k in reference if not torch.equal(_local(now[k]).cpu(), reference[k])]
        out["cases"][what]["exact"] = not bad
        if bad:
            out["cases"][what]["note"] = f"differs: {bad[:3]}"

    def saved(name: str) -> bool:
        return "seconds" in out["cases"].get(name, {}) and "error" not in out["cases"][name]

    def go(name: str) -> bool:
        box = [time.monotonic() - t_start < args.budget_s]
        dist.broadcast_object_list(box, src=0)
        if not box[0]:
            out["cases"][name] = {"skipped": f"over the {args.budget_s:.0f} s budget"}
        return box[0]

    case = Case(cuda)
    if cuda:
        # The line rate on this rank with the other rank copying at the same time (the
        # transitions below run that way too), so each transition's GB/s has its ratio.
        from tidal.device import DeviceOps
        from tidal_recipes.measure import measure_line_rate

        dist.barrier()
        out["line"] = measure_line_rate(DeviceOps(device), 1 << 30)
    ts = tidal.Timeshare(device)
    ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
    out["role_bytes"] = ts.role_bytes("actor")
    gc_log = _GCLog()
    for cycle in range(args.cycles):
        dist.barrier()
        gc_log.start()
        rec_out = ts.offload("actor")
        gc_out = gc_log.stop()
        used_out = _driver_used() if cuda else 0
        dist.barrier()
        gc_log.start()
        rec_in = ts.load("actor")
        gc_in = gc_log.stop()
        out["transitions"].append(
            {
                "offload_gbps": rec_out.gbps,
                "reload_gbps": rec_in.gbps,
                "offload_s": rec_out.seconds,
                "reload_s": rec_in.seconds,
                "release_s": rec_out.release_seconds,
                "unreleased": rec_out.unreleased_bytes,
                "driver_used_offloaded": used_out,
                "gc_out": gc_out,
                "gc_in": gc_in,
            }
        )
    state = TrainState(model, opt, timeshare=ts)
    tdir, pdir = os.path.join(root, "tidal"), os.path.join(root, "plain")

    def plain_save() -> None:
        msd, osd = get_state_dict(model, [opt])
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(pdir, "step-1"))

    def plain_load() -> None:
        msd, osd = get_state_dict(model, [opt])
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=os.path.join(pdir, "step-1"))
        set_state_dict(model, [opt], model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def record(name: str, fn, path: str | None = None, before=None, **extra) -> None:
        # ``--repeats`` timed runs (``before`` runs untimed ahead of each: resets, cache drops);
        # the row gives the median with the range as the noise.
        runs = []
        try:
            for _ in range(args.repeats):
                if before is not None:
                    before()
                runs.append(case(fn))
            r = {
                "seconds": statistics.median(x["seconds"] for x in runs),
                "seconds_all": [x["seconds"] for x in runs],
                "peak_extra": max(x["peak_extra"] for x in runs),
            }
        except Exception as e:  # reported in the row; the other cases still run
            r = {"error": f"{type(e).__name__}: {e}"[:300]}
        r.update(extra)
        if path is not None and rank == 0 and os.path.isdir(path):
            r["files_bytes"] = _dir_bytes(path)
        out["cases"][name] = r
        print(f"rank {rank}: {name}: {r}", flush=True)

    # Warm-up, not timed: one save of a one-tensor state by each path, so neither timed case
    # pays the one-off costs (tidal's gloo group, DCP's first planning, the directory's
    # creation). The earlier run timed tidal's resident save first and cold.
    tiny = torch.nn.Linear(4, 4, device=device)
    save(os.path.join(root, "warm-tidal"), TrainState(tiny, rng=False), step=0)
    dcp.save({"w": tiny.state_dict()}, checkpoint_id=os.path.join(root, "warm-plain"))

    def fresh(path: str):
        # Before each repeat: the previous repeat's files go (untimed), so the disk holds one
        # checkpoint per case and every save writes new files.
        def before() -> None:
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()

        return before

    # Plain DCP is timed first (an earlier run timed tidal's resident save first).
    if go("save plain"):
        record("save plain", plain_save, os.path.join(pdir, "step-1"), before=fresh(pdir))
    if go("save resident"):
        record(
            "save resident",
            lambda: save(os.path.join(tdir, "resident"), state, step=1),
            os.path.join(tdir, "resident", "step-1"),
            before=fresh(os.path.join(tdir, "resident")),
        )
    if go("save offloaded"):
        ts.offload("actor")
        record(
            "save offloaded",
            lambda: save(os.path.join(tdir, "offloaded"), state, step=2),
            os.path.join(tdir, "offloaded", "step-2"),
            before=fresh(os.path.join(tdir, "offloaded")),
        )
        out["cases"]["save offloaded"]["resident_after"] = ts.is_resident("actor")

    def cold_start(offloaded: bool):
        # Before each load: the state zeroed (so a load that reads nothing is caught), the
        # role where the case wants it, and the page cache dropped so the load reads the disk.
        def before() -> None:
            ts.load("actor")
            zero_state()
            if offloaded:
                ts.offload("actor")
            out["cold"] = _drop_caches() if rank == 0 else False
            dist.barrier()

        return before

    if go("load offloaded") and saved("save offloaded"):
        record(
            "load offloaded",
            lambda: load(os.path.join(tdir, "offloaded", "step-2"), state),
            os.path.join(tdir, "offloaded", "step-2"),
            before=cold_start(offloaded=True),
        )
        out["cases"]["load offloaded"]["cold_cache"] = out.get("cold")
        ts.load("actor")
        check("load offloaded")
    ts.load("actor")
    if go("load resident") and saved("save resident"):
        record(
            "load resident",
            lambda: load(os.path.join(tdir, "resident", "step-1"), state),
            os.path.join(tdir, "resident", "step-1"),
            before=cold_start(offloaded=False),
        )
        out["cases"]["load resident"]["cold_cache"] = out.get("cold")
        check("load resident")
    if go("load plain") and saved("save plain"):
        record("load plain", plain_load, os.path.join(pdir, "step-1"), before=cold_start(offloaded=False))
        out["cases"]["load plain"]["cold_cache"] = out.get("cold")
        check("load plain")
    ts.close()
    out["seconds"] = time.monotonic() - t_start
    return out


def _worker(rank: int, world: int, store: str, args, root: str, json_path: str) -> None:
    if args.device == "cuda":
        os.environ.update(NO_MULTICAST)
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, init_method=f"file://{store}", device_id=torch.device("cuda", rank)
        )
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    try:
        result = _run(rank, world, args, root)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            with open(json_path, "w") as f:
                json.dump(gathered, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _combine(ranks: list[dict], world: int) -> dict:
    """Per case: the slowest rank's seconds, the largest peak, rank 0's file bytes."""
    names = list(ranks[0]["cases"])
    cases = {}
    for n in names:
        rs = [r["cases"].get(n, {}) for r in ranks]
        c: dict = {}
        for key in ("skipped", "error"):
            found = [r[key] for r in rs if key in r]
            if found:
                c[key] = found[0]
        if "seconds" in rs[0]:
            # Per repeat the slowest rank; the median repeat, its range the noise.
            per = [max(r["seconds_all"][i] for r in rs) for i in range(len(rs[0]["seconds_all"]))]
            c["seconds_all"] = per
            c["seconds"] = statistics.median(per)
            c["peak_extra"] = max(r.get("peak_extra", 0) for r in rs)
            c["bytes"] = rs[0].get("files_bytes", 0)
            c["gbps"] = c["bytes"] / c["seconds"] / 1e9 if c["seconds"] > 0 else 0.0
            c["per_rank_gbps"] = c["gbps"] / world
            c["exact"] = all(r.get("exact", True) for r in rs)
            c["cold_cache"] = rs[0].get("cold_cache")
            c["notes"] = "; ".join(r["note"] for r in rs if "note" in r)
        cases[n] = c
    return cases


def _versions() -> dict:
    v = {"torch": torch.__version__}
    try:
        import transformers

        v["transformers"] = transformers.__version__
    except ImportError:
        v["transformers"] = "-"
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        v["gpu"] = "cpu"
        v["nccl"] = "-"
    return v


def _rows(ranks: list[dict], cases: dict, v: dict, args, world: int) -> list[str]:
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lead = f"| {now} | {v['gpu']} x{world} | {v['torch']} | {v['transformers']} | {args.preset} |"
    role_gb = max(r["role_bytes"] for r in ranks) / 1e9
    rows = []
    tr = [r["transitions"] for r in ranks]
    lines = [r.get("line") for r in ranks]
    for kind, line_key in (("offload", "d2h_gbps"), ("reload", "h2d_gbps")):
        # Per cycle the slowest rank (both move at once); cold = the first cycle.
        per_cycle = [min(ts[i][f"{kind}_gbps"] for ts in tr) for i in range(len(tr[0]))]
        cold, warm = per_cycle[0], per_cycle[1:]
        line = min(ln[line_key] for ln in lines) if all(lines) else None
        ratio = (lambda g: f" = {g / line:.2f}x") if line else (lambda g: "")
        warm_txt = (
            f"warm median {statistics.median(warm):.1f}{ratio(statistics.median(warm))} "
            f"(range {min(warm):.1f}-{max(warm):.1f}, {len(warm)} cycles)"
            if warm
            else "no warm cycles"
        )
        line_txt = f"line rate {line:.1f} GB/s per rank, both ranks copying" if line else "no line rate (CPU)"
        rows.append(
            f"{lead} transition {kind} (per rank) | {role_gb:.2f}/rank | "
            f"{max(t[0][f'{kind}_s'] for t in tr):.3f} | {cold:.1f}{ratio(cold)} (cold), {warm_txt} | - | - | "
            f"{line_txt}; slowest rank |"
        )
    for name, c in cases.items():
        if "seconds" not in c:
            rows.append(f"{lead} {name} | - | - | - | - | - | {c.get('skipped') or c.get('error')} |")
            continue
        notes = [n for n in (c.get("notes"), c.get("error")) if n]
        if c.get("cold_cache") is not None:
            notes.append("page cache dropped" if c["cold_cache"] else "page cache NOT dropped (warm read)")
        if name.startswith("load"):
            notes.append("bit-exact" if c["exact"] else "NOT EXACT")
        spread = f" ({min(c['seconds_all']):.2f}-{max(c['seconds_all']):.2f}, {len(c['seconds_all'])} runs)"
        rows.append(
            f"{lead} {name} | {c['bytes'] / 1e9:.2f} | {c['seconds']:.2f}{spread} | {c['per_rank_gbps']:.2f} | "
            f"{c['gbps']:.2f} | {c['peak_extra'] / MiB:.1f} | {'; '.join(notes)} |"
        )
    return rows


HEADER = """
{section}

Written by `python benchmarks/bench_checkpoint.py --results ...` (rows below copied from its
`--results` file of the run on the GPU machine). 2 processes, one GPU each, NCCL; a Qwen2-shape
causal LM from a config (random fp32 weights), FSDP2 stage 3 through
`tidal.distributed.shard_model` (bf16 compute, fp32 reduce), one AdamW step taken, grads
dropped: the state is fp32 params + both Adam moments, half on each rank. Transitions:
`ts.offload`/`ts.load` of that role, GB/s per rank from tidal's copy time (cold = first cycle).
Saves and loads: "plain" = `get_state_dict` + `torch.distributed.checkpoint.save`/`load`
(+ `set_state_dict`) of the GPU state dict with DCP's default writer; "resident"/"offloaded" =
`tidal.checkpoint.save`/`load` with the role on the GPU / offloaded to the timeshare's host
copies. Seconds: the slowest rank, barrier to barrier. GB = the checkpoint's files (both ranks);
GB/s total = GB / s, per rank = half. Peak extra = largest `torch.cuda.max_memory_allocated`
growth on any rank during the case. Files on the machine's local disk (/tmp).

| date | GPU | torch | transformers | model | case | GB | s | GB/s per rank | GB/s total | peak extra MiB | note |
|---|---|---|---|---|---|---|---|---|---|---|---|
"""


def append_rows(path: str, rows: list[str]) -> None:
    existing = open(path).read() if os.path.exists(path) else ""
    with open(path, "a") as f:
        if SECTION not in existing:
            f.write(HEADER.format(section=SECTION).lstrip("\n") if not existing else HEADER.format(section=SECTION))
        f.write("\n".join(rows) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2-0.5b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="local disk for the checkpoints")
    p.add_argument("--world", type=int, default=2, help="processes (one GPU each); 1 runs the same code on one GPU")
    p.add_argument("--cycles", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each save and load case (median, range)")
    p.add_argument("--budget-s", type=float, default=150.0, help="skip the cases left once this is spent")
    p.add_argument("--results", default=None, help="append rows to this markdown file")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    world = args.world
    if args.device == "cuda" and torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, found {torch.cuda.device_count()}")
        return 3
    if args.device == "cuda":
        os.environ.update(NO_MULTICAST)
    v = _versions()
    print(
        f"GPU {v['gpu']} x{world} | torch {v['torch']} | transformers {v['transformers']} | NCCL {v['nccl']} | "
        f"preset {args.preset} | checkpoints under {args.dir}",
        flush=True,
    )
    root = tempfile.mkdtemp(prefix="tidal-bench-ckpt-", dir=args.dir)
    work = tempfile.mkdtemp(prefix="tidal-bench-rdzv-")
    json_path = args.json or os.path.join(work, "result.json")
    try:
        mp.spawn(_worker, args=(world, os.path.join(work, "store"), args, root, json_path), nprocs=world, join=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    with open(json_path) as f:
        ranks = json.load(f)
    cases = _combine(ranks, world)
    print(
        f"\nmodel: {ranks[0]['model']}; role state per rank {max(r['role_bytes'] for r in ranks) / 1e9:.2f} GB; "
        f"run {max(r['seconds'] for r in ranks):.0f} s"
    )
    for r in ranks:
        for i, t in enumerate(r["transitions"]):
            print(
                f"  rank {r['rank']} cycle {i}: offload {t['offload_gbps']:.1f} GB/s ({t['offload_s']:.3f} s, "
                f"release {t['release_s']:.3f} s, unreleased {t['unreleased'] / MiB:.0f} MiB, driver used "
                f"{t['driver_used_offloaded'] / MiB:.0f} MiB once out), "
                f"reload {t['reload_gbps']:.1f} GB/s ({t['reload_s']:.3f} s)"
                + "".join(
                    f"; gen-{g} GC {sec * 1e3:.0f} ms in the {w}"
                    for w, spans in (("offload", t["gc_out"]), ("reload", t["gc_in"]))
                    for g, sec in spans
                    if g == 2 or sec > 0.005
                )
            )
        if r.get("line"):
            ln = r["line"]
            print(
                f"  rank {r['rank']} line rate (both ranks copying): D2H {ln['d2h_gbps']:.1f}, "
                f"H2D {ln['h2d_gbps']:.1f}, both ways {ln['bidir_gbps']:.1f} GB/s"
            )
    for name, c in cases.items():
        if "seconds" in c:
            print(
                f"  {name:<15} {c['bytes'] / 1e9:6.2f} GB {c['seconds']:7.2f} s (runs "
                f"{', '.join(f'{x:.2f}' for x in c['seconds_all'])}) {c['gbps']:6.2f} GB/s total "
                f"({c['per_rank_gbps']:.2f}/rank), peak extra {c['peak_extra'] / MiB:8.1f} MiB"
                f"{'' if c['exact'] else ', NOT EXACT'}{', ' + c['error'] if 'error' in c else ''}"
            )
        else:
            print(f"  {name:<15} {c}")
    ratios = {}
    for mine, plain in (
        ("save resident", "save plain"),
        ("save offloaded", "save plain"),
        ("load resident", "load plain"),
        ("load offloaded", "load plain"),
    ):
        a, b = cases.get(mine, {}), cases.get(plain, {})
        if a.get("gbps") and b.get("gbps"):
            ratios[f"{mine} / {plain}"] = a["gbps"] / b["gbps"]
    for k, r in ratios.items():
        print(f"  GB/s ratio {k}: {r:.3f}")
    rows = _rows(ranks, cases, v, args, world)
    print("\n" + "\n".join(rows))
    if args.results:
        append_rows(args.results, rows)
        print(f"rows appended to {args.results}")
    ok = all(c.get("exact", True) and "error" not in c for c in cases.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
