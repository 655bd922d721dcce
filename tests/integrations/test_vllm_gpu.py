"""VllmEngine with vLLM itself on a GPU (skipped without CUDA or vLLM): the real seams (sleep,
wake_up, the model runner's load_weights), the engine's memory back at driver level while it
sleeps, the policy's weights in it after each hand-over."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
vllm = pytest.importorskip("vllm")

import tidal  # noqa: E402
from tests.integrations.test_trl import save_char_models  # noqa: E402
from tidal.integrations.vllm import VllmEngine  # noqa: E402


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A model whose weights (480 MiB in bf16) take many allocations of vLLM's pool."""
    path = tmp_path_factory.mktemp("vllm_model")
    save_char_models(path, hidden=1024, intermediate=4096, layers=16, heads=8, kv_heads=4)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_path):
    """One engine for the module: vLLM's pool takes one engine a process."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        # vLLM's in-process launcher reads a world of one from the environment (TRL sets it so).
        for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}.items():
            mp.setenv(k, v)
        mp.setenv("MASTER_PORT", str(port))
        yield vllm.LLM(
            model=model_path,
            dtype="bfloat16",
            enable_sleep_mode=True,
            enforce_eager=True,
            kv_cache_memory_bytes=256 << 20,
            max_model_len=64,
            distributed_executor_backend="external_launcher",
            seed=0,
        )


GREEDY = dict(temperature=0.0, max_tokens=8)
PROMPTS = [{"prompt_token_ids": [1, 2, 3, 4]}]


def test_the_engine_takes_turns_with_the_roles_and_generates_with_the_pushed_weights(model_path, llm):
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    ts = tidal.Timeshare(device="cuda")
    ts.add_role("policy", model=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-3))
    ts.add_role("reference", model=reference, frozen=True)
    engine = VllmEngine(llm, ts, kv_cache_bytes=256 << 20)
    greedy, prompts = vllm.SamplingParams(**GREEDY), PROMPTS
    first = llm.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.sleep()
    torch.cuda.synchronize()
    asleep_free = torch.cuda.mem_get_info()[0]
    seen = []
    for _ in range(3):
        with engine.generating(policy) as running:
            seen.append(ts.resident_roles)
            out = running.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert list(out) == list(first)  # level 2 dropped the weights: the push put them back
        torch.cuda.synchronize()
        # Asleep again: what the engine held is the driver's (the roles are out too).
        assert torch.cuda.mem_get_info()[0] >= asleep_free - (256 << 20)
    assert seen == 3 * [[]]
    ts.close()


def test_a_wake_out_of_memory_is_put_back_to_sleep_and_woken_again_with_the_roles_out(model_path, llm):
    """vLLM's own wake running out of memory (its pool's ``CUDA Error: out of memory``) beside a
    role the engine's turn kept on a stale measurement of its memory: put back to sleep (its pool
    as the engine counts it), the role out, woken again; the generation is the one before."""
    from transformers import AutoModelForCausalLM

    from tidal.integrations.seams import engine_pool
    from tidal.memory import phase_need_bytes

    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    weights = sum(p.numel() * p.element_size() for p in policy.parameters())
    ts = tidal.Timeshare(device="cuda")
    ts.add_role("policy", model=policy, optimizer=torch.optim.SGD(policy.parameters(), lr=1e-3))
    engine = VllmEngine(llm, ts, kv_cache_bytes=256 << 20, keep_free_bytes=0, asleep=True)  # the test above's sleep
    greedy, prompts = vllm.SamplingParams(**GREEDY), PROMPTS
    with engine.generating(policy) as running:  # the wakes measured
        first = running.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids
    # Stale measurements (as if the engine's memory had been small), a 1 GiB role the turn will
    # keep by them, and the rest of the device held outside tidal but for room between what the
    # stale need asks and the weights.
    engine.woken = {"weights": 1 << 20, "kv_cache": 1 << 20}
    with ts.use("policy"):
        pass  # on the device, as after a training step
    ballast = torch.nn.Linear(1, 1, bias=False, device="cuda", dtype=torch.bfloat16)
    ballast.weight = torch.nn.Parameter(torch.empty(1 << 29, 1, device="cuda", dtype=torch.bfloat16))
    ts.add_role("ballast", model=ballast, frozen=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    room = (phase_need_bytes(2 << 20) + weights) // 2
    filler = torch.empty(torch.cuda.mem_get_info()[0] - room, dtype=torch.uint8, device="cuda")
    try:
        with engine.generating(policy) as running:
            pool, _, _ = engine_pool()
            assert not any(d.is_asleep for d in pool.pointer_to_data.values())
            out = running.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        del filler
    assert engine.oom_retries == 1 and "ballast" not in ts.resident_roles
    assert list(out) == list(first)
    ts.close()
