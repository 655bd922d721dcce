"""A test double of the part of vLLM's ``LLM`` that TRL's colocate mode and tidal call, for CPU
tests only (the GPU runs use vLLM itself): a real small Hugging Face model of its own (the
engine's copy of the weights), a KV cache of real memory sized as vLLM sizes it, sleep levels
1 and 2 that release both, and sampling with the process's random generator, as vLLM's.

What it keeps of vLLM's behaviour, because TRL and tidal depend on it:

* ``LLM(model=path, gpu_memory_utilization=..., kv_cache_memory_bytes=..., enable_sleep_mode=...,
  seed=...)`` loads the weights from ``path``; the KV cache is ``kv_cache_memory_bytes``, or
  ``gpu_memory_utilization`` of :data:`DEVICE_BYTES` less the weights (vLLM's sizing).
* ``sleep(level=1)`` backs the weights up on the host and drops the KV cache; ``level=2``
  drops both: a ``wake_up(tags=["weights"])`` after it maps memory whose bytes are garbage
  (here NaN), so a generation without a re-push of the weights is wrong, as vLLM's is (its
  issue 29341).
* Its memory is a sleep-mode pool as vLLM's ``CuMemAllocator`` keeps it (:class:`FakePool`, one
  a process, behind ``vllm.device_allocator.get_mem_allocator_instance``): one allocation a
  weight and one for the KV cache, each tagged. ``wake_up`` maps the allocations of its tags
  one by one and stops at the first that fails (``RuntimeError: CUDA Error: out of memory``
  where :attr:`FakeLLM.device_free` says the device lacks the room), those before it left
  mapped and the engine asleep by its own account; mapping a mapped allocation again fails
  (``CUDA Error: invalid argument``), as vLLM's second wake after such a failure would.
* ``llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, t)])``
  copies ``t`` into the engine's parameter of that name.
* ``generate(prompts, sampling_params)``: each ``{"prompt_token_ids": ids}`` sampled to
  ``max_tokens`` tokens (or an end token) at ``temperature``, with the per-token log-probability
  of the sampled token (``logprobs=0``), from torch's default generator, seeded with ``seed`` at
  construction (vLLM samples requests without a seed of their own from the device's default
  generator). A generation while asleep raises, as vLLM's would crash.
* The KV cache is vLLM's block pool: ``kv_cache_memory_bytes`` in blocks of 16 tokens (every
  layer's key and value), one of them vLLM's null block, which no request gets. A generation
  whose running sequences come to need more blocks than that at one decode step has its
  youngest request preempted (vLLM recomputes it later): counted in :attr:`FakeLLM.preemptions`
  (the tokens do not change here).
* A generation's requests stay the engine's until they finish
  (``llm_engine.output_processor.request_states``); one that raised leaves them there, and the
  next generation returns their outputs too (vLLM's ``generate`` collects every request that
  finishes), unless ``llm_engine.abort_request(ids, internal=True)`` dropped them. A failure
  injected at ``("decode", None, exc, k)`` raises at the k-th decoded token, mid-generation.

:func:`install` puts it where TRL's ``trl.generation.vllm_generation`` looks for vLLM.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import socket
import sys
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
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    detokenize: bool = True


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


@dataclasses.dataclass
class AllocationData:
    """``vllm.device_allocator.AllocationData``: an allocation of the sleep-mode pool."""

    handle: tuple  # (device, size, address, handle): vLLM's HandleType
    tag: str
    cpu_backup_tensor: torch.Tensor | None = None
    is_asleep: bool = False


class FakePool:
    """vLLM's ``CuMemAllocator`` as the double keeps it: the allocations by address, each the
    storage of one of an engine's tensors (mapped: its bytes allocated; unmapped: none)."""

    instance: "FakePool | None" = None
    _next = 1 << 44  # addresses no real memory has (ctypes never reads them)

    def __init__(self) -> None:
        self.pointer_to_data: dict[int, AllocationData] = {}
        self.tensors: dict[int, torch.Tensor] = {}

    def add(self, tensor: torch.Tensor, tag: str) -> int:
        ptr = FakePool._next
        FakePool._next += 1 << 32
        self.pointer_to_data[ptr] = AllocationData(handle=(0, tensor.untyped_storage().nbytes(), ptr, ptr), tag=tag)
        self.tensors[ptr] = tensor
        _POOLS[ptr] = self
        return ptr

    def mapped_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.tensors.values())

    def consistent(self) -> bool:
        """Every allocation's memory is as the pool counts it: mapped where awake, not where asleep."""
        return all(
            (self.tensors[ptr].untyped_storage().nbytes() == 0) == data.is_asleep
            for ptr, data in self.pointer_to_data.items()
        )


_POOLS: dict[int, FakePool] = {}  # address -> its pool


def _storage(ptr: int):
    return _POOLS[ptr].tensors[ptr].untyped_storage()


def create_and_map(allocation_handle: tuple) -> None:
    """``vllm.device_allocator.cumem.create_and_map``."""
    _, size, ptr, _ = allocation_handle
    FakeLLM.maps += 1
    f = FakeLLM.fail
    if f is not None and f[0] == "map" and f[1] == (_POOLS[ptr].pointer_to_data[ptr].tag,):
        FakeLLM._map_seen += 1
        if FakeLLM._map_seen == f[3]:
            raise f[2](f"injected at map{f[1]} (call {f[3]})")
    if _storage(ptr).nbytes():
        raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp (mapped already)")
    if FakeLLM.device_free is not None and FakeLLM.device_free() < size:
        raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp")
    _storage(ptr).resize_(size)


def unmap_and_release(allocation_handle: tuple) -> None:
    """``vllm.device_allocator.cumem.unmap_and_release``."""
    ptr = allocation_handle[2]
    if not _storage(ptr).nbytes():
        raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp (not mapped)")
    _storage(ptr).resize_(0)


class _CudaRT:
    """``vllm.device_allocator.cumem.libcudart``: ``cudaMemcpy`` between host memory and the
    pool's allocations (their addresses stand for their tensors' memory)."""

    @staticmethod
    def cudaMemcpy(dst: int, src: int, count: int) -> None:
        real = {p: _POOLS[p].tensors[p].data_ptr() for p in (dst, src) if p in _POOLS}
        ctypes.memmove(real.get(dst, dst), real.get(src, src), count)


def install_pool(monkeypatch) -> FakePool:
    """A fresh :class:`FakePool` for the process, behind the names of vLLM's that tidal reads
    it by (``vllm.device_allocator``, ``vllm.device_allocator.cumem``)."""
    pool = FakePool()
    monkeypatch.setattr(FakePool, "instance", pool)
    allocator = types.ModuleType("vllm.device_allocator")
    allocator.AllocationData = AllocationData
    allocator.get_mem_allocator_instance = lambda: FakePool.instance
    cumem = types.ModuleType("vllm.device_allocator.cumem")
    cumem.create_and_map, cumem.unmap_and_release, cumem.libcudart = create_and_map, unmap_and_release, _CudaRT()
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", allocator)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", cumem)
    FakeLLM.device_free, FakeLLM.maps, FakeLLM._map_seen = None, 0, 0
    return pool


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
    #: the device's free bytes now (a test's account of it), read as each allocation maps;
    #: None: room for all.
    device_free: Any = None
    maps = 0  # allocations mapped by any wake (FakePool's create_and_map)
    _map_seen = 0

    def __init__(
        self,
        model: str,
        *,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        max_model_len: int | None = None,
        pool: FakePool | None = None,
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
        cfg = self.model.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_block = 16 * 2 * cfg.num_hidden_layers * heads * head_dim * 4  # fp32, as its weights
        self.kv_blocks = kv_cache_memory_bytes // per_block - 1  # less vLLM's null block
        self.preemptions = 0  # decode steps that found the block pool short (see generate)
        self.enable_sleep_mode = enable_sleep_mode
        torch.manual_seed(seed)  # vLLM's engine seeds the process's generators as it starts
        self.request_states: dict[str, list[int]] = {}  # unfinished requests: id -> prompt ids
        self._next_request = 0
        self.sleeping_weights = self.sleeping_kv = False
        self.pool = pool or FakePool.instance or FakePool()
        self._allocations = [self.pool.add(p, "weights") for p in self.model.parameters()]
        self._allocations.append(self.pool.add(self.kv_cache, "kv_cache"))
        self.calls: list[tuple] = []
        self.pushes = 0
        self._seen: dict = {}
        limit = max_model_len or getattr(self.model.config, "max_position_embeddings", 2048)
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=limit),
            output_processor=types.SimpleNamespace(request_states=self.request_states),
            abort_request=self._abort_request,
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
        if self.sleeping_weights and self.sleeping_kv:
            return  # vLLM: "Executor is already sleeping."
        for ptr in self._allocations:  # vLLM's CuMemAllocator.sleep: every allocation, in order
            data = self.pool.pointer_to_data[ptr]
            if level == 1 and data.tag == "weights":
                backup = torch.empty(data.handle[1], dtype=torch.uint8)
                _CudaRT.cudaMemcpy(backup.data_ptr(), ptr, data.handle[1])
                data.cpu_backup_tensor = backup
            try:
                unmap_and_release(data.handle)
            finally:
                data.is_asleep = True
        self.sleeping_weights = self.sleeping_kv = True
        self._level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tuple(tags) if tags else None))
        self._maybe_fail("wake_up", tuple(tags) if tags else None)
        tags = tags or ["weights", "kv_cache"]
        asleep = {"weights": self.sleeping_weights, "kv_cache": self.sleeping_kv}
        if not any(asleep.values()) or not all(asleep[t] for t in tags):
            return  # vLLM: "Executor is not sleeping." / "Tag ... is not in sleeping tags"
        for ptr in self._allocations:  # vLLM's CuMemAllocator.wake_up: no check of is_asleep
            data = self.pool.pointer_to_data[ptr]
            if data.tag not in tags:
                continue
            create_and_map(data.handle)
            data.is_asleep = False
            if data.cpu_backup_tensor is not None:
                _CudaRT.cudaMemcpy(ptr, data.cpu_backup_tensor.data_ptr(), data.handle[1])
                data.cpu_backup_tensor = None
            elif data.tag == "weights":
                self.pool.tensors[ptr].fill_(math.nan)  # level 2: the bytes are whatever the new memory held
            else:
                self.pool.tensors[ptr].zero_()
        # Only a wake that returned changes what the engine counts asleep (vLLM's executor).
        if "weights" in tags:
            self.sleeping_weights = False
        if "kv_cache" in tags:
            self.sleeping_kv = False

    def _abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        """``llm_engine.abort_request``: the requests dropped."""
        self.calls.append(("abort_request", len(request_ids)))
        for rid in request_ids:
            self.request_states.pop(rid, None)

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
        given = sampling_params or SamplingParams()
        per_prompt = list(given) if isinstance(given, (list, tuple)) else [given] * len(prompts)
        eos = getattr(self.model.config, "eos_token_id", None)
        # Requests an earlier generation left unfinished run too, and are returned with these.
        stale = [(rid, ids) for rid, ids in self.request_states.items()]
        mine = []
        for prompt, sp in zip(prompts, per_prompt):
            rid = str(self._next_request)
            self._next_request += 1
            self.request_states[rid] = list(prompt["prompt_token_ids"])
            mine.append((rid, list(prompt["prompt_token_ids"]), sp))
        out, lengths = [], []
        for rid, ids, sp in [(r, i, per_prompt[0]) for r, i in stale] + mine:
            completions = []
            # A request with a seed of its own samples from its own generator (vLLM's too).
            gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
            for _ in range(sp.n):
                seq, toks, lps = torch.tensor([ids]), [], []
                for _ in range(sp.max_tokens):
                    self._maybe_fail("decode")
                    logits = self.model(input_ids=seq).logits[0, -1].float()
                    if sp.allowed_token_ids is not None:
                        keep = torch.full_like(logits, -math.inf)
                        keep[sp.allowed_token_ids] = 0.0
                        logits = logits + keep
                    logits = logits / max(sp.temperature, 1e-6)
                    logp = torch.log_softmax(logits, dim=-1)
                    tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
                    toks.append(tok)
                    lps.append({tok: Logprob(float(logp[tok]), rank=1)})
                    seq = torch.cat([seq, torch.tensor([[tok]])], dim=1)
                    if eos is not None and tok == eos and len(toks) >= sp.min_tokens:
                        break
                completions.append(CompletionOutput(token_ids=toks, logprobs=lps if sp.logprobs is not None else None))
                lengths.append((len(ids), len(toks)))
            del self.request_states[rid]
            out.append(RequestOutput(prompt_token_ids=ids, outputs=completions))
        self._count_preemptions(lengths)
        return out

    def _count_preemptions(self, lengths: list[tuple[int, int]]) -> None:
        """vLLM runs a generation's sequences together: at its t-th decode step each sequence
        still running holds its prompt and t tokens in whole blocks; a step that needs more
        blocks than the pool has preempts a request."""
        for t in range(1, max((c for _, c in lengths), default=0) + 1):
            need = sum(-(-(p + t) // 16) for p, c in lengths if c >= t)
            if need > self.kv_blocks:
                self.preemptions += 1


class FakeClient:
    """A test double of TRL's ``VLLMClient`` (server mode: the engine in another process, on other
    GPUs) backed by a :class:`FakeLLM` of ``FakeClient.model_path`` standing in for the server:
    the weights TRL streams to it are copied into that engine, generation runs there."""

    model_path: str | None = None
    instances: list["FakeClient"] = []

    def __init__(self, base_url: str | None = None, group_port: int = 51216, connection_timeout: float = 0.0, **_):
        # The server's engine is in another process: its memory is not this process's pool.
        self.server = FakeLLM(FakeClient.model_path, kv_cache_memory_bytes=1 << 20, seed=0, pool=FakePool())
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


def install_module(monkeypatch) -> None:
    """Make ``import vllm`` give the double (``LLM``, ``SamplingParams``) and its pool, for code
    that builds the engine itself (the GRPO recipe's ``rollout_engine="vllm"``)."""
    import importlib.machinery

    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM, module.SamplingParams = FakeLLM, SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances, FakeLLM.fail, FakeLLM.on_generate = [], None, None
    install_pool(monkeypatch)


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
    install_pool(monkeypatch)
    FakeClient.instances = []
    # TRL's colocate mode writes the rendezvous variables of a world of one into the process's
    # environment as it builds the engine: set here for every run of a test alike, and put back
    # after it.
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}.items():
        monkeypatch.setenv(k, v)
    with socket.socket() as sock:  # a free port, as TRL's own choice would be
        sock.bind(("localhost", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
