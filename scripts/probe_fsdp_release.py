"""Diagnostic: what keeps device memory after offloading an FSDP2-sharded role?

History: benchmarks/bench_checkpoint.py saw every offload after the first leave ~1.2 GiB per
rank with the caching allocator (2x H200, Qwen2-0.5B, stage 3): two cuBLAS workspaces inside
role segments, fixed by ``DeviceOps.release_to_driver``. After that fix it left 73 MiB per
rank on every warm offload (0 on the first), and nothing once the benchmark kept its bit-exact
reference on the host instead of as device clones. This probe says why, in one run.

The suspected mechanism: tensors that are not the role's (the old benchmark's clones of the
state) were allocated right after the training step, into the free space of segments the step
left in the cache, so segments hold a clone and free space at once. The first offload gives
back every segment holding only the role. A reload asks the allocator for each storage, and the
allocator serves a request from the smallest free block that fits, so storages land in the free
space beside the clones before they split the one block that ``ResizeBackend.reserve`` made for
them. From then on every offload frees those storages into segments the clones keep: their bytes
stay with the allocator (``unreleased_bytes``).

Each variant runs in fresh spawned ranks (2 GPUs, NCCL), built the way the benchmark builds
its role (Qwen2-shape, FSDP2 stage 3, one AdamW step, grads dropped), then ``cycles`` offload /
reload cycles through a ``Timeshare``:

- ``host-reference``: no device tensor beside the role (bench_checkpoint since 2026-11-24);
- ``clones-after-step``: a device clone of every state tensor made right after the step, before
  any ``empty_cache`` (bench_checkpoint before 2026-11-24, which left the 73 MiB);
- ``clones-after-empty-cache``: the same clones made after an ``empty_cache`` (the earlier probe's
  variant, which did not reproduce it).

After every reload it reads the allocator's segments and counts the role's bytes that lie in a
segment also holding something else: the bytes the next offload cannot give back (predicted).
After every offload it prints tidal's ``unreleased_bytes`` (measured) and the segments still
held, with their active bytes by owner (clone / other) and free bytes; other blocks are named by
their allocation stack (memory history on, Python frames). The summary compares measured and
predicted per warm offload: if they agree and the host-reference variant leaves nothing, the
holdback is the benchmark's clones sharing segments with the reloaded role, not tidal's release.

Usage: python scripts/probe_fsdp_release.py [preset] [cycles] [variant ...] [--json PATH] [--device cpu]
(default: qwen2-0.5b, 4 cycles, all three variants, 2 GPUs). ``--json``: every reading.
``--device cpu``: the same code on 2 CPU processes over gloo, without allocator readings (checks
the probe runs, measures nothing).
"""

from __future__ import annotations

import bisect
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MiB = 1 << 20
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
VARIANTS = ("host-reference", "clones-after-step", "clones-after-empty-cache")


def _close(measured: int, predicted: int) -> bool:
    """Measured and predicted holdback agree: within 4 MiB or 10% (the driver counts in 2 MiB
    pages; a role-only segment's cached free tail goes back with it and offsets the count)."""
    return abs(measured - predicted) <= max(4 * MiB, predicted // 10)


def _frames(block: dict, keep: int = 4) -> str:
    frames = block.get("frames") or []
    mark = ("tidal", "distributed", "transformers", "probe_fsdp_release")
    picked = [f for f in frames if any(m in f.get("filename", "") for m in mark)][:keep] or frames[:keep]
    return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in picked) or "(no stack)"


def attribute(snapshot: dict, owners: dict[str, list[tuple[int, int]]]) -> list[dict]:
    """The allocator segments that hold active blocks, each with its size, free bytes, active
    bytes by owner (``owners``: name -> [(address, bytes)]; a block belongs to the owner whose
    range holds its start, else to ``"other"``) and the largest block of ``"other"``.

    ``snapshot`` is ``torch.cuda.memory._snapshot()``'s (its ``segments`` and their
    ``blocks``, each with ``address``, ``size``, ``state``)."""
    spans = sorted((ptr, ptr + n, name) for name, ranges in owners.items() for ptr, n in ranges if n > 0)
    starts = [s[0] for s in spans]

    def owner(addr: int) -> str:
        i = bisect.bisect_right(starts, addr) - 1
        return spans[i][2] if i >= 0 and addr < spans[i][1] else "other"

    held = []
    for seg in snapshot["segments"]:
        active = [b for b in seg["blocks"] if b["state"] != "inactive"]
        if not active:
            continue
        by: dict[str, int] = {}
        largest_other = None
        for b in active:
            who = owner(b["address"])
            by[who] = by.get(who, 0) + b["size"]
            if who == "other" and (largest_other is None or b["size"] > largest_other["size"]):
                largest_other = b
        held.append(
            {
                "size": seg["total_size"],
                "free": seg["total_size"] - sum(b["size"] for b in active),
                "by": by,
                "other_stack": _frames(largest_other) if largest_other else None,
                "other_largest": largest_other["size"] if largest_other else 0,
            }
        )
    return held


def shared_bytes(held: list[dict], name: str) -> int:
    """``name``'s active bytes in segments that also hold another owner's blocks: what freeing
    ``name``'s blocks cannot give back to the driver."""
    return sum(s["by"].get(name, 0) for s in held if name in s["by"] and len(s["by"]) > 1)


def _ranges(tensors) -> list[tuple[int, int]]:
    out = {}
    for t in tensors:
        st = t.untyped_storage()
        if t.is_cuda and st.nbytes():
            out[st.data_ptr()] = st.nbytes()
    return list(out.items())


def _state(model, opt) -> list[torch.Tensor]:
    """The role's local tensors: parameter shards and optimizer state (as bench_checkpoint's
    reference saw them)."""
    from tests.distributed.test_fsdp import state_tensors

    return list(state_tensors(model, opt).values())


def _snapshot(cuda: bool) -> dict:
    return torch.cuda.memory._snapshot() if cuda else {"segments": []}


def _run(rank: int, world: int, store: str, preset: str, cycles: int, variant: str, out_path: str, cuda: bool) -> None:
    if cuda:
        torch.cuda.set_device(rank)
        os.environ.update(NO_MULTICAST)  # kept off on the lent machines (shared NVLink fabric)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, init_method=f"file://{store}", device_id=torch.device("cuda", rank)
        )
    else:  # --device cpu: the same code over gloo, without allocator readings (a dry run)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    import tidal
    from tidal_recipes.cli.models import build_model
    from tidal.distributed import shard_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # Python frames only: C++ stacks make every snapshot slow to symbolise.
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=20000, stacks="python")
    device = f"cuda:{rank}" if cuda else "cpu"
    # As bench_checkpoint builds its role.
    model, _ = build_model(preset, device=device, dtype=torch.float32, seed=0)
    shard_model(
        model,
        zero_stage=3,
        layers=model.model.layers,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, model.config.vocab_size, (1, 128), generator=g).to(device)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del ids
    kept: list[torch.Tensor] = []
    if variant == "clones-after-step":
        kept = [t.clone() for t in _state(model, opt)]  # exactly where the old benchmark made them
    elif variant == "clones-after-empty-cache":
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        kept = [t.clone() for t in _state(model, opt)]
    clones = _ranges(kept)
    ts = tidal.Timeshare(device)
    ts.add_role("actor", model=model, optimizer=opt, optimizer_residency="role")
    readings = []
    predicted = None
    for cycle in range(cycles):
        dist.barrier()
        out = ts.offload("actor")
        held = attribute(_snapshot(cuda), {"clone": clones})
        free, total = torch.cuda.mem_get_info() if cuda else (0, 0)
        r = {
            "cycle": cycle,
            "unreleased": out.unreleased_bytes,
            "predicted": predicted,
            "bytes_out": out.bytes_out,
            "driver_used": total - free,
            "reserved": torch.cuda.memory_reserved() if cuda else 0,
            "held_segments": len(held),
            "held_bytes": sum(s["size"] for s in held),
            "held_free": sum(s["free"] for s in held),
            "held_by": {k: sum(s["by"].get(k, 0) for s in held) for k in ("clone", "other")},
        }
        print(
            f"[{variant} rank {rank}] cycle {cycle} offload: unreleased {r['unreleased'] / MiB:.1f} MiB"
            f"{'' if predicted is None else f' (predicted {predicted / MiB:.1f})'}; driver used "
            f"{r['driver_used'] / MiB:.0f} MiB, reserved {r['reserved'] / MiB:.0f} MiB in {len(held)} held segments "
            f"({r['held_bytes'] / MiB:.1f} MiB: clone {r['held_by']['clone'] / MiB:.1f}, other "
            f"{r['held_by']['other'] / MiB:.1f}, free {r['held_free'] / MiB:.1f})",
            flush=True,
        )
        if cycle == 1:  # the first warm offload: the held segments themselves
            for s in sorted(held, key=lambda s: -s["free"])[:6]:
                print(
                    f"[{variant} rank {rank}]   segment {s['size'] / MiB:.1f} MiB: free {s['free'] / MiB:.2f}, "
                    + ", ".join(f"{k} {v / MiB:.2f}" for k, v in sorted(s["by"].items()))
                    + (
                        f"; largest other {s['other_largest'] / MiB:.2f} MiB from {s['other_stack']}"
                        if s["other_stack"]
                        else ""
                    ),
                    flush=True,
                )
        dist.barrier()
        ts.load("actor")
        # The role = every storage the timeshare moves (its live entries: also buffers, which
        # the state tensors above leave out).
        role = [(e.storage.data_ptr(), e.storage.nbytes()) for e in ts._live(ts.role("actor"))]
        held = attribute(_snapshot(cuda), {"role": role, "clone": clones})
        predicted = shared_bytes(held, "role")
        r["reload_role_in_shared"] = predicted
        r["reload_shared_segments"] = sum(1 for s in held if "role" in s["by"] and len(s["by"]) > 1)
        print(
            f"[{variant} rank {rank}] cycle {cycle} reload: {predicted / MiB:.1f} MiB of the role in "
            f"{r['reload_shared_segments']} segments shared with other blocks",
            flush=True,
        )
        readings.append(r)
    ts.close()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, readings)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def summarise(results: dict[str, list[list[dict]]]) -> list[str]:
    """Per variant and rank: measured / predicted MiB per offload, and the conclusion."""
    lines = ["variant                    rank  unreleased MiB per offload (predicted from the reload before)"]
    warm_ok, reproduced, clean = True, False, True
    for variant, ranks in results.items():
        for rank, readings in enumerate(ranks):
            cells = " ".join(
                f"{r['unreleased'] / MiB:.1f}" + ("" if r["predicted"] is None else f" ({r['predicted'] / MiB:.1f})")
                for r in readings
            )
            lines.append(f"{variant:<26} {rank:>4}  {cells}")
            for r in readings[1:]:
                warm_ok &= _close(r["unreleased"], r["predicted"])
                if variant == "clones-after-step" and r["unreleased"] > 4 * MiB:
                    reproduced = True
                if variant == "host-reference" and r["unreleased"] > 4 * MiB:
                    clean = False
    lines.append(
        f"holdback with the old benchmark's clones reproduced: {'yes' if reproduced else 'NO'}; "
        f"host-reference variant gives everything back: {'yes' if clean else 'NO'}; every warm offload's "
        f"unreleased bytes = the role's bytes the reload before put in segments shared with other blocks "
        f"(within 4 MiB or 10%): {'yes' if warm_ok else 'NO'}"
    )
    if reproduced and clean and warm_ok:
        lines.append(
            "=> explained: the holdback is the role's storages reloaded into the free space of segments that "
            "tensors outside the role keep (the benchmark's device clones), not memory tidal fails to release"
        )
    return lines


def main(argv: list[str]) -> int:
    json_path, cuda = None, True
    if "--json" in argv:
        i = argv.index("--json")
        json_path = argv[i + 1]
        argv = argv[:i] + argv[i + 2 :]
    if "--device" in argv:
        i = argv.index("--device")
        cuda = argv[i + 1] == "cuda"
        argv = argv[:i] + argv[i + 2 :]
    preset = argv[0] if argv else "qwen2-0.5b"
    cycles = int(argv[1]) if len(argv) > 1 else 4
    variants = argv[2:] or list(VARIANTS)
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variant(s) {sorted(unknown)}; choose from {VARIANTS}")
    if cycles < 2:
        raise SystemExit("cycles must be >= 2: the holdback shows from the second offload on")
    if cuda and torch.cuda.device_count() < 2:
        print(f"probe_fsdp_release: needs 2 GPUs, found {torch.cuda.device_count()}")
        return 3
    if cuda:
        os.environ.update(NO_MULTICAST)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for variant in variants:  # fresh ranks each: the allocator's history is the point
            path = os.path.join(d, f"{variant}.json")
            mp.spawn(
                _run,
                args=(2, os.path.join(d, f"store-{variant}"), preset, cycles, variant, path, cuda),
                nprocs=2,
                join=True,
            )
            with open(path) as f:
                results[variant] = json.load(f)
    print("\n".join(summarise(results)))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
