"""tidal: GPU time-sharing for the roles of LLM RL training.

Start with the quickstart in README.md: roles of a :class:`Timeshare` take turns on one
device, each on it only while it works. The face is small: :class:`Timeshare` (its verbs
``add_role``, ``use``, ``report``), its settings (:class:`TimeshareConfig`,
:class:`TransferConfig`), what it records (:class:`TransitionRecord`), the other memory levers
(:class:`CPUAdam`, :func:`offload_optimizer`, :func:`offload_activations`), the seam a new kind
of role plugs into (:class:`StateSource`), and its errors. The rest lives in the sub-packages,
each with a face of its own:

* :mod:`tidal.timeshare` (roles, the phase schedule), :mod:`tidal.activations` (the
  offloader, its plan and report), :mod:`tidal.transfer` (the per-device transfer context),
  :mod:`tidal.vmm` (address-stable regions), :mod:`tidal.memory` (readings), :mod:`tidal.plan`
  (the memory planner: pure Python, imported without torch);
* in the trainers people use, each imported by name: :mod:`tidal.integrations.trl`
  (``TidalGRPOTrainer``, ``TidalRLOOTrainer``, with HF generate or TRL's colocated vLLM),
  :mod:`tidal.integrations.hf` (``TidalTrainer``), :mod:`tidal.integrations.vllm`
  (``VllmEngine``, for loops of one's own), :mod:`tidal.distributed` (DDP, FSDP2, DeepSpeed
  engines as roles, Ray placement, a GPU lease between processes).

Importing tidal imports nothing else (not even torch): each name is loaded on first use, and a
:class:`Timeshare` on an accelerator is what initialises CUDA.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The face: name -> the module that defines it.
_FACE = {
    "Timeshare": "tidal.timeshare",
    "TimeshareConfig": "tidal.timeshare",
    "TransitionRecord": "tidal.timeshare",
    "TransferConfig": "tidal.transfer",
    "StateSource": "tidal.state.sources",
    "CPUAdam": "tidal.optim",
    "offload_optimizer": "tidal.timeshare",
    "offload_activations": "tidal.activations",
    "InsufficientMemoryError": "tidal.errors",
    "StrictAccessError": "tidal.state.strict",
    "strict_access": "tidal.state.strict",
    "snapshot": "tidal.memory",
}
# Names the top level had before its face was made small, still found here (each is in its
# sub-package's face, where the docs name it).
_ALSO = {
    "ActivationOffloadConfig": "tidal.activations",
    "ActivationOffloader": "tidal.activations",
    "ActivationPlan": "tidal.activations",
    "LayerMode": "tidal.activations",
    "StepReport": "tidal.activations",
    "MemorySnapshot": "tidal.memory",
    "host_rss_bytes": "tidal.memory",
    "Role": "tidal.timeshare",
    "TransferContext": "tidal.transfer",
    "Region": "tidal.vmm",
    "VmmUnavailableError": "tidal.vmm",
}

__all__ = [  # the face (_FACE's names, written out for readers and linters)
    "CPUAdam",
    "InsufficientMemoryError",
    "StateSource",
    "StrictAccessError",
    "Timeshare",
    "TimeshareConfig",
    "TransferConfig",
    "TransitionRecord",
    "offload_activations",
    "offload_optimizer",
    "snapshot",
    "strict_access",
]

if TYPE_CHECKING:  # for readers and type checkers: what the names are
    from tidal.activations import offload_activations
    from tidal.errors import InsufficientMemoryError
    from tidal.memory import snapshot
    from tidal.optim import CPUAdam
    from tidal.state.sources import StateSource
    from tidal.state.strict import StrictAccessError, strict_access
    from tidal.timeshare import Timeshare, TimeshareConfig, TransitionRecord, offload_optimizer
    from tidal.transfer import TransferConfig


def __getattr__(name: str) -> Any:
    module = _FACE.get(name) or _ALSO.get(name)
    if module is None:
        if importlib.util.find_spec(f"tidal.{name}") is not None:
            return importlib.import_module(f"tidal.{name}")  # a sub-package, as after its import
        raise AttributeError(f"module 'tidal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found once; the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FACE) | set(_ALSO))
