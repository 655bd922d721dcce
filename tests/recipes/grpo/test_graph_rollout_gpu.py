"""The rollout with its decode step in a CUDA graph (GRPOConfig(rollout_graph=True)): it samples
what the eager static-cache loop samples, its cache and workspace go back to the driver after
every rollout while the graph is kept, and the timeshare (the policy's weights moving in place in
the region) changes no result."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from tests.recipes.grpo import test_trainer_gpu  # noqa: E402
from tidal.device import DeviceOps  # noqa: E402
from tidal.vmm import Region  # noqa: E402
from tidal_recipes.grpo import DigitTask, GRPOConfig, GRPOTrainer  # noqa: E402
from tidal_recipes.grpo.graph_rollout import GraphDecoder  # noqa: E402

pytestmark = pytest.mark.gpu
MiB = 1 << 20
ACTIONS = (3, 13)


def policy(**kw):
    """The trainer tests' policy with SDPA attention (eager attention cannot be captured)."""
    model = test_trainer_gpu.policy(**kw)
    model.config._attn_implementation = "sdpa"
    return model


def _eager_static(model, prompts, new_tokens, gen):
    """The same sampling with a static cache and no graph."""
    batch, plen = prompts.shape
    cache = transformers.StaticCache(config=model.config, max_cache_len=plen + new_tokens)
    with torch.no_grad():
        out = model(input_ids=prompts, past_key_values=cache, cache_position=torch.arange(plen, device="cuda"))
        logits = out.logits[:, -1]
        picked = []
        for i in range(new_tokens):
            probs = torch.softmax(logits[:, ACTIONS[0] : ACTIONS[1]].float(), dim=-1)
            tok = torch.multinomial(probs, 1, generator=gen) + ACTIONS[0]
            picked.append(tok)
            if i + 1 == new_tokens:
                break
            pos = torch.full((1,), plen + i, dtype=torch.long, device="cuda")
            logits = model(input_ids=tok, past_key_values=cache, cache_position=pos).logits[:, -1]
    return torch.cat(picked, dim=1)


def test_graph_decoder_samples_like_the_eager_loop_and_gives_its_memory_back():
    model = policy(hidden=512, layers=4, vocab=4096).eval()
    prompts = torch.randint(0, 4096, (512, 500), device="cuda")  # a 512 MiB static cache
    ops = DeviceOps("cuda")
    # The baseline after one eager rollout: the kernels it loads and cuBLAS's workspace are
    # the process's, not the rollout's.
    _eager_static(model, prompts, 12, torch.Generator(device="cuda").manual_seed(0))
    ops.release_to_driver()
    free_before, _ = torch.cuda.mem_get_info()
    region = Region("test-rollout")
    dec = GraphDecoder(model, region)
    frees = []
    for seed in range(3):
        got = dec.sample(prompts, 12, ACTIONS, generator=torch.Generator(device="cuda").manual_seed(seed))
        assert not region.tags["kv"].resident and not region.tags["graph"].resident
        free, _ = torch.cuda.mem_get_info()
        frees.append(free)
        # Released: the static cache and the graph's workspace are back with the driver, within
        # 256 MiB of the baseline (the region's 66 MiB scratch guard, the graph itself).
        assert free >= free_before - 256 * MiB, (seed, free_before, free)
        assert region.tags["kv"].allocated_bytes >= 512 * MiB  # what went back is well over the slack
        want = _eager_static(model, prompts, 12, torch.Generator(device="cuda").manual_seed(seed))
        assert torch.equal(got, want), seed
        del want
        ops.release_to_driver()
    assert dec.captures == 1
    assert max(frees) - min(frees) <= 8 * MiB, frees  # nothing accumulates from rollout to rollout
    with pytest.raises(ValueError, match="captured for"):
        dec.sample(prompts[:32], 12, ACTIONS, generator=torch.Generator(device="cuda"))
    dec.close()
    del got
    region.close()


def _run(timeshare, steps=3):
    cfg = GRPOConfig(
        task=DigitTask(name="copy", num_digits=8),
        prompts_per_step=8,
        group_size=4,
        micro_batch=16,
        timeshare=timeshare,
        rollout_graph=True,
        lr=1e-4,
    )
    tr = GRPOTrainer(policy(hidden=256, layers=2, vocab=512), config=cfg)
    ptrs, res = [], []
    for _ in range(steps):
        res.append(tr.step())
        ptrs.append([p.data_ptr() for p in tr.policy.parameters()])
    captures = tr.decoder.captures
    moved = sum(ph["moved_bytes"] for r in res for ph in r.phases.values())
    tr.close()
    return tr, res, ptrs, captures, moved


def test_graph_rollout_with_the_timeshare_changes_no_result():
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):  # a deterministic backward
            a, ra, ptrs, captures, moved = _run(True)
            b, rb, _, _, _ = _run(False)
    finally:
        torch.use_deterministic_algorithms(False)
    assert moved > 0  # the policy's weights really went out and came back, in place
    assert captures == 1 and all(p == ptrs[0] for p in ptrs)
    assert [r.stats for r in ra] == [r.stats for r in rb]
    for (n, pa), pb in zip(a.policy.named_parameters(), b.policy.parameters()):
        assert torch.equal(pa.cpu(), pb.cpu()), n
    assert a.region is None  # closed with the trainer


def test_eager_attention_is_refused_with_a_clear_error():
    region = Region("test-eager")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        GraphDecoder(test_trainer_gpu.policy(hidden=64, layers=1, vocab=64), region)
    region.close()
