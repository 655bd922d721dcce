"""A rollout role in a region on a GPU: its weights are a timeshare role (``region=``), its KV
cache and captured decode graph are discard tags of the same region. Switching to a training
role and back three times, the graph replays bit-identically without re-capture, and the
driver gets the rollout's memory back while the training role runs."""

from __future__ import annotations

import pytest
import torch

from tests.activations.models import tiny_qwen2
from tests.vmm.test_region_gpu import _driver_free, capture_decode

MiB = 1 << 20
VOCAB = 131072


def _qwen2():
    # Tied embeddings: one 256 MiB embedding, so the role is over 256 MiB.
    return tiny_qwen2(
        2, dtype=torch.bfloat16, device="cuda", attn="sdpa", hidden=1024, intermediate=2048, vocab=VOCAB
    ).eval()


@pytest.mark.gpu
def test_rollout_role_with_captured_graph_takes_turns_with_training():
    pytest.importorskip("transformers")
    from transformers import StaticCache

    from tidal import Timeshare
    from tidal.vmm import Region

    region = Region("rollout")
    prompt = torch.randint(0, VOCAB, (1, 12), device="cuda")
    pos_prefill = torch.arange(12, device="cuda")
    with torch.no_grad():
        with region.allocate("weights", policy="discard"):  # only the role's state: its store holds the copy
            model = _qwen2()
        with region.allocate("kv", policy="discard"):
            ids = torch.full((1, 1), 7, dtype=torch.long, device="cuda")  # the graph's static inputs
            pos = torch.full((1,), 12, dtype=torch.long, device="cuda")
            cache = StaticCache(config=model.config, max_cache_len=64)
            model(input_ids=prompt, past_key_values=cache, cache_position=pos_prefill, use_cache=True)
        graph, logits = capture_decode(model, cache, ids, pos, region.pool("graph", policy="discard"))

    def rollout():
        with torch.no_grad():
            cache.reset()
            ids.fill_(7)  # discarded with the KV cache: set again, as a new rollout does
            pos.fill_(12)
            model(input_ids=prompt, past_key_values=cache, cache_position=pos_prefill, use_cache=True)
            graph.replay()
            return logits.clone()

    reference = rollout()
    weight_ptrs = [p.data_ptr() for p in model.parameters()]
    trainer = torch.nn.Linear(512, 512, device="cuda")  # 1 MiB of training state
    ts = Timeshare("cuda")
    ts.add_role("rollout", model=model, region=region.tag("weights"))
    ts.add_role("train", model=trainer)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    for cycle in range(3):
        with ts.use("train"):
            region.release(["kv", "graph"])  # the rollout's cache and graph memory, no copy
            assert not region.tags["weights"].resident, cycle  # the role's memory went in place
            assert region.mapped_bytes() == 0, cycle
            free_training = _driver_free()
            trainer.weight.data.mul_(1.0)
        region.restore(["kv", "graph"])
        with ts.use("rollout"):
            assert [p.data_ptr() for p in model.parameters()] == weight_ptrs
            assert torch.equal(rollout(), reference), cycle
            free_rollout = _driver_free()
        # While training, the driver had the rollout's weights back (less the 1 MiB trainer, the
        # region's 66 MiB scratch guard and allocator rounding).
        assert free_training - free_rollout >= weights - 96 * MiB, (cycle, free_training, free_rollout, weights)
        assert weights > 256 * MiB
