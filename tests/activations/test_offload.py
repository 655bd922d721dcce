"""Activation offload on CPU: bit-exact gradients, checkpoint composition, host memory reuse,
the skip rules, the stream protocol (with fake streams) and misuse errors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import tidal.activations as ta
from tidal.activations import ActivationOffloadConfig, ActivationOffloader, LayerMode
from tidal.activations.layers import RecomputePatch
from tests.activations.models import (
    AttnBlock,
    MixedLM,
    assert_bitwise_equal,
    grads_of,
    tiny_qwen2,
)
from tests.policies import SkipWaits
from tests.transfer.fakes import FakeAccelOps
from tidal.device import use_sync_policy
from tidal.transfer import TransferContext

CFG = ActivationOffloadConfig(min_offload_bytes=256)


def _ids(vocab: int = 96, shape=(3, 12), seed: int = 7) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _mixed_step(offload: bool, *, checkpoint=False, plan=None, layer_cls=None, config=CFG):
    torch.manual_seed(0)
    model = MixedLM(checkpoint=checkpoint)
    ids = _ids()
    torch.manual_seed(123)  # dropout masks
    report = None
    if offload:
        kw = {"layer_cls": layer_cls} if layer_cls is not None else {"layers": model.blocks}
        off = ActivationOffloader(model, config=config, plan=plan, **kw)
        with off:
            loss = model(ids)
        loss.backward()
        report = off.report()
    else:
        loss = model(ids)
        loss.backward()
    return loss.detach(), grads_of(model), report


@pytest.mark.parametrize("checkpoint", [False, True], ids=["eager", "torch-ckpt"])
def test_mixed_model_bit_exact(checkpoint):
    ref_loss, ref_grads, _ = _mixed_step(False, checkpoint=checkpoint)
    loss, grads, rep = _mixed_step(True, checkpoint=checkpoint)
    assert torch.equal(loss, ref_loss)
    assert_bitwise_equal(grads, ref_grads)
    assert rep.bytes_offloaded > 0
    assert rep.bytes_reloaded == rep.bytes_offloaded
    assert len(rep.modes) == 4
    if checkpoint:
        # Only the checkpointed block inputs reach the hooks: one hidden state per block
        # (and, before block 0, the token ids the embedding saves; the caller holds them).
        hidden_state = 3 * 12 * 32 * 4
        assert rep.group_saved_bytes == [hidden_state + 3 * 12 * 8] + [hidden_state] * 3
    else:
        assert min(rep.group_saved_bytes) > 3 * 3 * 12 * 32 * 4


def test_layer_cls_selects_both_block_types():
    ref_loss, ref_grads, _ = _mixed_step(False)
    loss, grads, rep = _mixed_step(True, layer_cls=(AttnBlock, "MLPBlock"))
    assert torch.equal(loss, ref_loss)
    assert_bitwise_equal(grads, ref_grads)
    assert len(rep.modes) == 4 and rep.bytes_offloaded > 0


def test_planner_modes_bit_exact_and_forward_restored():
    plan = [LayerMode.RECOMPUTE_OFFLOAD, LayerMode.KEEP, LayerMode.RECOMPUTE, LayerMode.OFFLOAD]
    ref_loss, ref_grads, _ = _mixed_step(False)
    loss, grads, rep = _mixed_step(True, plan=plan)
    assert torch.equal(loss, ref_loss)
    assert_bitwise_equal(grads, ref_grads)
    assert rep.modes == plan
    # Layer 0 (recompute+offload) saved only its input (and the embedding's token ids);
    # layer 1 (keep) offloaded nothing.
    assert rep.group_saved_bytes[0] == 3 * 12 * 32 * 4 + 3 * 12 * 8
    assert rep.group_saved_bytes[1] > 3 * 3 * 12 * 32 * 4
    model = MixedLM()
    patch = RecomputePatch(list(model.blocks))
    assert "forward" in model.blocks[0].__dict__
    patch.restore()
    assert all("forward" not in b.__dict__ for b in model.blocks)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["eager", "hf-ckpt"])
def test_hf_qwen2_bit_exact(checkpointing):
    ids = _ids(128, (2, 16))

    def step(offload):
        model = tiny_qwen2(3, checkpointing=checkpointing)
        torch.manual_seed(5)
        if offload:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with ta.offload_activations(model, layers=model.model.layers, min_offload_bytes=1024) as off:
                    loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss.detach(), grads_of(model), off.report()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), grads_of(model), None

    ref_loss, ref_grads, _ = step(False)
    loss, grads, rep = step(True)
    assert torch.equal(loss, ref_loss)
    assert_bitwise_equal(grads, ref_grads)
    hidden_state = 2 * 16 * 64 * 4
    if checkpointing:
        # Only the checkpointed inputs are saved through tidal: one hidden state per layer.
        # Layer 0's input is the embedding output, which the model keeps in a variable
        # (inputs_embeds) through the forward: it stays. Layer 1's input is offloaded.
        assert rep.group_saved_bytes == [hidden_state] * 3
        assert rep.bytes_offloaded == hidden_state
        assert rep.bytes_kept_referenced == hidden_state
    else:
        assert rep.bytes_offloaded > 10 * hidden_state


def _arena_used() -> int:
    return TransferContext.of(torch.device("cpu")).arena().used_bytes


def test_arena_reused_across_steps_and_offloader_cached():
    torch.manual_seed(0)
    model = MixedLM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    reserved, offs = [], set()
    used_before = _arena_used()  # the device's arena is shared with whatever ran before
    for step in range(12):
        with ta.offload_activations(model, layers=model.blocks, config=CFG) as off:
            loss = model(_ids(seed=step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rep = off.report()
        assert rep.bytes_offloaded > 0 and rep.bytes_reloaded == rep.bytes_offloaded
        reserved.append(off.host_reserved_bytes)
        offs.add(id(off))
        assert off.arena.used_bytes == used_before  # every slot returned once the graph died
    assert len(offs) == 1
    assert reserved[0] > 0 and len(set(reserved)) == 1, reserved
    # Host RAM is what the step offloads, plus slot alignment padding.
    assert reserved[0] <= rep.bytes_offloaded + 512 * 64


def test_offloaded_storages_leave_the_device_during_forward():
    torch.manual_seed(0)
    model = MixedLM(pairs=3)
    used_before = _arena_used()
    off = ActivationOffloader(model, layers=model.blocks, config=CFG)
    with off:
        loss = model(_ids())
        step = off._step
        # Released in forward: the group in flight when the next offload starts.
        assert all(r.x_gpu is None for b in step.batches[:-1] for r in b.records)
    assert all(r.x_gpu is None for b in step.batches for r in b.records)  # exit released the last
    assert all(r.slot is not None for b in step.batches for r in b.records)
    # The last layer group is never offloaded.
    assert step.groups[-1].batch is None and len(step.batches) == len(model.blocks) - 1
    loss.backward()
    assert off.arena.used_bytes == used_before


def test_views_rebuilt_and_storage_copied_once():
    """A transposed slice, a dtype view and a narrowed view of one storage come back with
    their own size, stride and offset; the storage is copied once."""

    class ViewLayer(nn.Module):
        def forward(self, x):
            base = x * 1.5  # fresh storage: 32 x 64 fp32
            a = base[3:20].t()  # strided view with an offset
            b = base.view(torch.int32)[:, 5:9].float()  # new tensor (cast), not a view
            c = base[:, 10:40]
            return (a.sin().sum() + (c * c).sum() + b.mean()).expand(1)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([ViewLayer(), ViewLayer()])

        def forward(self, x):
            return sum(layer(x) for layer in self.layers)

    x = torch.randn(32, 64, requires_grad=True)
    ref = Model()(x)
    (gx_ref,) = torch.autograd.grad(ref, x)
    model = Model()
    off = ActivationOffloader(model, layer_cls=ViewLayer, config=CFG)
    with off:
        out = model(x)
    (gx,) = torch.autograd.grad(out, x)
    assert torch.equal(out, ref) and torch.equal(gx, gx_ref)
    rep = off.report()
    # Group 0: base (sin saves a, mul saves c twice: one storage) copied once.
    assert rep.bytes_offloaded == 32 * 64 * 4


def test_skip_rules_parameters_small_and_referenced():
    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 64))
            self.kept: list[torch.Tensor] = []

        def forward(self, x):
            y = x @ self.w.t()  # saves x and a view of the parameter
            z = y.relu()  # saves its output
            self.kept.append(z)  # referenced outside autograd: offloading frees nothing
            small = z[:1, :2].exp()  # 8-byte storage saved by exp: below the threshold
            return z.sum() + small.sum()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Holder(), Holder(), Holder()])

        def forward(self, x):
            return sum(layer(x.clone()) for layer in self.layers)

    torch.manual_seed(0)
    model = Model()
    off = ActivationOffloader(model, layers=model.layers, config=CFG)
    with off:
        loss = model(torch.randn(16, 64))
        step = off._step
    recs = [r for g in step.groups for r in g.records]
    # Only x.clone() (16 x 64 fp32) and z are candidates; the weight view and exp's output are not.
    assert sorted(r.nbytes for r in recs) == [16 * 64 * 4] * 6
    loss.backward()
    rep = off.report()
    # Groups 0 and 1 offload their input; each z is held by self.kept and stays.
    assert rep.bytes_offloaded == 2 * 16 * 64 * 4
    assert rep.bytes_kept_referenced == 2 * 16 * 64 * 4


def test_retain_graph_second_backward_reloads():
    torch.manual_seed(0)
    model = MixedLM()
    ids = _ids()
    torch.manual_seed(1)
    loss = model(ids)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = grads_of(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    off = ActivationOffloader(model, layers=model.blocks, config=CFG)
    with off:
        loss = model(ids)
    loss.backward(retain_graph=True)
    first = off._step.bytes_reloaded
    with pytest.raises(ValueError, match="still"):  # the retained graph holds its activations
        with off:
            pass
    loss.backward()
    assert_bitwise_equal(grads_of(model), ref)
    assert off._step.bytes_reloaded == 2 * first > 0
    with off:  # the graph released its saved tensors: the next step may start
        pass


def test_backward_inside_context():
    ref_loss, ref_grads, _ = _mixed_step(False)
    torch.manual_seed(0)
    model = MixedLM()
    ids = _ids()
    torch.manual_seed(123)
    with ActivationOffloader(model, layers=model.blocks, config=CFG):
        loss = model(ids)
        loss.backward()
    assert torch.equal(loss.detach(), ref_loss)
    assert_bitwise_equal(grads_of(model), ref_grads)


def test_fake_accelerator_issues_every_wait():
    """With fake streams, every offload is ordered after compute, every release after its D2H,
    every reload after its allocation and its D2H, every use after its H2D."""
    torch.manual_seed(0)
    model = MixedLM(pairs=2)
    ops = FakeAccelOps()
    off = ActivationOffloader(model, layers=model.blocks, config=CFG, context=TransferContext(ops))
    with off:
        loss = model(_ids())
    loss.backward()
    log = ops.log
    d2h, h2d = off._mover.d2h_stream.name, off._mover.h2d_stream.name
    scatter = off._mover.engine.scatter_stream.name  # where each reload's event is recorded
    recorded = {e: s for kind, s, e in (x for x in log if x[0] == "record")}
    waits = [(s, e) for kind, s, e in (x for x in log if x[0] == "wait_event")]
    produced = [e for e, s in recorded.items() if s == "compute"]
    d2h_done = {e for e, s in recorded.items() if s == d2h}
    h2d_done = {e for e, s in recorded.items() if s == h2d}
    landed = {e for e, s in recorded.items() if s == scatter}
    batches = len(off._step.batches)
    assert batches == 3
    # produce: D2H waited on a compute event once per batch.
    assert sum(1 for s, e in waits if s == d2h and e in produced) == batches
    # release: compute waited on each batch's last D2H event; reload_after_offload: H2D too.
    last_d2h = {b.d2h_done.id for b in off._step.batches}
    assert last_d2h <= d2h_done
    assert {e for s, e in waits if s == "compute" and e in d2h_done} == last_d2h
    assert {e for s, e in waits if s == h2d and e in d2h_done} == last_d2h
    # alloc: H2D waited on a compute event per reload; consume: compute waited on the H2D
    # event of every reloaded storage, and on nothing else recorded on H2D.
    assert sum(1 for s, e in waits if s == h2d and e in produced) == batches
    reload_done = {r.h2d_done.id for b in off._step.batches for r in b.records}
    assert reload_done <= landed
    assert {e for s, e in waits if s == "compute" and e in landed} == reload_done
    # ...and the event of each segment's copy is what its scatter stream waits for.
    assert {e for s, e in waits if s == scatter} == h2d_done
    # A sync policy dropping these waits removes every one (the seam the GPU race tests use).
    ops.log.clear()
    names = {
        "act_produce",
        "act_release",
        "act_alloc",
        "act_consume",
        "act_reload_after_offload",
        "scatter_after_h2d",
        "staging_in_after_scatter",
    }
    with use_sync_policy(SkipWaits(names)) as policy:
        with off:
            loss = model(_ids())
        loss.backward()
    assert not any(x[0] == "wait_event" for x in ops.log)
    assert set(policy.skipped) == names


def test_fsdp2_wrapped_layers_bit_exact(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def step(offload):
            torch.manual_seed(0)
            model = MixedLM(dropout=0.0)
            for blk in model.blocks:
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
            ids = _ids()
            if offload:
                off = ActivationOffloader(model, layers=model.blocks, config=CFG)
                with off:
                    loss = model(ids)
                loss.backward()
                assert off.report().bytes_offloaded > 0
            else:
                loss = model(ids)
                loss.backward()
            assert any(type(p).__name__ == "DTensor" for p in model.parameters())
            return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}

        ref_loss, ref_grads = step(False)
        loss, grads = step(True)
        assert torch.equal(loss, ref_loss)
        assert_bitwise_equal(grads, ref_grads)
    finally:
        dist.destroy_process_group()


# ---- misuse ---------------------------------------------------------------------------------------
def test_nested_and_shadowing_contexts_refused():
    model = MixedLM()
    off = ActivationOffloader(model, layers=model.blocks, config=CFG)
    other = ActivationOffloader(model, layers=model.blocks, config=CFG)
    with off:
        with pytest.raises(ValueError, match="nesting is not supported"):
            with other:
                pass
    with torch.autograd.graph.save_on_cpu():
        with pytest.raises(ValueError, match="other saved-tensor hooks"):
            with off:
                pass
    with off:  # state was restored after the refusals
        loss = model(_ids())
    loss.backward()


def test_second_forward_before_backward_refused():
    model = MixedLM()
    off = ActivationOffloader(model, layers=model.blocks, config=CFG)
    with off:
        loss = model(_ids())
    with pytest.raises(ValueError, match="previous forward.*still"):
        with off:
            model(_ids())
    loss.backward()
    with off:
        loss = model(_ids())
    loss.backward()
    assert off.report().bytes_offloaded > 0


def test_layer_selection_errors():
    model = MixedLM()
    stranger = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="not submodules"):
        ActivationOffloader(model, layers=[model.blocks[0], stranger])
    with pytest.raises(ValueError, match="exactly one"):
        ActivationOffloader(model, layers=model.blocks, layer_cls=AttnBlock)
    with pytest.raises(ValueError, match="exactly one"):
        ActivationOffloader(model)
    with pytest.raises(ValueError, match="no submodule"):
        ActivationOffloader(model, layer_cls=nn.GRU)
    with pytest.raises(TypeError, match="not an nn.Module"):
        ActivationOffloader(model, layers=[model.blocks[0], "blocks.1"])
    with pytest.raises(ValueError, match="more than once"):
        ActivationOffloader(model, layers=[model.blocks[0], model.blocks[0]])
    with pytest.raises(ValueError, match="contains another"):
        ActivationOffloader(model, layers=[model.blocks[0], model.blocks[0].qkv])
    with pytest.raises(TypeError, match="torch.compile"):
        ActivationOffloader(torch.compile(model), layers=model.blocks)
    with pytest.raises(ValueError, match="modes for 4 layers"):
        ActivationOffloader(model, layers=model.blocks, plan=[LayerMode.KEEP])
    with pytest.raises(TypeError, match="sequence of LayerMode"):
        ActivationOffloader(model, layers=model.blocks, plan=["sometimes"] * 4)
    with pytest.raises(ValueError, match="needs an accelerator"):
        ActivationOffloader(model, layers=model.blocks, config=ActivationOffloadConfig(budget_bytes=1 << 30))
    with pytest.raises(TypeError, match="not both"):
        ta.offload_activations(model, layers=model.blocks, config=CFG, min_offload_bytes=0)


def test_config_errors():
    with pytest.raises(ValueError, match="min_offload_bytes"):
        ActivationOffloadConfig(min_offload_bytes=-1)
    with pytest.raises(ValueError, match="budget_bytes"):
        ActivationOffloadConfig(budget_bytes=0)
    with pytest.raises(ValueError, match="reset_peak=True"):
        ActivationOffloadConfig(budget_bytes=1 << 30, reset_peak=False)
    with pytest.raises(ValueError, match="prefetch_groups"):
        ActivationOffloadConfig(prefetch_groups=0)
    with pytest.raises(ValueError, match="default_mode"):
        ActivationOffloadConfig(default_mode="later")
    with pytest.raises(ValueError, match="small_copy_bytes"):
        ActivationOffloadConfig(small_copy_bytes=8 << 20, bucket_bytes=4 << 20)
    with pytest.raises(TypeError):
        ActivationOffloadConfig(1 << 20)  # keyword-only


def test_reentrant_checkpointing_refused():
    model = tiny_qwen2(2, checkpointing=True, reentrant=True)
    off = ActivationOffloader(model, layers=model.model.layers, config=CFG)
    with pytest.raises(ValueError, match="use_reentrant.*False"):
        with off:
            pass
    # torch's reentrant checkpoint around a block, found when the block runs.
    model = MixedLM(checkpoint="reentrant")
    off = ActivationOffloader(model, layers=model.blocks, config=CFG)
    with pytest.raises(ValueError, match="reentrant checkpointing"):
        with off:
            model(_ids())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # hooks popped
    assert not any(b._forward_pre_hooks for b in model.blocks)
