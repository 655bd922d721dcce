"""A checkpoint directory where a checkpoint is visible only once it is complete.

Layout of ``<dir>``::

    step-3/            committed checkpoints: DCP shard files, .metadata, tidal.json
    step-4/
    latest             "step-4": the newest committed checkpoint, replaced atomically
    .tmp-5/            a save in progress (or killed): never read, removed by the next save

Commit protocol (rank 0 does the file-system steps; every rank learns the outcome, so all
raise the same error instead of one hanging in a collective):

1. ``.tmp-<step>`` is created fresh; leftovers of killed saves are removed.
2. Every rank writes its shards there (DCP), and DCP writes ``.metadata`` last.
3. Rank 0 writes ``tidal.json`` (each file's size), fsyncs every file and the directory,
   renames ``.tmp-<step>`` to ``step-<step>``, fsyncs ``<dir>``, then writes ``latest.tmp``
   and ``os.replace`` s it onto ``latest`` (an atomic rename on POSIX) and fsyncs again.

A crash before the rename leaves only a ``.tmp-*`` directory; a crash between the rename and
the pointer update leaves ``latest`` on the previous checkpoint. Either way ``latest`` names a
complete checkpoint. The directory must be one that every rank sees (a shared file system),
as DCP itself requires, and only one job may save into it at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable, TypeVar

import torch.distributed as dist

__all__ = ["CheckpointError", "Manifest", "checkpoint_dirs", "latest_path", "validate", "on_rank0"]

MANIFEST = "tidal.json"
LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d+)$")
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, partial or corrupted files."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``tidal.json`` records about a committed checkpoint."""

    step: int
    world_size: int
    file_bytes: dict[str, int]


def step_name(step: int) -> str:
    return f"step-{step}"


def tmp_name(step: int) -> str:
    return f".tmp-{step}"


def checkpoint_dirs(directory: str | os.PathLike) -> list[Path]:
    """Committed-looking ``step-N`` directories, oldest first (by N)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_path(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``latest`` names; without a ``latest`` file, the highest ``step-N`` that
    has a manifest (a crash between commit and pointer update). None if there is none."""
    root = Path(directory)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not _STEP_RE.match(name):
            raise CheckpointError(f"{pointer} holds {name!r}, not a checkpoint name like 'step-12'; "
                                  f"fix or delete it (load a checkpoint by path with tidal.checkpoint.load)")
        return root / name
    committed = [p for p in checkpoint_dirs(root) if (p / MANIFEST).is_file()]
    return committed[-1] if committed else None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_tmp(directory: Path, step: int) -> Path:
    """Rank 0: a fresh, empty ``.tmp-<step>``; removes leftovers of killed saves."""
    if (directory / step_name(step)).exists():
        raise ValueError(f"checkpoint {directory / step_name(step)} exists already; checkpoints are never "
                         f"overwritten (the old one must stay loadable). Save under another step or delete it")
    directory.mkdir(parents=True, exist_ok=True)
    for p in directory.iterdir():
        if p.name.startswith(".tmp-") and p.is_dir():
            shutil.rmtree(p)
    tmp = directory / tmp_name(step)
    tmp.mkdir()
    return tmp


def commit(directory: Path, step: int, world_size: int, *, keep_last: int | None) -> Path:
    """Rank 0, after every rank's shards and ``.metadata`` are written: manifest, fsync,
    rename, pointer update, retention. Returns the committed path."""
    tmp = directory / tmp_name(step)
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    if not any(p.name == ".metadata" for p in files):
        raise CheckpointError(f"{tmp}: DCP wrote no .metadata; the save did not finish, nothing was committed")
    manifest = {"step": step, "world_size": world_size, "files": {p.name: p.stat().st_size for p in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for p in [*files, tmp / MANIFEST]:
        _fsync_path(p)  # data and sizes on disk before the name says "complete"
    _fsync_path(tmp)
    final = directory / step_name(step)
    os.rename(tmp, final)
    _fsync_path(directory)
    pointer_tmp = directory / (LATEST + ".tmp")
    with open(pointer_tmp, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, directory / LATEST)
    _fsync_path(directory)
    if keep_last is not None:
        for old in checkpoint_dirs(directory)[:-keep_last]:
            if old != final:
                shutil.rmtree(old)
    return final


def _problem(path: Path) -> str | None:
    """What makes ``path`` unloadable, or None if it looks complete."""
    if not path.is_dir():
        return "the directory does not exist"
    if not (path / MANIFEST).is_file():
        return f"{MANIFEST} is missing, so it was never committed (a partial copy or not a tidal checkpoint)"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"file {name} is missing"
        actual = f.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written (truncated or overwritten)"
    if ".metadata" not in files:
        return ".metadata is missing"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unpickling garbage raises anything
        return f".metadata is corrupted ({type(e).__name__}: {e})"
    for index, info in (meta.storage_data or {}).items():
        f = path / info.relative_path
        if not f.is_file():
            return f"shard file {info.relative_path} (holding {index.fqn}) is missing"
        if info.offset + info.length > f.stat().st_size:
            return (f"shard file {info.relative_path} ends at byte {f.stat().st_size} but {index.fqn} "
                    f"needs bytes {info.offset}..{info.offset + info.length} (truncated)")
    return None


def validate(path: Path) -> None:
    """Raise :class:`CheckpointError` naming what is wrong with ``path`` and the newest earlier
    checkpoint that looks complete."""
    problem = _problem(path)
    if problem is None:
        return
    earlier = [p for p in checkpoint_dirs(path.parent) if _older(p, path) and _problem(p) is None]
    hint = (f"The previous checkpoint {earlier[-1]} is complete: load it with "
            f"tidal.checkpoint.load({str(earlier[-1])!r}, state)" if earlier
            else f"No earlier complete checkpoint exists in {path.parent}")
    raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}. {hint}")


def _older(p: Path, than: Path) -> bool:
    a, b = _STEP_RE.match(p.name), _STEP_RE.match(than.name)
    return bool(a and b and int(a.group(1)) < int(b.group(1)))


def on_rank0(fn: Callable[[], T], *, group=None) -> T:
    """Run ``fn`` on rank 0 and give every rank its result, or raise its exception on every
    rank (so no rank waits in a collective that another has left). ``group``: the group to
    broadcast over (None: the default group); its rank 0 runs ``fn``."""
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed:
        return fn()
    box: list = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # re-raised on every rank below
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
