"""GRPO with its roles in separate processes on one device: Ray actors, or spawned processes.

The driver (:class:`RemoteGRPO`) draws prompts and sequences the step; the roles live in
workers (:mod:`tidal_recipes.grpo.workers`):

- ``policy`` (rollout + actor_train, one module) and ``reference``: GPU workers colocated on one
  GPU, each holding its state through its own Timeshare and taking turns through the GPU's
  :class:`~tidal.distributed.GPULease` (only the holder's state is resident; a hand-over
  completes after the previous holder's release is confirmed at driver level);
- ``reward``: CPU workers (the verifier), spread over the nodes.

Backends:

- ``"ray"``: :func:`tidal.distributed.place` reserves one GPU for the colocated roles
  (fractional shares) and CPUs for the reward workers; the lease arbiter is a Ray actor.
  Ray must be initialised by the caller (``ray.init(...)``).
- ``"processes"``: the workers are spawned processes of this host and the arbiter a
  :class:`~tidal.distributed.LeaseServer` thread of the driver; no Ray needed.

A step gives the same numbers as :class:`~tidal_recipes.grpo.GRPOTrainer` with the same config and
model (same prompts, same sampling stream, same updates), since the roles run the same code
on the same device; only host tensors of a few MB cross processes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import torch

from tidal.distributed.lease import LeaseServer, start_lease_actor
from tidal.distributed.placement import CPUWorker, GPURole, PlacementSpec, place
from tidal_recipes.grpo.trainer import GRPOConfig, StepResult, draw_prompts, prompt_generator
from tidal_recipes.grpo.workers import PolicyWorker, ReferenceWorker, RewardWorker

__all__ = ["RemoteConfig", "RemoteGRPO", "WorkerError"]


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its traceback."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    """
    Attributes:
        backend: ``"ray"`` or ``"processes"`` (see the module docstring).
        device: the workers' device, ``"cuda"`` or ``"cpu"``.
        reward_workers: CPU reward workers (the batch is split among them).
        lease_ttl_s: a worker not heard from for this long loses its turn (crash safety).
        acquire_timeout_s: most seconds a turn may wait (None: as long as the queue takes).
        gpu_resource: the Ray resource counting GPUs (a custom one for a CPU device).
        placement_timeout_s: most seconds to wait for Ray to place the workers.
        policy_cpus: CPUs Ray reserves for the policy worker. Ray caps an actor's torch
            threads at its CPUs, and CPU Adam's host update runs on them: measured on an
            H200 host, the demo's train phase took 8.7 s with 1 CPU against 2.5 s unlimited
            (spawned processes). Ignored by ``"processes"`` (no cap).
    """

    backend: Literal["ray", "processes"] = "ray"
    device: str = "cuda"
    reward_workers: int = 1
    lease_ttl_s: float = 60.0
    acquire_timeout_s: float | None = 600.0
    gpu_resource: str = "GPU"
    placement_timeout_s: float = 60.0
    policy_cpus: int = 1

    def __post_init__(self) -> None:
        if self.backend not in ("ray", "processes"):
            raise ValueError(f"backend must be 'ray' or 'processes', got {self.backend!r}")
        if self.reward_workers < 1:
            raise ValueError(f"reward_workers must be >= 1, got {self.reward_workers}")
        if not isinstance(self.policy_cpus, int) or self.policy_cpus < 1:
            raise ValueError(f"policy_cpus must be an int >= 1, got {self.policy_cpus!r}")
        if not self.lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")


# ---- a spawned process as an actor ---------------------------------------------------------
def _serve(conn, cls, args: tuple, kwargs: dict) -> None:
    try:
        obj = cls(*args, **kwargs)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 (reported to the driver, which raises)
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the driver is gone
            msg = None
        if msg is None:
            # Exit without interpreter teardown: the worker's device and pinned memory go
            # with the process, and no background thread (heartbeats, CPU Adam) can hold it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        method, a, kw = msg
        try:
            conn.send(("ok", getattr(obj, method)(*a, **kw)))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class _ProcessActor:
    """``cls(*args)`` in a spawned process; ``call`` sends a method call, ``result`` waits."""

    def __init__(self, name: str, cls, *args, **kwargs) -> None:
        ctx = multiprocessing.get_context("spawn")  # no CUDA state may be forked
        self.name = name
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, cls, args, kwargs), name=f"tidal-{name}", daemon=True)
        self._proc.start()
        child.close()

    def ready(self) -> None:
        self.result()  # the constructor's reply

    def call(self, method: str, *args, **kwargs) -> _ProcessActor:
        self._conn.send((method, args, kwargs))
        return self

    def result(self) -> Any:
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise WorkerError(
                f"worker {self.name!r} died (exit code {self._proc.exitcode}); see its output above"
            ) from None
        if status == "error":
            raise WorkerError(f"worker {self.name!r} failed:\n{value}")
        return value

    def stop(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()


class _RayCall:
    def __init__(self, ref) -> None:
        self.ref = ref

    def result(self) -> Any:
        import ray

        try:
            return ray.get(self.ref)
        except ray.exceptions.RayError as e:
            raise WorkerError(str(e)) from e


class _RayActor:
    def __init__(self, name: str, handle) -> None:
        self.name, self.handle = name, handle

    def ready(self) -> None:
        _RayCall(self.handle.__ray_ready__.remote()).result()

    def call(self, method: str, *args, **kwargs) -> _RayCall:
        return _RayCall(getattr(self.handle, method).remote(*args, **kwargs))

    def stop(self) -> None:
        import ray

        ray.kill(self.handle)


# ---- the driver -----------------------------------------------------------------------------
class RemoteGRPO:
    """GRPO whose roles are workers in separate processes sharing one device.

    Args:
        model_factory: picklable ``factory(device) -> model`` (e.g. a ``functools.partial`` of
            a module-level function); every worker calls it, so each gets the same weights.
        config: the GRPO settings, as for :class:`~tidal_recipes.grpo.GRPOTrainer`.
        remote: backend and device (see :class:`RemoteConfig`).

    Host memory: each GPU worker keeps its offloaded state in pinned host memory of its own
    process (the policy: weights, and the optimizer state unless it is CPU Adam's; the
    reference: weights). Call :meth:`close` (or use ``with``) to stop the workers.
    """

    def __init__(
        self, model_factory: Callable[[str], torch.nn.Module], *, config: GRPOConfig, remote: RemoteConfig | None = None
    ) -> None:
        self.config, self.remote = config, remote or RemoteConfig()
        if not config.timeshare:
            raise ValueError(
                "roles in separate processes take turns on the device through their "
                "Timeshares; GRPOConfig(timeshare=True) is required"
            )
        self.step_index = 0
        self._gen_prompts = prompt_generator(config)
        self._actors: list = []
        self._server: LeaseServer | None = None
        self.placement = None
        try:
            self._start(model_factory)
        except BaseException:
            self.close()
            raise

    def _start(self, model_factory) -> None:
        r, cfg = self.remote, self.config
        use_ref = cfg.loss.kl_coef > 0
        gpu_kw = {"device": r.device, "acquire_timeout_s": r.acquire_timeout_s}
        if r.backend == "processes":
            self._server = LeaseServer(ttl_s=r.lease_ttl_s).start()
            arbiter = self._server.address
            self.policy = _ProcessActor("policy", PolicyWorker, model_factory, cfg, arbiter=arbiter, **gpu_kw)
            self._actors.append(self.policy)
            self.policy.ready()
            self.reference = None
            if use_ref:
                self.reference = _ProcessActor(
                    "reference", ReferenceWorker, model_factory, cfg, arbiter=arbiter, **gpu_kw
                )
                self._actors.append(self.reference)
                self.reference.ready()
            self.rewarders = [_ProcessActor(f"reward{i}", RewardWorker, cfg) for i in range(r.reward_workers)]
            self._actors += self.rewarders
            for w in self.rewarders:
                w.ready()
            return
        self._start_ray(model_factory, use_ref, gpu_kw)

    def _start_ray(self, model_factory, use_ref: bool, gpu_kw: dict) -> None:
        import ray

        if not ray.is_initialized():
            raise ValueError(
                "backend='ray' runs the roles as Ray actors: call ray.init(...) first "
                "(or use backend='processes' for one host without Ray)"
            )
        r, cfg = self.remote, self.config
        roles = [GPURole(name="policy", colocate="gpu0", cpus=r.policy_cpus)]
        if use_ref:
            roles.append(GPURole(name="reference", colocate="gpu0"))
        spec = PlacementSpec(
            roles=roles,
            workers=[CPUWorker(name="reward", count=r.reward_workers)],
            gpu_resource=r.gpu_resource,
            timeout_s=r.placement_timeout_s,
            name="tidal-grpo",
        )
        self.placement = place(spec)
        lease_actor = start_lease_actor(self.placement.lease_name("policy"), ttl_s=r.lease_ttl_s)
        self._lease_actor = lease_actor

        def actor(name: str, cls, *args, index: int = 0, **kwargs) -> _RayActor:
            # The workers' own turns order their GPU allocations; Ray's fractional GPU shares
            # only put them on the same device.
            opts = self.placement.options_for(name, index)
            handle = ray.remote(cls).options(**opts, max_restarts=0).remote(*args, **kwargs)
            a = _RayActor(f"{name}{index or ''}", handle)
            self._actors.append(a)
            return a

        self.policy = actor("policy", PolicyWorker, model_factory, cfg, arbiter=lease_actor, **gpu_kw)
        self.reference = (
            actor("reference", ReferenceWorker, model_factory, cfg, arbiter=lease_actor, **gpu_kw) if use_ref else None
        )
        self.rewarders = [actor("reward", RewardWorker, cfg, index=i) for i in range(r.reward_workers)]
        # Wait for construction, so errors surface here and not at the first step.
        for a in self._actors:
            a.ready()

    def step(self) -> StepResult:
        """One GRPO step; the phases of every role in ``result.phases`` (measured in the
        worker that ran them)."""
        cfg = self.config
        t0 = time.perf_counter()
        res = StepResult(step=self.step_index, reward_mean=0.0, reward_std=0.0, stats={})
        prompts = draw_prompts(cfg, self._gen_prompts)
        out = self.policy.call("rollout", prompts).result()
        seqs, old_logp = out["seqs"], out["old_logp"]
        res.phases.update(out["phases"])
        # The verifiers (CPU) and the reference (the GPU) run at the same time.
        ref_call = self.reference.call("logprobs", seqs) if self.reference is not None else None
        parts = torch.arange(seqs.shape[0]).chunk(len(self.rewarders))
        calls = [w.call("rewards", prompts[idx], seqs[idx]) for w, idx in zip(self.rewarders, parts)]
        rewards = torch.cat([c.result() for c in calls])
        res.reward_mean, res.reward_std = float(rewards.mean()), float(rewards.std())
        ref_logp = None
        if ref_call is not None:
            ref = ref_call.result()
            ref_logp = ref["ref_logp"]
            res.phases.update(ref["phases"])
        out = self.policy.call("train", seqs, rewards, old_logp, ref_logp).result()
        res.stats = out["stats"]
        res.phases.update(out["phases"])
        res.seconds = time.perf_counter() - t0
        self.step_index += 1
        return res

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's current weights, on the driver's host."""
        return self.policy.call("state_dict").result()

    def timelines(self) -> dict[str, dict]:
        """Each GPU worker's memory timeline (absolute times, for merging)."""
        out = {"policy": self.policy.call("timeline").result()}
        if self.reference is not None:
            out["reference"] = self.reference.call("timeline").result()
        return out

    def close(self) -> None:
        """Stop the workers and remove the placement. A worker's device memory and pinned
        host memory go with its process (nothing is brought back to the device)."""
        for a in getattr(self, "_actors", []):
            a.stop()
        self._actors = []
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.placement is not None:
            self.placement.remove()
            self.placement = None

    def __enter__(self) -> RemoteGRPO:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
