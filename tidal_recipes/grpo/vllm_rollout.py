"""The GRPO recipe's rollout through an in-process vLLM engine (``GRPOConfig(rollout_engine="vllm")``,
``tidal demo --rollout-engine vllm``): :class:`VllmDecoder`.

The engine is built once from the policy as it starts (saved to a temporary folder: vLLM loads
a model from files), sleeps between rollouts (level 2: weights and KV cache back with the
driver) and takes turns with the trainer's roles through
:class:`tidal.integrations.vllm.VllmEngine`: the policy's new weights are pushed into it before
each rollout, and its KV cache holds every sequence of a rollout at once
(:func:`~tidal.integrations.vllm.kv_cache_bytes_for`). Sampling is restricted to the task's
action tokens and draws each sequence from a seed taken from the trainer's generator, so a
seeded run is reproducible; its draws are vLLM's, not those of the ``generate`` path.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from typing import Any

import torch

from tidal.integrations.vllm import VllmEngine, kv_cache_bytes_for

__all__ = ["VllmDecoder"]


def _world_of_one() -> None:
    """vLLM's in-process launcher reads a world of one from the environment (as TRL's
    colocate mode writes it): set where the launch has not."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("localhost", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}.items():
        os.environ.setdefault(k, v)


class VllmDecoder:
    """A vLLM engine generating the rollout of ``policy`` (the timeshare's role ``role``).

    Args:
        policy: the Hugging Face causal LM being trained (its weights pushed before each rollout).
        timeshare: the trainer's :class:`tidal.Timeshare`.
        role: the role holding ``policy``'s weights (the recipe's ``"rollout"``).
        sequences: sequences a rollout samples at once; max_len: their prompt and answer tokens.
        seed: the engine's seed.

    Memory cost: the engine's copy of the weights and its KV cache while it generates, a few
    hundred MiB of vLLM's own (its context, graphs) for good; a copy of the policy on disk.

    Raises:
        ValueError: vLLM is not installed (HF ``generate`` is the recipe's default).
    """

    def __init__(
        self, policy: torch.nn.Module, timeshare: Any, *, role: str, sequences: int, max_len: int, seed: int
    ) -> None:
        try:
            import vllm
        except ImportError as e:
            raise ValueError(
                f"rollout_engine='vllm' needs vLLM installed ({e}); on a GPU machine pip install vllm, or roll out "
                f"with rollout_engine='hf' (Hugging Face generate, the default)"
            ) from None
        self._vllm = vllm
        self._dir = tempfile.mkdtemp(prefix="tidal_vllm_")
        dtype = next(policy.parameters()).dtype
        try:
            policy.save_pretrained(self._dir)
            self.kv_cache_bytes = kv_cache_bytes_for(policy.config, dtype, sequences=sequences, max_len=max_len)
            _world_of_one()
            self.llm = vllm.LLM(
                model=self._dir,
                dtype=str(dtype).removeprefix("torch."),
                enable_sleep_mode=True,
                kv_cache_memory_bytes=self.kv_cache_bytes,
                max_model_len=max_len,
                max_num_seqs=sequences,
                skip_tokenizer_init=True,
                distributed_executor_backend="external_launcher",
                seed=seed,
            )
            self.llm.sleep(level=2)
            self.engine = VllmEngine(self.llm, timeshare, policy=role, kv_cache_bytes=self.kv_cache_bytes, asleep=True)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.policy = policy

    def sample(
        self,
        prompts: torch.Tensor,
        new_tokens: int,
        action_ids: tuple[int, int],
        *,
        generator: torch.Generator,
        temperature: float = 1.0,
        on_step=None,
    ) -> torch.Tensor:
        """``new_tokens`` action tokens after each row of ``prompts`` (B, P); returns (B,
        new_tokens) int64 ids on ``prompts``' device. Each row's seed is drawn from
        ``generator``; ``on_step(0)`` is called once the engine has generated (vLLM decodes
        in its own loop)."""
        lo, hi = action_ids
        seeds = torch.randint(0, 2**31 - 1, (prompts.shape[0],), generator=generator, device=generator.device)
        params = [
            self._vllm.SamplingParams(
                n=1,
                temperature=temperature,
                max_tokens=new_tokens,
                min_tokens=new_tokens,
                allowed_token_ids=list(range(lo, hi)),
                seed=int(s),
                detokenize=False,
            )
            for s in seeds.tolist()
        ]
        rows = [{"prompt_token_ids": p} for p in prompts.tolist()]
        with self.engine.generating(self.policy) as running:
            outs = running.generate(rows, params, use_tqdm=False)
        if on_step is not None:
            on_step(0)
        return torch.tensor([list(o.outputs[0].token_ids) for o in outs], dtype=torch.long, device=prompts.device)

    def close(self) -> None:
        """The engine's folder removed (its memory goes with the engine)."""
        shutil.rmtree(self._dir, ignore_errors=True)
