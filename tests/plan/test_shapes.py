"""Shapes: parameter counts equal the transformers implementations (built on ``meta``)."""

import json

import pytest
import torch

from tidal.plan import PRESETS, ModelShape, load_shape, preset

transformers = pytest.importorskip("transformers")

# Published parameter counts of the released checkpoints.
PUBLISHED = {
    "qwen2-0.5b": 494_032_768,
    "qwen2-1.5b": 1_543_714_304,
    "qwen2-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352,
    "llama3-8b": 8_030_261_248,
}


def _hf_config(s: ModelShape):
    cls = transformers.Qwen2Config if s.family == "qwen2" else transformers.LlamaConfig
    return cls(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        tie_word_embeddings=s.tied_embeddings,
    )


def _meta_numel(cfg) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied matrix once


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_param_count_equals_transformers_model(name):
    s = preset(name)
    assert s.param_count() == _meta_numel(_hf_config(s)) == PUBLISHED[name]


def test_qwen3_shape_with_qk_norm_and_explicit_head_dim():
    cfg = transformers.Qwen3Config(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=96,
        intermediate_size=512,
        vocab_size=1000,
        tie_word_embeddings=True,
    )
    s = ModelShape.from_hf_config(cfg)
    assert (s.head_dim, s.q_dim, s.qk_norm) == (96, 384, True)
    assert s.param_count() == _meta_numel(cfg)


def test_from_hf_config_object_and_json_match_preset(tmp_path):
    s = preset("qwen2-1.5b")
    cfg = _hf_config(s)
    from_obj = ModelShape.from_hf_config(cfg, name=s.name)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    from_json = load_shape(str(path))
    for got in (from_obj, from_json):
        assert (
            got.layers,
            got.hidden,
            got.intermediate,
            got.heads,
            got.kv_heads,
            got.head_dim,
            got.vocab,
            got.tied_embeddings,
            got.qkv_bias,
        ) == (28, 1536, 8960, 12, 2, 128, 151936, True, True)
        assert got.param_count() == s.param_count()


def test_unsupported_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not supported"):
        ModelShape.from_hf_config({"model_type": "gpt2"})
    moe = {
        "model_type": "qwen2",
        "num_experts": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "intermediate_size": 8,
        "vocab_size": 8,
    }
    with pytest.raises(ValueError, match="MoE"):
        ModelShape.from_hf_config(moe)
    path = tmp_path / "c.json"
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="JSON object"):
        ModelShape.from_json(path)
    with pytest.raises(ValueError, match="neither a preset"):
        load_shape("no-such-model")


def test_lora_params_by_hand():
    s = preset("qwen2-0.5b")  # h 896, q 896, kv 128, i 4864, 24 layers
    per_layer_r1 = (896 + 896) + 2 * (896 + 128) + (896 + 896) + 2 * (896 + 4864) + (4864 + 896)
    assert s.lora_params(8) == 24 * 8 * per_layer_r1
    assert s.lora_params(8, ("q_proj", "v_proj")) == 24 * 8 * ((896 + 896) + (896 + 128))
    assert s.lora_params(0) == 0
    with pytest.raises(ValueError, match="unknown LoRA target"):
        s.lora_params(8, ("qkv",))
