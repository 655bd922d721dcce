"""What a checkpoint holds: a DCP ``Stateful`` over a model, its optimizers, an LR scheduler,
the RNG states, the step counter and user extras, read from wherever each tensor lives.

``state_dict()`` returns the live tensors themselves (sharded ``DTensor`` s for an FSDP2 model,
optimizer moments keyed by parameter name, through torch's ``get_state_dict``), so DCP writes
them without a gathered or cloned copy, and ``dcp.load`` reads bytes straight into them: load
is in place.

A tensor whose storage a :class:`tidal.Timeshare` has offloaded (0 bytes on the device) is
replaced by a view of its host copy, so saving reads the host bytes and loading writes them,
with no reload to the device. Memory cost: nothing beyond the views (no copies).

RNG states are per rank (``rng/rank<r>``); a checkpoint loaded by a rank that did not exist at
save time (world size grew) keeps that rank's current RNG and warns.
"""

from __future__ import annotations

import pickle
import random
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from tidal.state.foreign import moved_out, readable

__all__ = ["TrainState"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor, str], torch.Tensor], where: str = "") -> Any:
    """A copy of the containers of ``obj`` with every tensor leaf replaced by ``fn(t)``. The
    containers are new (DCP writes loaded non-tensor values into them, not into the optimizer's
    own dicts); tensors are whatever ``fn`` returns."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, where)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, f"{where}.{k}" if where else str(k)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_map_tensors(v, fn, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(_map_tensors(v, fn, f"{where}[{i}]") for i, v in enumerate(obj))
    return obj


def _pairs(handed: Any, loaded: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(handed tensor, loaded tensor) at the same place of two structures."""
    if isinstance(handed, torch.Tensor):
        return [(handed, loaded)]
    if isinstance(handed, dict) and isinstance(loaded, dict):
        return [p for k in handed if k in loaded for p in _pairs(handed[k], loaded[k])]
    if isinstance(handed, (list, tuple)) and isinstance(loaded, (list, tuple)):
        return [p for a, b in zip(handed, loaded) for p in _pairs(a, b)]
    return []


class TrainState(Stateful):
    """The training state of one role, for :func:`tidal.checkpoint.save` and ``load``.

    Args:
        model: the module (plain, or sharded by :func:`tidal.distributed.shard_model`).
        optimizer: one optimizer or a list; ``None`` saves the model only.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``).
        timeshare: the :class:`tidal.Timeshare` holding this role, if any: offloaded tensors are
            then read from (and loaded into) its host copies.
        step: the training step; :func:`~tidal.checkpoint.load` restores it here.
        extra: a dict of picklable values or tensors saved with the state (same on every rank).
        rng: save and restore torch's CPU and accelerator RNG and Python's ``random`` per rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        scheduler: Any = None,
        timeshare: Any = None,
        step: int = 0,
        extra: dict | None = None,
        rng: bool = True,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        optimizers = (
            [] if optimizer is None else (list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        )
        for o in optimizers:
            if not isinstance(o, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a list), got {type(o).__name__}")
        if scheduler is not None and not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
            raise TypeError(f"scheduler must have state_dict() and load_state_dict(), got {type(scheduler).__name__}")
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
        self.model = model
        self.optimizers = optimizers
        self.scheduler = scheduler
        self.timeshare = timeshare
        self.step = int(step)
        self.extra = extra if extra is not None else {}
        self.rng = rng
        self.load_rng = True  # cleared by load() when this rank has no saved RNG
        self._handed: dict | None = None

    # ---- where each tensor lives --------------------------------------------------------------
    def _resolve(self, t: torch.Tensor, where: str) -> torch.Tensor:
        """``t``, or, if its storage is offloaded, the same view of its host copy (read by
        save, written in place by load, both while the role stays offloaded)."""
        if not moved_out(t):
            return t
        store = getattr(self.timeshare, "store", None)
        host = readable(store, t) if store is not None else t
        if host is t:
            raise ValueError(
                f"{where}: its storage has no memory and no timeshare holds it"
                + ("" if store is not None else " (no timeshare= was given)")
                + "; pass the Timeshare that offloaded this role as TrainState(timeshare=ts), or "
                "make the role resident before saving"
            )
        return host

    # ---- Stateful ------------------------------------------------------------------------------
    def _check_fresh_optimizers(self) -> None:
        # torch creates a fresh optimizer's state with a zero-lr step(), which needs the
        # params on the device.
        for o in self.optimizers:
            if o.state:
                continue
            params = [p for g in o.param_groups for p in g["params"]]
            if any(moved_out(p) for p in params):
                raise ValueError(
                    "the optimizer has no state yet and its parameters are offloaded, so its state "
                    "cannot be created to load into; make the role resident (ts.load(name)) before "
                    "loading the checkpoint, then switch as usual"
                )

    def state_dict(self) -> dict[str, Any]:
        self._check_fresh_optimizers()
        options = StateDictOptions(full_state_dict=False, cpu_offload=False)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=options)
        out: dict[str, Any] = {
            "model": _map_tensors(model_sd, self._resolve, "model"),
            "step": self.step,
            "extra": _map_tensors(self.extra, self._resolve, "extra"),
        }
        if self.optimizers:
            out["optim"] = _map_tensors(optim_sd, self._resolve, "optim")
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.rng and self.load_rng:
            out[f"rng/rank{_rank()}"] = pickle.dumps(_rng_state())
        self._handed = out
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        handed = self._handed
        if handed is None:
            raise RuntimeError("load_state_dict without state_dict(): load through tidal.checkpoint.load")
        # Tensors were loaded in place into what state_dict() handed out; should DCP have given
        # back other tensor objects, copy their bytes into the live ones.
        for live, got in _pairs(handed, state_dict):
            if got is not live:
                live.copy_(got)
        if "optim" in state_dict:
            self._apply_optimizer(handed["optim"], state_dict["optim"])
        if self.scheduler is not None and "scheduler" in state_dict:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        self.step = int(state_dict["step"])
        self.extra.update(state_dict.get("extra", {}))
        key = f"rng/rank{_rank()}"
        if self.rng and key in state_dict:
            _set_rng_state(pickle.loads(state_dict[key]))
        self._handed = None

    def _apply_optimizer(self, handed: dict, loaded: dict) -> None:
        """Hyper-parameters of every param group and the non-tensor state values (tensors were
        loaded in place)."""
        groups = [g for o in self.optimizers for g in o.param_groups]
        saved = loaded["param_groups"]
        if len(saved) != len(groups):
            raise ValueError(
                f"the checkpoint has {len(saved)} optimizer param groups, the optimizer "
                f"{len(groups)}; build the optimizer with the same groups as the saved run"
            )
        by_fqn: dict[str, tuple[torch.optim.Optimizer, torch.Tensor]] = {}
        i = 0
        for o in self.optimizers:
            for g in o.param_groups:
                for p, fqn in zip(g["params"], handed["param_groups"][i]["params"]):
                    by_fqn[fqn] = (o, p)
                i += 1
        for g, s in zip(groups, saved):
            for k, v in s.items():
                if k != "params":
                    g[k] = v
        for fqn, values in loaded["state"].items():
            if fqn not in by_fqn:
                raise ValueError(f"the checkpoint has optimizer state for {fqn!r}, which this model lacks")
            o, p = by_fqn[fqn]
            for k, v in values.items():
                if not isinstance(v, torch.Tensor):
                    o.state[p][k] = v


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    elif "cuda" in state:
        warnings.warn(
            "the checkpoint holds a CUDA RNG state but CUDA is not available here; not restored", stacklevel=3
        )
