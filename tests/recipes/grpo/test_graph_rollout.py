"""GraphDecoder's loop on the CPU: a decoder whose "graph" runs the decode step eagerly into the
same output buffer (what a replay does) samples what the eager static-cache loop samples, and
restores and releases its region tags around each rollout. The capture itself is GPU-only
(tests/recipes/grpo/test_graph_rollout_gpu.py)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.recipes.grpo.test_trainer import tiny_policy  # noqa: E402
from tidal_recipes.grpo.graph_rollout import GRAPH_TAG, KV_TAG, GraphDecoder  # noqa: E402
from tidal_recipes.grpo.rollout import cache_name, draw_answers  # noqa: E402

ACTIONS = (3, 13)


class _Region:
    """The region calls GraphDecoder makes, recorded."""

    def __init__(self) -> None:
        self.tags: dict = {}
        self.calls: list = []

    def restore(self, tags):
        self.calls.append(("restore", tuple(tags)))

    def release(self, tags):
        self.calls.append(("release", tuple(tags)))


class _Replay:
    def __init__(self, step) -> None:
        self.replay = step


class _EagerDecoder(GraphDecoder):
    """Captures nothing: its replay runs the decode step eagerly into the fixed output buffer."""

    def _capture(self, prompts, new_tokens):
        batch, plen = prompts.shape
        self._pos_prefill = torch.arange(plen)
        self._ids = torch.zeros(batch, 1, dtype=torch.long)
        self._pos = torch.zeros(1, dtype=torch.long)
        self._cache = transformers.StaticCache(config=self.model.config, max_cache_len=plen + new_tokens)
        self.model(
            input_ids=prompts, **{cache_name(self.model): self._cache}, cache_position=self._pos_prefill
        )  # lazy init
        self._logits = torch.empty(batch, 1, self.model.config.vocab_size)

        self.fed = []  # (position, token ids) given to each replay

        def step():
            self.fed.append((int(self._pos), self._ids.clone()))
            out = self.model(input_ids=self._ids, **{cache_name(self.model): self._cache}, cache_position=self._pos)
            self._logits.copy_(out.logits)

        self._graph = _Replay(step)
        self._shape = (batch, plen, new_tokens)
        self.region.tags.update({KV_TAG: None, GRAPH_TAG: None})
        self.captures += 1


def _eager_static(model, prompts, new_tokens, gen):
    plen = prompts.shape[1]
    cache = transformers.StaticCache(config=model.config, max_cache_len=plen + new_tokens)
    first = model(input_ids=prompts, **{cache_name(model): cache}, cache_position=torch.arange(plen)).logits[:, -1]

    def next_logits(tok, i):
        return model(input_ids=tok, **{cache_name(model): cache}, cache_position=torch.tensor([plen + i])).logits[:, -1]

    return draw_answers(
        first, new_tokens, ACTIONS, generator=gen, temperature=1.0, on_step=None, next_logits=next_logits
    )


@torch.no_grad()
def test_the_loop_around_the_graph_samples_what_the_eager_loop_samples():
    model = tiny_policy().eval()
    prompts = torch.randint(0, 16, (6, 5), generator=torch.Generator().manual_seed(1))
    region = _Region()
    dec = _EagerDecoder(model, region)
    steps = []
    for seed in range(3):
        fed = len(dec.fed) if dec._graph is not None else 0
        got = dec.sample(prompts, 7, ACTIONS, generator=torch.Generator().manual_seed(seed), on_step=steps.append)
        want = _eager_static(model, prompts, 7, torch.Generator().manual_seed(seed))
        assert torch.equal(got, want), seed
        # Each replay decodes the token just drawn, at the position after the ones before it.
        replays = dec.fed[fed:]
        assert [pos for pos, _ in replays] == list(range(5, 11)), replays
        for k, (_, ids) in enumerate(replays):
            assert torch.equal(ids, got[:, k : k + 1]), k
        assert got.shape == (6, 7) and bool(((got >= 3) & (got < 13)).all())
    assert steps == list(range(7)) * 3
    assert dec.captures == 1
    # Released after every rollout (the first included); restored before every later one.
    tags = (KV_TAG, GRAPH_TAG)
    assert region.calls == [
        ("release", tags),
        ("restore", tags),
        ("release", tags),
        ("restore", tags),
        ("release", tags),
    ]
    with pytest.raises(ValueError, match="captured for"):
        dec.sample(prompts[:3], 7, ACTIONS, generator=torch.Generator())
    assert len(region.calls) == 5  # refused before touching the region
