"""The workload every variant trains on: a Qwen2-shape model built from a config (random bf16
weights, saved to a folder so TRL loads the policy and builds its reference from it as it does
from a hub id), the character-level task of ``tidal_recipes/grpo/char_task.py`` (its tokenizer,
prompts ``"<i>+<i>="`` and reward), and the ``GRPOConfig`` of a run.

Importing this module imports ``tidal.plan.shapes`` (stdlib only); torch, transformers, TRL and
datasets are imported by the functions that use them.
"""

from __future__ import annotations

import importlib.util
import os

from trl_bench import ROOT

from tidal.plan.shapes import PRESETS as SHAPES, ModelShape

__all__ = [
    "CHARS",
    "NUM_GENERATIONS",
    "PRESETS",
    "SAVED_MARKER",
    "char_task",
    "deepspeed_config",
    "grpo_config",
    "prompts",
    "qwen2_config",
    "save_model",
]

_QWEN2 = dict(tied_embeddings=False, qkv_bias=True, family="qwen2")
_DRY_RUNS = {
    "tiny": ModelShape(
        name="tiny", layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256, **_QWEN2
    ),
    # The tensors of a 28-layer model (Qwen2-1.5B's count) at tiny sizes: host-side costs on a CPU.
    "tiny28": ModelShape(
        name="tiny28", layers=28, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256, **_QWEN2
    ),
}
PRESETS: dict[str, ModelShape] = {**_DRY_RUNS, **{k: v for k, v in SHAPES.items() if v.family == "qwen2"}}
"""The model shapes by name: the planner's Qwen2 family (``tidal.plan.shapes``) and two dry-run
shapes of the char task's vocabulary (``tiny``, and ``tiny28`` with 28 layers), for a CPU too."""

CHARS = list("0123456789+= abcdefghijklmnopqrstuvwxyz")
"""The char task's alphabet (its tokenizer's vocabulary, beside the special tokens)."""

NUM_GENERATIONS = 8
"""Completions per prompt in every run (``GRPOConfig.num_generations``)."""

SAVED_MARKER = "bench_trl_saved"
"""The file :func:`save_model` writes last in a model folder: a folder holding it is whole."""


def char_task():
    """``tidal_recipes/grpo/char_task.py`` loaded as a module of its own (the package's
    ``__init__`` imports tidal's trainer, which a script that only builds a model or a reward
    does not need): ``char_tokenizer``, ``reward_sevens``, ``PAD_ID``, ``EOS_ID``."""
    spec = importlib.util.spec_from_file_location(
        "_char_task", os.path.join(ROOT, "tidal_recipes", "grpo", "char_task.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qwen2_config(preset: str, *, pad_id: int, eos_id: int):
    """The ``Qwen2Config`` of ``preset`` (a key of :data:`PRESETS`; random weights are built
    from it), bf16, untied embeddings (as every row in RESULTS.md ran), its real vocabulary size
    (the embedding and head are a large part of a small model's bytes)."""
    from transformers import Qwen2Config

    shape = PRESETS[preset]
    return Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )


def save_model(preset: str, path: str, reward_path: str | None = None) -> None:
    """The policy of ``preset`` (a causal LM, random weights from seed 0) and the char task's
    tokenizer saved at ``path``, built on the GPU where there is one; with ``reward_path``, a
    reward model of the same shape (a sequence classifier with one label, seed 1) and the
    tokenizer there too. Without ``reward_path``, a folder already holding
    :data:`SAVED_MARKER` (an earlier run's whole save, ``--model-cache``) is kept as it is; the
    marker is written last, so a save cut short is not taken for a whole one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    done = os.path.join(path, SAVED_MARKER)
    if reward_path is None and os.path.exists(done):
        return
    task = char_task()
    task.char_tokenizer(CHARS).save_pretrained(path)
    cfg = qwen2_config(preset, pad_id=task.PAD_ID, eos_id=task.EOS_ID)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    if reward_path is not None:
        task.char_tokenizer(CHARS).save_pretrained(reward_path)
        cfg.num_labels = 1
        torch.manual_seed(1)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            reward = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.bfloat16)
        reward.save_pretrained(reward_path)
        del reward
    torch.cuda.empty_cache()  # the saving process goes on to measure the line rate
    with open(done, "w") as f:
        f.write(preset)


def prompts():
    """The training prompts: a ``datasets.Dataset`` of ``"<i>+<i>="`` for i in 0..255."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{i}+{i}=" for i in range(256)]})


def deepspeed_config() -> dict:
    """DeepSpeed ZeRO-3 with optimizer state and parameters offloaded to the CPU
    (``DeepSpeedCPUAdam``, pinned host memory): what a TRL user sets to fit a model that does
    not fit the GPU, through TRL's own ``GRPOConfig(deepspeed=...)``. One process: the
    distributed environment of a world of one is set in ``os.environ`` here where unset
    (DeepSpeed initialises it)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    return {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        "bf16": {"enabled": "auto"},
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }


def grpo_config(args, *, deepspeed: bool, cuda: bool):
    """The ``GRPOConfig`` of a run of ``args.steps`` steps of ``args.batch`` completions of at
    most ``args.completion`` tokens (``args.micro_batch`` at a time, their gradients
    accumulated: one generation and one optimizer step a step either way), beta 0.04, seed 0,
    weights loaded in ``args.dtype``. bf16 autocast on a GPU except under FSDP2 (accelerate's
    mixed precision there keeps fp32 masters of bf16 weights: the sharded runs train the
    weights in their own dtype, as one GPU does without autocast). With several processes
    (``args.nproc``) each loads the models whole onto its GPU (``device_map=None``: TRL's
    ``"auto"`` under FSDP spreads them over every GPU the process sees). ``deepspeed``: ZeRO-3
    with CPU offload (:func:`deepspeed_config`)."""
    import tempfile

    from trl import GRPOConfig

    micro = args.micro_batch or args.batch
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        beta=0.04,
        learning_rate=1e-6,
        max_steps=args.steps,
        num_generations=NUM_GENERATIONS,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.batch // micro,
        max_completion_length=args.completion,
        logging_steps=1,
        report_to=[],
        bf16=cuda and args.launch != "fsdp2",
        use_cpu=not cuda,
        save_strategy="no",
        seed=0,
        model_init_kwargs={"dtype": args.dtype, **({"device_map": None} if args.nproc > 1 else {})},
        deepspeed=deepspeed_config() if deepspeed else None,
    )
