"""tidal: GPU time-sharing for the roles of LLM RL training.

Start with the quickstart in README.md: roles of a :class:`Timeshare` take turns on one
device, each on it only while it works. In the trainers people use, each imported by name:

* :mod:`tidal.integrations.trl`: ``TidalGRPOTrainer`` and ``TidalRLOOTrainer`` in place of
  TRL's ``GRPOTrainer`` and ``RLOOTrainer``, in one process or several under ``torchrun`` /
  ``accelerate launch`` with DDP or FSDP2 (extra ``tidal[trl]``).
* :mod:`tidal.integrations.hf`: ``TidalTrainer`` in place of transformers' ``Trainer``.
* :mod:`tidal.distributed`: DDP's gradient buckets freed between steps, FSDP2 roles,
  DeepSpeed engines as roles, Ray placement and a GPU lease between processes.

Importing tidal touches no CUDA; a :class:`Timeshare` on an accelerator initialises it.
"""

from tidal.activations import (
    ActivationOffloadConfig,
    ActivationOffloader,
    ActivationPlan,
    LayerMode,
    StepReport,
    offload_activations,
)
from tidal.errors import InsufficientMemoryError
from tidal.memory import MemorySnapshot, host_rss_bytes, snapshot
from tidal.optim import CPUAdam
from tidal.state.sources import StateSource
from tidal.state.strict import StrictAccessError, strict_access
from tidal.timeshare import Role, Timeshare, TimeshareConfig, TransitionRecord, offload_optimizer
from tidal.transfer import TransferConfig, TransferContext
from tidal.vmm import Region, VmmUnavailableError

__version__ = "0.1.0"

__all__ = [
    "ActivationOffloadConfig",
    "ActivationOffloader",
    "ActivationPlan",
    "CPUAdam",
    "InsufficientMemoryError",
    "MemorySnapshot",
    "Region",
    "Role",
    "StateSource",
    "StrictAccessError",
    "Timeshare",
    "TimeshareConfig",
    "TransferConfig",
    "TransferContext",
    "TransitionRecord",
    "VmmUnavailableError",
    "LayerMode",
    "StepReport",
    "host_rss_bytes",
    "offload_activations",
    "offload_optimizer",
    "snapshot",
    "strict_access",
]
