import numpy as np
import pytest
import torch
from torch import nn

from tidal.state import StateEntry, collect_module_state, collect_optimizer_state, storage_key

CPU = torch.device("cpu")


def _by_name(entries):
    return {e.name: e for e in entries}


def _key(t):
    return storage_key(t.untyped_storage())


# ---- storage_key -------------------------------------------------------------------------------
def test_storage_key_is_shared_by_views_and_stable_across_resize():
    t = torch.randn(10)
    k = _key(t)
    assert _key(t[2:5]) == k and _key(t.view(2, 5).t()) == k
    assert _key(torch.randn(10)) != k
    t.untyped_storage().resize_(0)
    assert _key(t) == k
    t.untyped_storage().resize_(40)
    assert _key(t) == k


# ---- modules -----------------------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_are_one_entry():
    m = Tied()
    entries = collect_module_state([m], CPU)
    assert [e.name for e in entries] == ["embed.weight", "mid.weight", "mid.bias"]
    assert all(e.kind == "param" for e in entries)
    assert entries[0].nbytes == 11 * 4 * 4
    assert entries[0].storage.data_ptr() == m.head.weight.data_ptr()
    assert entries[0].key == _key(m.head.weight)
    assert len({e.key for e in entries}) == len(entries)


def test_views_slices_and_transposes_of_one_storage_are_one_entry():
    m = nn.Module()
    flat = torch.randn(100)
    m.a = nn.Parameter(flat[:40].view(4, 10))
    m.b = nn.Parameter(flat[40:])
    m.register_buffer("t", flat[:40].view(4, 10).t())  # non-contiguous
    m.register_buffer("s", flat[::3])
    assert not m.t.is_contiguous()
    entries = collect_module_state([m], CPU)
    assert len(entries) == 1
    (e,) = entries
    assert (e.name, e.kind, e.nbytes) == ("a", "param", 400)
    assert e.key == _key(flat)


def test_a_transposed_parameter_moves_its_whole_storage():
    m = nn.Module()
    base = torch.randn(6, 5)
    m.w = nn.Parameter(base.t())
    (e,) = collect_module_state([m], CPU)
    assert e.nbytes == 120 and e.storage.nbytes() == 120


def test_mixed_dtypes_and_buffers():
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(3, 3, dtype=torch.bfloat16))
    m.d = nn.Parameter(torch.randn(5, dtype=torch.float64))
    m.register_buffer("ids", torch.arange(7))  # int64
    m.register_buffer("mask", torch.ones(9, dtype=torch.bool))
    m.register_buffer("f16", torch.zeros(3, dtype=torch.float16))
    m.register_buffer("c", torch.zeros(2, dtype=torch.complex64))
    m.register_buffer("gone", None)
    got = {e.name: (e.kind, e.nbytes) for e in collect_module_state([m], CPU)}
    assert got == {
        "w": ("param", 18),
        "d": ("param", 40),
        "ids": ("buffer", 56),
        "mask": ("buffer", 9),
        "f16": ("buffer", 6),
        "c": ("buffer", 16),
    }


def test_batchnorm_buffers_and_min_offload_bytes():
    bn = nn.BatchNorm1d(8)
    got = {e.name: e for e in collect_module_state([bn], CPU)}
    assert set(got) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    assert got["running_mean"].kind == "buffer" and got["num_batches_tracked"].nbytes == 8
    small = {e.name for e in collect_module_state([bn], CPU, min_offload_bytes=16)}
    assert small == {"weight", "bias", "running_mean", "running_var"}
    exact = {e.name for e in collect_module_state([bn], CPU, min_offload_bytes=32)}
    assert exact == {"weight", "bias", "running_mean", "running_var"}  # 32 bytes is not < 32
    assert collect_module_state([bn], CPU, min_offload_bytes=33) == []


def _trained(model):
    model(torch.randn(2, model.in_features)).sum().backward()
    return model


@pytest.mark.parametrize("policy, with_grads", [("offload", True), ("keep", False), ("drop", False)])
def test_grads_by_policy(policy, with_grads):
    m = _trained(nn.Linear(4, 3))
    entries = collect_module_state([m], CPU, grads=policy)
    names = [e.name for e in entries]
    if with_grads:
        assert names == ["weight", "bias", "weight.grad", "bias.grad"]
        g = _by_name(entries)["weight.grad"]
        assert g.kind == "grad" and g.key == _key(m.weight.grad) and g.key != _key(m.weight)
    else:
        assert names == ["weight", "bias"]


def test_missing_grads_are_fine_and_tied_grads_count_once():
    m = Tied()
    m.mid(m.embed(torch.tensor([1, 2]))).sum().backward()
    names = [e.name for e in collect_module_state([m], CPU)]
    assert names == ["embed.weight", "mid.weight", "mid.bias", "embed.weight.grad", "mid.weight.grad", "mid.bias.grad"]
    m.zero_grad(set_to_none=True)
    assert [e.name for e in collect_module_state([m], CPU)] == ["embed.weight", "mid.weight", "mid.bias"]


def test_several_modules_and_extra_params():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    loose = nn.Parameter(torch.randn(5))
    loose.grad = torch.randn(5)
    b.weight = a.weight  # shared across modules: still one entry, under the first name
    names = [e.name for e in collect_module_state([a, b], CPU, extra_params=[loose, a.bias])]
    assert names == ["weight", "bias", "model1.bias", "optimizer_param0", "optimizer_param0.grad"]


def test_empty_parameters_are_skipped():
    m = nn.Module()
    m.empty = nn.Parameter(torch.empty(0))
    m.full = nn.Parameter(torch.ones(2))
    assert [e.name for e in collect_module_state([m], CPU)] == ["full"]


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)])
def test_device_spellings(device):
    assert len(collect_module_state([nn.Linear(2, 2)], device)) == 2
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    _step(opt)
    assert len(collect_optimizer_state([opt], device)) == 2


def test_tensors_on_another_device_are_skipped():
    m = nn.Module()
    m.here = nn.Parameter(torch.ones(4))
    m.there = nn.Parameter(torch.ones(4, device="meta"))
    m.register_buffer("meta_buf", torch.ones(4, device="meta"))
    assert [e.name for e in collect_module_state([m], CPU)] == ["here"]
    assert [e.name for e in collect_module_state([m], torch.device("meta"))] == ["there", "meta_buf"]
    assert all(e.storage.device.type == "cpu" for e in collect_module_state([m], CPU))


# ---- unsupported tensors -------------------------------------------------------------------
def test_non_resizable_storage_is_a_type_error_naming_the_tensor():
    m = nn.Module()
    m.ok = nn.Parameter(torch.ones(2))
    m.np_weight = nn.Parameter(torch.from_numpy(np.ones((3, 3), dtype=np.float32)))
    with pytest.raises(TypeError, match=r"np_weight: its storage is not resizable"):
        collect_module_state([m], CPU)


def test_sparse_tensor_is_a_type_error():
    m = nn.Module()
    m.register_buffer("sp", torch.eye(3).to_sparse())
    with pytest.raises(TypeError, match=r"sp: tensors with layout torch.sparse_coo"):
        collect_module_state([m], CPU)


def test_wrapper_subclass_is_opened_to_its_inner_tensors():
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    m = nn.Module()
    a, b = torch.randn(3), torch.randn(3)
    m.register_buffer("pair", two_tensor.TwoTensor(a, b))
    got = {e.name: e.key for e in collect_module_state([m], CPU)}
    assert got == {"pair.a": _key(a), "pair.b": _key(b)}


# ---- optimizers ----------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(opt, model=None):
    params = [p for g in opt.param_groups for p in g["params"]]
    loss = sum((p * p).sum() for p in params)
    loss.backward()
    opt.step()


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_state(foreach, amsgrad):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=foreach, amsgrad=amsgrad)
    _step(opt)
    params = list(m.parameters())
    names = {id(p): n for n, p in m.named_parameters()}
    entries = collect_optimizer_state([opt], CPU, names=names, min_offload_bytes=5)
    moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else [])
    assert len(entries) == len(params) * len(moments)
    assert all(e.kind == "optim" for e in entries)
    got = {e.key for e in entries}
    want = {_key(opt.state[p][k]) for p in params for k in moments}
    assert got == want
    assert "optimizer0.state[0.weight]['exp_avg']" in {e.name for e in entries}
    # Adam's `step` is a 4-byte scalar: skipped by min_offload_bytes, collected without it.
    all_entries = collect_optimizer_state([opt], CPU)
    steps = [e for e in all_entries if e.name.endswith("['step']")]
    assert len(steps) == len(params) and all(e.nbytes == 4 for e in steps)


def test_sgd_momentum_and_plain_sgd():
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    _step(opt)
    entries = collect_optimizer_state([opt], CPU)
    assert {e.key for e in entries} == {_key(opt.state[p]["momentum_buffer"]) for p in m.parameters()}
    plain = torch.optim.SGD(m.parameters(), lr=0.1)
    _step(plain)
    assert collect_optimizer_state([plain], CPU) == []  # None / no state: nothing, no error


def test_adagrad_state():
    m = _model()
    opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
    _step(opt)
    entries = collect_optimizer_state([opt], CPU, min_offload_bytes=8)
    assert {e.key for e in entries} == {_key(opt.state[p]["sum"]) for p in m.parameters()}


def test_several_optimizers_and_shared_storage_across_them():
    m = _model()
    a = torch.optim.SGD(list(m.parameters())[:2], lr=0.1, momentum=0.9)
    b = torch.optim.SGD(list(m.parameters())[2:], lr=0.1, momentum=0.9)
    _step(a)
    _step(b)
    p = next(iter(b.state))
    b.state[p]["alias"] = a.state[next(iter(a.state))]["momentum_buffer"][1:]
    entries = collect_optimizer_state([a, b], CPU)
    assert len(entries) == 4  # the alias is a view of a's buffer
    assert any(e.name.startswith("optimizer1.") for e in entries)


def test_non_tensor_values_are_left_alone():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    buf = torch.zeros(3)
    opt.state[p] = {"count": 3, "lr_scale": 0.5, "names": ["a", "b"], "nested": {"x": 1}, "buf": buf, "none": None}
    (e,) = collect_optimizer_state([opt], CPU)
    assert e.key == _key(buf)


@pytest.mark.parametrize("container", [list, tuple, lambda ts: {"a": ts[0], "b": ts[1]}])
def test_tensors_inside_containers_are_collected(container):
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    inner = [torch.zeros(3), torch.zeros(5)]
    opt.state[p] = {"buf": torch.zeros(3), "history": container(inner)}
    entries = collect_optimizer_state([opt], CPU, names={id(p): "w"})
    assert {e.key for e in entries} >= {_key(t) for t in inner}
    assert any(e.name.startswith("optimizer0.state[w]['history'][") for e in entries)


def test_a_set_of_tensors_is_a_type_error():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = {"history": {torch.zeros(3)}}
    with pytest.raises(TypeError, match=r"\['history'\] is a set of tensors"):
        collect_optimizer_state([opt], CPU, names={id(p): "w"})


def test_non_resizable_and_sparse_optimizer_state_are_type_errors():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = {"np": torch.from_numpy(np.zeros(4, dtype=np.float32))}
    with pytest.raises(TypeError, match=r"optimizer0.state\[w\]\['np'\]: its storage is not resizable"):
        collect_optimizer_state([opt], CPU, names={id(p): "w"})
    opt.state[p] = {"sp": torch.eye(2).to_sparse()}
    with pytest.raises(TypeError, match="layout"):
        collect_optimizer_state([opt], CPU)


def test_non_dict_optimizer_state_is_a_type_error():
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p] = torch.zeros(3)
    with pytest.raises(TypeError, match="expected a dict"):
        collect_optimizer_state([opt], CPU)


def test_entries_are_state_entries_with_live_storages():
    m = _model()
    for e in collect_module_state([m], CPU):
        assert isinstance(e, StateEntry)
        assert e.storage.nbytes() == e.nbytes and e.key == storage_key(e.storage)


# ---- cached module slots -------------------------------------------------------------------
def test_cached_slots_see_replaced_and_newly_registered_tensors():
    from tidal.state.collect import ModuleSlots

    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    slots = ModuleSlots([m])
    assert [n for n, _ in slots.named()[0]] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    new_w = nn.Parameter(torch.randn(4, 4))
    m[0].weight = new_w  # replaced under the same name: read through the slot
    assert slots.named()[0][0][1] is new_w
    m[1].register_buffer("scale", torch.ones(2))  # a registration: the slots are found again
    assert [n for n, _ in slots.named()[1]] == ["1.scale"]


def test_debug_mode_catches_a_tensor_registered_behind_torchs_back():
    """A tensor written into ``_parameters`` directly fires no registration hook, so the cache
    misses it; with verification on that is an error, not a silently unmoved tensor."""
    from tidal.state.collect import ModuleSlots

    m = nn.Sequential(nn.Linear(4, 4))
    quiet, checked = ModuleSlots([m]), ModuleSlots([m], verify=True)
    quiet.named(), checked.named()
    m[0]._parameters["extra"] = nn.Parameter(torch.randn(3))
    assert "0.extra" not in [n for n, _ in quiet.named()[0]]  # the stale cache, unverified
    with pytest.raises(RuntimeError, match=r"stale.*0\.extra"):
        checked.named()


def test_timeshare_config_turns_the_debug_check_on():
    import tidal

    m = nn.Sequential(nn.Linear(8, 8))
    ts = tidal.Timeshare("cpu", config=tidal.TimeshareConfig(verify_storage_sets=True))
    ts.add_role("a", model=m)
    ts.offload("a")
    ts.load("a")
    m[0]._parameters["extra"] = nn.Parameter(torch.randn(64))
    with pytest.raises(RuntimeError, match="stale"):
        ts.offload("a")
    assert ts.is_resident("a") and m[0].weight.untyped_storage().nbytes() > 0  # refused before moving


def test_unique_storage_bytes_counts_each_storage_once():
    from tidal.state import unique_storage_bytes

    w = torch.randn(10, 10)
    b = torch.randn(7)
    views = [w, w.t(), w[2:5], b, None, b[:3]]
    assert unique_storage_bytes(views) == 400 + 28
    assert unique_storage_bytes(views, torch.device("cpu")) == 428
    assert unique_storage_bytes(views, torch.device("meta")) == 0
