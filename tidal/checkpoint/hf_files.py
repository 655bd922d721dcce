"""The files of a Hugging Face export: arguments, how tensors are split into safetensors files,
the temporary directory and its atomic commit, ``config.json``, and which tied names to drop.
Shared by both exports of :mod:`tidal.checkpoint.export`; no tensor data passes through here
except in the file writer it returns.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from tidal.checkpoint import atomic

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 2**30


def _save_file() -> Callable:
    try:  # optional dependency: only the export needs it
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(
            "exporting to Hugging Face safetensors needs the safetensors package: pip install safetensors"
        ) from e
    return save_file


def _check_args(out_dir: Any, max_shard_bytes: Any) -> Path:
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise TypeError(f"max_shard_bytes must be an int (bytes), got {type(max_shard_bytes).__name__}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"out_dir must be a path, got {type(out_dir).__name__}")
    return Path(out_dir)


def _plan_files(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Names grouped into files, in order; a file closes before it would pass ``max_bytes``."""
    files: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if files[-1] and used + nbytes > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += nbytes
    return files


def _file_names(n: int) -> list[str]:
    return [WEIGHTS] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _tmp_dirs(out: Path) -> tuple[Path, Path]:
    return out.parent / f".{out.name}.export-tmp", out.parent / f".{out.name}.export-old"


def _prepare(out: Path, overwrite: bool) -> Path:
    """The writer: refuse a non-empty ``out`` unless ``overwrite``; a fresh temporary dir."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(
            f"out_dir {out} exists and is not empty; pass overwrite=True to replace it, or choose another directory"
        )
    tmp, old = _tmp_dirs(out)
    for leftover in (tmp, old):  # names only exports use: a killed export's files
        if leftover.exists():
            shutil.rmtree(leftover)
    tmp.mkdir(parents=True)
    return tmp


def _commit(tmp: Path, out: Path, weight_map: dict[str, str], total_size: int) -> None:
    """The writer, once every file is in ``tmp``: index, fsync, rename."""
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    for p in tmp.iterdir():
        atomic._fsync_path(p)  # bytes on disk before the name says "complete"
    atomic._fsync_path(tmp)
    _, old = _tmp_dirs(out)
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    atomic._fsync_path(out.parent)
    if old.exists():
        shutil.rmtree(old)


def _write_config(model: torch.nn.Module, directory: Path, dtype: torch.dtype | None) -> None:
    """``config.json`` (and ``generation_config.json``) as ``save_pretrained`` writes them, from a
    copy of the config: the user's model is not modified."""
    config = getattr(model, "config", None)
    if not hasattr(config, "save_pretrained"):
        return
    from torch.distributed.fsdp import FSDPModule

    config = copy.deepcopy(config)
    # FSDP2 renames the class (FSDPQwen2ForCausalLM); the config names the model's own class.
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    config.architectures = [cls.__name__]
    if dtype is not None:  # from_pretrained(dtype="auto") reads it
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", str(dtype).removeprefix("torch."))
    config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if hasattr(generation, "save_pretrained") and (can_generate is None or can_generate()):
        generation.save_pretrained(directory)


def _tied_patterns(model: torch.nn.Module) -> list[str]:
    """Patterns of the names Hugging Face re-ties on load (its ``_tied_weights_keys``: a dict
    target -> source in transformers >= 5, a list of patterns before)."""
    out = []
    for prefix, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None) or ()
        prefix = prefix.replace("_orig_mod.", "").removeprefix("_orig_mod")  # torch.compile's wrapper
        out += [f"{prefix}.{k}" if prefix else k for k in keys]
    return out


def _drop_aliases(groups: Iterable[list[str]], patterns: list[str]) -> set[str]:
    """Of each group of names for one tensor (in state-dict order), the names not to write:
    keep the first one no tied-weights pattern matches (the first name if all match)."""
    drop: set[str] = set()
    for names in groups:
        if len(names) < 2:
            continue
        keep = next((n for n in names if not any(re.search(p, n) for p in patterns)), names[0])
        drop.update(n for n in names if n != keep)
    return drop


def _warn_conversions(model: torch.nn.Module) -> None:
    if "transformers" not in sys.modules or not hasattr(model, "config"):
        return  # not a transformers model (and no slow import to find out)
    try:  # transformers >= 5 only; an internal module, so any failure means "cannot tell"
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange

        conversions = [
            c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
        ]
    except Exception:  # noqa: BLE001
        return
    if conversions:
        warnings.warn(
            f"{type(model).__name__} is converted by transformers at load time ({len(conversions)} "
            f"weight conversions, e.g. fused experts); the export holds the in-memory layout, which "
            f"transformers >= 5 loads, not the original hub layout",
            stacklevel=3,
        )
