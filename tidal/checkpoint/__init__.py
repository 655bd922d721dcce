"""Checkpoints: DCP sharded save/load of a role's training state, committed atomically.

    state = TrainState(model, opt, scheduler=sched, timeshare=ts)
    start = load_latest("ckpt", state) or 0
    ...
    save("ckpt", state, step=step)      # every rank; visible only once complete
"""

from tidal.checkpoint.atomic import CheckpointError
from tidal.checkpoint.dcp import CheckpointConfig, load, load_latest, save
from tidal.checkpoint.state import TrainState

__all__ = ["CheckpointConfig", "CheckpointError", "TrainState", "load", "load_latest", "save"]
