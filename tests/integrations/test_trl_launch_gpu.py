"""TidalGRPOTrainer under ``accelerate launch`` on 2 GPUs, with TRL's ``multi_gpu`` (DDP) and
``fsdp2`` configs, against TRL alone under the same launch run twice: every logged value and
every final weight of tidal's run is within the distance between TRL alone's two runs (where
those agree bit for bit, tidal's must too)."""

from __future__ import annotations

import pytest
import torch

from tests.integrations.test_trl_launch import _launch, tiny  # noqa: F401  (the fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


@pytest.mark.parametrize("config", ["multi_gpu", "fsdp2"])
def test_accelerate_launch_on_two_gpus_is_within_trl_alones_spread(config, tiny, tmp_path):  # noqa: F811
    runs = _launch(
        "accelerate", tiny, tmp_path, "--runs", "trl,trl,tidal", "--prefetch", "--save-weights", config=config
    )
    a, b, ours = runs["trl"], runs["trl2"], runs["tidal"]
    assert [r["world"] for r in a + b + ours] == [2] * 6
    ha, hb, ht = a[0]["history"], b[0]["history"], ours[0]["history"]
    assert len(ha) == len(ht) == 3
    for row_a, row_b, row_t in zip(ha, hb, ht):
        for x, y, t in zip(row_a, row_b, row_t):
            assert abs(t - x) <= abs(y - x), (config, ha, hb, ht)
    wa, wb, wt = (torch.load(tmp_path / n / "weights.pt") for n in ("trl", "trl2", "tidal"))
    for k in wa:
        assert (wt[k] - wa[k]).abs().max() <= (wb[k] - wa[k]).abs().max(), k
    for rank in ours:
        moves = [m for m in rank["moves"] if m[0] == "switch"]
        assert moves and all(m[3] > 0 or m[4] > 0 for m in moves)  # the roles took turns, moving bytes
        if config == "fsdp2":
            assert rank["gathered_generations"] == 3
        else:
            assert len(rank["buckets_freed"]) == 2
