"""``transformers.Trainer`` with tidal: CPU Adam and activation offload by configuration.

Replace ``Trainer`` by :class:`TidalTrainer` and say what to use::

    from tidal.integrations.hf import TidalTrainer, TidalTrainerConfig

    trainer = TidalTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                           tidal=TidalTrainerConfig(cpu_adam=True, activation_offload=True))
    trainer.train()

* ``cpu_adam``: the optimizer is :class:`tidal.CPUAdam` (fp32 masters, moments and gradients
  on the host; the device keeps only the parameters), built from the training arguments as
  Trainer builds its AdamW: ``learning_rate``, ``adam_beta1``/``adam_beta2``,
  ``adam_epsilon``, and ``weight_decay`` for the same decay / no-decay parameter groups. The
  scheduler drives it as usual. Gradient clipping (``max_grad_norm``) and the logged
  ``grad_norm`` go through :meth:`tidal.CPUAdam.clip_grad_norm_` (the gradients are on the
  host, so ``torch.nn.utils.clip_grad_norm_`` would see none).
* ``activation_offload``: each loss forward runs under :func:`tidal.offload_activations`
  over the model's transformer blocks (``activation_layers``), so the activations saved for
  backward wait on the host; the backward brings them back ahead of use.

Every log line (console, TensorBoard, W&B: whatever ``report_to`` says) carries, for the
steps since the previous log: with ``activation_offload``, ``tidal/act_offloaded_gb`` and
``tidal/act_reloaded_gb`` (bytes the saved activations moved each way) and, on a GPU,
``tidal/act_exposed_s`` (time the compute waited on those copies); with ``cpu_adam``,
``tidal/optimizer_step_s`` (host seconds inside ``optimizer.step()``, summed); on a GPU,
``tidal/peak_gib`` (the peak allocated device memory).

Results: activation offload is pure data movement (bit-identical); CPUAdam is AdamW computed
by torch's fused CPU kernel in fp32 (equal to torch's AdamW up to float rounding). Checkpoints
and resume save and load CPUAdam's state like any optimizer's.

Refused before any work (``ValueError`` naming the setting): ``cpu_adam`` with DeepSpeed or
FSDP through accelerate (they shard and step the optimizer themselves), with an
``optimizers=`` / ``optimizer_cls_and_kwargs=`` of one's own, or with an ``optim=`` that is
not full-precision AdamW (``adamw_torch``, ``adamw_torch_fused``); ``activation_offload`` with
``torch_compile=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
import warnings
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from tidal.activations import offload_activations
from tidal.integrations.seams import HF_TRAINER_SEAMS, check_trainer_class
from tidal.optim import CPUAdam

__all__ = [
    "AUTO_LAYER_PATHS",
    "ActivationFigures",
    "TidalTrainer",
    "TidalTrainerConfig",
    "check_bool_fields",
    "find_layers",
    "host_adam",
    "host_grad_norm",
]

#: Where ``activation_layers="auto"`` looks for a model's list of transformer blocks, in this
#: order: the first dotted path that names a non-empty ``nn.ModuleList`` wins. Together these
#: cover the decoder stacks of the causal-LM families transformers ships (Llama, Qwen, Mistral,
#: Gemma, Phi and most others: ``model.layers``; multimodal Gemma 3, Fuyu:
#: ``model.language_model.layers``; OPT, BART, Marian, Whisper: ``model.decoder.layers``; GPT-2,
#: GPT-J, GPT-Neo, Bloom, Falcon, CodeGen: ``transformer.h``; MPT: ``transformer.blocks``;
#: GPT-NeoX, Pythia: ``gpt_neox.layers``; Mamba: ``backbone.layers``; RWKV: ``rwkv.blocks``;
#: BERT-style models used as decoders: ``<model>.encoder.layer``), checked against every
#: causal-LM class of the installed transformers by ``tests/integrations/test_layers_auto.py``.
#: XLM keeps attention and feed-forward in separate lists and has none of blocks: pass its
#: path yourself, or leave activation offload off. Paths are read from the model as given
#: first, then from the model inside it: a PEFT ``PeftModel``'s base model
#: (``get_base_model()``) or a wrapper's ``.module``, so a path written for the transformers
#: model works for its PEFT wrapper too (explicit paths alike).
AUTO_LAYER_PATHS: tuple[str, ...] = (
    "model.layers",
    "model.language_model.layers",
    "model.decoder.layers",
    "transformer.h",
    "transformer.blocks",
    "transformer.layer",
    "gpt_neox.layers",
    "gpt_neox_japanese.layers",
    "backbone.layers",
    "backbone.blocks",
    "rwkv.blocks",
    "biogpt.layers",
    "cpmant.encoder.layers",
    "prophetnet.decoder.layers",
    "model.global_transformer.layers",
    "model.L_module.layers",
    "git.encoder.layer",
    "bert.encoder.layer",
    "roberta.encoder.layer",
    "roberta_prelayernorm.encoder.layer",
    "roc_bert.encoder.layer",
    "roformer.encoder.layer",
    "rembert.encoder.layer",
    "electra.encoder.layer",
    "ernie.encoder.layer",
    "data2vec_text.encoder.layer",
    "layers",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TidalTrainerConfig:
    """What :class:`TidalTrainer` turns on.

    Attributes:
        cpu_adam: use :class:`tidal.CPUAdam` as the optimizer.
        activation_offload: offload the activations saved in each loss forward.
        activation_layers: dotted path from the model to its list of transformer blocks
            (``"model.layers"`` for Llama/Qwen-style models), or ``"auto"``: the paths of
            :data:`AUTO_LAYER_PATHS`, in order (where a PEFT model's path is read: see there).
            Checked when the trainer is built (``ValueError`` if nothing is found).
        activation_min_offload_bytes: saved tensors smaller than this stay on the device.
    """

    cpu_adam: bool = False
    activation_offload: bool = False
    activation_layers: str = "auto"
    activation_min_offload_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        check_bool_fields(self)
        check_activation_fields(self)


def check_bool_fields(cfg: Any) -> None:
    """``TypeError`` for a field declared ``bool`` that holds anything but ``True`` or
    ``False``: a string such as ``"false"`` or ``"no"`` is truthy and would switch the feature on."""
    for f in dataclasses.fields(cfg):
        if f.type in ("bool", bool):
            value = getattr(cfg, f.name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"{type(cfg).__name__}.{f.name} must be True or False, got {value!r} ({type(value).__name__})"
                )


def check_activation_fields(cfg: Any) -> None:
    """Validate a config's ``activation_*`` fields (``TypeError``/``ValueError``), and warn when
    they are set but ``activation_offload`` is off (they are then ignored)."""
    name = type(cfg).__name__
    if not isinstance(cfg.activation_layers, str) or not cfg.activation_layers:
        raise TypeError(f"{name}.activation_layers must be a dotted path or 'auto', got {cfg.activation_layers!r}")
    nbytes = cfg.activation_min_offload_bytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"{name}.activation_min_offload_bytes must be an int >= 0, got {nbytes!r}")
    if not cfg.activation_offload:
        fields = {f.name: f.default for f in dataclasses.fields(cfg)}
        changed = [k for k in ("activation_layers", "activation_min_offload_bytes") if getattr(cfg, k) != fields[k]]
        if changed:
            warnings.warn(
                f"{name}: {', '.join(changed)} ignored: activation_offload is off (set activation_offload=True)",
                stacklevel=4,
            )


# TrainingArguments.optim values that are AdamW in full precision: what CPUAdam computes.
_ADAMW = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused"})


class ActivationFigures:
    """What the loss forwards' activation offloaders moved, summed into ``figures`` (the next
    log line takes them). Whoever runs a loss forward under :func:`tidal.offload_activations`
    sets :attr:`offloader`; :meth:`step_ended` (after the micro-batch's backward) reads its
    report. Memory cost: none."""

    def __init__(self, figures: dict[str, float]) -> None:
        self.figures = figures
        self.offloader: Any = None  # the last loss forward's, until its backward has run

    def step_ended(self) -> None:
        off, self.offloader = self.offloader, None
        if off is not None:
            # Waits for the backward's copies; Trainer's NaN check of the loss just after
            # (logging_nan_inf_filter, on by default) waits for the backward anyway.
            add_activation_figures(self.figures, off.report())


def host_adam(optimizer: Any) -> CPUAdam | None:
    """The :class:`tidal.CPUAdam` a trainer steps (inside accelerate's wrapper, where wrapped),
    or None for any other optimizer: with it, clipping and the logged gradient norm read its
    host gradients (:meth:`tidal.CPUAdam.clip_grad_norm_`), which the device's parameters
    lack."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch one
    return optimizer if isinstance(optimizer, CPUAdam) else None


def host_grad_norm(optimizer: Any, max_norm: float, otherwise: Any) -> Any:
    """With :class:`tidal.CPUAdam` as the trainer's ``optimizer``: the norm of its host gradients,
    clipped to ``max_norm`` (``inf``: only read); with any other, ``otherwise()`` (Trainer's own
    clipping or norm)."""
    opt = host_adam(optimizer)
    return otherwise() if opt is None else opt.clip_grad_norm_(max_norm)


class TidalTrainer(Trainer):
    """``transformers.Trainer`` with CPU Adam and/or activation offload (see the module
    docstring). Takes Trainer's arguments, plus ``tidal=TidalTrainerConfig(...)``.

    Memory cost: with ``cpu_adam``, 16 bytes per parameter on the host (pinned fp32 masters
    and gradients, moments) and no optimizer state or gradients on the device; with
    ``activation_offload``, host RAM for the activations of one step (pinned once, reused).

    Raises:
        ValueError: a setting tidal cannot work with, before any work.
        TypeError: ``tidal`` is not a :class:`TidalTrainerConfig`.
    """

    def __init__(self, *args: Any, tidal: TidalTrainerConfig | None = None, **kwargs: Any) -> None:
        if tidal is not None and not isinstance(tidal, TidalTrainerConfig):
            raise TypeError(f"tidal must be a tidal.integrations.hf.TidalTrainerConfig, got {type(tidal).__name__}")
        self.tidal_config = tidal = tidal or TidalTrainerConfig()
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if tidal.cpu_adam:
            if kwargs.get("optimizers", (None, None))[0] is not None or kwargs.get("optimizer_cls_and_kwargs"):
                raise ValueError(
                    "TidalTrainerConfig(cpu_adam=True) builds the optimizer itself; drop optimizers= / "
                    "optimizer_cls_and_kwargs=, or set cpu_adam=False and pass tidal.CPUAdam there yourself"
                )
            optim = getattr(getattr(targs, "optim", None), "value", getattr(targs, "optim", None))
            if optim is not None and optim not in _ADAMW:
                raise ValueError(
                    f"TidalTrainerConfig(cpu_adam=True) replaces the optimizer by tidal.CPUAdam (AdamW in fp32), "
                    f"but the training arguments ask for optim={optim!r}, which is not AdamW: the run would not be "
                    f"the one asked for. Set optim='adamw_torch' (or 'adamw_torch_fused'), or cpu_adam=False"
                )
            if targs is not None and (getattr(targs, "deepspeed", None) or getattr(targs, "fsdp", None)):
                raise ValueError(
                    "TidalTrainerConfig(cpu_adam=True) does not work with DeepSpeed or FSDP in the training "
                    "arguments: they shard and step the optimizer themselves. Use their own CPU offload, or "
                    "remove deepspeed= / fsdp="
                )
        if tidal.activation_offload and targs is not None and getattr(targs, "torch_compile", False):
            raise ValueError(
                "TidalTrainerConfig(activation_offload=True) does not support torch_compile=True (the saved-tensor "
                "hooks need the eager model); set one of them off"
            )
        super().__init__(*args, **kwargs)
        if tidal.cpu_adam and self.accelerator.num_processes > 1:
            raise ValueError(
                f"TidalTrainerConfig(cpu_adam=True) does not work with several processes "
                f"({self.accelerator.num_processes} were launched): CPU Adam takes each gradient to the host as the "
                f"backward produces it, before DDP's all-reduce, so every rank would step on its own gradients. "
                f"Run one process, or set cpu_adam=False"
            )
        if tidal.cpu_adam:
            a = self.args
            self.optimizer_cls_and_kwargs = (
                CPUAdam,
                {"lr": a.learning_rate, "betas": (a.adam_beta1, a.adam_beta2), "eps": a.adam_epsilon},
            )
        self._tidal_layers = find_layers(self.model, tidal.activation_layers) if tidal.activation_offload else None
        self._tidal_figures: dict[str, float] = {}  # summed since the last log
        self._tidal_activations = ActivationFigures(self._tidal_figures)
        if tidal.cpu_adam:
            self.add_callback(_OptimizerStepTimer(self._tidal_figures))

    def compute_loss(self, model, inputs, *args: Any, **kwargs: Any):
        if self._tidal_layers is None or not model.training:
            return super().compute_loss(model, inputs, *args, **kwargs)
        with offload_activations(
            self.accelerator.unwrap_model(model),
            layers=self._tidal_layers,
            min_offload_bytes=self.tidal_config.activation_min_offload_bytes,
        ) as off:
            self._tidal_activations.offloader = off
            return super().compute_loss(model, inputs, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any):
        loss = super().training_step(*args, **kwargs)  # forward and backward
        self._tidal_activations.step_ended()
        return loss

    def _clip_grad_norm(self, model):
        inner = super()._clip_grad_norm
        return host_grad_norm(self.optimizer, self.args.max_grad_norm, lambda: inner(model))

    def _get_grad_norm(self, model, grad_norm=None):
        inner = super()._get_grad_norm
        if grad_norm is not None:
            return inner(model, grad_norm)
        return host_grad_norm(self.optimizer, float("inf"), lambda: inner(model, grad_norm))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update(take_figures(self._tidal_figures, self.args.device))
        super().log(logs, start_time)


# The private surfaces of transformers' Trainer used above, checked as the class is built.
check_trainer_class(Trainer, who="TidalTrainer", seams=HF_TRAINER_SEAMS)


class _OptimizerStepTimer(TrainerCallback):
    """Host seconds inside ``optimizer.step()`` (Trainer calls these two around it)."""

    def __init__(self, figures: dict[str, float]) -> None:
        self.figures = figures
        self._t0: float | None = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self._t0 = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self._t0 is not None:
            seconds = time.perf_counter() - self._t0
            self.figures["tidal/optimizer_step_s"] = self.figures.get("tidal/optimizer_step_s", 0.0) + seconds
            self._t0 = None


def add_activation_figures(figures: dict[str, float], report: Any) -> None:
    """Add one step's activation-offload report to the figures of the next log line."""
    for key, value in (
        ("tidal/act_offloaded_gb", report.bytes_offloaded / 1e9),
        ("tidal/act_reloaded_gb", report.bytes_reloaded / 1e9),
        ("tidal/act_exposed_s", report.exposed_copy_s),
    ):
        if value is not None:
            figures[key] = figures.get(key, 0.0) + value


def take_figures(figures: dict[str, float], device: torch.device) -> dict[str, float]:
    """The figures summed since the last log, plus (on a GPU) the peak allocated memory since
    then (the peak is reset, as are the figures)."""
    out = dict(figures)
    figures.clear()
    if device.type == "cuda":
        out["tidal/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    return out


def find_layers(model: torch.nn.Module, path: str) -> torch.nn.ModuleList:
    """The model's transformer blocks: the non-empty ``nn.ModuleList`` at the dotted ``path``,
    or (``"auto"``) at the first of :data:`AUTO_LAYER_PATHS` that has one. Each path is read
    from ``model`` first, then from the model it wraps: a PEFT ``PeftModel``'s base model
    (``get_base_model()``; the LoRA layers are inside the same blocks) or a wrapper's
    ``.module`` (for ``"auto"``, every path is tried on the outer model before the inner one).

    Raises:
        ValueError: nothing found; the message names the model's class and every path tried.
    """
    paths = AUTO_LAYER_PATHS if path == "auto" else (path,)
    models = [model]
    for _ in range(4):
        inner = models[-1]
        getter = getattr(inner, "get_base_model", None)
        inner = getter() if callable(getter) else getattr(inner, "module", None)
        if not isinstance(inner, torch.nn.Module) or inner is models[-1]:
            break
        models.append(inner)
    for m in models:
        for p in paths:
            with contextlib.suppress(AttributeError):
                found = operator.attrgetter(p)(m)
                if isinstance(found, torch.nn.ModuleList) and len(found) > 0:
                    return found
    where = " inside ".join(type(m).__name__ for m in reversed(models))
    tried = "the paths of tidal.integrations.hf.AUTO_LAYER_PATHS" if path == "auto" else repr(path)
    raise ValueError(
        f"activation_offload=True: no list of transformer blocks (a non-empty nn.ModuleList) found in {where} "
        f"at {tried} ({', '.join(paths)}); pass activation_layers='<dotted path to the ModuleList>'"
    )
