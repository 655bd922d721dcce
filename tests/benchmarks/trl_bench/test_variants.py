"""trl_bench.variants: a variant string parsed into what its run builds, and a bad one refused
with the part at fault named."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))

variants = pytest.importorskip("trl_bench.variants")
Variant, VariantError = variants.Variant, variants.VariantError


def test_trl_alone_and_deepspeeds_offload_are_no_tidal_variant():
    for name in ("trl", "ds-zero3-offload"):
        v = Variant.parse(name)
        assert v.trainer == name and not v.is_tidal and v.residency is None and v.env() == {}
    v = Variant.parse("trl+expandable")
    assert v.trainer == "trl" and v.name == "trl+expandable"
    assert v.env() == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    with pytest.raises(ValueError, match="not a tidal variant"):
        v.tidal_config()


def test_a_tidal_variant_reads_its_residency_and_every_suffix_in_any_order():
    v = Variant.parse("stream+prefetch+peak=17.4")
    assert (v.trainer, v.residency, v.prefetch, v.peak_gib) == ("tidal", "stream", True, 17.4)
    assert not v.sets_timeshare and not v.unpaced and not v.expandable
    v = Variant.parse("role+evict=as_needed+budget=14+headroom=0.5+unpaced+expandable+prefetch")
    assert (v.residency, v.evict, v.budget_gib, v.headroom_gib) == ("role", "as_needed", 14.0, 0.5)
    assert v.unpaced and v.expandable and v.prefetch and v.sets_timeshare
    assert Variant.parse("step") == Variant(name="step", trainer="tidal", residency="step")


def test_the_parsed_variant_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        Variant("step", "tidal")  # noqa
    v = Variant.parse("step")
    with pytest.raises(AttributeError):
        v.prefetch = True


@pytest.mark.parametrize(
    "name, says",
    [
        ("steam+prefetch", "'steam' is neither trl"),
        ("stream+prefech", "'+prefech' is no suffix"),
        ("stream+peak=lots", "peak takes a number of GiB"),
        ("stream+budget=-1", "budget takes a number of GiB"),
        ("stream+evict=all", "evict takes others or as_needed"),
        ("stream+prefetch+prefetch", "'+prefetch' given twice"),
        ("trl+prefetch", "trl takes only '+expandable'"),
        ("stream+prefetch=1", "no suffix"),
    ],
)
def test_a_bad_variant_is_refused_naming_it_and_the_part_at_fault(name, says):
    with pytest.raises(VariantError) as e:
        Variant.parse(name)
    assert f"unknown variant {name!r}" in str(e.value) and says in str(e.value)
    assert "a variant is trl, ds-zero3-offload, or <residency>" in str(e.value)


def test_the_tidal_config_carries_the_variants_settings():
    pytest.importorskip("trl")
    cfg = Variant.parse("stream+prefetch+peak=2").tidal_config()
    assert cfg.optimizer_residency == "stream" and cfg.prefetch is True
    assert cfg.prefetch_peak_bytes == 2 * 2**30
    cfg = Variant.parse("role+budget=14+evict=as_needed+unpaced").tidal_config()
    ts = cfg.timeshare
    assert ts.budget_bytes == 14 * 2**30 and ts.headroom_bytes == 0 and ts.evict == "as_needed"
    assert ts.release_to_driver is False and ts.wait_for_copies is False
    assert ts.transfer.paced_piece_bytes == 0
    assert Variant.parse("step").tidal_config().optimizer_residency == "step"


def test_the_bench_refuses_a_bad_variant_before_any_work(tmp_path, capsys):
    launch = pytest.importorskip("trl_bench.launch")
    cache = tmp_path / "models"
    with pytest.raises(SystemExit) as e:
        launch.main(["--variants", "trl,stream+prefech", "--model-cache", str(cache)])
    assert e.value.code == 2 and "unknown variant 'stream+prefech'" in capsys.readouterr().err
    assert not cache.exists()
