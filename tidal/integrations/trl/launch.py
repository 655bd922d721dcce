"""The launches TidalGRPOTrainer and TidalRLOOTrainer run under, read from TRL's accelerator
before it wraps any model: one process; several under ``torchrun`` or ``accelerate launch``
with DDP (each rank's roles take turns on its own device, moving their whole state) or with
FSDP2 (each rank's roles take turns, moving their shards). What else is refused, before any
work, names the launch that works."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor

from tidal.distributed.fsdp import gathered, gathered_bytes, hooks_off_while_gathered
from tidal.integrations.seams import instead, module_functions_instead
from tidal.memory import phase_need_bytes
from tidal.state.collect import unique_storage_bytes

__all__ = [
    "Launch",
    "check_launch",
    "gathered_for_generation",
    "gather_mode",
    "prepare_fsdp_per_block",
    "reference_sharded_per_block",
    "runs_collectives",
    "use_bucket_views",
]

Launch = Literal["single", "ddp", "fsdp2"]

# accelerate's distributed types that wrap the policy in DistributedDataParallel.
_DDP_TYPES = frozenset(
    {"MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU"}
)


def check_launch(accelerator: Any, who: str) -> Launch:
    """The launch ``accelerator`` stands for. ``ValueError`` for one tidal cannot work with:
    DeepSpeed through accelerate (its engine keeps its own copies of the state), FSDP1,
    FSDP2's CPU offload, and multi-process types other than DDP's and FSDP's."""
    state = accelerator.state
    ways = (
        "Launch with torchrun or with accelerate's multi_gpu config (DDP: each rank's roles take turns on its own "
        "GPU), or with an FSDP2 config (fsdp_version: 2, as TRL's fsdp2.yaml)"
    )
    if getattr(state, "deepspeed_plugin", None) is not None:
        raise ValueError(
            f"{who} does not work with DeepSpeed through accelerate: its engine keeps its own copies of the "
            f"state, which tidal cannot move from the trainer. {ways}; or drive a DeepSpeed engine yourself with "
            "tidal.distributed.add_deepspeed_role"
        )
    plugin = getattr(state, "fsdp_plugin", None)
    if plugin is not None:
        if getattr(plugin, "fsdp_version", 1) != 2:
            raise ValueError(
                f"{who} does not work with FSDP1 (fsdp_version: 1): its flat parameters are not the modules' "
                f"own tensors. Set fsdp_version: 2 in the accelerate config (TRL ships fsdp2.yaml)"
            )
        if isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy):
            raise ValueError(
                f"{who} does not work with FSDP2's CPU offload (fsdp_offload_params: true): it keeps every "
                f"shard on the host for good, where tidal moves each role's shards in for its turns. Set "
                f"fsdp_offload_params: false"
            )
        return "fsdp2"
    if accelerator.num_processes <= 1:
        return "single"
    kind = str(getattr(state.distributed_type, "value", state.distributed_type))
    if kind not in _DDP_TYPES:
        raise ValueError(
            f"{who} does not work with accelerate's {kind} launch ({accelerator.num_processes} processes). {ways}"
        )
    return "ddp"


def wraps_in_ddp(accelerator: Any) -> bool:
    """``accelerator.prepare`` will wrap the policy in DistributedDataParallel: a DDP launch, one
    of a single process included (``torchrun --nproc_per_node 1``, or a process whose
    environment names a world of one, as TRL's colocated vLLM sets it)."""
    kind = str(getattr(accelerator.state.distributed_type, "value", accelerator.state.distributed_type))
    return kind in _DDP_TYPES


def use_bucket_views(accelerator: Any) -> None:
    """Make the DistributedDataParallel wrapper that ``accelerator.prepare`` builds keep the
    gradients as views of its buckets (``gradient_as_bucket_view=True``: the same values, one
    copy of the gradients less), so that tidal can free the buckets between steps
    (:class:`tidal.distributed.GradientBuckets`). Called before the trainer prepares the model."""
    from accelerate.utils import DistributedDataParallelKwargs

    handler = getattr(accelerator, "ddp_handler", None)
    if handler is None:
        handler = accelerator.ddp_handler = DistributedDataParallelKwargs()
    handler.gradient_as_bucket_view = True


def runs_collectives(model: torch.nn.Module) -> bool:
    """A forward of ``model`` takes part in collectives (a DDP wrapper syncs its buffers and
    prepares the reducer; an FSDP2 model gathers its units): run again on one rank alone, it
    would meet the other ranks in another collective. The module inside a DDP wrapper runs
    none."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return True
    return any(isinstance(m, FSDPModule) for m in model.modules())


def decodes_in_step(policy: torch.nn.Module) -> bool:
    """A generation by ``policy`` as it is now takes part in collectives, so no rank can run it
    again alone: :func:`runs_collectives`, except an FSDP2 policy held gathered whole
    (:func:`gathered_for_generation`: no parameter a ``DTensor``), whose forwards gather
    nothing and whose ``generate`` runs without transformers' ``synced_gpus``."""
    if not runs_collectives(policy):
        return False
    return isinstance(policy, torch.nn.parallel.DistributedDataParallel) or _still_sharded(policy)


def _still_sharded(model: torch.nn.Module) -> bool:
    """A parameter of ``model`` is a ``DTensor``: not gathered (or sharded along another
    dimension too, tensor or context parallel), so its forwards run collectives."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def prepare_fsdp_per_block(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """TRL's ``prepare_fsdp`` for a model it does not train (the reference), with FSDP2: sharded
    as accelerate shards the policy (``fsdp2_prepare_model``: each transformer block its own
    unit by the plugin's auto-wrap policy, the embedding and the model's tail units of their
    own, then the root), frozen first (``requires_grad=False``: under mixed precision accelerate
    upcasts what trains to fp32, which a reference never does). TRL shards the whole model as
    one unit, so each of its forwards gathers all of it at once: at 32B on 4 GPUs, 64 GB in bf16
    beside the shards. With the plugin's ``cpu_ram_efficient_loading`` only rank 0's weights
    count: accelerate sends each rank its shards from them, as it does the policy's (TRL's own
    sharding keeps what each rank loaded, which that launch leaves empty on the others). The
    values a forward computes do not change. FSDP1 goes to TRL's own."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from trl.models import utils as trl_models

    plugin = accelerator.state.fsdp_plugin
    if isinstance(model, FSDPModule) or plugin.fsdp_version != 2:
        return trl_models.prepare_fsdp(model, accelerator)
    model.requires_grad_(False)
    model = fsdp2_prepare_model(accelerator, model)
    model.eval()
    return model


@contextlib.contextmanager
def reference_sharded_per_block(trainer_cls: type) -> Iterator[None]:
    """While TRL's trainer is built: its ``prepare_fsdp`` (which shards the reference) is
    :func:`prepare_fsdp_per_block`, in the modules that define ``trainer_cls``'s bases."""
    with module_functions_instead(trainer_cls, "prepare_fsdp", prepare_fsdp_per_block):
        yield


GatherMode = Literal["per-unit", "lending", "whole"]
_MODES: tuple[GatherMode, ...] = ("per-unit", "lending", "whole")  # in order of what they need


def gather_mode(need_bytes: int, free_bytes: int, lendable_bytes: int, device: torch.device) -> GatherMode:
    """How every rank gathers the policy for generation, each passing its own readings:
    ``"whole"`` where every rank has ``need_bytes`` free, else ``"lending"`` where every rank
    has them once its shards (``lendable_bytes``) are out on the host, else ``"per-unit"``. One
    all-reduce, so that every rank decides alike (a gather that runs out of memory on one rank
    leaves the others waiting in it)."""
    own = 2 if free_bytes >= need_bytes else (1 if free_bytes + lendable_bytes >= need_bytes else 0)
    mode = torch.tensor([own], dtype=torch.int32, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(mode, op=dist.ReduceOp.MIN)
    return _MODES[int(mode.item())]


@contextlib.contextmanager
def gathered_for_generation(policy: torch.nn.Module, timeshare: Any, role: str = "policy") -> Iterator[int]:
    """An FSDP2 policy gathered once for the block (:func:`tidal.distributed.gathered`: its
    forwards, one per generated token, then run no collective), where every rank has the room
    for a full copy (+10%, 256 MiB) beside what the generation's turn left on its device; where
    that room is there only without the policy's own shards, each unit's shards go to the host
    as soon as the unit is gathered (``timeshare.lending(role)``: nothing reads them until the
    reshard) and come back after it; else nothing (each forward gathers per unit, as TRL
    alone). The room is read before the gather and decided by all ranks alike (one
    all-reduce). ``timeshare``: the :class:`~tidal.Timeshare` whose ``role`` (in use) the
    policy is. Memory cost: a full copy of the policy's parameters for the block, less its
    shards where they are lent; lent, a copy of the shards out and back (host memory: the
    role's own host copy). Yields the device bytes the gather added (0 where it gathers per
    unit).

    Gathered whole (no parameter still a ``DTensor``: no tensor or context parallel
    dimension), each token's forward runs no collective and no FSDP2 hook
    (:func:`~tidal.distributed.fsdp.hooks_off_while_gathered`, where no unit casts), and
    ``policy.generate`` decodes
    without transformers' ``synced_gpus`` (which it turns on for any sharded model: an
    all-reduce and a host read every token, so that ranks whose forwards gather per unit stay
    in step): each rank decodes at its own pace, and one that finishes first waits for the
    others in the next phase's first collective. The values are the same."""
    ops = timeshare.ops
    whole = gathered_bytes(policy)
    need = phase_need_bytes(whole)
    free = ops.driver_free_bytes()[0] + ops.cached_free_bytes() if ops.is_accelerator else need  # the host: room
    shards = unique_storage_bytes(policy.parameters(), ops.device) if ops.is_accelerator else 0
    mode = gather_mode(need, free, shards, ops.device)
    if mode == "per-unit":
        yield 0
        return
    with contextlib.ExitStack() as stack:
        # Entered first, left last: the lent shards come back once the full copy is freed.
        lend = stack.enter_context(timeshare.lending(role)) if mode == "lending" else None
        stack.enter_context(gathered(policy, on_unit=lend.out if lend is not None else None))
        added = whole - (lend.lent_bytes if lend is not None else 0)
        if _still_sharded(policy):
            # Still sharded along another dimension (tensor or context parallel): its forwards
            # run collectives, so the ranks decode in step, with FSDP2's hooks, as TRL alone.
            yield added
            return
        with hooks_off_while_gathered(policy), _unsynced_generate(policy):
            yield added


def _unsynced_generate(policy: torch.nn.Module):
    """``policy.generate`` with ``synced_gpus=False`` unless the caller passes it: an attribute
    of the instance for the block (one the instance had already is put back after)."""
    generate = policy.generate

    def unsynced(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("synced_gpus", False)
        return generate(*args, **kwargs)

    return instead(policy, "generate", unsynced)
