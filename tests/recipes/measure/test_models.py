"""The recipes' model presets: built from a config (on the meta device: no memory), each has
the parameters its shape says and the planner's shape of the same name counts."""

import pytest

from tidal.plan import PRESETS as PLAN_SHAPES
from tidal_recipes.measure import PRESETS, build_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_builds_with_the_parameters_its_shape_says(name):
    model, desc = build_model(name, device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert n == PRESETS[name].param_count()
    if name in PLAN_SHAPES:
        assert n == PLAN_SHAPES[name].param_count()
    want = "LlamaForCausalLM" if PRESETS[name].family == "llama" else "Qwen2ForCausalLM"
    assert desc == f"transformers {want}"


def test_llama_has_no_attention_biases_and_qwen2_has_them():
    llama, _ = build_model("llama3-8b", device="meta")
    qwen, _ = build_model("qwen2-7b", device="meta")
    assert llama.model.layers[0].self_attn.q_proj.bias is None
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    assert sum(p.numel() for p in llama.parameters()) == 8_030_261_248  # Llama-3-8B's published count


def test_the_cli_offers_every_preset():
    from tidal_recipes.cli.main import _PRESETS  # the CLI lists them without importing the models

    assert sorted(_PRESETS) == sorted(PRESETS)
