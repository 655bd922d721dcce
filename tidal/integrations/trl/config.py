"""What :class:`~tidal.integrations.trl.TidalGRPOTrainer` and
:class:`~tidal.integrations.trl.TidalRLOOTrainer` turn on: :class:`TidalConfig`."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tidal.integrations.hf import check_activation_fields, check_bool_fields
from tidal.timeshare import TimeshareConfig
from tidal.timeshare.role import OptimizerResidency

__all__ = ["TidalConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TidalConfig:
    """How :class:`TidalGRPOTrainer` and :class:`TidalRLOOTrainer` use tidal.

    Attributes:
        optimizer_residency: where the policy's optimizer state lives between steps
            (``"step"``: on the host except inside ``step()``; ``"stream"``: the same, moved a
            chunk at a time; ``"role"``: with the policy, so that with ``prefetch`` only the
            reference moves, behind generation: the fastest where the policy's weights,
            gradients and optimizer state fit beside the step's activations). Ignored for
            ``tidal.CPUAdam``, whose state is on the host by design.
        timeshare: the timeshare's settings (budget, headroom, transfer). The default keeps
            freed memory in this process's caching allocator (``release_to_driver=False``: every
            role lives in the trainer's process, and a release to the driver synchronises the
            device) and lets transitions return once their copies are queued
            (``wait_for_copies=False``: the host queues the next phase's work while the bytes
            move). A ``TimeshareConfig`` given here is used as it is.
        activation_offload: offload the activations the loss forward saves for backward
            (:func:`tidal.offload_activations` over ``activation_layers``, a dotted path to the
            policy's transformer blocks, or ``"auto"``: the paths of
            :data:`tidal.integrations.hf.AUTO_LAYER_PATHS`, which also says where a PEFT
            policy's path is read). Checked when the trainer is built. Saved tensors under
            ``activation_min_offload_bytes`` stay on the device.
        prefetch: the next role comes in behind the current phase's compute
            (:meth:`tidal.Timeshare.prefetch`): generation starts bringing the reference in,
            reference scoring starts bringing the reward model in (if there is one), and the
            last of them the policy back. On an accelerator each phase leaves free what it
            allocated the last time it ran (plus 10% and 256 MiB), so the first generation and
            scoring prefetch nothing; it trades peak memory for time. Each turn (generation,
            scoring, the loss) then moves out only what it takes to leave free what its phase
            allocated the last time (plus 10% and 256 MiB; within ``prefetch_peak_bytes`` if
            set), least recently used first: the reference's (and a reward model's) turn keeps
            the policy on the device where it fits, so the loss needs no copy of it back in;
            the loss's turn keeps the frozen reference where it fits beside the loss's and the
            backward's need (then nothing moves at all; counting the driver's free memory and
            the allocator's whole free segments, not the free pieces of its partly used ones,
            which the backward's large blocks may not fit; the room is read again right before
            the backward), and drops it without a copy where not.
            A phase that needs more than its last reading (longer prompts or completions) and
            runs out of memory beside the roles its turn kept (or a prefetch brought in) runs
            again once they are out, its random generators set back: the same results (the
            generation, the scorings and the loss's forward; not a forward whose activations
            are offloaded, nor the backward, which reads the room again instead).
            Where the room is lacking (and in the first step, before the phases were measured),
            generation's prefetch writes the policy back to the host and the switch releases it
            without a copy if nothing wrote it since.
            The policy's optimizer state (``"step"``/``"stream"`` residency) starts coming in
            as the backward starts (:meth:`tidal.Timeshare.prefetch_optimizer`), as much as the
            backward leaves free, so its step finds it arrived.
            Needs a role beside the policy (``beta > 0`` or a reward model) to move the roles
            ahead; the optimizer state is brought in ahead either way.
            With ``use_vllm=True`` the engine's turns keep too: once the engine's weights and KV
            cache have woken once (their bytes read at driver level), each generation moves out
            only what it takes to leave them (+10%, 256 MiB) and 1 GiB for the generation free,
            least recently used first and the policy last; where all of it fits (TRL + vLLM
            alone fits), nothing moves for the engine. Its room made, the reference comes in
            behind the generation (leaving those 1 GiB free), and the device's cache goes back
            to the driver before a wake only where the driver lacks the room for it (a release
            waits for the optimizer state's queued copies to the host). Under
            ``prefetch_peak_bytes`` the engine's turns keep a role only where the engine's
            memory fits beside it below the bound, read at driver level (vLLM's pool is the
            driver's, not torch's allocator's).
        prefetch_peak_bytes: with ``prefetch``, the device's allocated bytes a prefetch may
            bring it up to (what a phase will still allocate counted, and what a prefetch
            brought in counted once; the allocator's fragments, free memory a large block cannot
            use, are left free beside it but are not allocated and do not count): prefetch
            trades peak memory for time, and this bounds the trade. ``None``: free memory
            decides.
        vllm_kv_cache_bytes: with ``use_vllm=True`` (colocate), the engine's KV cache in bytes
            (vLLM's ``kv_cache_memory_bytes``), sized for the generation the step runs instead
            of a fraction of the device fixed before the optimizer exists. ``"auto"``: the cache
            that holds every sequence TRL's engine runs at once (its ``max_num_seqs``: the
            generation batch) at ``vllm_max_model_length`` tokens, in whole blocks of 16
            (:func:`tidal.integrations.vllm.kv_cache_bytes_for`; Qwen2-7B, 64 sequences of 1024
            tokens: 3.5 GiB); needs ``vllm_max_model_length`` set. ``None``: as TRL
            sizes it (``vllm_gpu_memory_utilization``). With sleep mode the cache is on the
            device only while the engine generates, the training roles out of its way.
    """

    optimizer_residency: OptimizerResidency = "step"
    timeshare: TimeshareConfig = dataclasses.field(
        default_factory=lambda: TimeshareConfig(release_to_driver=False, wait_for_copies=False)
    )
    activation_offload: bool = False
    activation_layers: str = "auto"
    activation_min_offload_bytes: int = 1 << 20
    prefetch: bool = False
    prefetch_peak_bytes: int | None = None
    vllm_kv_cache_bytes: int | Literal["auto"] | None = None

    def __post_init__(self) -> None:
        check_bool_fields(self)  # prefetch="no" is a truthy string: refused, not switched on
        if self.optimizer_residency not in ("step", "stream", "role"):
            raise ValueError(
                f"TidalConfig.optimizer_residency must be 'step', 'stream' or 'role', got {self.optimizer_residency!r}"
            )
        if not isinstance(self.timeshare, TimeshareConfig):
            raise TypeError(
                f"TidalConfig.timeshare must be a tidal.TimeshareConfig, got {type(self.timeshare).__name__}"
            )
        check_activation_fields(self)
        v = self.vllm_kv_cache_bytes
        if v is not None and v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"TidalConfig.vllm_kv_cache_bytes must be an int > 0, 'auto' or None, got {v!r}")
        if self.prefetch_peak_bytes is not None and self.prefetch_peak_bytes < 0:
            raise ValueError(f"TidalConfig.prefetch_peak_bytes must be >= 0 or None, got {self.prefetch_peak_bytes}")
