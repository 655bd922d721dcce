"""A checkpoint directory where a checkpoint is visible only once it is complete, and is
verified before it is read.

Layout of ``<dir>``::

    step-3/            committed checkpoints: DCP shard files, .metadata, tidal.json
    step-4/
    latest             "step-4": the newest committed checkpoint, replaced atomically
    .tmp-5/            a save in progress (or killed): never read, removed by the next save

Commit protocol (rank 0 does the file-system steps; every rank learns the outcome, so all
raise the same error instead of one hanging in a collective):

1. ``.tmp-<step>`` is created fresh; leftovers of killed saves are removed.
2. Every rank writes its shards there (DCP), and DCP writes ``.metadata`` last.
3. Rank 0 computes each file's CRC-32 and writes ``tidal.json`` (each file's size and CRC-32,
   and the algorithm's name), fsyncs every file and the directory, renames ``.tmp-<step>`` to
   ``step-<step>``, fsyncs ``<dir>``, then writes ``latest.tmp`` and ``os.replace`` s it onto
   ``latest`` (an atomic rename on POSIX) and fsyncs again.

A crash before the rename leaves only a ``.tmp-*`` directory; a crash between the rename and
the pointer update leaves ``latest`` on the previous checkpoint. Either way ``latest`` names a
complete checkpoint. The directory must be one that every rank sees (a shared file system),
as DCP itself requires, and only one job may save into it at a time.

Verification (before DCP reads anything): every rank recomputes the CRC-32 of its share of
the files the manifest lists (:func:`checksum_findings`; shares balanced by size, so the
checkpoint is read and hashed by all ranks at once), then rank 0 (:func:`validate`) checks
that every file exists with its size, takes the gathered checksum findings, and checks the
``.metadata`` ranges against the shard files. Outside a process group :func:`validate`
hashes every file itself. CRC-32 (``zlib.crc32``, the
standard whole-file CRC that ``zlib.crc32(open(f, "rb").read())`` gives) detects damage, not
tampering: any error burst up to 32 bits, and other damage but for a 2**-32 chance. It is the
fastest content checksum of the standard library where measured (files in the page cache, one
core of a 2-core AMD EPYC VM: 2.4 GB/s, against 1.3 for sha256 and 0.7 for blake2b). Files are
hashed in 64 MiB pieces on up to 8 threads (zlib releases the GIL), so one large shard file is
hashed in parallel too (4.5 GB/s on those 2 cores: 0.06 s per 256 MiB). A checkpoint
written before checksums were recorded (no ``checksums`` in its manifest) still loads, after
the size and range checks only, with a warning that its contents are not verified.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import torch.distributed as dist

from tidal.device import sync_policy

__all__ = [
    "CHECKSUM",
    "CheckpointError",
    "Manifest",
    "checkpoint_dirs",
    "coordination_group",
    "crc32_combine",
    "file_checksums",
    "latest_path",
    "validate",
    "checksum_findings",
    "on_rank0",
]

MANIFEST = "tidal.json"
LATEST = "latest"
CHECKSUM = "crc32"  # the algorithm recorded in (and verified from) the manifest
_READ_CHUNK = 1 << 20  # one read, hashed while it is in cache (32 MiB reads hashed at a third of the rate)
_PIECE = 64 << 20  # the bytes one thread hashes; a larger file is split and its pieces' CRCs combined
_MAX_HASH_THREADS = 8
_STEP_RE = re.compile(r"^step-(\d+)$")
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, partial or corrupted files."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``tidal.json`` records about a committed checkpoint.

    ``checksums`` maps each file of ``file_bytes`` to its checksum (``checksum_algorithm``,
    8 hex digits for CRC-32); both are None in a manifest written before tidal recorded them.
    """

    step: int
    world_size: int
    file_bytes: dict[str, int]
    checksum_algorithm: str | None = None
    checksums: dict[str, str] | None = None

    def to_json(self) -> str:
        out = {"step": self.step, "world_size": self.world_size, "files": self.file_bytes}
        if self.checksums is not None:
            out["checksum_algorithm"] = self.checksum_algorithm
            out["checksums"] = self.checksums
        return json.dumps(out, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Raises ``ValueError``, ``KeyError`` or ``TypeError`` if ``text`` is not a manifest."""
        m = json.loads(text)
        sums = m.get("checksums")
        return cls(
            step=int(m["step"]),
            world_size=int(m["world_size"]),
            file_bytes={str(k): int(v) for k, v in dict(m["files"]).items()},
            checksum_algorithm=None if sums is None else str(m["checksum_algorithm"]),
            checksums=None if sums is None else {str(k): str(v) for k, v in dict(sums).items()},
        )


# ---- checksums ---------------------------------------------------------------------------------
_CRC32_POLY = 0xEDB88320  # CRC-32 of zlib (IEEE 802.3), bit-reflected


def _gf2_apply(matrix: list[int], vector: int) -> int:
    """``matrix`` (32 columns, each a bit mask) times ``vector`` over GF(2)."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


@functools.cache
def _zero_byte_operators() -> tuple[list[int], ...]:
    """``ops[k]``: the linear map that advances a CRC-32 register over ``2**k`` zero bytes."""
    op = [_CRC32_POLY] + [1 << (i - 1) for i in range(1, 32)]  # over one zero bit
    ops = []
    for k in range(3 + 48):  # 2**3 bits = 1 byte ... 2**47 bytes
        if k >= 3:
            ops.append(op)
        op = [_gf2_apply(op, column) for column in op]  # squared: twice as many zeros
    return tuple(ops)


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """``zlib.crc32(a + b)`` from ``zlib.crc32(a)``, ``zlib.crc32(b)`` and ``len(b)``.

    Why it holds: CRC-32 is affine in its register, so ``crc32(b, start)`` differs from
    ``crc32(b, 0)`` by ``start`` advanced over ``len(b)`` zero bytes (a linear map, the
    inversions zlib applies on entry and exit cancel), and ``crc32(a + b) = crc32(b, crc32(a))``.
    """
    ops = _zero_byte_operators()
    k = 0
    while length_b:
        if length_b & 1:
            crc_a = _gf2_apply(ops[k], crc_a)
        length_b >>= 1
        k += 1
    return crc_a ^ crc_b


def _crc32_range(path: Path, offset: int, length: int) -> int:
    buf = bytearray(min(_READ_CHUNK, length))
    view = memoryview(buf)
    crc = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while length:
            n = f.readinto(view[: min(length, len(buf))])
            if not n:
                raise CheckpointError(
                    f"{path} ended at byte {f.tell()} while its checksum was computed (it was truncated meanwhile)"
                )
            crc = zlib.crc32(view[:n], crc)
            length -= n
    return crc


def _hash_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(_MAX_HASH_THREADS, cores))


def file_checksums(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """The CRC-32 of each file ``directory/name`` as 8 hex digits: the standard whole-file CRC.

    The files are cut into 64 MiB pieces, hashed on up to 8 threads (one per core; zlib
    releases the GIL) with 1 MiB reads, and each file's piece CRCs are combined.
    """
    sizes = {name: (directory / name).stat().st_size for name in names}
    pieces = [
        (name, offset, min(_PIECE, size - offset)) for name, size in sizes.items() for offset in range(0, size, _PIECE)
    ]
    threads = min(_hash_threads(), len(pieces))
    if threads <= 1:
        crcs = [_crc32_range(directory / name, offset, length) for name, offset, length in pieces]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="tidal-checksum") as pool:
            crcs = list(pool.map(lambda piece: _crc32_range(directory / piece[0], piece[1], piece[2]), pieces))
    whole = dict.fromkeys(sizes, 0)  # an empty file's CRC-32 is 0
    for (name, offset, length), crc in zip(pieces, crcs):
        whole[name] = crc if offset == 0 else crc32_combine(whole[name], crc, length)
    return {name: f"{crc:08x}" for name, crc in whole.items()}


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
            raise CheckpointError(
                f"{pointer} holds {name!r}, not a checkpoint name like 'step-12'; "
                f"fix or delete it (load a checkpoint by path with tidal.checkpoint.load)"
            )
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
        raise ValueError(
            f"checkpoint {directory / step_name(step)} exists already; checkpoints are never "
            f"overwritten (the old one must stay loadable). Save under another step or delete it"
        )
    directory.mkdir(parents=True, exist_ok=True)
    for p in directory.iterdir():
        if p.name.startswith(".tmp-") and p.is_dir():
            shutil.rmtree(p)
    tmp = directory / tmp_name(step)
    tmp.mkdir()
    return tmp


def commit(directory: Path, step: int, world_size: int, *, keep_last: int | None) -> Path:
    """Rank 0, after every rank's shards and ``.metadata`` are written: checksums, manifest,
    fsync, rename, pointer update, retention. Returns the committed path.

    Each step ends at a named point of the sync policy, where the fault-injection tests raise.
    """
    policy = sync_policy()
    tmp = directory / tmp_name(step)
    files = sorted(p for p in tmp.iterdir() if p.is_file())
    if not any(p.name == ".metadata" for p in files):
        raise CheckpointError(f"{tmp}: DCP wrote no .metadata; the save did not finish, nothing was committed")
    names = [p.name for p in files]
    manifest = Manifest(
        step=step,
        world_size=world_size,
        file_bytes={p.name: p.stat().st_size for p in files},
        checksum_algorithm=CHECKSUM,
        checksums=file_checksums(tmp, names),
    )
    (tmp / MANIFEST).write_text(manifest.to_json())
    policy.point("checkpoint_manifest_written")
    for p in [*files, tmp / MANIFEST]:
        _fsync_path(p)  # data and sizes on disk before the name says "complete"
    _fsync_path(tmp)
    policy.point("checkpoint_synced")
    final = directory / step_name(step)
    os.rename(tmp, final)
    _fsync_path(directory)
    policy.point("checkpoint_renamed")
    pointer_tmp = directory / (LATEST + ".tmp")
    with open(pointer_tmp, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer_tmp, directory / LATEST)
    _fsync_path(directory)
    policy.point("checkpoint_pointer_updated")
    if keep_last is not None:
        for old in checkpoint_dirs(directory)[:-keep_last]:
            if old != final:
                shutil.rmtree(old)
    return final


def _mismatch(name: str, actual: str, recorded: str) -> str:
    return f"file {name} has {CHECKSUM} {actual}, {recorded} was recorded when it was written"


def _share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files ``rank`` of ``world`` hashes: largest first, each to the rank with the fewest
    bytes so far (ties to the lowest rank), so every rank computes the same split."""
    load = [0] * world
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sizes[name]
        if r == rank:
            mine.append(name)
    return mine


def checksum_findings(path: Path, rank: int, world: int) -> list[str]:
    """Recompute the CRC-32 of this rank's share of the files ``path``'s manifest lists and
    return one line per file that differs from the recorded one (empty: its share is intact).

    Every rank of a load runs it on its share at once (so the bytes are read and hashed by
    all of them, not by rank 0 alone); :func:`validate` then takes the gathered findings
    instead of hashing again. What is not about contents (no manifest, a missing or truncated
    file, no checksums recorded) is left to :func:`validate`, which reports it."""
    try:
        manifest = Manifest.from_json((path / MANIFEST).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if manifest.checksums is None or manifest.checksum_algorithm != CHECKSUM:
        return []
    sizes = manifest.file_bytes
    names = [
        n
        for n in _share(sizes, rank, world)
        if n in manifest.checksums and (path / n).is_file() and (path / n).stat().st_size == sizes[n]
    ]
    actual = file_checksums(path, names)
    return [_mismatch(n, actual[n], manifest.checksums[n]) for n in sorted(names) if actual[n] != manifest.checksums[n]]


def _problem(path: Path, findings: list[str] | None = None) -> tuple[str | None, bool]:
    """What makes ``path`` unloadable (None if it is complete), and whether its contents were
    verified by checksum (False for a manifest written before checksums were recorded).
    ``findings``: the checksum mismatches already found by :func:`checksum_findings` over
    every share of the files (None: hash them all here)."""
    if not path.is_dir():
        return "the directory does not exist", False
    if not (path / MANIFEST).is_file():
        return f"{MANIFEST} is missing, so it was never committed (a partial copy or not a tidal checkpoint)", False
    try:
        manifest = Manifest.from_json((path / MANIFEST).read_text())
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})", False
    files = manifest.file_bytes
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            return f"file {name} is missing", False
        actual = f.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written (truncated or overwritten)", False
    if ".metadata" not in files:
        return ".metadata is missing", False
    verified = manifest.checksums is not None
    if verified:  # before DCP reads anything: .metadata is unpickled below
        if manifest.checksum_algorithm != CHECKSUM:
            return (
                f"{MANIFEST} records {manifest.checksum_algorithm!r} checksums; this tidal version verifies "
                f"{CHECKSUM!r} only"
            ), True
        unsummed = sorted(set(files) - set(manifest.checksums))
        if unsummed:
            return f"{MANIFEST} is inconsistent: it records no checksum for {', '.join(unsummed)}", True
        if findings is None:
            actual_sums = file_checksums(path, files)
            findings = [
                _mismatch(name, actual_sums[name], manifest.checksums[name])
                for name in sorted(files)
                if actual_sums[name] != manifest.checksums[name]
            ]
        if findings:
            which = "; ".join(sorted(findings))
            return (
                f"it is corrupted: {which} (bytes changed after the save: overwritten in place, a "
                f"disk or file-system error, or an incomplete copy)"
            ), True
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # unpickling garbage raises anything
        return f".metadata is corrupted ({type(e).__name__}: {e})", verified
    for index, info in (meta.storage_data or {}).items():
        f = path / info.relative_path
        if not f.is_file():
            return f"shard file {info.relative_path} (holding {index.fqn}) is missing", verified
        if info.offset + info.length > f.stat().st_size:
            return (
                f"shard file {info.relative_path} ends at byte {f.stat().st_size} but {index.fqn} "
                f"needs bytes {info.offset}..{info.offset + info.length} (truncated)"
            ), verified
    return None, verified


def validate(path: Path, *, findings: list[str] | None = None) -> None:
    """Raise :class:`CheckpointError` naming what is wrong with ``path`` (missing, truncated or
    corrupted files: every file's size and checksum is checked) and the newest earlier
    checkpoint that is complete. Warns if ``path`` has no checksums to verify (written before
    tidal recorded them). Reads every byte of the checkpoint (see the module docstring), unless
    ``findings`` gives what :func:`checksum_findings` found over every share of the files."""
    problem, verified = _problem(path, findings)
    if problem is None:
        if not verified:
            warnings.warn(
                f"checkpoint {path} is not verified: its {MANIFEST} holds no checksums (written by a "
                f"tidal version before they were recorded), so only its file sizes were checked; a "
                f"file damaged in place would load silently. A checkpoint saved now is verified",
                stacklevel=2,
            )
        return
    earlier = next(
        (p for p in reversed(checkpoint_dirs(path.parent)) if _older(p, path) and _problem(p)[0] is None), None
    )
    hint = (
        f"The previous checkpoint {earlier} is complete: load it with tidal.checkpoint.load({str(earlier)!r}, state)"
        if earlier is not None
        else f"No earlier complete checkpoint exists in {path.parent}"
    )
    raise CheckpointError(f"checkpoint {path} cannot be loaded: {problem}. {hint}")


def _older(p: Path, than: Path) -> bool:
    a, b = _STEP_RE.match(p.name), _STEP_RE.match(than.name)
    return bool(a and b and int(a.group(1)) < int(b.group(1)))


def coordination_group():
    """The group DCP and the commit coordinate over: None (the default group) when it is gloo
    or there is no process group, else a gloo group over all ranks, made once per default
    group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend() == "gloo":
        return None
    return _gloo_over(dist.group.WORLD)


@functools.lru_cache(maxsize=1)
def _gloo_over(world):
    # A memo, not a registry: new_group is itself a collective, so every rank must make the
    # group once and in the same order; a re-created default group is a new key.
    return dist.new_group(backend="gloo")


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
        except BaseException as e:  # re-raised on every rank below (an interrupt too: no rank waits)
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
