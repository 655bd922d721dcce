"""transformers.Trainer with tidal (tidal.integrations.hf): CPU Adam and activation offload
against the same Trainer run without them, on a tiny causal LM on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Trainer, TrainingArguments

from tidal.integrations.hf import TidalTrainer, TidalTrainerConfig
from tidal.transfer import TransferContext


def _model():
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _data(n=32, seq=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def _args(out, **kw):
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=1e-2,
        max_grad_norm=0.5,  # small enough that clipping acts: it must see the gradients
        weight_decay=0.1,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
    )
    base.update(kw)
    return TrainingArguments(**base)


def _train(out, tidal=None, resume=None, wrap=None, **kw):
    model = _model() if wrap is None else wrap(_model())
    extra = {"tidal": tidal} if tidal is not None else {}
    cls = TidalTrainer if tidal is not None else Trainer
    trainer = cls(model=model, args=_args(out, **kw), train_dataset=_data(), **extra)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _logs(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_activation_offload_is_bit_identical_and_really_offloads(tmp_path):
    plain = _train(tmp_path / "plain")
    ours = _train(tmp_path / "ours", TidalTrainerConfig(activation_offload=True, activation_min_offload_bytes=0))
    assert _logs(ours) == _logs(plain) and len(_logs(ours)) == 4
    want, got = _weights(plain), _weights(ours)
    assert all(torch.equal(want[k], got[k]) for k in want)
    off = TransferContext.of("cpu").owner_of(ours.model)
    assert off is not None and off.report().bytes_offloaded > 0
    # each log line carries what the activations moved since the previous one (2 micro-batches)
    logged = [h for h in ours.state.log_history if "loss" in h]
    per_step = off.report().bytes_offloaded / 1e9
    for h in logged:
        assert h["tidal/act_offloaded_gb"] == pytest.approx(2 * per_step, rel=0.05)
        assert h["tidal/act_reloaded_gb"] == pytest.approx(h["tidal/act_offloaded_gb"])
        assert "tidal/act_exposed_s" not in h and "tidal/peak_gib" not in h  # device timings: GPU only
        assert "tidal/optimizer_step_s" not in h  # no CPU Adam here


@pytest.mark.slow
def test_a_peft_model_finds_its_blocks_and_stays_bit_identical(tmp_path):
    """activation_layers="auto" looks inside the PeftModel (its base model's blocks, with the
    LoRA layers in them)."""
    peft = pytest.importorskip("peft")

    def lora(model):
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    plain = _train(tmp_path / "plain", wrap=lora)
    cfg = TidalTrainerConfig(activation_offload=True, activation_min_offload_bytes=0)
    ours = _train(tmp_path / "ours", cfg, wrap=lora)
    assert _logs(ours) == _logs(plain) and len(_logs(ours)) == 4
    want, got = _weights(plain), _weights(ours)
    assert any("lora_" in k for k in want)
    assert all(torch.equal(want[k], got[k]) for k in want)
    off = TransferContext.of("cpu").owner_of(ours.model)
    assert off is not None and off.report().bytes_offloaded > 0


@pytest.mark.slow
def test_cpu_adam_matches_adamw_with_clipping_and_weight_decay(tmp_path):
    plain = _train(tmp_path / "plain")
    ours = _train(tmp_path / "ours", TidalTrainerConfig(cpu_adam=True))
    assert type(ours.optimizer.optimizer).__name__ == "CPUAdam"
    logged = [h for h in ours.state.log_history if "loss" in h]
    assert all(h["tidal/optimizer_step_s"] > 0 for h in logged) and len(logged) == 4
    assert not any("tidal/act_offloaded_gb" in h for h in logged)
    for (loss_a, norm_a), (loss_b, norm_b) in zip(_logs(plain), _logs(ours)):
        assert loss_b == pytest.approx(loss_a, rel=1e-5)
        assert norm_b == pytest.approx(norm_a, rel=1e-5) and norm_a > 0.5  # clipping acted, on host grads
    want, got = _weights(plain), _weights(ours)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_resume_with_both_equals_the_uninterrupted_run(tmp_path):
    cfg = TidalTrainerConfig(cpu_adam=True, activation_offload=True, activation_min_offload_bytes=0)
    full = _train(tmp_path / "full", cfg)
    _train(tmp_path / "parts", cfg, save_strategy="steps", save_steps=2)
    resumed = _train(tmp_path / "parts", cfg, resume=str(tmp_path / "parts" / "checkpoint-2"))
    want, got = _weights(full), _weights(resumed)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_settings_tidal_cannot_work_with_are_refused(tmp_path):
    model = _model()
    with pytest.raises(ValueError, match="builds the optimizer itself"):
        TidalTrainer(
            model=model,
            args=_args(tmp_path),
            train_dataset=_data(),
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
            tidal=TidalTrainerConfig(cpu_adam=True),
        )
    for optim in ("sgd", "adamw_bnb_8bit"):  # not what CPUAdam computes
        cfg = TidalTrainerConfig(cpu_adam=True)
        with pytest.raises(ValueError, match=f"optim='{optim}'"):
            TidalTrainer(model=model, args=_args(tmp_path, optim=optim), train_dataset=_data(), tidal=cfg)
    with pytest.raises(ValueError, match="no list of transformer blocks"):
        TidalTrainer(
            model=model,
            args=_args(tmp_path),
            train_dataset=_data(),
            tidal=TidalTrainerConfig(activation_offload=True, activation_layers="model.nope"),
        )
    with pytest.raises(TypeError, match="TidalTrainerConfig"):
        TidalTrainer(model=model, args=_args(tmp_path), train_dataset=_data(), tidal={"cpu_adam": True})


def test_activation_settings_without_activation_offload_warn_that_they_are_ignored():
    with pytest.warns(UserWarning, match="activation_min_offload_bytes ignored: activation_offload is off"):
        TidalTrainerConfig(cpu_adam=True, activation_min_offload_bytes=0)


@pytest.mark.parametrize("field", ["cpu_adam", "activation_offload"])
@pytest.mark.parametrize("value", ["false", "no", 0, 1, None])
def test_a_bool_field_given_another_type_is_refused(field, value):
    """A non-empty string is truthy: TidalTrainerConfig(cpu_adam="false") switched CPU Adam on."""
    with pytest.raises(TypeError, match=rf"TidalTrainerConfig.{field} must be True or False, got {value!r}"):
        TidalTrainerConfig(**{field: value})
    assert getattr(TidalTrainerConfig(**{field: True}), field) is True
    with pytest.raises(ValueError, match="activation_min_offload_bytes"):
        TidalTrainerConfig(activation_offload=True, activation_min_offload_bytes=-5)


_TWO_PROCESS_CPU_ADAM = """
import os, sys, torch
sys.path.insert(0, {root!r})
from tests.integrations.test_hf import _args, _data, _model
from tidal.integrations.hf import TidalTrainer, TidalTrainerConfig
try:
    TidalTrainer(model=_model(), args=_args({out!r}), train_dataset=_data(), tidal=TidalTrainerConfig(cpu_adam=True))
except ValueError as e:
    # A file a rank: the two processes' prints into one pipe may interleave mid-line.
    with open(os.path.join({said!r}, "refused." + os.environ["RANK"]), "w") as f:
        f.write(str(e))
"""


@pytest.mark.slow
def test_cpu_adam_with_several_processes_is_refused_before_training(tmp_path):
    """Under torchrun (DDP) CPU Adam would step each rank on its own gradients (it takes them
    before the all-reduce): refused when the trainer is built, on every rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "two.py"
    said = tmp_path / "said"
    said.mkdir()
    script.write_text(_TWO_PROCESS_CPU_ADAM.format(root=root, out=str(tmp_path / "out"), said=str(said)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        refusal = (said / f"refused.{rank}").read_text()
        assert refusal.startswith("TidalTrainerConfig(cpu_adam=True) does not work with several processes"), refusal
