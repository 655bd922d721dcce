"""A test double of the part of vLLM's ``LLM`` that TRL's colocate mode and tidal call, for CPU
tests only (the GPU runs use vLLM itself): a real small Hugging Face model of its own (the
engine's copy of the weights), a KV cache of real memory sized as vLLM sizes it, sleep levels
1 and 2 that release both, and sampling with the engine's own generator.

What it keeps of vLLM's behaviour, because TRL and tidal depend on it:

* ``LLM(model=path, gpu_memory_utilization=..., kv_cache_memory_bytes=..., enable_sleep_mode=...,
  seed=...)`` loads the weights from ``path``; the KV cache is ``kv_cache_memory_bytes``, or
  ``gpu_memory_utilization`` of :data:`DEVICE_BYTES` less the weights (vLLM's sizing).
* ``sleep(level=1)`` backs the weights up on the host and drops the KV cache; ``level=2``
  drops both: a ``wake_up(tags=["weights"])`` after it maps memory whose bytes are garbage
  (here NaN), so a generation without a re-push of the weights is wrong, as vLLM's is (its
  issue 29341).
* ``llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, t)])``
  copies ``t`` into the engine's parameter of that name.
* ``generate(prompts, sampling_params)``: each ``{"prompt_token_ids": ids}`` sampled to
  ``max_tokens`` tokens (or an end token) at ``temperature``, with the per-token log-probability
  of the sampled token (``logprobs=0``), from one generator seeded by ``seed`` at construction.
  A generation while asleep raises, as vLLM's would crash.

:func:`install` puts it where TRL's ``trl.generation.vllm_generation`` looks for vLLM.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import types
from typing import Any

import torch

DEVICE_BYTES = 64 << 20  # the "device" the utilization fraction is of (small: a CPU test)


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    max_tokens: int = 16
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    structured_outputs: Any = None
    seed: int | None = None


@dataclasses.dataclass
class StructuredOutputsParams:
    regex: str | None = None


@dataclasses.dataclass
class Logprob:
    logprob: float
    rank: int = 1
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None


@dataclasses.dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class _Loader:
    """``model_runner.model``: vLLM's model, of which TRL calls ``load_weights``."""

    def __init__(self, llm: "FakeLLM") -> None:
        self._llm = llm

    def load_weights(self, weights) -> set[str]:
        self._llm._maybe_fail("load_weights")
        params = dict(self._llm.model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if self._llm.sleeping_weights:
                    raise RuntimeError("load_weights while the weights sleep: wake_up(tags=['weights']) first")
                params[name].copy_(tensor)
                loaded.add(name)
        self._llm.pushes += 1
        return loaded


class FakeLLM:
    """See the module docstring. Counts what it was asked (``calls``) for the tests."""

    instances: list["FakeLLM"] = []
    #: (method, tags or None, exception type, on which call of it): raised as that call starts.
    fail: tuple[str, tuple | None, type, int] | None = None
    #: called as each generation starts (what the tests read of the trainer then).
    on_generate: Any = None

    def __init__(
        self,
        model: str,
        *,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        max_model_len: int | None = None,
        **_: Any,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
            p.data = p.data.clone()  # memory of its own (a load may map the checkpoint file)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if kv_cache_memory_bytes is None:
            kv_cache_memory_bytes = int(gpu_memory_utilization * DEVICE_BYTES) - self.weights_bytes
            if kv_cache_memory_bytes <= 0:
                raise ValueError(
                    f"No available memory for the cache blocks: gpu_memory_utilization={gpu_memory_utilization}"
                )
        self.kv_cache_bytes = kv_cache_memory_bytes
        self.kv_cache = torch.zeros(kv_cache_memory_bytes, dtype=torch.uint8)
        self.enable_sleep_mode = enable_sleep_mode
        self.generator = torch.Generator().manual_seed(seed)
        self.sleeping_weights = self.sleeping_kv = False
        self._backup: dict[str, torch.Tensor] | None = None
        self.calls: list[tuple] = []
        self.pushes = 0
        self._seen: dict = {}
        limit = max_model_len or getattr(self.model.config, "max_position_embeddings", 2048)
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=limit),
            model_executor=types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=_Loader(self)))
            ),
        )
        FakeLLM.instances.append(self)

    def _maybe_fail(self, method: str, tags: tuple | None = None) -> None:
        f = FakeLLM.fail
        if f is None or f[0] != method or (f[1] is not None and f[1] != tags):
            return
        key = (method, tags)
        self._seen[key] = self._seen.get(key, 0) + 1
        if self._seen[key] == f[3]:
            raise f[2](f"injected at {method}{tags or ''} (call {f[3]})")

    # ---- memory --------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """The engine's memory held now (weights and KV cache)."""
        w = sum(p.untyped_storage().nbytes() for p in self.model.parameters())
        return w + self.kv_cache.untyped_storage().nbytes()

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self._maybe_fail("sleep")
        if not self.enable_sleep_mode:
            raise RuntimeError("Sleep mode is not enabled")
        if level == 1 and not self.sleeping_weights:
            self._backup = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        if not self.sleeping_weights:
            for p in self.model.parameters():
                p.untyped_storage().resize_(0)
        self.kv_cache.untyped_storage().resize_(0)
        self.sleeping_weights = self.sleeping_kv = True
        self._level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        self._maybe_fail("wake_up", tuple(tags) if tags else None)
        tags = tags or ["weights", "kv_cache"]
        if "weights" in tags and self.sleeping_weights:
            for n, p in self.model.named_parameters():
                p.untyped_storage().resize_(p.numel() * p.element_size())
                with torch.no_grad():
                    if self._backup is not None:
                        p.copy_(self._backup[n])
                    else:
                        p.fill_(math.nan)  # level 2: the bytes are whatever the new memory held
            self._backup = None
            self.sleeping_weights = False
        if "kv_cache" in tags and self.sleeping_kv:
            self.kv_cache.untyped_storage().resize_(self.kv_cache_bytes)
            self.kv_cache.zero_()
            self.sleeping_kv = False

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    # ---- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, sampling_params: SamplingParams | None = None, use_tqdm: bool = True, **_: Any):
        self.calls.append(("generate", len(prompts)))
        self._maybe_fail("generate")
        if FakeLLM.on_generate is not None:
            FakeLLM.on_generate(self)
        if self.sleeping_weights or self.sleeping_kv:
            raise RuntimeError("generate() while the engine sleeps: its memory is unmapped")
        sp = sampling_params or SamplingParams()
        eos = getattr(self.model.config, "eos_token_id", None)
        out = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            completions = []
            for _ in range(sp.n):
                seq, toks, lps = torch.tensor([ids]), [], []
                for _ in range(sp.max_tokens):
                    logits = self.model(input_ids=seq).logits[0, -1].float()
                    logits = logits / max(sp.temperature, 1e-6)
                    logp = torch.log_softmax(logits, dim=-1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=self.generator))
                    toks.append(tok)
                    lps.append({tok: Logprob(float(logp[tok]), rank=1)})
                    seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
                    if eos is not None and tok == eos:
                        break
                completions.append(CompletionOutput(token_ids=toks, logprobs=lps if sp.logprobs is not None else None))
            out.append(RequestOutput(prompt_token_ids=ids, outputs=completions))
        return out


class FakeClient:
    """A test double of TRL's ``VLLMClient`` (server mode: the engine in another process, on other
    GPUs) backed by a :class:`FakeLLM` of ``FakeClient.model_path`` standing in for the server:
    the weights TRL streams to it are copied into that engine, generation runs there."""

    model_path: str | None = None
    instances: list["FakeClient"] = []

    def __init__(self, base_url: str | None = None, group_port: int = 51216, connection_timeout: float = 0.0, **_):
        self.server = FakeLLM(FakeClient.model_path, kv_cache_memory_bytes=1 << 20, seed=0)
        self.calls: list[tuple] = []
        FakeClient.instances.append(self)

    def init_communicator(self, device=0) -> None:
        self.calls.append(("init_communicator",))

    def get_server_info(self) -> dict:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def update_named_params(self, metadata, named_params) -> None:
        self.calls.append(("update_named_params", len(metadata)))
        # What the broadcast would carry: each tensor read now, where it is (a moved-out one raises).
        self.server.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(
            [(n, t.detach().to("cpu", copy=True)) for n, t in named_params]
        )

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def generate(
        self,
        prompts,
        features=None,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        logprobs: int | None = 0,
        **_,
    ) -> dict:
        self.calls.append(("generate", len(prompts)))
        sp = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, logprobs=logprobs)
        outs = self.server.generate([{"prompt_token_ids": list(p)} for p in prompts], sp)
        completions = [c for o in outs for c in o.outputs]
        return {
            "prompt_ids": [o.prompt_token_ids for o in outs],
            "completion_ids": [c.token_ids for c in completions],
            "logprobs": [[[lp[t].logprob] for lp, t in zip(c.logprobs, c.token_ids)] for c in completions],
            "logprob_token_ids": [[[t] for t in c.token_ids] for c in completions],
        }


def install(monkeypatch) -> None:
    """Make TRL's colocate mode build :class:`FakeLLM` for ``LLM`` (and the double's
    ``SamplingParams``), as if vLLM were installed."""
    import trl.generation.vllm_generation as vg

    monkeypatch.setattr(vg, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vg, "LLM", FakeLLM, raising=False)
    monkeypatch.setattr(vg, "SamplingParams", SamplingParams, raising=False)
    monkeypatch.setattr(vg, "StructuredOutputsParams", StructuredOutputsParams, raising=False)
    monkeypatch.setattr(vg, "RequestOutput", RequestOutput, raising=False)
    monkeypatch.setattr(vg, "VLLMClient", FakeClient, raising=False)
    FakeLLM.instances, FakeLLM.fail, FakeLLM.on_generate = [], None, None
    FakeClient.instances = []
    # TRL's colocate mode writes the rendezvous variables of a world of one into the process's
    # environment as it builds the engine: set here for every run of a test alike, and put back
    # after it.
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}.items():
        monkeypatch.setenv(k, v)
    with socket.socket() as sock:  # a free port, as TRL's own choice would be
        sock.bind(("localhost", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
