"""``activation_layers="auto"`` (``tidal.integrations.hf.AUTO_LAYER_PATHS``) finds the decoder
stack of the causal-LM families transformers ships: models built on the meta device (no
memory, no download) from each family's default config, shrunk to two layers where the
config allows."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from tidal.integrations.hf import AUTO_LAYER_PATHS, find_layers  # noqa: E402

# One family per path of AUTO_LAYER_PATHS (model_type -> where its blocks are).
FAMILIES = {
    "llama": "model.layers",
    "qwen2": "model.layers",
    "gemma3": "model.language_model.layers",
    "opt": "model.decoder.layers",
    "gpt2": "transformer.h",
    "falcon": "transformer.h",
    "mpt": "transformer.blocks",
    "xlnet": "transformer.layer",
    "gpt_neox": "gpt_neox.layers",
    "gpt_neox_japanese": "gpt_neox_japanese.layers",
    "mamba": "backbone.layers",
    "xlstm": "backbone.blocks",
    "rwkv": "rwkv.blocks",
    "biogpt": "biogpt.layers",
    "cpmant": "cpmant.encoder.layers",
    "prophetnet": "prophetnet.decoder.layers",
    "blt": "model.global_transformer.layers",
    "hrm_text": "model.L_module.layers",
    "git": "git.encoder.layer",
    "bert": "bert.encoder.layer",
    "roberta": "roberta.encoder.layer",
    "roberta-prelayernorm": "roberta_prelayernorm.encoder.layer",
    "roc_bert": "roc_bert.encoder.layer",
    "roformer": "roformer.encoder.layer",
    "rembert": "rembert.encoder.layer",
    "electra": "electra.encoder.layer",
    "ernie": "ernie.encoder.layer",
    "data2vec-text": "data2vec_text.encoder.layer",
}
# No list of whole blocks to find: XLM keeps attention and feed-forward in separate lists.
NO_BLOCKS = {"xlm"}
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")


def _build(model_type: str, shrink: bool):
    cfg = AutoConfig.for_model(model_type)
    if shrink:
        for sub in [cfg] + [getattr(cfg, a) for a in ("text_config",) if hasattr(getattr(cfg, a, None), "to_dict")]:
            for field in _LAYER_FIELDS:
                value = getattr(sub, field, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 2:
                    setattr(sub, field, 2)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(cfg)


_TOWERS = ("vision", "visual", "audio", "image", "speech", "embed_tokens_extend")


def _path(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None)


def _decoder_stack(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """What "the decoder stack" means here, found without any list of names: of the module lists
    not nested in another one and not in a vision, audio or image tower, the one holding the
    most parameters."""
    best, best_n = None, -1
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.ModuleList) or not len(m) or any(t in name for t in _TOWERS):
            continue
        parts = name.split(".")
        if any(isinstance(model.get_submodule(".".join(parts[:k])), torch.nn.ModuleList) for k in range(1, len(parts))):
            continue
        n = sum(p.numel() for p in m.parameters())
        if n > best_n:
            best, best_n = m, n
    return best


def build(model_type: str):
    """The family's causal LM on the meta device, two layers where its config allows; None if
    this transformers cannot build it from its default config (a config that needs extras)."""
    for shrink in (True, False):
        try:
            return _build(model_type, shrink)
        except Exception:  # noqa: BLE001 (any failure: try the unshrunk config, then give up)
            continue
    return None


def test_the_families_list_covers_every_auto_path():
    assert set(FAMILIES.values()) == set(AUTO_LAYER_PATHS) - {"layers"}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_auto_finds_each_familys_decoder_stack(model_type):
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    model = build(model_type)
    assert model is not None, f"{model_type} could not be built from its default config"
    want = FAMILIES[model_type]
    found = find_layers(model, "auto")
    assert found is model.get_submodule(want), (model_type, want)


@pytest.mark.slow  # builds every causal-LM class transformers ships (~200, on the meta device)
def test_auto_finds_a_stack_of_blocks_in_every_causal_lm_transformers_ships():
    """Every causal-LM class of the installed transformers that builds from its default config:
    "auto" returns its decoder stack (:func:`_decoder_stack`; XLM, which has none: refused,
    naming the paths)."""
    built, missed = 0, []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        model = build(model_type)
        if model is None:
            continue
        built += 1
        if model_type in NO_BLOCKS:
            with pytest.raises(ValueError, match="AUTO_LAYER_PATHS"):
                find_layers(model, "auto")
            continue
        try:
            found = find_layers(model, "auto")
        except ValueError:
            missed.append(model_type)
            continue
        want = _decoder_stack(model)
        if found is not want:
            missed.append(f"{model_type}: found {_path(model, found)}, its stack is {_path(model, want)}")
    assert not missed, missed
    assert built >= 0.8 * len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), (built, len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))


def test_a_peft_path_is_read_from_the_wrapper_then_the_base_model():
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    base = LlamaForCausalLM(cfg)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    layers = base.model.layers
    assert find_layers(wrapped, "auto") is layers
    assert find_layers(wrapped, "model.layers") is layers  # the transformers model's own path
    assert find_layers(wrapped, "base_model.model.model.layers") is layers  # the wrapper's
    with pytest.raises(ValueError, match=r"no list of transformer blocks .* in LlamaForCausalLM inside .*PeftModel"):
        find_layers(wrapped, "model.nope")
