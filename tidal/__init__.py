"""tidal: GPU time-sharing for the roles of LLM RL training.

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
