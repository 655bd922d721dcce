"""DeepSpeed engine offload / reload on one GPU: tidal's transfer engine against DeepSpeed's own
``engine.offload_states()`` / ``reload_states()``, on the same engines.

    python benchmarks/bench_deepspeed.py [--preset qwen2-0.5b] [--stages 1,2,3] [--cycles 4]
                                         [--batch 2] [--seq 512] [--device cuda:0] [--out PATH]

For each ZeRO stage and each way, a fresh process (so the first cycle is really cold: nothing
pinned, no allocator cache) builds a Qwen2-shape causal LM with random weights
(``tidal_recipes.cli.models.build_model``: transformers ``from_config``, no download), wraps it with
``deepspeed.initialize`` (bf16, gradient clipping, DeepSpeed's default buckets, world size 1
over NCCL), trains 2 steps on random tokens so every buffer exists, then offloads and
reloads ``--cycles`` times:

- ``via="tidal"``: :class:`tidal.distributed.DeepSpeedOffload` (a one-role ``Timeshare``:
  pinned host slots reserved at construction, two copy streams, storages resized in place,
  memory returned to the driver). Optimizer: ``torch.optim.AdamW``.
- ``via="deepspeed"``: ``engine.offload_states(pin_memory=True, non_blocking=True)`` and
  ``reload_states(non_blocking=True)``, then a device synchronize. ZeRO-3 needs DeepSpeed's
  ``FusedAdam`` there (its offload_states asserts so; a CUDA op JIT-built on first use); if it
  does not build, the run says why and is skipped. Otherwise ``torch.optim.AdamW``.

Per run it prints and records: the engine's state bytes on the device (tidal's count), bytes
each way (tidal: storages moved; DeepSpeed: the allocator's allocated-bytes change), the wall
time of each call (first cycle = cold, median of the rest = warm) and GB/s over it, the driver's
free memory gained by the offload, the allocator bytes left after it, host RSS added by the
first cycle (pinned buffers), and whether the state came back bit-exact (per-tensor checksums
of params, masters, moments and gradient partitions; ZeRO-3's reduce bucket is scratch and is
left out). The PCIe line rate measured in each process (1 GiB pinned copies) is printed for
scale. ``--out`` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GB = 1e9
VIAS = ("tidal", "deepspeed")


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- one run, in its own process ------------------------------------------------------------


def engine_state(engine) -> dict[str, torch.Tensor]:
    """The engine's state tensors by DeepSpeed's attribute names, looked up afresh (DeepSpeed's
    own offload replaces ``.data`` and rebuilds views)."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    out: dict[str, torch.Tensor] = {}
    for n, p in engine.module.named_parameters():
        if getattr(p, "ds_tensor", None) is not None:
            # ZeRO-3: the partition is the state; a gathered (persistent) copy is derived from
            # it, and DeepSpeed's offload_states releases it until the next forward.
            out[f"ds_tensor:{n}"] = p.ds_tensor.detach()
        else:
            out[f"param:{n}"] = p.detach()
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        for i, t in enumerate(getattr(opt, attr, None) or []):
            out[f"{attr}[{i}]"] = t.detach()
    if isinstance(getattr(opt, "grad_partitions_flat_buffer", None), torch.Tensor):
        out["grad_partitions_flat_buffer"] = opt.grad_partitions_flat_buffer
    for i, st in enumerate(inner.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.is_cuda and k in ("exp_avg", "exp_avg_sq"):
                out[f"optim[{i}].{k}"] = v
    return out


def line_rate(device: torch.device, nbytes: int = 1 << 30) -> dict:
    """D2H and H2D GB/s of one pinned copy of ``nbytes`` (best of 3); empty on CPU."""
    if device.type != "cuda":
        return {}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h_gbps", host, dev), ("h2d_gbps", dev, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)  # the copy is done only when the device says so
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / GB
    del dev, host
    torch.cuda.empty_cache()
    return out


def train_step(engine, batch: int, seq: int, vocab: int, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(engine.device)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.item())


def run_one(args) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device(args.device)
    on_cpu = device.type == "cpu"  # a smoke test of this script (DeepSpeed's CPU accelerator, gloo)
    if on_cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        torch.cuda.set_device(device)
    import logging

    import deepspeed

    from tidal_recipes.measure import PRESETS, StateReference, build_model
    from tidal.device import DeviceOps
    from tidal.distributed import DeepSpeedOffload, deepspeed_state_bytes
    from tidal.memory import host_rss_bytes

    if on_cpu:  # its CPU comm op would be JIT-compiled first (a minute of g++); gloo suffices
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else "nccl")
    ops = DeviceOps(device)
    res: dict = {"stage": args.stage, "via": args.via, "preset": args.preset, "deepspeed": deepspeed.__version__}
    model, desc = build_model(args.preset, device=device, dtype=torch.bfloat16)
    res["model"] = desc
    if args.stage == 3 and args.via == "deepspeed":
        try:
            from deepspeed.ops.adam import FusedAdam

            opt = FusedAdam(model.parameters(), lr=1e-5)
        except Exception as e:  # noqa: BLE001 - a JIT build failure means "not available here"
            res["unavailable"] = (
                f"DeepSpeed's ZeRO-3 offload_states needs its FusedAdam, which did not build "
                f"here: {type(e).__name__}: {str(e)[:300]}"
            )
            return res
        res["optimizer"] = "deepspeed FusedAdam"
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        res["optimizer"] = "torch AdamW"
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    vocab = PRESETS[args.preset].vocab
    losses = [train_step(engine, args.batch, args.seq, vocab, s) for s in range(2)]
    ops.synchronize()
    ops.empty_cache()
    res["line"] = line_rate(device)
    res["state_bytes"] = deepspeed_state_bytes(engine)
    res["scratch_bytes"] = sum(  # ZeRO-3's reduce bucket: moved by tidal, dropped by DeepSpeed
        b.buffer.numel() * b.buffer.element_size()
        for b in getattr(engine.optimizer, "ipg_buckets", {}).values()
        if isinstance(getattr(b, "buffer", None), torch.Tensor)
    )
    reference = StateReference(engine_state(engine), mode="fingerprint")
    rss0 = host_rss_bytes()
    t0 = time.perf_counter()
    try:
        off = DeepSpeedOffload(engine, via=args.via)
    except ValueError as e:
        res["unavailable"] = str(e)
        return res
    res["setup_seconds"] = time.perf_counter() - t0  # tidal pins its host slots here
    cycles = []
    for i in range(args.cycles):
        ops.synchronize()
        free0, alloc0 = ops.driver_free_bytes()[0], ops.allocated_bytes()
        t = time.perf_counter()
        out = off.offload()  # returns when the copies are done and the memory is released
        out_wall = time.perf_counter() - t
        free1, alloc1 = ops.driver_free_bytes()[0], ops.allocated_bytes()
        t = time.perf_counter()
        back = off.reload()
        in_wall = time.perf_counter() - t
        free2 = ops.driver_free_bytes()[0]
        if i == 0:
            res["host_rss_added_bytes"] = host_rss_bytes() - rss0
        cycles.append(
            {
                "out_bytes": out.bytes_out,
                "in_bytes": back.bytes_in,
                "out_wall_s": out_wall,
                "in_wall_s": in_wall,
                "out_copy_s": out.seconds,
                "in_copy_s": back.seconds,
                "driver_gained_bytes": free1 - free0,
                "driver_returned_bytes": free1 - free2,
                "alloc_left_bytes": alloc1,
                "alloc_freed_bytes": alloc0 - alloc1,
            }
        )
    res["cycles"] = cycles
    bad = reference.mismatches(engine_state(engine))
    res["bit_exact"] = not bad
    res["mismatches"] = bad[:10]
    losses.append(train_step(engine, args.batch, args.seq, vocab, 2))
    res["losses"] = losses
    off.close()
    return res


# ---- summary --------------------------------------------------------------------------------


def _cold_warm(cycles: list[dict], key: str) -> tuple[float, float]:
    vals = [c[key] for c in cycles]
    return vals[0], statistics.median(vals[1:])  # main() insists on >= 2 cycles


def summarize(r: dict) -> dict:
    c = r["cycles"]
    out_cold, out_warm = _cold_warm(c, "out_wall_s")
    in_cold, in_warm = _cold_warm(c, "in_wall_s")
    moved_out = statistics.median(x["out_bytes"] for x in c)
    moved_in = statistics.median(x["in_bytes"] for x in c)
    return {
        "out_cold_s": out_cold,
        "out_warm_s": out_warm,
        "in_cold_s": in_cold,
        "in_warm_s": in_warm,
        "out_bytes": moved_out,
        "in_bytes": moved_in,
        "out_warm_gbps": moved_out / out_warm / GB,
        "in_warm_gbps": moved_in / in_warm / GB,
        "out_cold_gbps": moved_out / out_cold / GB,
        "in_cold_gbps": moved_in / in_cold / GB,
        "driver_gained_bytes": min(x["driver_gained_bytes"] for x in c),
        "alloc_left_bytes": max(x["alloc_left_bytes"] for x in c),
    }


def print_table(runs: list[dict]) -> None:
    log(
        "\nstage via        state GB  out GB  offload cold/warm s (warm GB/s)  in GB  reload cold/warm s "
        "(warm GB/s)  driver +GB  left MB  host +GB  bit-exact"
    )
    for r in runs:
        if "unavailable" in r or "error" in r:
            log(f"{r['stage']:>5} {r['via']:<10} {r.get('unavailable') or r.get('error')}")
            continue
        s = r["summary"]
        log(
            f"{r['stage']:>5} {r['via']:<10} {r['state_bytes'] / GB:8.2f} {s['out_bytes'] / GB:7.2f}  "
            f"{s['out_cold_s']:7.3f} / {s['out_warm_s']:6.3f} ({s['out_warm_gbps']:5.1f})      "
            f"{s['in_bytes'] / GB:6.2f}  {s['in_cold_s']:7.3f} / {s['in_warm_s']:6.3f} ({s['in_warm_gbps']:5.1f})    "
            f"{s['driver_gained_bytes'] / GB:9.2f}  {s['alloc_left_bytes'] / 2**20:7.1f}  "
            f"{r.get('host_rss_added_bytes', 0) / GB:7.2f}  {'yes' if r['bit_exact'] else 'NO ' + str(r['mismatches'][:3])}"
        )
    by_stage: dict[int, dict[str, dict]] = {}
    for r in runs:
        if "summary" in r:
            by_stage.setdefault(r["stage"], {})[r["via"]] = r
    for stage, d in sorted(by_stage.items()):
        if len(d) == 2:
            t, ds = d["tidal"]["summary"], d["deepspeed"]["summary"]
            log(
                f"stage {stage}: DeepSpeed / tidal wall time, warm: offload {ds['out_warm_s'] / t['out_warm_s']:.2f}x, "
                f"reload {ds['in_warm_s'] / t['in_warm_s']:.2f}x; cold: offload {ds['out_cold_s'] / t['out_cold_s']:.2f}x, "
                f"reload {ds['in_cold_s'] / t['in_cold_s']:.2f}x (tidal moved {d['tidal']['scratch_bytes'] / GB:.2f} GB "
                f"of scratch bucket DeepSpeed drops)"
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2-0.5b")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--vias", default=",".join(VIAS))
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", default=None, help="write every figure here as JSON")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a single run (child process)
    ap.add_argument("--stage", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--via", default="tidal", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29610, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cycles < 2:
        ap.error("--cycles must be >= 2 (the first is cold, the rest give the warm median)")
    if args.one:
        res = run_one(args)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("bench_deepspeed: no CUDA device; nothing measured (--device cpu runs a smoke test)")
        return 0
    import importlib.metadata as md

    env = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "batch": args.batch,
        "seq": args.seq,
        "cycles": args.cycles,
    }
    for pkg in ("deepspeed", "transformers"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    log(f"bench_deepspeed: {env}")
    if env["deepspeed"] is None:
        log(
            "deepspeed is not installed; nothing measured (bash benchmarks/gpu.sh deepspeed installs the carried wheels)"
        )
        return 0
    runs = []
    port = 29610
    with tempfile.TemporaryDirectory() as d:
        for stage in [int(s) for s in args.stages.split(",")]:
            for via in args.vias.split(","):
                port += 1
                path = os.path.join(d, f"s{stage}_{via}.json")
                cmd = [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--one",
                    "--stage",
                    str(stage),
                    "--via",
                    via,
                    "--port",
                    str(port),
                    "--preset",
                    args.preset,
                    "--cycles",
                    str(args.cycles),
                    "--batch",
                    str(args.batch),
                    "--seq",
                    str(args.seq),
                    "--device",
                    args.device,
                    "--out",
                    path,
                ]
                log(f"\n-- ZeRO-{stage} via {via}")
                t0 = time.perf_counter()
                rc = subprocess.call(cmd, cwd=ROOT)
                if rc != 0 or not os.path.exists(path):
                    runs.append({"stage": stage, "via": via, "error": f"run failed with exit code {rc}"})
                    continue
                with open(path) as f:
                    r = json.load(f)
                if "cycles" in r:
                    r["summary"] = summarize(r)
                    line = (
                        f"line D2H/H2D {r['line']['d2h_gbps']:.1f}/{r['line']['h2d_gbps']:.1f} GB/s"
                        if r["line"]
                        else "no line rate on CPU"
                    )
                    log(
                        f"   state {r['state_bytes'] / GB:.2f} GB (scratch {r['scratch_bytes'] / GB:.2f} GB), {line}, setup "
                        f"{r['setup_seconds']:.2f} s, bit-exact {r['bit_exact']}, losses {r['losses']}, "
                        f"{time.perf_counter() - t0:.0f} s in all"
                    )
                    for i, c in enumerate(r["cycles"]):
                        log(
                            f"   cycle {i}: out {c['out_bytes'] / GB:.2f} GB in {c['out_wall_s']:.3f} s (copies "
                            f"{c['out_copy_s']:.3f} s), driver +{c['driver_gained_bytes'] / GB:.2f} GB, "
                            f"{c['alloc_left_bytes'] / 2**20:.1f} MiB left; in {c['in_bytes'] / GB:.2f} GB in "
                            f"{c['in_wall_s']:.3f} s (copies {c['in_copy_s']:.3f} s)"
                        )
                else:
                    log(f"   {r.get('unavailable')}")
                runs.append(r)
    print_table(runs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "runs": runs}, f, indent=1)
        log(f"wrote {args.out}")
    failed = [r for r in runs if "error" in r or r.get("bit_exact") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
