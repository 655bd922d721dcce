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
    path = tmp_path_factory.mktemp("vllm_tiny")
    save_char_models(path, hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2)
    return str(path)


def test_the_engine_takes_turns_with_the_roles_and_generates_with_the_pushed_weights(model_path, monkeypatch):
    import socket

    from transformers import AutoModelForCausalLM

    # vLLM's in-process launcher reads a world of one from the environment (TRL sets it so).
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(port))

    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).cuda()
    ts = tidal.Timeshare(device="cuda")
    ts.add_role("policy", model=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=1e-3))
    ts.add_role("reference", model=reference, frozen=True)
    llm = vllm.LLM(
        model=model_path,
        dtype="bfloat16",
        enable_sleep_mode=True,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_model_len=64,
        distributed_executor_backend="external_launcher",
        seed=0,
    )
    engine = VllmEngine(llm, ts, kv_cache_bytes=256 << 20)
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}]
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
