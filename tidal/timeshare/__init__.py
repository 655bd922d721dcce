"""Roles taking turns on a device, and optimizer state kept on the host between steps."""

from tidal.timeshare.optimizer import offload_optimizer
from tidal.timeshare.role import Role
from tidal.timeshare.telemetry import TransitionRecord
from tidal.timeshare.timeshare import Timeshare, TimeshareConfig

__all__ = ["Role", "Timeshare", "TimeshareConfig", "TransitionRecord", "offload_optimizer"]
