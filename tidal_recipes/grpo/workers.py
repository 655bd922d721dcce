"""The GRPO roles as workers of their own processes, sharing one GPU through a lease.

Each class is plain Python: :class:`tidal_recipes.grpo.RemoteGRPO` runs it as a Ray actor or in a
spawned process, and it can be built in-process in tests. A worker builds its model itself
(from a picklable ``model_factory(device) -> nn.Module``), so no weights cross processes.

- :class:`PolicyWorker`: ``rollout`` and ``actor_train``, one module with its optimizer (a
  :class:`~tidal_recipes.grpo.GRPOTrainer` without a reference role), so the weights exist once.
- :class:`ReferenceWorker`: the frozen reference, log-probs only.
- :class:`RewardWorker`: the task's verifier, on the CPU.

The GPU workers hold their state through a :class:`~tidal.Timeshare` and take turns through
a :class:`~tidal.distributed.GPULease`: a turn brings the worker's role in; leaving it offloads
everything of the worker and confirms at driver level before the next worker is granted. The
model is built inside a turn as well, so two workers never allocate on the GPU at once.
What crosses processes per step: prompts, sampled sequences, rewards and log-probs (a few KB
to MB of host tensors).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch

from tidal.device import DeviceOps
from tidal.distributed.lease import GPULease, LeaseConfig
from tidal_recipes.grpo.grpo import group_advantages
from tidal_recipes.grpo.modes import role_mode
from tidal_recipes.grpo.phases import RoleTurns
from tidal_recipes.grpo.trainer import GRPOConfig, GRPOTrainer, StepResult, answer_logprobs
from tidal.state import unique_storage_bytes
from tidal.timeline import MemoryTimeline
from tidal.timeshare import Timeshare

__all__ = ["PolicyWorker", "ReferenceWorker", "RewardWorker"]

ModelFactory = Callable[[str], torch.nn.Module]


def _lease(arbiter, holder: str, ttl_s: float | None) -> GPULease | None:
    if arbiter is None:
        return None
    return GPULease(arbiter, holder=holder, config=LeaseConfig(acquire_timeout_s=ttl_s))


def _build_in_turn(lease: GPULease | None, role: str, build: Callable[[], Timeshare | None]):
    """Run ``build`` (allocating on the device) inside a lease turn whose release offloads
    what it built, so construction never overlaps another worker's turn."""
    if lease is None:
        return build()
    built: dict = {}

    def release_fn() -> dict:
        return _offload(built.get("ts"))

    with lease.hold(f"setup:{role}", release_fn=release_fn):
        built["ts"] = build()
    return built["ts"]


def _offload(ts: Timeshare | None) -> dict:
    record = ts.offload_all() if ts is not None else None
    return {"bytes_out": record.bytes_out if record else 0}


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu")


class PolicyWorker:
    """``rollout`` + ``actor_train`` of the policy, in this process.

    Args:
        model_factory: ``factory(device)`` builds the policy on ``device`` (same seed in every
            process that must agree).
        config: the GRPO settings (``timeshare`` must be on when ``arbiter`` is given).
        device: this worker's device (``"cuda"``: the GPU Ray or the launcher gave it).
        arbiter: the GPU's lease arbiter (``"host:port"`` or a Ray actor handle), or None to
            keep the roles resident (no other process on the device).
        acquire_timeout_s: most seconds a turn may wait (None: as long as it takes).
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        config: GRPOConfig,
        *,
        device: str,
        arbiter=None,
        acquire_timeout_s: float | None = None,
    ) -> None:
        self.lease = _lease(arbiter, "policy", acquire_timeout_s)
        self.config = config

        def build() -> Timeshare | None:
            policy = model_factory(device)
            self.trainer = GRPOTrainer(policy, config=config, remote_reference=True, lease=self.lease)
            return self.trainer.ts

        _build_in_turn(self.lease, "policy", build)

    def rollout(self, prompts: torch.Tensor) -> dict:
        """Sample answers; returns host tensors ``seqs``, ``old_logp`` (or None) and the phase."""
        res = StepResult(step=self.trainer.step_index, reward_mean=0.0, reward_std=0.0, stats={})
        seqs, old_logp = self.trainer.rollout_phase(prompts, res)
        return {"seqs": _host(seqs), "old_logp": _host(old_logp), "phases": res.phases}

    def train(
        self, seqs: torch.Tensor, rewards: torch.Tensor, old_logp: torch.Tensor | None, ref_logp: torch.Tensor | None
    ) -> dict:
        """The updates of one step. Advantages are computed here, on the policy's device, as
        the in-process trainer does (same numbers, bit for bit)."""
        res = StepResult(step=self.trainer.step_index, reward_mean=0.0, reward_std=0.0, stats={})
        adv = group_advantages(rewards.to(self.trainer.device), self.config.group_size)
        self.trainer.train_phase(seqs, adv, old_logp, ref_logp, res)
        return {"stats": res.stats, "phases": res.phases}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights on the host (their current values, wherever they live)."""
        ts = self.trainer.ts
        if ts is not None and self.lease is not None:
            with self.lease.hold("read:policy", acquire_fn=lambda: ts.load("rollout"), release_fn=lambda: _offload(ts)):
                return {k: v.detach().to("cpu", copy=True) for k, v in self.trainer.policy.state_dict().items()}
        return {k: v.detach().to("cpu", copy=True) for k, v in self.trainer.policy.state_dict().items()}

    def timeline(self) -> dict:
        return _timeline_dump(self.trainer.timeline)

    def close(self) -> None:
        self.trainer.close()
        if self.lease is not None:
            self.lease.close()


class ReferenceWorker:
    """The frozen reference policy, in this process; arguments as :class:`PolicyWorker`."""

    def __init__(
        self,
        model_factory: ModelFactory,
        config: GRPOConfig,
        *,
        device: str,
        arbiter=None,
        acquire_timeout_s: float | None = None,
    ) -> None:
        self.lease = _lease(arbiter, "reference", acquire_timeout_s)
        self.config = config
        self.step_index = 0

        def build() -> Timeshare | None:
            self.model = model_factory(device).requires_grad_(False).eval()
            self.device = next(self.model.parameters()).device
            self.ops = DeviceOps(self.device)
            self.timeline_ = MemoryTimeline(self.ops, state_bytes=self._state_bytes)
            ts = None
            if config.timeshare:
                ts = Timeshare(self.device, config=config.timeshare_config)
                ts.add_role("reference", model=self.model)
            self.turns = RoleTurns(self.ops, self.timeline_, ts, self.lease)
            self.ts = ts
            return ts

        _build_in_turn(self.lease, "reference", build)

    def _state_bytes(self) -> int:
        """Bytes of the reference's weights held on the device now (CPU timelines plot it)."""
        return unique_storage_bytes(itertools.chain(self.model.parameters(), self.model.buffers()), self.device)

    def logprobs(self, seqs: torch.Tensor) -> dict:
        """The reference's log-probs of the answers in ``seqs`` (host tensor) and the phase."""
        phases: dict = {}
        with self.turns.phase("reference", role="reference", into=phases, step=self.step_index):
            with role_mode(self.model, "reference"):
                ref_logp = answer_logprobs(
                    self.model,
                    seqs.to(self.device),
                    self.config.task.answer_len,
                    micro_batch=self.config.micro_batch,
                    on_chunk=self.timeline_.sample,
                )
            ref_logp = _host(ref_logp)
        self.step_index += 1
        return {"ref_logp": ref_logp, "phases": phases}

    def timeline(self) -> dict:
        return _timeline_dump(self.timeline_)

    def close(self) -> None:
        if self.ts is not None:
            self.ts.close()
        if self.lease is not None:
            self.lease.close()


class RewardWorker:
    """The task's verifier on the CPU (a stand-in for a reward model or a sandbox)."""

    def __init__(self, config: GRPOConfig) -> None:
        self.task = config.task

    def rewards(self, prompts: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
        return self.task.rewards(prompts, seqs[:, prompts.shape[1] :])


def _timeline_dump(tl: MemoryTimeline) -> dict:
    """A timeline's records with absolute times (``time.perf_counter`` is the system's
    monotonic clock on Linux, shared by the processes of one host), for merging."""
    t0 = time.perf_counter() - tl.now()
    return {
        "t0": t0,
        "samples": list(tl.samples),
        "marks": list(tl.marks),
        "phases": [vars(p).copy() for p in tl.phases],
    }
