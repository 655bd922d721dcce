"""Tasks with a reward computed in code: digit strings to copy, reverse, sort or add.

A prompt is ``BOS d1 .. dn SEP``; the answer is ``n`` digits. The policy only ever chooses
among the ten digit tokens (its action space), so every answer is well formed and the reward
is the fraction of answer positions that are right: dense enough that a tiny model trained
from random weights by GRPO improves within a few hundred samples.

Token ids are the first :data:`TASK_VOCAB` ids of the model's vocabulary, so the same task
runs on a model with a 16-token vocabulary or on a Qwen2-shape one with 151936 (the other
ids are never sampled, and log-probabilities are taken over the digit ids only).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["BOS", "SEP", "DIGIT0", "TASK_VOCAB", "TASKS", "DigitTask"]

BOS, SEP, DIGIT0 = 0, 1, 2
TASK_VOCAB = DIGIT0 + 10  # BOS, SEP and the ten digits

TASKS = ("copy", "reverse", "sort", "add")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DigitTask:
    """
    Attributes:
        name: ``copy`` (repeat the digits), ``reverse``, ``sort`` (ascending), or ``add``
            (the prompt holds two ``n/2``-digit numbers; the answer is their sum's last
            ``n/2`` digits, least significant first, padded with the carry-free width).
        num_digits: digits in the prompt (= answer length, for ``add`` half of it).
    """

    name: str = "reverse"
    num_digits: int = 4

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"unknown task {self.name!r}; choose one of {TASKS}")
        if self.num_digits < 1:
            raise ValueError(f"num_digits must be >= 1, got {self.num_digits}")
        if self.name == "add" and self.num_digits % 2:
            raise ValueError(f"task 'add' needs an even num_digits (two numbers), got {self.num_digits}")

    @property
    def prompt_len(self) -> int:
        return self.num_digits + 2  # BOS, digits, SEP

    @property
    def answer_len(self) -> int:
        return self.num_digits // 2 if self.name == "add" else self.num_digits

    def prompts(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """``batch`` random prompts, int64 of shape (batch, prompt_len), on the CPU."""
        digits = torch.randint(0, 10, (batch, self.num_digits), generator=generator)
        bos = torch.full((batch, 1), BOS, dtype=torch.long)
        sep = torch.full((batch, 1), SEP, dtype=torch.long)
        return torch.cat([bos, digits + DIGIT0, sep], dim=1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        """The right answers (digit values 0-9) for ``prompts``: shape (batch, answer_len)."""
        digits = prompts[:, 1 : 1 + self.num_digits] - DIGIT0
        if self.name == "copy":
            return digits
        if self.name == "reverse":
            return digits.flip(1)
        if self.name == "sort":
            return digits.sort(dim=1).values
        half = self.num_digits // 2  # add: numbers written least significant digit first
        out, carry = [], torch.zeros_like(digits[:, 0])
        for i in range(half):
            s = digits[:, i] + digits[:, half + i] + carry
            out.append(s % 10)
            carry = s // 10
        return torch.stack(out, dim=1)

    def rewards(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Fraction of answer positions right, in [0, 1]: float32 of shape (batch,).

        ``responses`` are token ids (batch, >= answer_len); positions past ``answer_len`` are
        ignored. Computed on the CPU.
        """
        if responses.shape[0] != prompts.shape[0] or responses.shape[1] < self.answer_len:
            raise ValueError(
                f"responses of shape {tuple(responses.shape)} do not answer "
                f"{prompts.shape[0]} prompts of {self.answer_len} digits"
            )
        got = responses[:, : self.answer_len].cpu() - DIGIT0
        want = self.answers(prompts.cpu())
        return (got == want).float().mean(dim=1)
