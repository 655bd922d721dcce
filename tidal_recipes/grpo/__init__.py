"""The reference RL loop: GRPO with rollout, reference and training roles on one device, in
one process (:class:`GRPOTrainer`) or as workers of separate processes (:class:`RemoteGRPO`)."""

from tidal_recipes.grpo.grpo import LossConfig, action_logprobs, group_advantages, grpo_loss, kl_k3
from tidal_recipes.grpo.rollout import sample_answers
from tidal_recipes.grpo.tasks import TASKS, DigitTask
from tidal_recipes.grpo.remote import RemoteConfig, RemoteGRPO, WorkerError
from tidal_recipes.grpo.trainer import GRPOConfig, GRPOTrainer, StepResult

__all__ = [
    "DigitTask",
    "GRPOConfig",
    "GRPOTrainer",
    "LossConfig",
    "RemoteConfig",
    "RemoteGRPO",
    "StepResult",
    "TASKS",
    "action_logprobs",
    "group_advantages",
    "grpo_loss",
    "kl_k3",
    "sample_answers",
    "WorkerError",
]
