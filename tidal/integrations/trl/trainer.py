"""The trainers: :class:`TidalRLTrainer`, the tidal side of a TRL trainer with GRPOTrainer's
phases, and :class:`TidalGRPOTrainer` / :class:`TidalRLOOTrainer` (see the package docstring)."""

from __future__ import annotations

from typing import Any

from trl import GRPOTrainer, RLOOTrainer

from tidal.integrations.hf import host_grad_norm
from tidal.integrations.seams import check_trainer, check_trainer_class
from tidal.integrations.trl.adapter import TrlAdapter
from tidal.integrations.trl.checks import place_models_whole, refuse_settings
from tidal.integrations.trl.config import TidalConfig
from tidal.timeshare import Timeshare

__all__ = ["TidalGRPOTrainer", "TidalRLOOTrainer", "TidalRLTrainer"]


class TidalRLTrainer:
    """The tidal side of :class:`TidalGRPOTrainer` and :class:`TidalRLOOTrainer`: a mixin put in
    front of a TRL trainer with GRPOTrainer's phases (``_generate``,
    ``_get_per_token_logps_and_entropies``, ``_calculate_rewards``, ``compute_loss``,
    ``training_step``, ``log``), each of which it hands to its
    :class:`~tidal.integrations.trl.adapter.TrlAdapter` (``trainer.tidal``) with TRL's own work.
    Takes the trainer's arguments, plus ``tidal=TidalConfig(...)``. ``trainer.timeshare`` is the
    adapter's :class:`~tidal.Timeshare`.

    Memory cost: host RAM for the state of each role while it is out (pinned once, when the
    role is registered: the reference and reward models at construction, the policy when its
    optimizer exists); on the device, the role in use plus one staging bucket per direction
    during a switch.

    Raises:
        ValueError: a setting tidal cannot work with (see the module docstring), before any
            work.
        TypeError: ``tidal`` is not a :class:`TidalConfig`.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Every private surface of TRL, transformers and accelerate used here, checked as the
        # class is built: a renamed one is an error, not a lever silently gone.
        after = cls.__mro__[cls.__mro__.index(TidalRLTrainer) + 1 :]
        base = next((c for c in after if not c.__module__.startswith("tidal.")), None)
        if base is not None and base is not object:
            check_trainer_class(base, who=cls.__name__)

    def __init__(self, *args: Any, tidal: TidalConfig | None = None, **kwargs: Any) -> None:
        if tidal is not None and not isinstance(tidal, TidalConfig):
            raise TypeError(f"tidal must be a tidal.integrations.trl.TidalConfig, got {type(tidal).__name__}")
        targs = kwargs.get("args") if "args" in kwargs else (args[2] if len(args) > 2 else None)
        refuse_settings(targs, type(self).__name__, tidal)
        place_models_whole(targs)
        self.tidal_config = tidal or TidalConfig()
        adapter = TrlAdapter(self.tidal_config, who=type(self).__name__)
        with adapter.building(self, targs):
            super().__init__(*args, **kwargs)
        check_trainer(self, who=type(self).__name__)
        self.tidal = adapter
        adapter.attach(self)

    @property
    def timeshare(self) -> Timeshare:
        """The roles of this trainer (the policy, the reference, reward models) taking turns."""
        return self.tidal.timeshare

    # ---- the phases: TRL's work, handed to the adapter ----------------------------------------
    def _generate(self, prompts: list):
        return self.tidal.generate(lambda: super(TidalRLTrainer, self)._generate(prompts))

    def _get_per_token_logps_and_entropies(self, model, *args: Any, **kwargs: Any):
        inner = super()._get_per_token_logps_and_entropies
        return self.tidal.score(model, lambda: inner(model, *args, **kwargs))

    def _calculate_rewards(self, *args: Any, **kwargs: Any):
        return self.tidal.rewards(lambda: super(TidalRLTrainer, self)._calculate_rewards(*args, **kwargs))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inner = super().compute_loss
        return self.tidal.loss(model, lambda: inner(model, inputs, return_outputs, num_items_in_batch))

    def training_step(self, model, inputs, num_items_in_batch=None):
        inner = super().training_step
        return self.tidal.training_step(lambda: inner(model, inputs, num_items_in_batch))

    # ---- CPUAdam's host gradients, tidal's figures in each log line ---------------------------
    def _clip_grad_norm(self, model):
        inner = super()._clip_grad_norm
        return host_grad_norm(self.optimizer, self.args.max_grad_norm, lambda: inner(model))

    def _get_grad_norm(self, model, grad_norm=None):
        inner = super()._get_grad_norm
        if grad_norm is not None:
            return inner(model, grad_norm)
        return host_grad_norm(self.optimizer, float("inf"), lambda: inner(model, grad_norm))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.tidal.add_figures(logs)
        super().log(logs, start_time)


class TidalGRPOTrainer(TidalRLTrainer, GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy, reference and reward models take turns on the device
    (see the module docstring). Takes GRPOTrainer's arguments, plus ``tidal=TidalConfig(...)``."""


class TidalRLOOTrainer(TidalRLTrainer, RLOOTrainer):
    """``trl.RLOOTrainer`` (REINFORCE leave-one-out; a reference by default, ``beta=0.05``)
    whose policy, reference and reward models take turns on the device, as
    :class:`TidalGRPOTrainer`. Takes RLOOTrainer's arguments, plus ``tidal=TidalConfig(...)``."""
