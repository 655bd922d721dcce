"""TRL's ``GRPOTrainer`` and ``RLOOTrainer`` with tidal (extra ``tidal[trl]``).

Replace ``GRPOTrainer`` by :class:`TidalGRPOTrainer` (``RLOOTrainer`` by
:class:`TidalRLOOTrainer`); nothing else in the training script changes::

    from tidal.integrations.trl import TidalGRPOTrainer

    trainer = TidalGRPOTrainer(model=path, reward_funcs=reward, args=GRPOConfig(beta=0.04, ...),
                               train_dataset=ds)
    trainer.train()

What it does, on the trainer's one device:

* The policy (its weights, gradients and optimizer) and, with ``beta > 0``, the reference
  model TRL builds are roles of a :class:`~tidal.Timeshare`: the reference is on the device
  only while it scores, the policy only while it generates, computes the loss and steps. Each
  hand-over is one overlapped switch at PCIe line rate. The reference is a frozen role: after
  its first trip out, it goes out without a copy (only its reload moves bytes), unless
  ``sync_ref_model=True`` makes TRL write it. That mix (TRL's ``SyncRefModelCallback``, which
  would write the offloaded tensors through null pointers) is replaced by one that computes the
  same values with the same device ops where each tensor is: on the device if resident, else
  one tensor at a time into its host copy.
* Reward models (``reward_funcs`` given as a model or a path) are one more frozen role, on the
  device only while TRL scores the completions with them (after the reference).
* The policy's optimizer state stays on the host except inside ``optimizer.step()`` (step
  residency; ``TidalConfig.optimizer_residency``), so generation, reference scoring and the
  loss's forward/backward never hold it. A :class:`tidal.CPUAdam` passed as
  ``optimizers=(CPUAdam(...), None)`` keeps it on the host for good; gradient clipping and the
  logged ``grad_norm`` then use its host gradients.
* With ``TidalConfig(activation_offload=True)`` the activations the loss forward saves wait
  on the host until its backward.
* Every log line (console, TensorBoard, W&B: whatever ``report_to`` says) carries
  ``tidal/transitions``, ``tidal/moved_gb``, ``tidal/transition_s``, ``tidal/gbps`` and
  ``tidal/exposed_s`` (what the steps waited on them: on a GPU the compute stream's time
  inside the transitions, from device events; see ``TransitionRecord.exposed_seconds``) for
  the transitions since the previous log; with ``prefetch``, ``tidal/oom_retries`` (phases
  run again after running out of memory beside the roles their turn kept); with activation
  offload, ``tidal/act_offloaded_gb`` and ``tidal/act_reloaded_gb`` (and on a GPU
  ``tidal/act_exposed_s``) for the same steps;
  and on a GPU ``tidal/peak_gib/<phase>``: the peak allocated from the start of a phase to
  the start of the next (``generate``; ``score``, the policy's log-probs of the samples;
  ``reference``; ``reward``, with reward models; ``loss``, with the backward and the
  optimizer step that follow it), and ``tidal/fragments_gib/<phase>``: the most the
  allocator's fragments (free pieces of partly used segments, which a large block cannot use)
  reached the last time the phase ran, which the room left beside it for prefetches and kept
  roles counts as taken.
  With TRL's colocated vLLM engine, ``tidal/engine_gib/weights`` and ``.../kv_cache``: what its
  last wakes took at driver level, and ``tidal/engine_oom_retries``: its wakes that ran out of
  memory, were put back to sleep and woke again once every role that may leave had left, and its
  generations that ran out of memory and ran again so.
* ``save_model``, checkpoints and resume read and write the state wherever it is (tidal's
  state-dict hooks), so saving with the reference offloaded or the optimizer state on the
  host writes the real values.

Results do not change: the moves are pure data movement, bit-exact (tested against the same
TRL run without tidal).

A PEFT policy (``peft_config=``) works as in TRL: its reference is the policy itself with
the adapters disabled, so there is no reference role and nothing takes turns; the adapters'
optimizer state still leaves the device between steps, and activation offload finds the
transformer blocks inside the ``PeftModel``.

Several processes (``torchrun``, ``accelerate launch`` with the ``multi_gpu`` config): DDP.
Each rank's roles take turns on its own device, moving their whole state; the wrapper keeps the
gradients as views of its buckets and tidal frees the buckets between steps
(:class:`tidal.distributed.GradientBuckets`). With an FSDP2 config (``fsdp_version: 2``) each
rank's roles move their shards; the reference is sharded per block as the policy; generation
gathers the policy once where every rank has the room (:func:`tidal.distributed.gathered`), and
a forward without backward reshards every unit. The log adds each rank's host memory
(``tidal/host_held_gib/rank<r>``, ``host_pinned_gib``, ``host_rss_gib``).

Refused, before any work (``ValueError`` naming the setting and the launch that works):
DeepSpeed through accelerate, FSDP1, FSDP2's CPU offload, other multi-process launches (XLA,
Megatron), vLLM
generation under several processes, a ``vllm_mode`` other than ``"colocate"`` and
``"server"``, and ``torch_compile=True``. In server mode (the engine on other GPUs) the roles
take turns as with HF generate: the policy is on the device while TRL streams its weights to the
server.

With ``use_vllm=True, vllm_mode="colocate"`` TRL's engine takes turns with the roles
(:class:`tidal.integrations.vllm.VllmEngine`): before its weights wake the policy is on the
device (their source) and the other roles go where the weights do not fit beside it; once the
weights are in the engine the policy and every other role go to the host, and the engine's
KV cache takes the room; after it sleeps (sleep mode on) its memory is the driver's again and
the next phase brings its role back. ``TidalConfig(vllm_kv_cache_bytes=...)`` sizes the cache
(vLLM's ``kv_cache_memory_bytes``) instead of TRL's ``vllm_gpu_memory_utilization``.

The private surfaces of TRL, transformers and accelerate it uses are named in
:mod:`tidal.integrations.seams` and checked when the trainer class is built: a TRL whose
surfaces changed is a :class:`~tidal.integrations.seams.SeamError` naming the tested versions.

The package, by concept: ``config`` (:class:`TidalConfig`), ``trainer`` (the trainers: TRL's
phases overridden, each handing TRL's own work to the trainer's adapter), ``adapter``
(:class:`~tidal.integrations.trl.adapter.TrlAdapter`, ``trainer.tidal``: the one object that
does tidal's part of each phase and owns the timeshare, the phase schedule, the colocated vLLM
engine, the retries and the log's figures), ``phases`` (work started at a block's first forward),
``schedule`` (TRL's step for the library's :class:`~tidal.timeshare.schedule.PhaseSchedule`,
which decides what each turn keeps and what comes in ahead),
``retry`` (:class:`~tidal.integrations.trl.retry.OutOfMemoryRetry`: a phase run again after
running out of memory beside kept roles), ``reference``
(``sync_ref_model`` with a moved-out reference), ``launch`` (the launches it runs under),
``checks`` (the settings refused before any work).
"""

from tidal.integrations.trl.config import TidalConfig
from tidal.integrations.trl.trainer import TidalGRPOTrainer, TidalRLOOTrainer, TidalRLTrainer

__all__ = ["TidalConfig", "TidalGRPOTrainer", "TidalRLOOTrainer", "TidalRLTrainer"]
