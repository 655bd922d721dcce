"""What issue 12's safety costs on a GPU: verified restore and strict access.

    python benchmarks/bench_reliability.py [--preset qwen2-1.5b] [--cycles 3] [--results PATH]

1. Verified restore (``TransferConfig(verify=...)``): offload and reload of a Qwen2-shape model
   with its AdamW state (params, grads, moments), with ``verify="off"``, ``"sampled"`` and
   ``"full"``, each in its own timeshare; GB/s of each, as a fraction of the PCIe line rate
   measured in the same run and of the unverified run; plus the digest alone (GB/s of device
   bytes digested, the HBM-bound cost). A fresh timeshare per mode; cold is its first
   transition, warm the median of the next ``--cycles``.
2. Strict access (``tidal.strict_access``): wall time per small op with and without it (a
   loop of launches, host-bound: the mode's cost is host time per op), and a forward+backward
   of the same model on a short batch with and without it.

Prints every figure beside its anchor (the unverified transfer, the run without strict mode)
and the floor (the line rate), and appends rows to ``--results`` (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import tidal  # noqa: E402
from tidal_recipes.measure import environment, measure_line_rate  # noqa: E402
from tidal_recipes.measure import build_model, make_adamw_state  # noqa: E402
from tidal.device import DeviceOps  # noqa: E402
from tidal.state.digest import digest, digest_many  # noqa: E402
from tidal.transfer import TransferConfig  # noqa: E402

GIB = 1 << 30


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_verify(model, opt, cycles: int, line: dict) -> dict:
    out = {}
    for mode in ("off", "sampled", "full"):
        cfg = tidal.TimeshareConfig(transfer=TransferConfig(verify=mode))
        ts = tidal.Timeshare("cuda", config=cfg)
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        nbytes = ts.role_bytes("actor")
        offs, ins = [], []
        for _ in range(cycles + 1):
            offs.append(_sync_time(lambda: ts.offload("actor")))
            ins.append(_sync_time(lambda: ts.load("actor")))
        ts.close()
        r = {
            "bytes": nbytes,
            "offload_cold_gbps": nbytes / offs[0] / 1e9,
            "reload_cold_gbps": nbytes / ins[0] / 1e9,
            "offload_warm_gbps": nbytes / statistics.median(offs[1:]) / 1e9,
            "reload_warm_gbps": nbytes / statistics.median(ins[1:]) / 1e9,
        }
        r["offload_warm_vs_line"] = r["offload_warm_gbps"] / line["d2h_gbps"]
        r["reload_warm_vs_line"] = r["reload_warm_gbps"] / line["h2d_gbps"]
        out[mode] = r
        print(
            f"  verify={mode:<8} {nbytes / 1e9:.2f} GB  offload cold/warm {r['offload_cold_gbps']:.1f}/"
            f"{r['offload_warm_gbps']:.1f} GB/s ({r['offload_warm_vs_line']:.3f} of line)  reload cold/warm "
            f"{r['reload_cold_gbps']:.1f}/{r['reload_warm_gbps']:.1f} GB/s ({r['reload_warm_vs_line']:.3f} of line)",
            flush=True,
        )
    for mode in ("sampled", "full"):
        for d in ("offload", "reload"):
            out[mode][f"{d}_vs_off"] = out[mode][f"{d}_warm_gbps"] / out["off"][f"{d}_warm_gbps"]
    x = torch.randint(0, 255, (GIB,), dtype=torch.uint8, device="cuda")
    for key, fn in (("digest_full_gbps", lambda: digest_many([x])), ("digest_torch_gbps", lambda: digest(x))):
        fn()
        secs = statistics.median(_sync_time(fn) for _ in range(5))
        out[key] = GIB / secs / 1e9
    print(
        f"  digest alone (full): {out['digest_full_gbps']:.0f} GB/s of device bytes (digest_many, the store's "
        f"path); {out['digest_torch_gbps']:.0f} GB/s per-storage torch ops",
        flush=True,
    )
    return out


def bench_strict(model, steps: int = 5, ops_n: int = 3000) -> dict:
    x = torch.randn(1024, device="cuda")

    def loop():
        for _ in range(ops_n):
            torch.add(x, 1.0)

    def per_op(strict: bool) -> float:
        if strict:
            with tidal.strict_access():
                loop()
                secs = [_sync_time(loop) for _ in range(3)]
        else:
            loop()
            secs = [_sync_time(loop) for _ in range(3)]
        return statistics.median(secs) / ops_n

    plain_op, strict_op = per_op(False), per_op(True)
    ids = torch.randint(0, 1000, (2, 128), device="cuda")

    def step():
        model(input_ids=ids).logits.float().mean().backward()

    def step_time(strict: bool) -> float:
        if strict:
            with tidal.strict_access():
                step()
                return statistics.median(_sync_time(step) for _ in range(steps))
        step()
        return statistics.median(_sync_time(step) for _ in range(steps))

    plain_step, strict_step = step_time(False), step_time(True)
    model.zero_grad(set_to_none=True)
    r = {
        "op_us": plain_op * 1e6,
        "op_strict_us": strict_op * 1e6,
        "op_extra_us": (strict_op - plain_op) * 1e6,
        "step_s": plain_step,
        "step_strict_s": strict_step,
        "step_ratio": strict_step / plain_step,
    }
    print(
        f"  strict access: small op {r['op_us']:.1f} -> {r['op_strict_us']:.1f} us (+{r['op_extra_us']:.1f} us/op); "
        f"fwd+bwd {plain_step * 1e3:.1f} -> {strict_step * 1e3:.1f} ms ({r['step_ratio']:.2f}x)",
        flush=True,
    )
    return r


def append_rows(path: str, env: dict, preset: str, line: dict, v: dict, s: dict) -> None:
    date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    gpu = env["device_name"]
    vers = f"torch {env['torch']}, transformers {env['transformers']}"
    rows = [
        "",
        f"### Reliability (issue 12): verified restore and strict access, {preset} + AdamW, {date}",
        "",
        "| date | GPU | versions | verify | GB moved | offload warm GB/s | x line | x verify=off | "
        "reload warm GB/s | x line | x verify=off | digest alone GB/s (store's / torch ops) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("off", "sampled", "full"):
        r = v[mode]
        rows.append(
            f"| {date} | {gpu} | {vers} | {mode} | {r['bytes'] / 1e9:.2f} | {r['offload_warm_gbps']:.1f} | "
            f"{r['offload_warm_vs_line']:.3f} | {r.get('offload_vs_off', 1.0):.3f} | "
            f"{r['reload_warm_gbps']:.1f} | {r['reload_warm_vs_line']:.3f} | {r.get('reload_vs_off', 1.0):.3f} | "
            f"{v['digest_full_gbps']:.0f} / {v['digest_torch_gbps']:.0f} |"
        )
    rows += [
        "",
        f"Line rate in the same run: D2H {line['d2h_gbps']:.1f}, H2D {line['h2d_gbps']:.1f} GB/s.",
        "",
        "| date | GPU | versions | small op us | with strict_access us | extra us/op | fwd+bwd ms | "
        "with strict_access ms | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {date} | {gpu} | {vers} | {s['op_us']:.1f} | {s['op_strict_us']:.1f} | {s['op_extra_us']:.1f} | "
        f"{s['step_s'] * 1e3:.1f} | {s['step_strict_s'] * 1e3:.1f} | {s['step_ratio']:.2f} |",
        "",
    ]
    with open(path, "a") as f:
        f.write("\n".join(rows) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2-1.5b")
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_reliability: needs a CUDA device", file=sys.stderr)
        return 3
    ops = DeviceOps("cuda")
    env = environment(ops)
    print(f"bench_reliability on {env['device_name']} (torch {env['torch']}, transformers {env['transformers']})")
    line = measure_line_rate(ops, GIB)
    print(f"  line rate D2H {line['d2h_gbps']:.1f} H2D {line['h2d_gbps']:.1f} both {line['bidir_gbps']:.1f} GB/s")
    model, impl = build_model(args.preset, device="cuda")
    opt = make_adamw_state(model)
    print(f"  {args.preset} ({impl}) + AdamW state built")
    v = bench_verify(model, opt, args.cycles, line)
    s = bench_strict(model)
    append_rows(args.results, env, args.preset, line, v, s)
    print(f"rows appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
