"""Hugging Face export from models on GPUs: the device memory it takes beyond the model (at
most one full tensor while gathering FSDP2 shards; none for a plain or an offloaded model),
and the files reload bit for bit. One GPU, and 2 GPUs over NCCL (one process per GPU)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import tidal
from tests.distributed.multiproc import run_distributed
from tidal.checkpoint import TrainState, export_hf, export_hf_from_checkpoint, save
from tidal.distributed import shard_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SLACK = 1 * MiB


def big_config(tied: bool):
    """Qwen2-shaped, with a 64 MiB embedding (vocab 32768 x hidden 512, fp32; even shards on
    2 ranks): the largest tensor, and large enough that a second copy would show."""
    return transformers.Qwen2Config(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )


def big_model(tied: bool, device: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(big_config(tied))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return model.to(device).eval()


def expected_state(tied: bool) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in big_model(tied, "cpu").state_dict().items()}


def largest_bytes(model) -> int:
    return max(p.numel() * p.element_size() for p in model.parameters())


def peak_extra(fn, *args, **kwargs) -> int:
    """Device bytes allocated at the peak of ``fn(*args, **kwargs)`` beyond what was allocated
    before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def assert_reloads(out: Path, expected: dict[str, torch.Tensor], tied: bool) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tied", [True, False])
def test_export_gpu_model_and_offloaded_role_take_no_device_memory(tmp_path, tied):
    model = big_model(tied, "cuda:0")
    resident = peak_extra(export_hf, model, tmp_path / "resident", max_shard_bytes=32 * MiB)
    assert resident <= SLACK, f"exporting a plain GPU model took {resident / MiB:.1f} MiB of device memory"

    ts = tidal.Timeshare("cuda:0")
    ts.add_role("actor", model=model)
    ts.offload("actor")
    offloaded = peak_extra(export_hf, model, tmp_path / "offloaded", timeshare=ts)
    assert not ts.is_resident("actor"), "exporting brought the role back"
    assert offloaded <= SLACK, f"exporting an offloaded role took {offloaded / MiB:.1f} MiB of device memory"
    ts.close()
    expected = expected_state(tied)
    assert_reloads(tmp_path / "resident", expected, tied)
    assert_reloads(tmp_path / "offloaded", expected, tied)


def _nccl_worker(rank: int, world_size: int, directory: str, tied: bool) -> None:
    root = Path(directory)
    model = big_model(tied, f"cuda:{rank}")
    largest = largest_bytes(model)
    shard_model(model, zero_stage=3, layers=model.model.layers)
    torch.cuda.empty_cache()

    resident = peak_extra(export_hf, model, root / "resident", max_shard_bytes=48 * MiB)
    print(
        f"rank {rank}: export peak extra {resident / MiB:.2f} MiB, largest tensor {largest / MiB:.0f} MiB", flush=True
    )
    assert resident <= largest + SLACK, (
        f"rank {rank}: exporting took {resident / MiB:.1f} MiB extra, more than "
        f"the largest full tensor ({largest / MiB:.0f} MiB)"
    )
    assert resident >= largest // 2, "the gather of the largest tensor did not show: the bound means nothing"
    save(root / "ckpt", TrainState(model), step=1)

    # Offloaded: the shards are gathered from the host copies over gloo, nothing on the device.
    ts = tidal.Timeshare(f"cuda:{rank}")
    ts.add_role("actor", model=model)
    ts.offload("actor")
    offloaded = peak_extra(export_hf, model, root / "offloaded", timeshare=ts)
    assert not ts.is_resident("actor"), "exporting brought the role back"
    assert offloaded <= SLACK, f"rank {rank}: exporting an offloaded role took {offloaded / MiB:.1f} MiB"
    ts.close()
    del model, ts
    gc.collect()  # FSDP2's reference cycles go while the process group lives


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("tied", [True, False])
def test_fsdp2_nccl_export_peak_extra_at_most_one_full_tensor(tmp_path, tied):
    run_distributed(_nccl_worker, str(tmp_path), tied, backend="nccl")
    expected = expected_state(tied)
    assert_reloads(tmp_path / "resident", expected, tied)
    assert_reloads(tmp_path / "offloaded", expected, tied)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(big_config(tied))
    out = export_hf_from_checkpoint(tmp_path / "ckpt", tmp_path / "from-ckpt", model=meta)
    assert_reloads(out, expected, tied)
