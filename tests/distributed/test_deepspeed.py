"""DeepSpeed engines as timeshare roles, on CPU (DeepSpeed's CPU accelerator, gloo, 2 processes).

Each test spawns its processes (tests/distributed/multiproc.py): DeepSpeed picks its accelerator
once per process at import and keeps a global communication backend, so it never runs in the
pytest process itself. Skipped cleanly when deepspeed is not installed.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import tidal
from tests.distributed.multiproc import run_distributed
from tests.helpers import held_bytes, is_out

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install 'tidal[deepspeed]')"
)

VOCAB = 63  # odd, so ZeRO's flat buffers need alignment padding (which must move too)


# ---- helpers, imported by the spawned processes (and by test_deepspeed_gpu.py) --------------


def import_deepspeed(rank: int, world_size: int, *, cpu: bool):
    """Import deepspeed in a worker whose process group run_distributed already set up."""
    if cpu:
        os.environ["DS_ACCELERATOR"] = "cpu"  # chosen once, at import
    # DeepSpeed's init_distributed wants the launcher's variables even when torch.distributed
    # is initialised already (it then adopts that group).
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"
    )
    import logging

    import deepspeed

    if cpu:
        # On its CPU accelerator DeepSpeed JIT-compiles a shared-memory all-reduce op at its
        # first init (a minute of g++, and g++ must exist); gloo's own collectives suffice here.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return deepspeed


class Net(nn.Module):
    """LM-shaped: embedding, two MLP blocks, head."""

    def __init__(self, hidden: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)) for _ in range(2)
        )
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = x + blk(x)
        return self.head(x)


def ds_config(stage: int, *, gas: int = 1, fp32_accum: bool = False, bucket: int = 2000) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
        # Small buckets and threshold, so the tiny model has several buckets and ZeRO-3 both
        # persistent and partitioned params.
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            "stage3_param_persistence_threshold": 200,
            "stage3_prefetch_bucket_size": bucket,
        },
    }
    if fp32_accum:  # at stage 1: DeepSpeed's BF16_Optimizer (fp32 gradient buffers) instead of ZeRO's
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    return cfg


def make_engine(deepspeed, stage: int, *, device: str = "cpu", seed: int = 0, groups: int = 1, hidden: int = 24, **kw):
    torch.manual_seed(seed)
    model = Net(hidden).to(device)
    params = list(model.parameters())
    if groups == 2:  # decay / no decay, as real trainers do: two groups, two inner steps
        param_groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": 0.01},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
    else:
        param_groups = [{"params": params}]
    opt = torch.optim.AdamW(param_groups, lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, **kw))
    return engine


def batch(step: int, rank: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (4, 9), generator=g).to(device)


def micro_step(engine, step: int, rank: int) -> float:
    ids = batch(step, rank, engine.device)
    logits = engine(ids[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()  # a no-op for the optimizer until the accumulation boundary
    return loss.item()


def named_state(engine) -> dict[str, torch.Tensor]:
    """The engine's state tensors by DeepSpeed's own attribute names (live tensors, not
    copies): an account independent of the adapter's walk."""
    opt = engine.optimizer
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    out: dict[str, torch.Tensor] = {}
    for n, p in engine.module.named_parameters():
        out[f"param:{n}"] = p
        if getattr(p, "ds_tensor", None) is not None:
            out[f"ds_tensor:{n}"] = p.ds_tensor
    for attr in (
        "bit16_groups_flat",
        "single_partition_of_fp32_groups",
        "fp32_partitioned_groups_flat",
        "fp32_groups",
        "fp32_groups_flat_partition",
        "fp32_groups_gradients_flat",
    ):
        for i, t in enumerate(getattr(opt, attr, None) or []):
            if isinstance(t, torch.Tensor):
                out[f"{attr}[{i}]"] = t
            elif isinstance(t, (list, tuple)):
                for j, x in enumerate(t):
                    out[f"{attr}[{i}][{j}]"] = x
    for attr in ("lp_param_buffer", "grad_partitions_flat_buffer"):
        if isinstance(getattr(opt, attr, None), torch.Tensor):
            out[attr] = getattr(opt, attr)
    for dtype, bucket in getattr(opt, "ipg_buckets", {}).items():
        if isinstance(getattr(bucket, "buffer", None), torch.Tensor):
            out[f"ipg_bucket[{dtype}]"] = bucket.buffer
    for i, (p, st) in enumerate(inner.state.items()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and k != "step":
                out[f"optim[{i}].{k}"] = v
    return out


def snapshot_values(state: dict[str, torch.Tensor], *, scratch: bool = True) -> dict[str, torch.Tensor]:
    """Copies of the values; ``scratch=False`` leaves out ZeRO-3's reduce bucket, whose
    contents are dead between steps (DeepSpeed's own offload drops them)."""
    return {k: v.detach().clone() for k, v in state.items() if scratch or not k.startswith("ipg_bucket")}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN patterns included: an uninitialised bucket may hold some)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(_bits(a), _bits(b))


def without_zero3_padding(engine, snap: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero the elements of ZeRO-3's flat partitions that pad a rank's share of a parameter:
    DeepSpeed leaves them uninitialised, so two identical runs differ there."""
    opt = engine.optimizer
    lp = getattr(opt, "lp_param_buffer", None)
    if lp is None:
        return snap
    rank = torch.distributed.get_rank()
    pad = torch.zeros(lp.numel(), dtype=torch.bool)
    for n, p in engine.module.named_parameters():
        ds = p.ds_tensor
        valid = max(0, min(ds.numel(), p.ds_numel - rank * ds.numel()))
        off = ds.storage_offset() - lp.storage_offset()
        pad[off + valid : off + ds.numel()] = True
        if f"ds_tensor:{n}" in snap:
            snap[f"ds_tensor:{n}"].view(-1)[valid:] = 0
    for k, t in snap.items():
        if t.numel() == lp.numel() and not k.startswith("ds_tensor:"):
            t.view(-1)[pad.to(t.device)] = 0
    return snap


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def live_storages() -> dict[int, torch.UntypedStorage]:
    """Every storage of a live tensor object the garbage collector knows, by key."""
    out = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type != "meta":  # type(): no lazy attribute lookups
            st = obj.untyped_storage()
            out[st._cdata] = st
    return out


CASES = [  # (label, stage, extra engine kwargs)
    ("stage0", 0, {}),
    ("stage1", 1, {}),
    ("stage1-bf16-optimizer", 1, {"fp32_accum": True}),
    ("stage2", 2, {}),
    ("stage3", 3, {}),
]


# ---- workers ---------------------------------------------------------------------------------


def _roundtrip_worker(rank: int, world_size: int) -> None:
    deepspeed = import_deepspeed(rank, world_size, cpu=True)
    from tidal.distributed import add_deepspeed_role, deepspeed_state_bytes

    for label, stage, kw in CASES:
        gc.collect()
        before_engine = set(live_storages())
        engine = make_engine(deepspeed, stage, **kw)
        assert engine.zero_optimization_stage() == stage
        for step in range(2):
            micro_step(engine, step, rank)
        gc.collect()
        # Storages the engine made (module, masters, moments, DeepSpeed's buffers): every one
        # must be emptied by the offload, whatever attribute holds it.
        owned = {k: st for k, st in live_storages().items() if k not in before_engine and st.nbytes() >= 16}
        state = named_state(engine)
        want = snapshot_values(state)
        with tidal.Timeshare("cpu") as ts:
            add_deepspeed_role(ts, "actor", engine)
            assert ts.role_bytes("actor") == deepspeed_state_bytes(engine) > 0
            assert ts.role_bytes("actor") >= sum(st.nbytes() for st in owned.values()), label
            ts.offload("actor")
            assert deepspeed_state_bytes(engine) == 0, label
            left = {k: held_bytes(st) for k, st in owned.items() if held_bytes(st) > 0}
            assert not left, f"{label}: {len(left)} storages made by the engine still hold memory: {left}"
            for k, t in state.items():
                assert is_out(t), f"{label}: {k} still holds memory"
            with pytest.raises(RuntimeError, match="offloaded"):
                micro_step(engine, 9, rank)
            ts.load("actor")
            after = named_state(engine)
            for k, t in state.items():
                assert after[k] is t, f"{label}: {k} is a new tensor object"
                if k in want:
                    assert same_bits(t, want[k]), f"{label}: {k} changed across offload/reload"
            assert torch.isfinite(torch.tensor(micro_step(engine, 2, rank)))
        del engine, state, want, owned


def _run(
    deepspeed,
    rank: int,
    stage: int,
    *,
    timeshare: bool,
    residency: str = "role",
    gas: int = 1,
    groups: int = 1,
    steps: int = 4,
    device: str = "cpu",
    **kw,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    from tidal.distributed import add_deepspeed_role

    engine = make_engine(deepspeed, stage, gas=gas, groups=groups, device=device, **kw)
    torch.manual_seed(7)
    ref = nn.Linear(24, VOCAB).to(device)  # a second role, so every switch moves the engine out and back
    ts = None
    if timeshare:
        ts = tidal.Timeshare(device)
        add_deepspeed_role(ts, "actor", engine, optimizer_residency=residency)
        ts.add_role("reference", model=ref)
    losses = []
    for step in range(steps * gas):
        if ts is not None:
            with ts.use("reference"):  # the engine goes out, even between micro-batches
                ref(torch.zeros(1, 24, device=device))
        with ts.use("actor") if ts is not None else _nullctx():
            losses.append(micro_step(engine, step, rank))
    if ts is not None:
        ts.offload_all()  # end with everything on the host: close() must bring it back intact
        ts.close()
    # The bucket holds uninitialised memory, and so does ZeRO-3's partition padding.
    out = without_zero3_padding(engine, snapshot_values(named_state(engine), scratch=False))
    return losses, {k: v.cpu() for k, v in out.items()}


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


EQUIVALENCE_VARIANTS = [  # (stage, kwargs of _run)
    (1, {}),
    (2, {}),
    (3, {}),
    (0, {}),
    (2, {"gas": 2}),  # offloaded between micro-batches: gradient buckets in flight move too
    (3, {"gas": 2}),
    (1, {"residency": "step", "groups": 2}),  # moments on the host except in each group's step
    (3, {"residency": "step"}),
    (1, {"fp32_accum": True, "gas": 2}),
]


def check_equivalence(deepspeed, rank: int, variants=EQUIVALENCE_VARIANTS, **run_kw) -> None:
    for stage, kw in variants:
        kw = {**kw, **run_kw}
        plain_losses, plain_state = _run(deepspeed, rank, stage, timeshare=False, **kw)
        ts_losses, ts_state = _run(deepspeed, rank, stage, timeshare=True, **kw)
        differ = [k for k in plain_state if not same_bits(plain_state[k], ts_state[k])]
        if plain_losses != ts_losses or differ:
            # Tell a tidal bug from a nondeterministic kernel: does the plain run repeat itself?
            again_losses, again_state = _run(deepspeed, rank, stage, timeshare=False, **kw)
            repeats = again_losses == plain_losses and all(same_bits(v, again_state[k]) for k, v in plain_state.items())
            raise AssertionError(
                f"stage {stage} {kw}: losses {ts_losses} with the timeshare vs {plain_losses}; differing: "
                f"{differ[:5]}; the plain run {'repeats itself bit for bit' if repeats else 'is nondeterministic itself'}"
            )
        assert any(".exp_avg_sq" in k for k in plain_state)


def _equivalence_worker(rank: int, world_size: int) -> None:
    check_equivalence(import_deepspeed(rank, world_size, cpu=True), rank)


def _offload_api_worker(rank: int, world_size: int) -> None:
    deepspeed = import_deepspeed(rank, world_size, cpu=True)
    from tidal.distributed import (
        DeepSpeedOffload,
        add_deepspeed_role,
        deepspeed_state_bytes,
    )

    # via="tidal": every stage, bit-exact, refuses double moves and a second manager.
    engine = make_engine(deepspeed, 3)
    micro_step(engine, 0, rank)
    state = named_state(engine)
    want = snapshot_values(state)
    off = DeepSpeedOffload(engine)
    total = off.state_bytes()
    with pytest.raises(ValueError, match="already managed"):
        DeepSpeedOffload(engine, via="tidal")
    out = off.offload()
    assert out.bytes_out == total and deepspeed_state_bytes(engine) == 0 and off.offloaded
    with pytest.raises(RuntimeError, match="offloaded already"):
        off.offload()
    back = off.reload()
    assert back.bytes_in == out.bytes_out
    assert all(same_bits(state[k], v) for k, v in want.items())
    off.close()
    ts = tidal.Timeshare("cpu")  # close() released the engine: it can join a timeshare now
    add_deepspeed_role(ts, "actor", engine)
    with pytest.raises(ValueError, match="already managed"):
        add_deepspeed_role(ts, "again", engine)
    ts.close()

    # via="deepspeed": what DeepSpeed supports, refused with the reason otherwise.
    with pytest.raises(ValueError, match="ZeRO stages 1-3"):
        DeepSpeedOffload(make_engine(deepspeed, 0), via="deepspeed")
    with pytest.raises(ValueError, match="FusedAdam"):
        DeepSpeedOffload(make_engine(deepspeed, 3), via="deepspeed")
    with pytest.raises(ValueError, match="ZeRO stages 1-3"):  # stage 1 on DeepSpeed's BF16_Optimizer
        DeepSpeedOffload(make_engine(deepspeed, 1, fp32_accum=True), via="deepspeed")
    for stage in (1, 2):
        engine = make_engine(deepspeed, stage)
        micro_step(engine, 0, rank)
        want = snapshot_values(named_state(engine), scratch=False)
        off = DeepSpeedOffload(engine, via="deepspeed")
        off.offload()
        off.reload()
        got = snapshot_values(named_state(engine), scratch=False)  # DeepSpeed replaces .data: compare by name
        differ = [k for k in want if not same_bits(want[k], got[k])]
        assert not differ, f"stage {stage}: DeepSpeed's offload_states round trip changed {differ[:5]}"
        micro_step(engine, 1, rank)
        off.close()

    # Misuse of add_deepspeed_role.
    engine = make_engine(deepspeed, 1)
    ts = tidal.Timeshare("cpu")
    with pytest.raises(ValueError, match="stream"):
        add_deepspeed_role(ts, "actor", engine, optimizer_residency="stream")
    with pytest.raises(TypeError, match="DeepSpeedEngine"):
        add_deepspeed_role(ts, "actor", engine.module)
    with pytest.raises(TypeError, match="Timeshare"):
        add_deepspeed_role(object(), "actor", engine)
    with pytest.raises(ValueError, match="via must be"):
        DeepSpeedOffload(engine, via="nccl")
    add_deepspeed_role(ts, "actor", engine)  # the failed calls above claimed nothing
    ts.close()


# ---- tests -----------------------------------------------------------------------------------


@needs_deepspeed
@pytest.mark.slow
def test_roundtrip_every_stage_bit_exact_and_complete():
    """ZeRO 0-3 (and DeepSpeed's BF16_Optimizer): offload empties every storage the engine
    made (found independently, from the garbage collector), reload restores each bit and
    tensor identity, and the engine trains on."""
    run_distributed(_roundtrip_worker, world_size=2)


@needs_deepspeed
@pytest.mark.slow
def test_training_with_offload_between_steps_is_identical():
    """Losses and final params, masters and moments are bit-identical with the engine switched
    out before every micro-batch, for each stage, with gradient accumulation and with the
    optimizer state on the host between steps."""
    run_distributed(_equivalence_worker, world_size=2)


@needs_deepspeed
@pytest.mark.slow
def test_deepspeed_offload_both_ways_and_misuse():
    run_distributed(_offload_api_worker, world_size=1)


def test_import_does_not_load_deepspeed():
    code = (
        "import sys, tidal, tidal.distributed as d; assert 'deepspeed' not in sys.modules; "
        "d.add_deepspeed_role; assert 'deepspeed' not in sys.modules, 'resolving the name imported deepspeed'"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_missing_deepspeed_says_how_to_install(monkeypatch):
    from tidal.distributed import DeepSpeedOffload, add_deepspeed_role

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(ImportError, match=r"tidal\[deepspeed\]"):
        add_deepspeed_role(tidal.Timeshare("cpu"), "actor", nn.Linear(2, 2))
    with pytest.raises(ImportError, match=r"tidal\[deepspeed\]"):
        DeepSpeedOffload(nn.Linear(2, 2))
