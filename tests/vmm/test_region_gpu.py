"""Address-stable regions on a GPU: tensors and a captured CUDA graph survive release/restore
cycles at the same addresses, the memory really goes back to the driver, discard tags move no
bytes, and the restore's wait is needed (a race test)."""

from __future__ import annotations

import pytest
import torch

from tests.activations.models import tiny_qwen2
from tests.policies import SkipWaits
from tidal.device import use_sync_policy

MiB = 1 << 20
SLACK = 256 * MiB  # driver-level free memory after a release is within this of the baseline


def _driver_free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.gpu
def test_tensors_keep_their_addresses_and_bytes_and_memory_goes_back():
    from tidal.vmm import Region

    torch.cuda.empty_cache()
    baseline = _driver_free()
    region = Region("t")
    with region.allocate("w"):
        big = torch.randn(256 * MiB, device="cuda")  # 1 GiB
        small = [torch.randn(1000 + i, device="cuda") for i in range(64)]
    with region.allocate("scratch", policy="discard"):
        work = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    raw = region.tag("w").alloc(4 * MiB)  # raw memory beside torch's pool in the same tag
    raw_view = region.driver.view(raw, 4 * MiB)
    raw_view.copy_(torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8))
    raw_host = raw_view.cpu()
    big_host, small_host = big.cpu(), [s.cpu() for s in small]
    ptrs = [big.data_ptr()] + [s.data_ptr() for s in small] + [work.data_ptr()]
    assert _driver_free() < baseline - 1536 * MiB

    for cycle in range(3):
        out = region.release()
        assert _driver_free() >= baseline - SLACK, (cycle, baseline, _driver_free())
        live = big.numel() * 4 + sum(s.numel() * 4 for s in small) + 4 * MiB
        # Only the backup tag's live blocks move: not the discard tag, not the pool's free room.
        assert live <= out.bytes_copied <= live + 64 * 512, (out.bytes_copied, live)
        region.restore()
        assert [big.data_ptr()] + [s.data_ptr() for s in small] + [work.data_ptr()] == ptrs
        assert torch.equal(big.cpu(), big_host)
        assert all(torch.equal(s.cpu(), h) for s, h in zip(small, small_host))
        assert torch.equal(region.driver.view(raw, 4 * MiB).cpu(), raw_host)
        work.fill_(cycle)  # the discard tag's memory is usable again
        assert int(work[-1]) == cycle


@pytest.mark.gpu
def test_restore_is_ordered_before_the_compute_that_reads_it():
    """Race test: a 2 GiB restore and a kernel that reads the memory right after. Without the
    compute stream's wait on the last H2D copy the kernel reads fresh memory."""
    from tidal.vmm import Region

    region = Region("race", guard_released=False)
    with region.allocate("w"):
        x = torch.full((512 * MiB,), 3.0, device="cuda")  # 2 GiB
    expected = float(x.numel() * 3.0)

    region.release()
    region.restore()
    assert float(x.sum(dtype=torch.float64)) == expected

    region.release()
    with use_sync_policy(SkipWaits(["compute_after_h2d"])) as policy:
        region.restore()
        racy = float(x.sum(dtype=torch.float64))  # queued before the copy has landed
    assert policy.skipped == ["compute_after_h2d"]
    torch.cuda.synchronize()
    assert racy != expected, "the race did not show: the test cannot detect a missing wait"
    assert float(x.sum(dtype=torch.float64)) == expected


def _tiny_qwen2():
    return tiny_qwen2(
        2, dtype=torch.bfloat16, device="cuda", attn="sdpa", hidden=256, intermediate=512, vocab=1024
    ).eval()


def capture_decode(model, cache, ids, pos, pool):
    """A decode step of ``model`` captured in a CUDA graph whose memory comes from ``pool``
    (after the warm-up a capture needs, on a side stream); returns the graph and its logits."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the warm-up reads what the default stream wrote
    with torch.cuda.stream(side):
        for _ in range(2):
            model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True)
    torch.cuda.current_stream().wait_stream(side)  # the capture starts after the warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.id):
        logits = model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits
    return graph, logits


@pytest.mark.gpu
def test_captured_decode_graph_replays_bit_identically_after_100_cycles():
    pytest.importorskip("transformers")
    from transformers import StaticCache

    from tidal.vmm import Region

    torch.cuda.empty_cache()
    baseline = _driver_free()
    region = Region("rollout")
    prompt = torch.randint(0, 1024, (1, 12), device="cuda")
    pos_prefill = torch.arange(12, device="cuda")
    with torch.no_grad():
        with region.allocate("weights"):
            model = _tiny_qwen2()
            ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")  # the graph's static input
            pos = torch.full((1,), 12, dtype=torch.long, device="cuda")
        with region.allocate("kv", policy="discard"):
            cache = StaticCache(config=model.config, max_cache_len=64)
            model(input_ids=prompt, past_key_values=cache, cache_position=pos_prefill, use_cache=True)  # lazy init

        def prefill():
            cache.reset()  # keys, values and the write position (a tensor in the discarded tag too)
            model(input_ids=prompt, past_key_values=cache, cache_position=pos_prefill, use_cache=True)
            ids.fill_(7)

        graph, logits = capture_decode(model, cache, ids, pos, region.pool("graph", policy="discard"))

        prefill()
        graph.replay()
        reference = logits.clone()
        kv_ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
        for cycle in range(100):
            out = region.release()
            assert _driver_free() >= baseline - SLACK, (cycle, baseline, _driver_free())
            assert region.tags["kv"].slots == {} and region.tags["graph"].slots == {}  # discard: no copies
            region.restore()
            prefill()  # the KV cache was discarded: fill it again, as a new rollout does
            graph.replay()
            assert torch.equal(logits, reference), cycle
        assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == kv_ptrs
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        assert weights <= out.bytes_copied < weights + 64 * MiB, (out.bytes_copied, weights)
