"""Checkpoints: DCP sharded save/load of a role's training state, committed atomically.

    state = TrainState(model, opt, scheduler=sched, timeshare=ts)
    start = load_latest("ckpt", state, allow_missing=True) or 0   # None: no checkpoint yet
    ...
    save("ckpt", state, step=step)      # every rank; visible only once complete

``load_latest`` raises :class:`CheckpointError` if ``"ckpt"`` does not exist, unless
``allow_missing=True`` (pass it where a first run starts fresh; leave it out where a
checkpoint must be there, so a mistyped path is an error rather than training from scratch).
Every file's CRC-32 is recorded at save and checked before a load reads anything: a damaged
checkpoint is a :class:`CheckpointError` naming the file and the previous complete one.

    export_hf(model, "hf-out", timeshare=ts)                  # a Hugging Face safetensors dir
    export_hf_from_checkpoint("ckpt", "hf-out", model=meta)   # the same, offline from a checkpoint
"""

from tidal.checkpoint.atomic import CheckpointError
from tidal.checkpoint.dcp import CheckpointConfig, load, load_latest, save
from tidal.checkpoint.export import export_hf, export_hf_from_checkpoint
from tidal.checkpoint.state import TrainState

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "TrainState",
    "export_hf",
    "export_hf_from_checkpoint",
    "load",
    "load_latest",
    "save",
]
