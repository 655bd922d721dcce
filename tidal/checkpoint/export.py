"""A consolidated Hugging Face export (safetensors files that ``from_pretrained`` reads) of a
live, possibly sharded or offloaded model, or of a tidal checkpoint offline, written one
tensor at a time: no rank ever holds the whole model, on the device or on the host.

    export_hf(model, "out", timeshare=ts)                   # every rank calls it
    export_hf_from_checkpoint("ckpt", "out", model=meta)    # later, one CPU process

Layout of ``out`` (as ``save_pretrained`` writes it): ``model.safetensors`` when everything
fits in one file, else ``model-00001-of-0000N.safetensors`` ... plus
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``); ``config.json``
and ``generation_config.json`` when the model has a Hugging Face config. Each tensor keeps its
dtype. Tensors are put into files in state-dict order, a file is closed before it would pass
``max_shard_bytes`` (a larger tensor gets a file of its own).

Tied weights (two names, one tensor, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``)
are written once, under the name ``save_pretrained`` keeps: names the model lists in its
``_tied_weights_keys`` are dropped, so transformers (>= 5 included) re-ties them on load and
reports no missing key. Models that transformers loads through a weight conversion (fused MoE
experts) are written in their in-memory layout, which transformers >= 5 loads as it is but
other tools may not; a warning says so.

Atomic: files are written into ``.<out>.export-tmp`` beside ``out`` and renamed to ``out``
once complete, so ``out`` is either absent, the previous export (``overwrite=True``), or the
new one complete. With ``overwrite=True`` the old directory is first renamed to
``.<out>.export-old`` and deleted after the rename; a crash between the two renames leaves the
old export there. Leftovers of killed exports are removed by the next export to ``out``.
"""

from __future__ import annotations

import inspect
import math
import os
import pickle
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tidal.checkpoint import atomic
from tidal.checkpoint.atomic import CheckpointError
from tidal.checkpoint.hf_files import (
    DEFAULT_SHARD_BYTES,
    _check_args,
    _commit,
    _drop_aliases,
    _file_names,
    _plan_files,
    _prepare,
    _save_file,
    _tied_patterns,
    _warn_conversions,
    _write_config,
)
from tidal.state.collect import storage_key
from tidal.state.foreign import moved_out

__all__ = ["export_hf", "export_hf_from_checkpoint"]

T = TypeVar("T")


# ---- live model --------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class _Gloo:
    """gloo groups (and CPU meshes on them) made for one ``export_hf`` call, by the member ranks
    only, and destroyed when it ends: no process group outlives the call, so none is left for
    the interpreter's exit to tear down (where gloo can abort the process)."""

    def __init__(self) -> None:
        self.groups: list = []
        self.meshes: dict = {}

    def group(self, ranks: list[int]):
        kw = {}
        if "sort_ranks" in inspect.signature(dist.new_group).parameters:
            kw["sort_ranks"] = False  # keep the mesh's order (torch >= 2.12)
        elif list(ranks) != sorted(ranks):
            raise ValueError(
                f"this torch ({torch.__version__}) sorts a new group's ranks, and the mesh "
                f"orders them {list(ranks)}; export from a checkpoint instead "
                f"(export_hf_from_checkpoint)"
            )
        group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True, **kw)
        self.groups.append(group)
        return group

    def mesh(self, ranks: list[int]):
        if tuple(ranks) not in self.meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self.meshes[tuple(ranks)] = DeviceMesh.from_group(self.group(ranks), "cpu", mesh=ranks)
        return self.meshes[tuple(ranks)]

    def close(self) -> None:
        self.meshes.clear()
        for group in self.groups:
            dist.destroy_process_group(group)
        self.groups.clear()


def _coordination_group(process_group, gloo: _Gloo):
    """The group the outcome of each step is shared over: gloo, so that it never touches the
    device (an NCCL job's export allocates nothing on the device for its messages)."""
    if not _distributed():
        return None
    if process_group is None:
        return atomic.coordination_group()
    if dist.get_rank(process_group) < 0:
        raise ValueError("this process is not a member of process_group; only its members call export_hf")
    if dist.get_backend(process_group) == "gloo":
        return process_group
    return gloo.group(dist.get_process_group_ranks(process_group))


def _agree(group, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raised on any, raise on every rank (this rank's own
    exception first, else the lowest failing rank's), so none waits in a later collective."""
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 - shared below
        result, error = None, e
    if _distributed():
        try:
            pickle.dumps(error)
            sent = error
        except Exception:  # noqa: BLE001 - an exception that cannot travel: its text does
            sent = RuntimeError(f"{type(error).__name__}: {error}")
        errors: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, sent, group=group)
        error = error or next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return result


def _host_view(plain: torch.Tensor, timeshare: Any, where: str) -> torch.Tensor:
    """``plain`` (its storage offloaded: 0 bytes) read from its host copy, without a reload;
    the same view ``state_dict()`` and ``TrainState`` hand out (``OffloadStore.host_tensor``)."""
    store = getattr(timeshare, "store", None)
    host = store.host_tensor(plain) if store is not None else None
    if host is None:
        raise ValueError(
            f"{where}: its storage has no memory and no timeshare holds it"
            + ("" if store is not None else " (no timeshare= was given)")
            + "; pass the Timeshare that offloaded this role as export_hf(..., timeshare=ts), "
            "or make the role resident first"
        )
    return host


def _local_source(t: torch.Tensor, timeshare: Any, where: str) -> torch.Tensor:
    """The tensor holding ``t``'s bytes (its local shard for a ``DTensor``): itself, or
    (offloaded) a view of its host copy. No collective: errors here are agreed on first."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if local.device.type == "meta":
        raise ValueError(f"{where} is on the meta device: it has no values to export")
    if moved_out(local):
        local = _host_view(local, timeshare, where)
    if (
        isinstance(t, DTensor)
        and local.device.type == "cpu"
        and t.device_mesh.device_type != "cpu"
        and t.device_mesh.ndim != 1
    ):
        raise ValueError(
            f"{where}: its shards are on the host on a {t.device_mesh.ndim}-D mesh; export_hf "
            f"gathers host shards on 1-D meshes only. Make the role resident first, or save a "
            f"checkpoint and use export_hf_from_checkpoint"
        )
    return local


def _gatherable(t: torch.Tensor, local: torch.Tensor, gloo: _Gloo) -> torch.Tensor:
    """What to gather: ``t`` itself, or a ``DTensor`` over ``local``. Shards on the host whose
    mesh is not (an offloaded role, or FSDP2's CPU offload) go on a CPU mesh over the same
    ranks and are gathered over gloo: no device memory. Collective (the first time for a mesh)."""
    if not isinstance(t, DTensor):
        return local
    mesh = t.device_mesh
    if local.device.type != "cpu" or mesh.device_type == "cpu":
        # Built directly: DTensor.from_local would move a host view to the mesh's device.
        return t if local is t._local_tensor else DTensor(local, t._spec, requires_grad=False)
    return DTensor.from_local(
        local, gloo.mesh(mesh.mesh.flatten().tolist()), t.placements, shape=t.shape, stride=t.stride(), run_check=False
    )


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host as a tensor with a storage of its own (safetensors refuses tensors
    sharing one, e.g. two views of the timeshare's host arena); copies only if needed."""
    if t.device.type != "cpu":
        t = t.to("cpu")  # a fresh host tensor; allocates nothing on the device
    exclusive = (
        t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )
    return t if exclusive else t.contiguous().clone()


def _gather_and_write(
    named: list[tuple[str, torch.Tensor]], path: Path | None, save_file: Callable, weight_map: dict[str, str]
) -> None:
    """Gather each tensor in turn (a collective for a ``DTensor``: every rank calls this); the
    writer (``path`` given) keeps a host copy and writes the file at the end."""
    shard: dict[str, torch.Tensor] = {}
    while named:
        name, t = named.pop(0)  # dropped here, so an offloaded view is not kept past its use
        with torch.no_grad():  # a copy to write, not part of any graph
            full = t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()
        if path is not None:
            shard[name] = _owned(full)
        del t, full  # the gathered device copy goes before the next one is made
    if path is not None:
        save_file(shard, str(path), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, path.name))


def export_hf(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    config: bool = True,
    timeshare: Any = None,
    process_group=None,
    overwrite: bool = False,
) -> Path:
    """Write ``model``'s state dict as a Hugging Face safetensors directory ``out_dir``; return it.

    ``model``: a plain module, or one sharded by :func:`tidal.distributed.shard_model` (``DTensor``
    parameters, CPU/gloo or CUDA/NCCL). With a process group every rank of ``process_group``
    (default: all) calls it; every rank takes part in each gather, only its rank 0 writes, and
    all return once the directory is complete (or all raise the same error).

    Args:
        max_shard_bytes: bytes per safetensors file (a larger tensor gets a file of its own).
        config: also write ``config.json`` (and ``generation_config.json``) if the model has a
            Hugging Face ``config``.
        timeshare: the :class:`tidal.Timeshare` holding the model's role, if any. An offloaded
            role is read from its host copies, with no reload and no device memory; its
            ``DTensor`` shards are gathered over gloo on the host (a gloo group over the mesh's
            ranks, made for the call).
        overwrite: replace a non-empty ``out_dir`` (otherwise a ``ValueError``).

    Memory: one tensor at a time is gathered (``full_tensor``), so the extra device memory per
    rank is one full tensor (plus one padded shard when its first dimension does not divide
    evenly), freed before the next; plain tensors and offloaded ones take none. Host: rank 0
    holds the tensors of one file until it is written (at most ``max_shard_bytes``, or the
    largest tensor; tensors already on the host in a storage of their own are not copied); a
    host gather holds one full tensor on every rank for its duration. safetensors before 0.8
    copies a file's bytes once more while writing it (later versions write from the tensors).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    out = _check_args(out_dir, max_shard_bytes)
    gloo = _Gloo()
    try:
        return _export(
            model,
            out,
            max_shard_bytes=max_shard_bytes,
            config=config,
            timeshare=timeshare,
            process_group=process_group,
            overwrite=overwrite,
            gloo=gloo,
        )
    finally:
        gloo.close()


def _export(
    model: torch.nn.Module,
    out: Path,
    *,
    max_shard_bytes: int,
    config: bool,
    timeshare: Any,
    process_group,
    overwrite: bool,
    gloo: _Gloo,
) -> Path:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    group = _coordination_group(process_group, gloo)
    writer = not _distributed() or dist.get_rank(process_group) == 0

    def plan() -> tuple[list[tuple[str, torch.Tensor]], list]:
        save_file = _save_file()  # fails early on every rank if it is missing
        # The live tensors (sharded DTensors as they are), under the names DCP saves them with.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))
        ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        named, groups = [], {}
        for name, t in state.items():
            if name in ignore:
                continue
            if not isinstance(t, torch.Tensor):
                warnings.warn(
                    f"{name}: not a tensor ({type(t).__name__}); safetensors holds tensors only, so it is not exported",
                    stacklevel=4,
                )
                continue
            local = t._local_tensor if isinstance(t, DTensor) else t
            alias = (
                storage_key(local.untyped_storage()),
                local.storage_offset(),
                tuple(local.shape),
                local.stride(),
                tuple(t.shape),
                local.dtype,
            )
            groups.setdefault(alias, []).append(name)
            named.append((name, t))
        drop = _drop_aliases(groups.values(), _tied_patterns(model))
        named = [(n, t, _local_source(t, timeshare, n)) for n, t in named if n not in drop]
        return named, [(n, tuple(t.shape), t.dtype) for n, t, _ in named], save_file

    resolved, signature, save_file = _agree(group, plan)
    if _distributed():  # every rank must gather the same tensors in the same order
        signatures: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(signatures, signature, group=group)
        if any(s != signatures[0] for s in signatures):
            raise ValueError(
                "the ranks hold different models (names, shapes or dtypes differ); export_hf "
                "needs the same model on every rank of process_group"
            )
    named = [(n, _gatherable(t, local, gloo)) for n, t, local in resolved]
    del resolved
    if writer:
        _warn_conversions(model)
    tmp = _agree(group, lambda: _prepare(out, overwrite) if writer else None)
    sizes = [(n, math.prod(t.shape) * t.element_size()) for n, t in named]
    files = _plan_files(sizes, max_shard_bytes)
    file_names = _file_names(len(files))
    sources = dict(named)
    del named
    weight_map: dict[str, str] = {}
    for names, file_name in zip(files, file_names):
        batch = [(n, sources.pop(n)) for n in names]
        target = tmp / file_name if writer else None
        _agree(group, lambda b=batch, t=target: _gather_and_write(b, t, save_file, weight_map))
        del batch

    def finish() -> None:
        if writer:
            if config:
                dtype = next((d for _, _, d in signature if d.is_floating_point), None)
                _write_config(model, tmp, dtype)
            _commit(tmp, out, weight_map, sum(s for _, s in sizes))

    _agree(group, finish)
    if _distributed():
        dist.barrier(group=group)
    return out


# ---- offline, from a tidal checkpoint ----------------------------------------------------------
def _checkpoint_path(checkpoint_dir: Path) -> Path:
    """A committed ``step-N`` directory: ``checkpoint_dir`` itself, or what its ``latest`` names."""
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint {checkpoint_dir} does not exist")
    path = checkpoint_dir
    if not (checkpoint_dir / ".metadata").exists() and not (checkpoint_dir / atomic.MANIFEST).exists():
        path = atomic.latest_path(checkpoint_dir)
        if path is None:
            raise CheckpointError(
                f"{checkpoint_dir} holds no committed checkpoint (no 'latest' pointer and no "
                f"step-N directory with a manifest)"
            )
    atomic.validate(path)
    return path


def export_hf_from_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    prefix: str = "app.model.",
    model: torch.nn.Module | None = None,
    drop_keys: Iterable[str] = (),
    overwrite: bool = False,
) -> Path:
    """Write the model of a checkpoint saved by :func:`tidal.checkpoint.save` as a Hugging Face
    safetensors directory ``out_dir``; return it. Offline: one process, CPU only, no process
    group needed (any world size at save time; DCP reassembles each tensor from its shards).

    Args:
        checkpoint_dir: a checkpoint root (its ``latest`` is used) or a ``step-N`` directory.
            Raises :class:`~tidal.checkpoint.CheckpointError` if it is missing or partial.
        prefix: where the model's tensors sit in the checkpoint (``TrainState`` saves them
            under ``app.model.``); the rest of each key is the parameter name written.
        model: optional, a module of the saved model's structure; ``torch.device("meta")`` is
            enough (no memory). Its names must match the checkpoint's. With it, tied weights are
            written once, as ``save_pretrained`` does, and its Hugging Face config is written.
        drop_keys: names (without ``prefix``) to leave out, e.g. ``["lm_head.weight"]`` for a
            tied head when no ``model`` is given. Without either, every tensor is written: a
            tied pair is then stored twice, with equal bytes, which still loads correctly.
        overwrite: replace a non-empty ``out_dir`` (otherwise a ``ValueError``).

    Memory: host memory peaks at about one output file (``max_shard_bytes``, or the largest
    tensor) plus DCP's read buffer for one stored chunk (twice the file with safetensors < 0.8).
    """
    out = _check_args(out_dir, max_shard_bytes)
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if isinstance(drop_keys, str):
        raise TypeError("drop_keys must be a list of names, not one string")
    save_file = _save_file()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = _checkpoint_path(Path(checkpoint_dir))
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {
        k[len(prefix) :]: v
        for k, v in metadata.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }
    skipped = [k for k, v in metadata.items() if k.startswith(prefix) and not isinstance(v, TensorStorageMetadata)]
    if skipped:
        warnings.warn(
            f"{len(skipped)} non-tensor entries under {prefix!r} are not exported (safetensors holds "
            f"tensors only), e.g. {skipped[0]}",
            stacklevel=2,
        )
    if not tensors:
        roots = sorted({k.rsplit(".", 1)[0] for k in metadata})[:8]
        raise ValueError(
            f"checkpoint {path} holds no tensors under prefix {prefix!r}; its keys start with e.g. {roots}"
        )
    drop = set(drop_keys)
    if unknown := sorted(drop - tensors.keys()):
        raise ValueError(f"drop_keys names {unknown[:5]}, which the checkpoint does not hold under {prefix!r}")
    if model is not None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {n: t for n, t in get_model_state_dict(model).items() if isinstance(t, torch.Tensor)}
        if state.keys() != tensors.keys():
            missing, extra = sorted(state.keys() - tensors.keys()), sorted(tensors.keys() - state.keys())
            raise ValueError(
                f"model does not match the checkpoint: missing from the checkpoint {missing[:5]}, "
                f"not in the model {extra[:5]}"
            )
        groups: dict = {}
        for n, t in state.items():
            groups.setdefault((storage_key(t.untyped_storage()), t.storage_offset(), tuple(t.shape)), []).append(n)
        drop |= _drop_aliases(groups.values(), _tied_patterns(model))
        drop |= set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        _warn_conversions(model)
    kept = [(n, m) for n, m in tensors.items() if n not in drop]
    sizes = [(n, math.prod(m.size) * m.properties.dtype.itemsize) for n, m in kept]
    files = _plan_files(sizes, max_shard_bytes)
    tmp = _prepare(out, overwrite)
    weight_map: dict[str, str] = {}
    for names, file_name in zip(files, _file_names(len(files))):
        # Full-size host tensors for this file only; DCP fills each from its stored chunks.
        shard = {n: torch.empty(tuple(tensors[n].size), dtype=tensors[n].properties.dtype) for n in names}
        try:
            dcp.load(
                {prefix + n: t for n, t in shard.items()}, storage_reader=FileSystemReader(str(path)), no_dist=True
            )
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {path} passed the completeness checks but reading it failed ({type(e).__name__}: {e})"
            ) from e
        save_file(shard, str(tmp / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        del shard
    if model is not None:
        _write_config(
            model, tmp, next((m.properties.dtype for _, m in kept if m.properties.dtype.is_floating_point), None)
        )
    _commit(tmp, out, weight_map, sum(s for _, s in sizes))
    return out
