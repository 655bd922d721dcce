"""Every private surface of another library that tidal's trainer integrations touch, named once
and checked; and the one room where tidal replaces another object's attribute for a block.

TRL's trainers have no public hooks for what tidal does around each phase (a role brought in
for the generation, the scorings and the loss; the phase's memory read; a phase run again
after running out of memory), so the integrations override TRL's and transformers' private
methods and read a few private attributes. A library that renamed one of them would leave
tidal running without that lever and no error: each surface is listed here with what tidal
does with it, and :func:`check_trainer_class` (called when a tidal trainer class is built,
which is when ``tidal.integrations.trl`` is imported) and :func:`check_trainer` (when one is
constructed) raise :class:`SeamError` naming every missing or changed one and the versions
tidal is tested with.

The versions CI tests are :data:`TESTED`; ``pyproject.toml`` bounds TRL to them. A version
outside them whose surfaces all check is used as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.metadata
import inspect
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "ACCELERATE_SEAMS",
    "HF_TRAINER_SEAMS",
    "INSTANCE_SEAMS",
    "SeamError",
    "Seam",
    "TESTED",
    "TRANSFORMERS_SEAMS",
    "TRL_SEAMS",
    "check_module_seams",
    "check_trainer",
    "check_engine",
    "check_trainer_class",
    "VLLM_SEAMS",
    "TRL_VLLM_SEAMS",
    "VLLM_POOL_SEAMS",
    "abort_unfinished",
    "engine_pool",
    "load_weights_of",
    "instead",
    "module_functions_instead",
    "wrap_step",
]

#: The versions tidal's integrations are tested with (CI: the CPU; the GPU machine: transformers
#: 5.17 with the same TRL).
TESTED: dict[str, str] = {"trl": "1.16.0", "transformers": "5.17-5.24", "accelerate": "1.15", "vllm": "0.25.0"}


class SeamError(RuntimeError):
    """A private surface of TRL, transformers or accelerate that tidal uses is missing or changed
    in the installed version: tidal would run without one of its levers."""


@dataclasses.dataclass(frozen=True)
class Seam:
    """One surface: ``name`` on ``owner`` (a class of the trainer's bases, by its library's
    name; or a dotted module path), a callable whose parameters after ``self`` begin with
    ``params`` (in order) where ``params`` is given, and ``why`` tidal uses it."""

    owner: str
    name: str
    params: tuple[str, ...] | None = None
    why: str = ""
    kind: str = "callable"  # "callable" | "class" | "field" (a dataclass field of the class named)

    def problem(self, holder: Any) -> str | None:
        """What is wrong with this surface on ``holder`` (a class or a module); None: it checks."""
        if self.kind == "field":
            fields = getattr(holder, "__dataclass_fields__", {})
            return None if self.name in fields else f"{self.owner} has no field {self.name!r}"
        value = inspect.getattr_static(holder, self.name, None) if isinstance(holder, type) else None
        if value is None:
            value = getattr(holder, self.name, None)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if self.kind == "class":
            return None if isinstance(value, type) else f"{self.owner}.{self.name} is not a class"
        if value is None or not callable(value):
            return f"{self.owner}.{self.name} is missing"
        if self.params is None:
            return None
        try:
            names = list(inspect.signature(value).parameters)
        except (TypeError, ValueError):
            return f"{self.owner}.{self.name} has no readable signature"
        if isinstance(holder, type) and names and names[0] == "self":
            names = names[1:]
        if tuple(names[: len(self.params)]) != self.params:
            want = ", ".join(self.params)
            return f"{self.owner}.{self.name} takes ({', '.join(names)}), tidal calls it with ({want}, ...)"
        return None


#: TRL's trainer methods tidal overrides and calls through ``super()``: each one is where a
#: phase's role comes onto the device and its memory is read.
TRL_SEAMS: tuple[Seam, ...] = (
    Seam("trainer", "__init__", ("model", "reward_funcs", "args"), "the training arguments read before TRL builds"),
    Seam("trainer", "_generate", ("prompts",), "the generation's turn: the policy in, the reference prefetched"),
    Seam(
        "trainer",
        "_get_per_token_logps_and_entropies",
        ("model", "input_ids", "attention_mask", "logits_to_keep"),
        "the scorings' turns: the reference (or the policy) in, the next role prefetched",
    ),
    Seam("trainer", "_calculate_rewards", None, "the reward models' turn"),
)

#: transformers ``Trainer`` methods tidal overrides or calls (TRL's trainers and TidalTrainer).
TRANSFORMERS_SEAMS: tuple[Seam, ...] = (
    Seam("trainer", "compute_loss", ("model", "inputs", "return_outputs", "num_items_in_batch"), "the loss's turn"),
    Seam("trainer", "training_step", ("model", "inputs", "num_items_in_batch"), "a micro-batch run again after OOM"),
    Seam("trainer", "_prepare_inputs", None, "the prepared inputs recorded, to run a micro-batch again"),
    Seam("trainer", "log", ("logs", "start_time"), "tidal's figures added to each log line"),
    Seam("trainer", "_clip_grad_norm", ("model",), "CPUAdam clips its host gradients"),
    Seam("trainer", "_get_grad_norm", ("model",), "CPUAdam's logged grad_norm"),
)

#: What :class:`tidal.integrations.hf.TidalTrainer` uses of transformers' ``Trainer``.
HF_TRAINER_SEAMS: tuple[Seam, ...] = (
    Seam("trainer", "__init__", ("model", "args"), "the training arguments read before Trainer builds"),
    *TRANSFORMERS_SEAMS,
)

#: Module-level surfaces (checked once, when the trainer class is built).
ACCELERATE_SEAMS: tuple[Seam, ...] = (
    Seam(
        "accelerate.utils.fsdp_utils",
        "fsdp2_prepare_model",
        ("accelerator", "model"),
        "the reference sharded per block under FSDP2",
    ),
    Seam(
        "accelerate.utils.DistributedDataParallelKwargs",
        "gradient_as_bucket_view",
        kind="field",
        why="DDP's gradients as views of its buckets, freed between steps",
    ),
    Seam("trl.trainer.callbacks", "SyncRefModelCallback", kind="class", why="replaced where sync_ref_model=True"),
    Seam("trl.models.utils", "prepare_fsdp", ("model", "accelerator"), "the reference's FSDP preparation"),
)

#: Attributes a TRL trainer has once built (checked on each construction): name -> why.
INSTANCE_SEAMS: dict[str, str] = {
    "accelerator": "the device, the launch, the policy unwrapped",
    "ref_model": "the reference role",
    "reward_funcs": "reward models as a role",
    "callback_handler": "sync_ref_model's callback replaced",
    "_metrics": "what a failed micro-batch logged taken back before it runs again",
}


#: What tidal calls on an in-process ``vllm.LLM`` (checked when a
#: :class:`~tidal.integrations.vllm.VllmEngine` is built): the sleep-mode verbs, the generation,
#: and the model runner's ``load_weights`` (the path TRL's colocate mode pushes weights by).
VLLM_SEAMS: tuple[Seam, ...] = (
    Seam("llm", "sleep", ("level",), "the engine's memory back to the driver"),
    Seam("llm", "wake_up", ("tags",), "the engine's weights, then its KV cache, back"),
    Seam("llm", "generate", None, "the room made before a generation"),
    Seam("llm", "reset_prefix_cache", None, "cached prefixes of old weights dropped after a push"),
)
_LOAD_WEIGHTS_PATH = ("llm_engine", "model_executor", "driver_worker", "model_runner", "model", "load_weights")

#: vLLM's sleep-mode pool in this process (its ``CuMemAllocator``; checked with
#: :data:`VLLM_SEAMS`). vLLM's ``wake_up`` maps the pool's allocations one by one and stops at the
#: first the driver has no room for, those before it left mapped and the engine still asleep by
#: its own account; waking again would map those a second time. tidal puts such a wake back to
#: sleep (each allocation that woke unmapped again, its bytes first copied to the host where they
#: were backed up there) before it makes more room and wakes the engine again.
VLLM_POOL_SEAMS: tuple[Seam, ...] = (
    Seam("vllm.device_allocator", "get_mem_allocator_instance", (), "the engine's pool (vLLM's CuMemAllocator)"),
    Seam("vllm.device_allocator.AllocationData", "handle", kind="field", why="an allocation's mapping"),
    Seam("vllm.device_allocator.AllocationData", "tag", kind="field", why="weights or kv_cache"),
    Seam("vllm.device_allocator.AllocationData", "is_asleep", kind="field", why="which allocations woke"),
    Seam(
        "vllm.device_allocator.AllocationData",
        "cpu_backup_tensor",
        kind="field",
        why="the host copy a level-1 sleep keeps of the weights",
    ),
    Seam(
        "vllm.device_allocator.cumem",
        "unmap_and_release",
        ("allocation_handle",),
        "an allocation of a failed wake unmapped again",
    ),
    Seam(
        "vllm.device_allocator.cumem.libcudart",
        "cudaMemcpy",
        None,
        "a woken level-1 weight copied back to the host before it is unmapped again",
    ),
)

#: What tidal uses of TRL's colocated vLLM (checked when the policy becomes a role beside TRL's
#: engine): the module's names its ``VLLMGeneration`` builds the engine by (``LLM``: replaced
#: while TRL builds, to size the KV cache) and empties the device's cache by before a wake
#: (``empty_cache``: replaced while tidal drives the engine), and the trainer's generation
#: backend (name -> why).
TRL_VLLM_SEAMS: tuple[Seam, ...] = (
    Seam("trl.generation.vllm_generation", "VLLMGeneration", kind="class", why="TRL's vLLM backend"),
    Seam("trl.generation.vllm_generation", "LLM", kind="class", why="the engine built with the KV cache tidal sizes"),
    Seam(
        "trl.generation.vllm_generation",
        "empty_cache",
        (),
        "the cache released before the weights wake only where the driver lacks the room",
    ),
)
TRL_VLLM_INSTANCE_SEAMS: dict[str, str] = {
    "llm": "the engine, made a turn of the timeshare",
    "enable_sleep_mode": "whether the engine's memory leaves the device between generations",
    "mode": "colocate (in this process) or server",
}


def _versions() -> str:
    out = []
    for name in TESTED:
        try:
            out.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{name} (not installed)")
    return ", ".join(out)


def _raise(problems: list[str], who: str) -> None:
    if problems:
        tested = ", ".join(f"{k} {v}" for k, v in TESTED.items())
        raise SeamError(
            f"{who}: the installed libraries lack what tidal's integration uses ({'; '.join(problems)}). "
            f"Installed: {_versions()}; tidal is tested with {tested}. Install those versions "
            f"(pip install 'tidal[trl]'), or use the trainer without tidal"
        )


def _holder(owner: str) -> Any:
    module, _, attr = owner.rpartition(".")
    try:
        return importlib.import_module(owner)
    except ImportError:
        pass
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def check_module_seams(seams: Iterable[Seam] = ACCELERATE_SEAMS, *, who: str = "tidal") -> None:
    """Raise :class:`SeamError` for each of ``seams`` (module-level surfaces) missing or changed."""
    problems = []
    for seam in seams:
        holder = _holder(seam.owner)
        problem = f"{seam.owner} cannot be imported" if holder is None else seam.problem(holder)
        if problem:
            problems.append(f"{problem} [{seam.why}]")
    _raise(problems, who)


def check_trainer_class(base: type, *, who: str, seams: Iterable[Seam] = TRL_SEAMS + TRANSFORMERS_SEAMS) -> None:
    """Raise :class:`SeamError` for each of ``seams`` missing from, or changed on, ``base`` (the
    other library's trainer class tidal's trainer derives from), and for the module-level
    surfaces (:data:`ACCELERATE_SEAMS`, and ``prepare_fsdp`` in the module of each of
    ``base``'s classes that TRL defines, which the FSDP2 launch replaces while TRL builds)."""
    problems = []
    for seam in seams:
        problem = seam.problem(base)
        if problem:
            problems.append(f"{problem.replace('trainer.', base.__name__ + '.', 1)} [{seam.why}]")
    _raise(problems, who)
    trl_base = next((c for c in base.__mro__ if c.__module__.startswith("trl.")), None)
    if trl_base is not None:
        check_module_seams(ACCELERATE_SEAMS, who=who)
        module = sys.modules[trl_base.__module__]  # where TRL's trainer calls prepare_fsdp by name
        problem = Seam(module.__name__, "prepare_fsdp", ("model", "accelerator")).problem(module)
        if problem:
            _raise([f"{problem} [the reference sharded per block under FSDP2]"], who)


def _trl_modules(cls: type) -> list[Any]:
    """The modules of TRL that define ``cls``'s classes and call ``prepare_fsdp`` (imported by
    name into them)."""
    modules = [sys.modules.get(c.__module__) for c in cls.__mro__ if c.__module__.startswith("trl.")]
    return [m for m in dict.fromkeys(modules) if m is not None and "prepare_fsdp" in vars(m)]


def check_trainer(trainer: Any, *, who: str) -> None:
    """Raise :class:`SeamError` for each of :data:`INSTANCE_SEAMS` a built TRL trainer lacks
    (``_metrics`` must be TRL's per-mode dictionary)."""
    problems = [
        f"the trainer has no {name!r} [{why}]" for name, why in INSTANCE_SEAMS.items() if not hasattr(trainer, name)
    ]
    if hasattr(trainer, "_metrics") and not isinstance(trainer._metrics, dict):
        problems.append(
            f"the trainer's _metrics is a {type(trainer._metrics).__name__}, not a dict [{INSTANCE_SEAMS['_metrics']}]"
        )
    _raise(problems, who)


def load_weights_of(llm: Any) -> Any:
    """vLLM's ``load_weights`` of the model an in-process ``LLM`` runs (what TRL's colocate mode
    pushes the policy's weights with); :class:`SeamError` where the path is not there."""
    obj = llm
    for name in _LOAD_WEIGHTS_PATH:
        obj = getattr(obj, name, None)
        if obj is None:
            _raise(
                [f"LLM.{'.'.join(_LOAD_WEIGHTS_PATH)} is missing (at {name!r}) [the policy's weights pushed]"], "tidal"
            )
    return obj


def check_engine(llm: Any, *, who: str) -> None:
    """Raise :class:`SeamError` for each of :data:`VLLM_SEAMS` an in-process ``vllm.LLM`` lacks,
    and each of :data:`VLLM_POOL_SEAMS` missing from the installed vLLM."""
    problems = [p for p in (seam.problem(type(llm)) for seam in VLLM_SEAMS) if p]
    problems = [p.replace("llm.", type(llm).__name__ + ".", 1) for p in problems]
    _raise(problems, who)
    load_weights_of(llm)
    engine = getattr(llm, "llm_engine", None)
    problems = []
    if not isinstance(getattr(getattr(engine, "output_processor", None), "request_states", None), dict):
        problems.append("LLM.llm_engine.output_processor.request_states is missing [a failed generation's requests]")
    abort = Seam("llm_engine", "abort_request", ("request_ids", "internal"), "a failed generation's requests dropped")
    if engine is not None and (p := abort.problem(engine)):
        problems.append(p.replace("llm_engine.", "LLM.llm_engine.", 1) + f" [{abort.why}]")
    _raise(problems, who)
    check_module_seams(VLLM_POOL_SEAMS, who=who)


def abort_unfinished(llm: Any) -> int:
    """Drop the requests an in-process ``vllm.LLM`` holds unfinished (a ``generate`` that raised
    leaves them, and the next one would return their outputs with its own): its engine's
    ``abort_request`` of its output processor's ``request_states``. Returns how many."""
    engine = llm.llm_engine
    ids = list(engine.output_processor.request_states)
    if ids:
        engine.abort_request(ids, internal=True)
    return len(ids)


def engine_pool() -> tuple[Any, Any, Any]:
    """vLLM's sleep-mode pool of this process, its ``unmap_and_release`` and its ``libcudart``
    (:data:`VLLM_POOL_SEAMS`, checked as the engine was built)."""
    cumem = importlib.import_module("vllm.device_allocator.cumem")
    pool = importlib.import_module("vllm.device_allocator").get_mem_allocator_instance()
    return pool, cumem.unmap_and_release, cumem.libcudart


def check_trl_engine(generation: Any, *, who: str) -> None:
    """Raise :class:`SeamError` where TRL's vLLM module lacks a surface tidal uses
    (:data:`TRL_VLLM_SEAMS`) or its backend (``trainer.vllm_generation``) an attribute tidal
    reads (:data:`TRL_VLLM_INSTANCE_SEAMS`)."""
    check_module_seams(TRL_VLLM_SEAMS, who=who)
    problems = [
        f"TRL's vLLM backend has no {name!r} [{why}]"
        for name, why in TRL_VLLM_INSTANCE_SEAMS.items()
        if not hasattr(generation, name)
    ]
    _raise(problems, who)


# ---- the one room for replacing another object's attribute -------------------------------------
@contextlib.contextmanager
def instead(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` (an attribute of the instance) through the block; then what
    the instance had of its own under that name again, or none. Used for: TRL's
    ``_prepare_inputs`` (a micro-batch's inputs recorded), a policy's ``generate`` (run again
    after running out of memory; FSDP2's ``synced_gpus`` off where gathered whole)."""
    own = vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is None:
            delattr(obj, name)
        else:
            setattr(obj, name, own)


@contextlib.contextmanager
def module_functions_instead(trainer_cls: type, name: str, value: Any) -> Iterator[None]:
    """The function ``name`` of each TRL module defining ``trainer_cls``'s classes is ``value``
    through the block (TRL's ``prepare_fsdp``, while TRL's trainer builds the reference under
    FSDP2); then the original again."""
    saved = {m: vars(m)[name] for m in _trl_modules(trainer_cls) if name in vars(m)}
    for m in saved:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, fn in saved.items():
            setattr(m, name, fn)


def wrap_step(optimizer: Any, step: Any) -> None:
    """``optimizer.step`` is ``step(optimizer, *args, **kwargs)`` from now on (a method of the
    instance, as torch's LR schedulers expect; where a scheduler's counter already wraps what
    was there, the mark it leaves is kept, so it does not wrap again). Used for: the policy's
    optimizer step made room for and run again after running out of memory beside kept roles
    (:class:`tidal.integrations.trl.retry.OutOfMemoryRetry`)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        step._wrapped_by_lr_sched = True
    optimizer.step = types.MethodType(step, optimizer)
