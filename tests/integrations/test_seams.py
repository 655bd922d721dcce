"""The private surfaces of TRL, transformers and accelerate that tidal's trainers use: named in
one file (tidal/integrations/seams.py), all present in the installed versions, and a renamed or
changed one is an error when the trainer class is built, not a lever silently gone."""

from __future__ import annotations

import types

import pytest

trl = pytest.importorskip("trl")

from transformers import Trainer  # noqa: E402

from tidal.integrations import seams  # noqa: E402
from tidal.integrations.hf import TidalTrainer  # noqa: E402
from tidal.integrations.trl import TidalGRPOTrainer, TidalRLOOTrainer, TidalRLTrainer  # noqa: E402


def test_every_surface_is_there_in_the_installed_versions():
    for base in (trl.GRPOTrainer, trl.RLOOTrainer):
        seams.check_trainer_class(base, who="test")
    seams.check_trainer_class(Trainer, who="test", seams=seams.HF_TRAINER_SEAMS)
    seams.check_module_seams()


@pytest.mark.parametrize(
    "ours, theirs, named",
    [
        (TidalRLTrainer, trl.GRPOTrainer, seams.TRL_SEAMS + seams.TRANSFORMERS_SEAMS),
        (TidalTrainer, Trainer, seams.HF_TRAINER_SEAMS),
    ],
)
def test_every_method_of_theirs_that_tidal_overrides_is_named_a_seam(ours, theirs, named):
    """What tidal's classes define over a method of the other library's trainer is a seam (the
    MRO's tidal classes all count: the adapter's mixins)."""
    mine = {n for c in ours.__mro__ if c.__module__.startswith("tidal.") for n in vars(c)}
    overridden = {n for n in mine if hasattr(theirs, n) and not n.startswith("__")} | {"__init__"}
    assert overridden <= {s.name for s in named}, overridden - {s.name for s in named}


def test_a_renamed_trl_method_is_an_error_naming_the_tested_versions_when_the_class_is_built():
    """TRL renaming ``_generate`` left tidal's generation turn (its prefetch, its memory reading,
    its run-again) silently unused: building the class now refuses."""

    class Renamed(trl.GRPOTrainer):
        _generate = None

        def _generate_completions(self, prompts):  # where a new TRL might put it
            return super()._generate(prompts)

    with pytest.raises(seams.SeamError, match=r"Renamed\._generate is missing.*tested with trl 1\.16\.0"):
        type("Mine", (TidalRLTrainer, Renamed), {})


def test_a_changed_signature_is_an_error_naming_what_tidal_calls():
    class Changed(trl.GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, batch, logits_to_keep):
            raise AssertionError("never called")

    with pytest.raises(seams.SeamError, match=r"takes \(model, batch, logits_to_keep\), tidal calls it with"):
        type("Mine", (TidalRLTrainer, Changed), {})


def test_a_subclass_of_tidals_trainer_is_checked_against_trls_class_not_its_own():
    class Mine(TidalGRPOTrainer):  # built: checked against GRPOTrainer's _generate, not this one
        def _generate(self, batch):  # a user's override with its own signature
            return super()._generate(batch)

    assert issubclass(Mine, trl.GRPOTrainer) and issubclass(TidalRLOOTrainer, trl.RLOOTrainer)


def test_a_built_trainer_lacking_an_attribute_tidal_reads_is_an_error():
    with pytest.raises(seams.SeamError, match=r"no '_metrics'"):
        seams.check_trainer(
            types.SimpleNamespace(accelerator=0, ref_model=0, reward_funcs=0, callback_handler=0), who="t"
        )
    with pytest.raises(seams.SeamError, match=r"_metrics is a list, not a dict"):
        seams.check_trainer(
            types.SimpleNamespace(accelerator=0, ref_model=0, reward_funcs=0, callback_handler=0, _metrics=[]),
            who="t",
        )


def test_a_missing_module_surface_is_an_error():
    gone = seams.Seam("accelerate.utils.fsdp_utils", "fsdp9_prepare_model", ("accelerator", "model"), why="x")
    with pytest.raises(seams.SeamError, match="fsdp9_prepare_model is missing"):
        seams.check_module_seams([gone])
    field = seams.Seam("accelerate.utils.DistributedDataParallelKwargs", "bucket_views", kind="field", why="x")
    with pytest.raises(seams.SeamError, match="has no field 'bucket_views'"):
        seams.check_module_seams([field])


def test_replacements_put_back_what_was_there_even_on_an_exception():
    obj = types.SimpleNamespace(f=1)
    with pytest.raises(KeyboardInterrupt):
        with seams.instead(obj, "f", 2):
            assert obj.f == 2
            raise KeyboardInterrupt
    assert obj.f == 1
    with seams.instead(obj, "g", 3):
        assert obj.g == 3
    assert not hasattr(obj, "g")
    import sys

    module = sys.modules[trl.GRPOTrainer.__module__]
    original = module.prepare_fsdp
    with pytest.raises(RuntimeError):
        with seams.module_functions_instead(trl.GRPOTrainer, "prepare_fsdp", len):
            assert module.prepare_fsdp is len
            raise RuntimeError
    assert module.prepare_fsdp is original
