"""A phase that runs out of device memory beside the roles its turn kept runs again once they
are out, from the same random draws: :class:`AgainIfOutOfMemory`, a mixin of
:class:`~tidal.integrations.trl.trainer.TidalRLTrainer`."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable

import torch

from tidal.integrations.trl.launch import runs_collectives

__all__ = ["AgainIfOutOfMemory", "RandomState"]


class RandomState:
    """The state of the random generators a phase draws from (the host's and, on CUDA, the
    device's default generator), to run the phase again from the same draws."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.get_rng_state()
        self.on_device = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.host)
        if self.on_device is not None:
            torch.cuda.set_rng_state(self.on_device, self.device)


class AgainIfOutOfMemory:
    """The trainer's phases run through :meth:`_again_if_out_of_memory`. Reads the trainer's
    ``timeshare``, ``tidal_config``, ``_tidal_memory`` and ``_tidal_retries``."""

    def _again_if_out_of_memory(self, role: str, compute: Callable[[], Any]) -> Any:
        """``compute()``: a phase's work that changes nothing but the random generators' state
        (generation, the scorings, the loss's forward). With ``prefetch``, where it runs out of
        device memory while roles a turn kept (or a prefetch brought in) are on the device
        beside ``role`` (the phase needs more than the last step's reading: longer prompts or
        completions), those go (:meth:`~tidal.Timeshare.evict_others`: a frozen role dropped
        without a copy), the random generators are set back to where they were, and it runs
        once more: its results are those of a run that never kept them. Its need is measured
        again from there, so the next turns keep for it. Where nothing was beside ``role``, the
        ``torch.OutOfMemoryError`` goes on as it came (the run does not fit without tidal's keep
        either). Memory cost: the random generators' state, a few kilobytes on the host."""
        ts = self.timeshare
        if not self.tidal_config.prefetch or role not in ts.roles or not ts.is_resident(role):
            return compute()
        generators = RandomState(ts.device)
        try:
            return compute()
        except torch.OutOfMemoryError:
            if ts.evict_others(role) == 0:
                raise
        # Past the handler: the failed run's tensors, held by its traceback's frames, are freed.
        generators.restore()
        self._tidal_retries += 1
        warnings.warn(
            f"tidal: TRL's {role} ran out of device memory beside the roles its turn kept on the device "
            f"(its need grew since the last step); they were moved out and it ran again (same results, "
            f"{self._tidal_retries} such run(s) so far, logged as tidal/oom_retries)",
            stacklevel=2,
        )
        if self._tidal_memory is not None:
            self._tidal_memory.rebase()  # the need counted from what the eviction left
        return compute()

    @contextlib.contextmanager
    def _generate_again_if_out_of_memory(self):
        """The policy's ``generate()`` (what allocates the KV cache) run by
        :meth:`_again_if_out_of_memory` for the block: an attribute of the unwrapped policy's
        instance, removed as the block ends."""
        policy = self.accelerator.unwrap_model(self.model)
        if not self.tidal_config.prefetch or "policy" not in self.timeshare.roles or runs_collectives(policy):
            # (A sharded policy's generation may gather per unit, and transformers syncs the
            # ranks' decoding loops where it knows the model sharded: no rank runs it alone.)
            yield
            return
        own = vars(policy).get("generate")
        generate = policy.generate
        policy.generate = lambda *a, **kw: self._again_if_out_of_memory("policy", lambda: generate(*a, **kw))
        try:
            yield
        finally:
            if own is None:
                del policy.generate
            else:
                policy.generate = own
