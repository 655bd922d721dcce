"""Rollout with the decode step captured in a CUDA graph, its memory in a tidal region.

The same sampling as :func:`tidal_recipes.grpo.rollout.sample_answers` (the same ops on the same
logits, drawn with the same generator), but the KV cache is a Hugging Face ``StaticCache`` and
each decoded token is one replay of a graph captured once: no kernel launches from Python per
layer. The cache and the graph's workspace are ``discard`` tags of a :class:`tidal.Region`:
released to the driver at the end of every rollout, with no copy, and mapped again at the same
addresses at the start of the next, so the graph is never captured again. The policy's
weights must keep their addresses too: with a timeshare they live in the region's
``"weights"`` tag, a role registered with ``region=`` (see ``GRPOTrainer``).

Memory while a rollout runs: the static cache (``batch x (prompt + new)`` tokens for every
layer, allocated at full length), the graph's workspace (one decode step's activations and its
logits) and the prefill's activations; between rollouts, none of it (the region's 66 MiB
scratch guard excepted).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tidal.vmm import Region
from tidal_recipes.grpo.rollout import cache_name, check_sampling, draw_answers, logits_kwargs

__all__ = ["GraphDecoder"]

KV_TAG, GRAPH_TAG = "kv", "graph"


class GraphDecoder:
    """Samples answers like ``sample_answers`` with a captured decode step (see the module
    docstring). Shapes (batch, prompt length, new tokens) are fixed by the first call; a call
    with other shapes raises ``ValueError``, as does a model with transformers' eager attention.

    Attributes:
        captures: graphs captured so far (1 after the first rollout, then unchanged).
    """

    def __init__(self, model: torch.nn.Module, region: Region) -> None:
        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if attn == "eager":
            # transformers' eager attention builds its mask from a host scalar copied to the
            # device, which a graph capture refuses (measured: transformers 5.17).
            raise ValueError(
                "rollout_graph cannot capture transformers' eager attention (its mask copies a host "
                "scalar to the device); build the model with attn_implementation='sdpa'"
            )
        self.model = model
        self.region = region
        self.captures = 0
        self._shape: tuple[int, int, int] | None = None
        self._graph: Any = None
        self._cache: Any = None
        self._ids: torch.Tensor | None = None  # the graph's inputs (in the kv tag)
        self._pos: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None  # the graph's output (in its pool)
        self._pos_prefill: torch.Tensor | None = None

    @torch.no_grad()
    def sample(
        self,
        prompts: torch.Tensor,
        new_tokens: int,
        action_ids: tuple[int, int],
        *,
        generator: torch.Generator,
        temperature: float = 1.0,
        on_step: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """(B, new_tokens) int64 ids sampled after ``prompts`` (B, P); see ``sample_answers``."""
        check_sampling(new_tokens, temperature)
        shape = (prompts.shape[0], prompts.shape[1], new_tokens)
        if self._shape is not None and shape != self._shape:
            raise ValueError(
                f"this GraphDecoder was captured for batch, prompt length, new tokens = {self._shape}; "
                f"got {shape}. Use one decoder per shape"
            )
        batch, plen, _ = shape
        if self._graph is not None:
            self.region.restore([KV_TAG, GRAPH_TAG])  # no-op while resident
        try:
            if self._graph is None:
                self._capture(prompts, new_tokens)
            self._cache.reset()  # keys, values and write positions: fresh memory after a restore
            out = self.model(
                input_ids=prompts,
                **{cache_name(self.model): self._cache},
                cache_position=self._pos_prefill,
                use_cache=True,
                **logits_kwargs(self.model, 1),
            )
            first = out.logits[:, -1]
            del out

            def next_logits(tok: torch.Tensor, i: int) -> torch.Tensor:
                self._ids.copy_(tok)
                self._pos.fill_(plen + i)
                self._graph.replay()
                return self._logits[:, -1]

            answers = draw_answers(
                first,
                new_tokens,
                action_ids,
                generator=generator,
                temperature=temperature,
                on_step=on_step,
                next_logits=next_logits,
            )
            del first
        finally:
            # The cache and the graph's workspace go back to the driver; the graph stays.
            self.region.release([t for t in (KV_TAG, GRAPH_TAG) if t in self.region.tags])
        assert answers.shape == (batch, new_tokens)
        return answers

    def _capture(self, prompts: torch.Tensor, new_tokens: int) -> None:
        from transformers import StaticCache

        batch, plen = prompts.shape
        device = prompts.device
        self._pos_prefill = torch.arange(plen, device=device)  # outside the region: kept as is
        with self.region.allocate(KV_TAG, policy="discard"):
            self._ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
            self._pos = torch.zeros(1, dtype=torch.long, device=device)
            self._cache = StaticCache(config=self.model.config, max_cache_len=plen + new_tokens)
            kv = {cache_name(self.model): self._cache}  # the keyword this transformers takes it by
            # The cache allocates its tensors at the first forward (for this batch), here in the tag.
            self.model(
                input_ids=prompts,
                **kv,
                cache_position=self._pos_prefill,
                use_cache=True,
                **logits_kwargs(self.model, 1),
            )
        self._ids.copy_(prompts[:, -1:])
        self._pos.fill_(plen)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))  # the warm-up reads what the prefill wrote
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(input_ids=self._ids, **kv, cache_position=self._pos, use_cache=True)
        torch.cuda.current_stream(device).wait_stream(side)  # the capture starts after the warm-up
        graph = torch.cuda.CUDAGraph()
        pool = self.region.pool(GRAPH_TAG, policy="discard")
        with torch.cuda.graph(graph, pool=pool.id):
            self._logits = self.model(input_ids=self._ids, **kv, cache_position=self._pos, use_cache=True).logits
        self._graph = graph
        self._shape = (batch, plen, new_tokens)
        self.captures += 1

    def close(self) -> None:
        """Drop the graph, the cache and its inputs (the region can then be closed)."""
        self._graph = self._cache = self._ids = self._pos = self._logits = None
        self._shape = None
