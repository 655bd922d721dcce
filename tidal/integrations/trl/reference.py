"""``sync_ref_model=True`` with a reference that is out on the host between its turns:
:class:`SyncReference`, in place of TRL's ``SyncRefModelCallback`` (which writes the
reference's ``.data`` in place, through the empty storages of a moved-out role)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from tidal.state.foreign import moved_out

if TYPE_CHECKING:
    from tidal.state.store import OffloadStore

__all__ = ["SyncReference", "sync_reference"]


class SyncReference(TrainerCallback):
    """``sync_ref_model=True``: every ``ref_model_sync_steps`` steps the reference becomes
    ``(1 - alpha) * reference + alpha * policy``, as TRL's ``SyncRefModelCallback`` computes it
    (the same in-place ops on the device, so the same bits), wherever each tensor is
    (:func:`sync_reference`)."""

    def __init__(self, trainer: Any) -> None:  # a TidalRLTrainer (its timeshare, policy and reference)
        # Weak: the trainer holds this callback; the trainer (and the pinned host memory of its
        # roles) must go when the user drops it, not at the next cyclic collection.
        self.trainer = weakref.ref(trainer)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        trainer = self.trainer()
        if trainer is not None and state.global_step % args.ref_model_sync_steps == 0:
            ts = trainer.timeshare
            policy = trainer.accelerator.unwrap_model(trainer.model)
            sync_reference(ts.store, ts.device, trainer.ref_model, policy, args.ref_model_mixup_alpha)


def sync_reference(
    store: OffloadStore, device: torch.device, reference: torch.nn.Module, policy: torch.nn.Module, alpha: float
) -> None:
    """``reference = (1 - alpha) * reference + alpha * policy``, parameter by parameter, with
    TRL's in-place ops on the device: a reference tensor that is out is brought to the device
    one at a time, mixed there and written back into its host copy in ``store`` (the next
    reload brings the mix in); a policy tensor that is out is read from its host copy. With
    FSDP2 the same on this rank's shards. Memory cost: on the device, one reference tensor (and
    one policy tensor, if out) at a time."""
    with torch.no_grad():
        for target, source in zip(reference.parameters(), policy.parameters(), strict=True):
            # FSDP2: both sharded alike (dim 0 over the same ranks), so the mix is the mix of
            # this rank's shards, where tidal moves them.
            target, source = _local(target), _local(source)
            src = source.data
            if moved_out(src):
                held = store.host_tensor(src)
                assert held is not None, "an emptied policy tensor that the timeshare does not hold"
                src = held.to(device)
            if not moved_out(target.data):
                target.data.mul_(1.0 - alpha).add_(src, alpha=alpha)
                continue
            host = store.host_tensor(target.data)
            assert host is not None, "an emptied reference tensor that the timeshare does not hold"
            mixed = host.to(device, copy=True)
            mixed.mul_(1.0 - alpha).add_(src, alpha=alpha)
            host.copy_(mixed)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
