"""Optimizers whose state lives on the host."""

from tidal.optim.cpu_adam import CPUAdam

__all__ = ["CPUAdam"]
