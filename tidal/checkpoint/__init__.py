"""Checkpoints: DCP sharded save/load of a role's training state, committed atomically.

    state = TrainState(model, opt, scheduler=sched, timeshare=ts)
    start = load_latest("ckpt", state) or 0
    ...
    save("ckpt", state, step=step)      # every rank; visible only once complete

    export_hf(model, "hf-out", timeshare=ts)                  # a Hugging Face safetensors dir
    export_hf_from_checkpoint("ckpt", "hf-out", model=meta)   # the same, offline from a checkpoint
"""

from tidal.checkpoint.atomic import CheckpointError
from tidal.checkpoint.dcp import CheckpointConfig, load, load_latest, save
from tidal.checkpoint.export import export_hf, export_hf_from_checkpoint
from tidal.checkpoint.state import TrainState

__all__ = ["CheckpointConfig", "CheckpointError", "TrainState", "export_hf", "export_hf_from_checkpoint", "load",
           "load_latest", "save"]
