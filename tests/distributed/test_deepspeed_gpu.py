"""DeepSpeed engines as timeshare roles on the GPU (NCCL, one process per GPU; one GPU is
enough, the 2-rank test needs two): bit-exact round trips at ZeRO 0-3, the driver-level memory
an offloaded engine gives back, training identical with offloads between steps, and DeepSpeed's
own offload_states on the same engines for comparison.

Each test spawns its processes (as the CPU tests do): DeepSpeed's accelerator and process
group are per process. Run with deepspeed importable, e.g. ``bash benchmarks/gpu.sh deepspeed``.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import tidal
from tests.distributed.multiproc import run_distributed
from tests.distributed.test_deepspeed import (
    CASES,
    EQUIVALENCE_VARIANTS,
    check_equivalence,
    import_deepspeed,
    make_engine,
    micro_step,
    named_state,
    needs_deepspeed,
    same_bits,
    snapshot_values,
)
from tests.helpers import is_out

pytestmark = [pytest.mark.gpu, needs_deepspeed]

MiB = 1 << 20
HIDDEN = 2048  # two blocks of 2 x (2048 x 8192): 67 M params, about 0.95 GiB of state per engine
BUCKET = 50_000_000  # elements: ZeRO-3's reduce bucket is then 100 MB of bf16


def host_copies(state: dict[str, torch.Tensor], *, scratch: bool = True) -> dict[str, torch.Tensor]:
    """Host copies of the values, made without device temporaries (which would sit in torch's
    cache and skew the driver readings); ``scratch=False`` leaves out ZeRO-3's reduce bucket."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items() if scratch or not k.startswith("ipg_bucket")}


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _settle() -> None:
    gc.collect()  # DeepSpeed's hooks hold engines in reference cycles
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _warm(deepspeed, rank: int, device: str) -> None:
    # What stays for the life of the process is made before any baseline, as an inference
    # engine sharing the GPU would see it: NCCL's communicator, cuBLAS workspaces, the kernels
    # CUDA loads lazily. The same kind of engine is built, trained and dropped once.
    engine = make_engine(deepspeed, 3, device=device, hidden=HIDDEN, bucket=BUCKET)
    for step in range(2):
        micro_step(engine, step, rank)
    del engine
    _settle()


def _roundtrip_worker(rank: int, world_size: int) -> None:
    deepspeed = import_deepspeed(rank, world_size, cpu=False)
    from tidal.distributed import add_deepspeed_role, deepspeed_state_bytes

    device = f"cuda:{rank}"
    _warm(deepspeed, rank, device)
    for label, stage, kw in CASES:
        _settle()
        base_free, base_alloc = _free(), torch.cuda.memory_allocated()
        engine = make_engine(deepspeed, stage, device=device, hidden=HIDDEN, bucket=BUCKET, **kw)
        for step in range(2):
            micro_step(engine, step, rank)
        _settle()
        state = named_state(engine)
        want = host_copies(state)
        _settle()
        with tidal.Timeshare(device) as ts:
            add_deepspeed_role(ts, "actor", engine)
            role = ts.role_bytes("actor")
            assert role == deepspeed_state_bytes(engine) > 500 * MiB // world_size, (label, role)
            loaded_free, loaded_alloc = _free(), torch.cuda.memory_allocated()
            rec = ts.offload("actor")
            out_free, out_alloc = _free(), torch.cuda.memory_allocated()
            # Every byte of the engine's state left the device, and the driver got it back.
            assert out_alloc - base_alloc <= 8 * MiB, (
                f"{label}: {(out_alloc - base_alloc) / MiB:.1f} MiB still allocated"
            )
            assert loaded_alloc - out_alloc >= role, label
            assert out_free - loaded_free >= role - 128 * MiB, (
                f"{label}: the driver got back {(out_free - loaded_free) / MiB:.0f} MiB of {role / MiB:.0f} MiB"
            )
            assert out_free >= base_free - 256 * MiB, (
                f"{label}: driver free {(base_free - out_free) / MiB:.0f} MiB below the never-loaded baseline"
            )
            for k, t in state.items():
                assert is_out(t), f"{label}: {k} still holds device memory"
            with pytest.raises(RuntimeError, match="offloaded"):
                micro_step(engine, 9, rank)
            back = ts.load("actor")
            back_free = _free()
            assert abs(back_free - loaded_free) <= 256 * MiB, (
                f"{label}: driver free after reload differs by {(back_free - loaded_free) / MiB:.0f} MiB"
            )
            after = named_state(engine)
            for k, t in state.items():
                assert after[k] is t, f"{label}: {k} is a new tensor object"
                assert same_bits(t.cpu(), want[k]), f"{label}: {k} changed across offload/reload"
            assert torch.isfinite(torch.tensor(micro_step(engine, 2, rank)))
            print(
                f"[rank {rank}] {label}: {role / MiB:.0f} MiB moved; offload {rec.gbps:.1f} GB/s, reload "
                f"{back.gbps:.1f} GB/s; driver +{(out_free - loaded_free) / MiB:.0f} MiB after offload, "
                f"{(base_free - out_free) / MiB:.0f} MiB short of the never-loaded baseline",
                flush=True,
            )
        del engine, state, want
    _settle()


def _equivalence_worker(rank: int, world_size: int) -> None:
    # Kernels that may pick nondeterministic algorithms (cuBLAS split-K, embedding backward)
    # are asked for deterministic ones, so the plain run repeats itself bit for bit.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts, below
    torch.use_deterministic_algorithms(True, warn_only=True)
    deepspeed = import_deepspeed(rank, world_size, cpu=False)
    check_equivalence(deepspeed, rank, EQUIVALENCE_VARIANTS, device=f"cuda:{rank}", hidden=256, bucket=100_000)


def _via_deepspeed_worker(rank: int, world_size: int) -> None:
    deepspeed = import_deepspeed(rank, world_size, cpu=False)
    from tidal.distributed import DeepSpeedOffload, deepspeed_state_bytes

    device = f"cuda:{rank}"
    _warm(deepspeed, rank, device)
    for stage in (1, 2):
        for via in ("deepspeed", "tidal"):
            _settle()
            engine = make_engine(deepspeed, stage, device=device, hidden=HIDDEN, bucket=BUCKET)
            for step in range(2):
                micro_step(engine, step, rank)
            _settle()
            state_bytes = deepspeed_state_bytes(engine)
            want = host_copies(named_state(engine), scratch=False)
            off = DeepSpeedOffload(engine, via=via)
            _settle()
            before = _free()
            out = off.offload()
            gained = _free() - before
            back = off.reload()
            got = snapshot_values(named_state(engine), scratch=False)  # looked up afresh: DeepSpeed swaps .data
            differ = [k for k in want if not same_bits(got[k].cpu(), want[k])]
            assert not differ, f"stage {stage} via {via}: round trip changed {differ[:5]}"
            assert gained >= state_bytes // 2, f"stage {stage} via {via}: driver got back {gained / MiB:.0f} MiB"
            assert torch.isfinite(torch.tensor(micro_step(engine, 2, rank)))
            print(
                f"[rank {rank}] stage {stage} via {via}: state {state_bytes / MiB:.0f} MiB, driver "
                f"+{gained / MiB:.0f} MiB; offload {out.seconds * 1e3:.1f} ms, reload {back.seconds * 1e3:.1f} ms "
                f"(first cycle: DeepSpeed pins its host buffers here, tidal at construction)",
                flush=True,
            )
            off.close()
            del engine, off
    _settle()
    # ZeRO-3: DeepSpeed's offload_states needs its FusedAdam, a CUDA op built on first use
    # (nvcc needed). Where it builds, the round trip is checked; otherwise the reason is printed.
    try:
        from deepspeed.ops.adam import FusedAdam

        torch.manual_seed(0)
        probe = FusedAdam([torch.nn.Parameter(torch.zeros(4, device=device))])
        del probe
    except Exception as e:  # noqa: BLE001 - any build failure means "not available here"
        print(
            f"[rank {rank}] stage 3 via deepspeed not run: DeepSpeed's FusedAdam did not build: "
            f"{type(e).__name__}: {str(e)[:200]}",
            flush=True,
        )
        return
    from tests.distributed.test_deepspeed import Net, ds_config

    torch.manual_seed(0)
    model = Net(HIDDEN).to(device)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=FusedAdam(model.parameters(), lr=1e-2), config=ds_config(3, bucket=BUCKET)
    )
    for step in range(2):
        micro_step(engine, step, rank)
    want = host_copies(named_state(engine), scratch=False)
    off = DeepSpeedOffload(engine, via="deepspeed")
    off.offload()
    off.reload()
    got = snapshot_values(named_state(engine), scratch=False)
    differ = [k for k in want if not same_bits(got[k].cpu(), want[k])]
    assert not differ, f"stage 3 via deepspeed: round trip changed {differ[:5]}"
    off.close()
    print(f"[rank {rank}] stage 3 via deepspeed (FusedAdam): round trip bit-exact", flush=True)


def test_gpu_roundtrip_bit_exact_and_driver_memory():
    """ZeRO 0-3 on one GPU: the offload empties every state storage, the driver gets the
    memory back (to within 256 MiB of never having loaded the engine), reload is bit-exact."""
    run_distributed(_roundtrip_worker, world_size=1, backend="nccl")


def test_gpu_training_with_offload_between_steps_is_identical():
    run_distributed(_equivalence_worker, world_size=1, backend="nccl")


def test_gpu_deepspeed_offload_states_and_tidal_on_the_same_engines():
    run_distributed(_via_deepspeed_worker, world_size=1, backend="nccl")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_two_ranks_roundtrip_and_training():
    """Each rank moves its own partitions (ZeRO-1/2/3 shard masters and moments over 2 ranks)."""
    run_distributed(_roundtrip_worker, world_size=2, backend="nccl")
    run_distributed(_equivalence_worker, world_size=2, backend="nccl")


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
