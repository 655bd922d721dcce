"""Model shapes for the memory planner: presets, HF configs, parameter counts.

A :class:`ModelShape` is everything the planner needs to know about a decoder-only
transformer of the Llama / Qwen2 family: RMSNorm, rotary embeddings, grouped-query
attention, a gated SiLU MLP (gate, up, down), an embedding table and an LM head that may be
tied to it. Parameter counts are computed from the shapes; they equal the ``numel`` sums of
the transformers implementations (checked in ``tests/plan/test_shapes.py`` by building the
models on the ``meta`` device).

Only the standard library is imported: a shape can be read from a ``config.json`` path, a
dict, or any object with the attributes of a ``transformers.PretrainedConfig`` (duck-typed,
so transformers is never imported here).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

__all__ = ["ALL_PRESETS", "LORA_TARGETS", "ModelShape", "PRESETS", "TOY_PRESETS", "load_shape", "preset"]

# Every linear layer of a decoder layer: the usual LoRA target list ("all-linear").
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Families whose decoder layer matches the formulas of this package. Anything else is
# refused rather than planned wrong (MoE, parallel attention, LayerNorm with bias, ...).
_FAMILIES = {
    # model_type: (q/k/v bias, per-head q/k RMSNorm)
    "qwen2": (True, False),
    "llama": (False, False),
    "mistral": (False, False),
    "qwen3": (False, True),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The shape of a Llama/Qwen2-style causal LM.

    Attributes:
        name: label used in reports.
        layers, hidden, intermediate: decoder layers, residual width, MLP width.
        heads, kv_heads, head_dim: attention heads, key/value heads (GQA), width of one head
            (``hidden // heads`` for Qwen2 and Llama; Qwen3 sets it explicitly).
        vocab: rows of the embedding table (the padded vocabulary of the checkpoint).
        tied_embeddings: the LM head shares the embedding matrix (counted once).
        qkv_bias: q/k/v projections carry a bias (Qwen2: yes; Llama: no).
        mlp_bias, o_bias: the MLP projections / the output projection carry biases.
        qk_norm: a per-head RMSNorm on queries and keys (Qwen3).
        family: the ``model_type`` the shape came from.
    """

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool = False
    mlp_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    family: str = "llama"

    def __post_init__(self) -> None:
        for f in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"ModelShape.{f} must be > 0, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    # ---- widths ---------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the query projection output (``heads * head_dim``)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection output (``kv_heads * head_dim``)."""
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of every linear layer of one decoder layer."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    # ---- parameter counts -----------------------------------------------------------------
    def layer_params(self) -> int:
        """Parameters of one decoder layer: 7 linears (+ biases), 2 RMSNorms (+ q/k norms)."""
        n = sum(a * b for a, b in self.linear_shapes().values())
        if self.qkv_bias:
            n += self.q_dim + 2 * self.kv_dim
        if self.o_bias:
            n += self.hidden
        if self.mlp_bias:
            n += 2 * self.intermediate + self.hidden
        n += 2 * self.hidden
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def lm_head_params(self) -> int:
        """Parameters of the LM head that are not the embedding's (0 when tied)."""
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def root_params(self) -> int:
        """Parameters outside the decoder layers: embedding, final norm, untied LM head."""
        return self.embedding_params() + self.hidden + self.lm_head_params()

    def param_count(self) -> int:
        """All parameters, a tied matrix counted once (what ``sum(p.numel())`` gives)."""
        return self.root_params() + self.layers * self.layer_params()

    def largest_param(self) -> int:
        """Elements of the largest single parameter (the embedding for these families)."""
        return max(self.embedding_params(), max(a * b for a, b in self.linear_shapes().values()))

    def lora_params(self, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
        """Trainable parameters of LoRA adapters of ``rank`` on ``targets`` of every layer:
        ``rank * (in + out)`` per adapted linear (A is ``rank x in``, B is ``out x rank``)."""
        if rank <= 0:
            return 0
        shapes = self.linear_shapes()
        unknown = sorted(set(targets) - set(shapes))
        if unknown:
            raise ValueError(f"unknown LoRA target modules {unknown}; known: {sorted(shapes)}")
        widest = min((min(shapes[t]) for t in targets), default=rank)
        if rank > widest:
            raise ValueError(
                f"LoRA rank {rank} is more than {widest}, the narrowest side of the adapted layers of {self.name}: "
                f"a larger rank adds parameters but no expressiveness; use a rank <= {widest}"
            )
        return self.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, *, name: str | None = None, source: str = "the config") -> "ModelShape":
        """Read a ``transformers.PretrainedConfig`` (or a dict of ``config.json``).

        Supported ``model_type``: qwen2, llama, mistral, qwen3. Mixture-of-experts configs
        and other families raise ``ValueError`` (their layers differ from the formulas here),
        as does a config missing a field the planner needs (``source`` names it in the message).
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        model_type = get("model_type")
        if model_type not in _FAMILIES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported by the planner; "
                f"supported: {sorted(_FAMILIES)} (Llama/Qwen2-style dense decoders)"
            )
        missing = [k for k in _REQUIRED if get(k) is None]
        if missing:
            raise ValueError(
                f"{source} has no {', '.join(repr(k) for k in missing)}: the planner needs "
                f"{', '.join(_REQUIRED)} to size the model. Use the model's complete config.json "
                f"(as saved by save_pretrained), or a preset (--preset)"
            )
        for moe_key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if get(moe_key):
                raise ValueError(f"{model_type} config has {moe_key}={get(moe_key)}: MoE models are not supported")
        qkv_bias, qk_norm = _FAMILIES[model_type]
        if model_type != "qwen2" and get("attention_bias") is not None:
            qkv_bias = bool(get("attention_bias"))

        def count(key: str, default: Any = None) -> int:
            # A size must be a whole number > 0: JSON allows 0, 2.5, "64", true or 1e999 (inf).
            x = get(key, default)
            if isinstance(x, float) and x.is_integer():
                x = int(x)
            if isinstance(x, bool) or not isinstance(x, int) or not 0 < x <= _MAX_SIZE:
                raise ValueError(
                    f"{source}: {key} must be a whole number between 1 and {_MAX_SIZE:,}, got {x!r}; "
                    f"fix the config or use a preset (--preset)"
                )
            return x

        heads = count("num_attention_heads")
        hidden = count("hidden_size")
        head_dim = count("head_dim") if get("head_dim") is not None else hidden // heads
        if head_dim < 1:
            raise ValueError(
                f"{source}: hidden_size {hidden} over num_attention_heads {heads} leaves heads of width 0; "
                f"fix the config or use a preset (--preset)"
            )
        return cls(
            name=name or str(get("name_or_path") or get("_name_or_path") or model_type),
            layers=count("num_hidden_layers"),
            hidden=hidden,
            intermediate=count("intermediate_size"),
            heads=heads,
            kv_heads=count("num_key_value_heads") if get("num_key_value_heads") is not None else heads,
            head_dim=head_dim,
            vocab=count("vocab_size"),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=bool(get("attention_bias")) and model_type != "qwen2",
            mlp_bias=bool(get("mlp_bias", False)),
            qk_norm=qk_norm,
            family=model_type,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelShape":
        """Read an HF ``config.json`` file, or the ``config.json`` of a Hugging Face model
        folder (no transformers needed). ``ValueError`` names the file and what is wrong."""
        path = os.fspath(path)
        if os.path.isdir(path):
            folder, path = path, os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise ValueError(
                    f"{folder} is a folder without a config.json; pass a Hugging Face model folder "
                    f"(one that save_pretrained wrote) or the path of its config.json"
                )
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                f"fix the file or pass another config"
            ) from None
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not a text (JSON) file; pass a model's config.json") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object (a model config), got {type(data).__name__}")
        name = data.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or "config"
        return cls.from_hf_config(data, name=name, source=path)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["params"] = self.param_count()
        return d


# The largest width, count or vocabulary a config may give: beyond it no tensor of the model
# could be allocated (and a JSON 1e999 is infinity).
_MAX_SIZE = 1 << 31

# Fields from_hf_config reads without a default.
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _qwen2(
    name: str, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int, tied: bool
) -> ModelShape:
    return ModelShape(
        name=name,
        layers=layers,
        hidden=hidden,
        intermediate=intermediate,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=hidden // heads,
        vocab=vocab,
        tied_embeddings=tied,
        qkv_bias=True,
        family="qwen2",
    )


# The public configs of the released checkpoints (config.json of each model on the Hub).
PRESETS: dict[str, ModelShape] = {
    "qwen2-0.5b": _qwen2(
        "Qwen2-0.5B", layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936, tied=True
    ),
    "qwen2-1.5b": _qwen2(
        "Qwen2-1.5B", layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936, tied=True
    ),
    "qwen2-7b": _qwen2(
        "Qwen2-7B", layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064, tied=False
    ),
    "qwen2.5-14b": _qwen2(
        "Qwen2.5-14B", layers=48, hidden=5120, intermediate=13824, heads=40, kv_heads=8, vocab=152064, tied=False
    ),
    "qwen2.5-32b": _qwen2(
        "Qwen2.5-32B", layers=64, hidden=5120, intermediate=27648, heads=40, kv_heads=8, vocab=152064, tied=False
    ),
    "llama3-8b": ModelShape(
        name="Llama-3-8B",
        layers=32,
        hidden=4096,
        intermediate=14336,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=128256,
        tied_embeddings=False,
        family="llama",
    ),
}


#: Small shapes of the same family for runs on a CPU (the demo's default ``nano``, ``tiny`` for
#: the benchmarks' dry runs): no released checkpoint has them.
TOY_PRESETS: dict[str, ModelShape] = {
    "nano": _qwen2("nano", layers=2, hidden=128, intermediate=512, heads=4, kv_heads=2, vocab=16, tied=False),
    "tiny": _qwen2("tiny", layers=4, hidden=256, intermediate=704, heads=4, kv_heads=2, vocab=8192, tied=False),
}
#: Every shape by name: the one list the planner, the recipes, the CLI and the benchmarks read.
ALL_PRESETS: dict[str, ModelShape] = {**TOY_PRESETS, **PRESETS}


def preset(name: str) -> ModelShape:
    """The preset called ``name`` (see :data:`PRESETS`); ``ValueError`` names the choices."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


def load_shape(spec: Any) -> ModelShape:
    """A shape from a preset name, a ``config.json`` path, a dict, a config object or a shape."""
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, str) and spec in PRESETS:
        return PRESETS[spec]
    if isinstance(spec, (str, os.PathLike)):
        if not os.path.exists(spec):
            raise ValueError(
                f"{spec!r} is neither a preset ({sorted(PRESETS)}) nor an existing config.json or model folder"
            )
        return ModelShape.from_json(spec)
    return ModelShape.from_hf_config(spec)
