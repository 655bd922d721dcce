"""Measure the phases the planner models, with plain transformers + torch, and compare.

Each phase runs alone in a fresh state, so ``torch.cuda.max_memory_allocated`` after a reset
is exactly that phase's peak with only its role resident (what
:func:`tidal.plan.predict_phases` predicts with ``timeshare=True``):

* rollout: the model, ``generate`` of ``prompts*group`` left-padded prompts to the full length
  (sampling, ``min_new_tokens=gen_len``);
* reference: the model, a no-grad forward of one micro-batch, fp32 log-softmax, gather;
* train: model + AdamW states + all micro-batches (fp32 log-softmax, gather, a policy-gradient
  style loss, backward), gradients accumulated;
* optimizer_step: ``opt.step()`` after that.

Run as ``python -m tests.plan.calibrate [--preset qwen2-0.5b] ...`` on a GPU; the GPU test in
``test_calibration.py`` calls :func:`measure`. Random weights, built from a config: no download.
"""

from __future__ import annotations

import argparse
import gc

import torch

from tests.helpers import enable_checkpointing
from tidal.plan import GIB, PlanConfig, build_plan

__all__ = ["measure", "compare"]


def _model(s, device: str, grad_ckpt: bool, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: PLC0415

    cls = Qwen2Config if s.family == "qwen2" else LlamaConfig
    cfg = cls(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        tie_word_embeddings=s.tied_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if grad_ckpt:
        enable_checkpointing(model)
    return model


def _batch(n: int, c: PlanConfig, device: str, *, full: bool):
    """Left-padded ids and mask: each row has 1..prompt_len-? pad tokens at the left."""
    length = c.seq_len if full else c.prompt_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, c.shape.vocab, (n, length), generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    for r in range(n):
        mask[r, : r % 8] = 0  # a little padding, so the attention mask is real
        ids[r, : r % 8] = 0
    return ids.to(device), mask.to(device)


def _peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _logp(model, ids, mask):
    logits = model(input_ids=ids, attention_mask=mask).logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def measure(c: PlanConfig, *, device: str = "cuda") -> dict[str, int]:
    """Measured peak allocated bytes per phase for ``c`` (bf16, AdamW foreach, sdpa)."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        return _phases(c, device)
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def _phases(c: PlanConfig, device: str) -> dict[str, int]:
    out: dict[str, int] = {}
    model = _model(c.shape, device, c.grad_ckpt)
    model.eval()
    ids, mask = _batch(c.rollout_batch, c, device, full=False)
    with torch.no_grad():
        out["rollout"] = _peak(
            lambda: model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=c.gen_len,
                min_new_tokens=c.gen_len,
                do_sample=True,
                pad_token_id=0,
                use_cache=True,
            )
        )
    ids, mask = _batch(c.reference_micro_batch or c.micro_batch, c, device, full=True)
    with torch.no_grad():
        out["reference"] = _peak(lambda: _logp(model, ids, mask))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=c.adamw_foreach)
    for p in model.parameters():  # materialise the states, then drop the grads
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    ids, mask = _batch(c.micro_batch, c, device, full=True)

    def train() -> None:
        for _ in range(c.micro_batches):
            lp = _logp(model, ids, mask)
            (-(lp * mask[:, 1:]).sum() / mask.sum()).backward()
            del lp

    out["train"] = _peak(train)
    out["optimizer_step"] = _peak(opt.step)
    return out


def compare(c: PlanConfig, measured: dict[str, int]) -> list[tuple[str, int, int, float]]:
    """``(phase, predicted, measured, predicted/measured)`` per phase."""
    plan = build_plan(c)
    return [(p, plan.timeshared[p].peak_bytes, m, plan.timeshared[p].peak_bytes / m) for p, m in measured.items()]


# generate() with min_new_tokens adds one fp32 (batch x vocab) buffer to the sampling step.
_COMMON = dict(sampling_fp32_buffers=6)
CONFIGS = {
    "0.5b": dict(shape="qwen2-0.5b", prompts=8, group=4, prompt_len=128, gen_len=128, micro_batch=4),
    "0.5b-ckpt": dict(
        shape="qwen2-0.5b", prompts=8, group=8, prompt_len=256, gen_len=256, micro_batch=8, grad_ckpt=True
    ),
    "1.5b": dict(shape="qwen2-1.5b", prompts=8, group=4, prompt_len=128, gen_len=256, micro_batch=4),
    "1.5b-ckpt": dict(
        shape="qwen2-1.5b", prompts=16, group=8, prompt_len=256, gen_len=512, micro_batch=8, grad_ckpt=True
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    for key in args.configs:
        c = PlanConfig(**_COMMON, **CONFIGS[key])
        for phase, pred, meas, ratio in compare(c, measure(c)):
            print(
                f"{key:>10} {phase:>15}  predicted {pred / GIB:7.3f}  measured {meas / GIB:7.3f} GiB  ratio {ratio:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
