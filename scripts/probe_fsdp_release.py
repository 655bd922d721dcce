"""Diagnostic: what keeps device memory after offloading an FSDP2-sharded role?

benchmarks/bench_checkpoint.py saw every offload after the first leave ~1.2 GiB per rank with
the caching allocator (2x H200, Qwen2-0.5B, stage 3). This runs the same role through
offload/reload cycles on each of 2 GPUs (torchrun-free: spawned ranks, NCCL), with and
without coalesced reload allocations, and after each offload prints per rank: allocated and
reserved bytes, what the driver got back, and every allocator segment still holding active
blocks, with the sizes and the allocation stacks of those blocks (memory history on).

Usage: python scripts/probe_fsdp_release.py [preset] [cycles]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MiB = 1 << 20
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _frames(block: dict, keep: int = 6) -> str:
    frames = block.get("frames") or []
    picked = [
        f
        for f in frames
        if "tidal" in f.get("filename", "") or "fsdp" in f.get("filename", "") or "distributed" in f.get("filename", "")
    ][:keep] or frames[:keep]
    return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in picked)


def _report(rank: int, label: str) -> None:
    snap = torch.cuda.memory._snapshot()
    held = []
    for seg in snap["segments"]:
        active = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
        if active:
            held.append((seg["total_size"], seg.get("stream", 0), active))
    free, total = torch.cuda.mem_get_info()
    print(
        f"[rank {rank}] {label}: allocated {torch.cuda.memory_allocated() / MiB:.0f} MiB, reserved "
        f"{torch.cuda.memory_reserved() / MiB:.0f} MiB, driver used {(total - free) / MiB:.0f} MiB; "
        f"{len(held)} segments hold active blocks",
        flush=True,
    )
    for size, stream, active in sorted(held, key=lambda h: -h[0])[:8]:
        act = sum(b["size"] for b in active)
        print(
            f"[rank {rank}]   segment {size / MiB:.1f} MiB (stream {stream}): {len(active)} active blocks, "
            f"{act / MiB:.2f} MiB; largest {max(b['size'] for b in active) / MiB:.2f} MiB from "
            f"{_frames(max(active, key=lambda b: b['size']))}",
            flush=True,
        )


def _state(model, opt) -> list[torch.Tensor]:
    """The role's local tensors: parameter shards and optimizer state."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    for st in opt.state.values():
        local += [v.to_local() if hasattr(v, "to_local") else v for v in st.values() if torch.is_tensor(v)]
    return [t for t in local if t.is_cuda]


def _run(rank: int, world: int, store: str, preset: str, cycles: int) -> None:
    torch.cuda.set_device(rank)
    os.environ.update(NO_MULTICAST)  # kept off on the lent machines (shared NVLink fabric)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, init_method=f"file://{store}", device_id=torch.device("cuda", rank)
    )
    import tidal
    from tidal_recipes.cli.models import build_model
    from tidal.distributed import shard_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.cuda.memory._record_memory_history(max_entries=200000)
    device = f"cuda:{rank}"
    model, _ = build_model(preset, device=device, dtype=torch.float32, seed=0)
    shard_model(
        model,
        zero_stage=3,
        layers=model.model.layers,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (1, 128), device=device)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del ids
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _report(rank, "after one train step")
    # The third variant keeps a device clone of every state tensor alive beside the role (as
    # bench_checkpoint once did for its bit-exact check): the clones' segments have free space
    # that a reload fills with role storages, which no later offload can hand to the driver.
    for coalesce, neighbours in ((True, False), (False, False), (True, True)):
        kept = [t.detach().clone() for t in _state(model, opt)] if neighbours else []
        ts = tidal.Timeshare(
            device, config=tidal.TimeshareConfig(transfer=tidal.TransferConfig(coalesce_allocations=coalesce))
        )
        ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
        label = f"coalesce={coalesce} neighbours={len(kept)}"
        for cycle in range(cycles):
            dist.barrier()
            out = ts.offload("actor")
            _report(
                rank,
                f"{label} cycle {cycle} after offload (unreleased "
                f"{out.unreleased_bytes / MiB:.0f} MiB of {out.bytes_out / MiB:.0f} MiB out)",
            )
            dist.barrier()
            ts.load("actor")
            _report(rank, f"{label} cycle {cycle} after reload")
        ts.close()
        del kept
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen2-0.5b"
    cycles = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    os.environ.update(NO_MULTICAST)
    world = min(2, torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_run, args=(world, os.path.join(d, "store"), preset, cycles), nprocs=world)


if __name__ == "__main__":
    main()
