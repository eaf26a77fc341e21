"""Muon steps without host synchronisation (``on_nonfinite="skip"``); the compiled step (``torch.compile(opt.step,
fullgraph=True)`` equal to the eager one, a NaN step inside the graph) is checked in tests/test_compiled_step.py.

Host syncs are counted on the CPU two ways: Python-level reads of a tensor's value (``item``, ``bool``, ``float``,
``int``, ``index``, ``tolist``, ``numpy``, ``cpu``) are monkeypatched to count, and a dispatch mode counts
``aten._local_scalar_dense`` (what every scalar read of a tensor becomes, also from C++).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from weightgeom.optim import Muon, MuonConfig, NonFiniteGradientError
from weightgeom.schema import from_dict

_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy", "cpu")


# one thread (the 2-core machine is shared; tiny ops with two threads wait on each other) and the msign
# choice fixed instead of measured
pytestmark = pytest.mark.usefixtures("one_torch_thread", "fixed_msign")


class _ScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _count_syncs(monkeypatch, fn) -> tuple[int, int]:
    """(Python-level reads, aten._local_scalar_dense calls) while ``fn()`` runs."""
    calls = {"n": 0}
    for name in _READS:
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            calls["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    mode = _ScalarReads()
    with mode:
        fn()
    monkeypatch.undo()
    return calls["n"], mode.n


def _model() -> torch.nn.Module:
    # three same-shape 32×32 matrices (one batched msign call), a 32×16 and an 8×32 one (2-D path), biases (AdamW)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))


def _opt(model: torch.nn.Module, **kw) -> Muon:
    mats = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    vecs = [(n, p) for n, p in model.named_parameters() if p.ndim != 2]
    return Muon([{"params": [p for _, p in mats], "names": [n for n, _ in mats], "weight_decay": 0.1},
                 {"params": [p for _, p in vecs], "names": [n for n, _ in vecs], "algorithm": "adamw",
                  "lr": 1e-3, "weight_decay": 0.01}], **kw)


def _grads(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


def _snapshot(model: torch.nn.Module, opt: Muon) -> dict[str, bytes]:
    out = {f"param {n}": p.detach().numpy().tobytes() for n, p in model.named_parameters()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            out[f"state {i} {k}"] = v.detach().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()
    return out


def test_skip_steps_without_any_host_sync_raise_with_one(monkeypatch):
    torch.manual_seed(0)
    model = _model()
    for mode, want in (("skip", 0), ("raise", 1)):  # "raise": one sync per device (all on the CPU here)
        opt = _opt(model, on_nonfinite=mode)
        for seed in range(2):  # the first step (state created) and a later one
            _grads(model, seed)
            assert _count_syncs(monkeypatch, opt.step) == (want, want), (mode, seed)


def test_skip_with_a_nan_gradient_changes_nothing_and_counts(monkeypatch):
    torch.manual_seed(0)
    model = _model()
    ref_model = copy.deepcopy(model)
    opt, ref = _opt(model, on_nonfinite="skip"), _opt(ref_model, on_nonfinite="raise")
    for seed in range(2):
        _grads(model, seed), _grads(ref_model, seed)
        opt.step(), ref.step()
    before = _snapshot(model, opt)
    for bad, where in ((float("nan"), "2.weight"), (float("inf"), "5.bias"), (float("-inf"), "0.weight")):
        _grads(model, 7)
        dict(model.named_parameters())[where].grad.view(-1)[3] = bad
        with pytest.raises(NonFiniteGradientError, match=where):
            _opt(model).step()  # the default ("raise") refuses it, naming the parameter
        assert _count_syncs(monkeypatch, opt.step) == (0, 0)
        assert _snapshot(model, opt) == before  # every parameter, buffer, moment and step counter, bitwise
    assert int(opt.skipped_steps) == 3
    # a skipped step is a no-op: the next finite steps equal those of an optimizer that never saw it, bitwise
    for seed in range(2, 4):
        _grads(model, seed), _grads(ref_model, seed)
        opt.step(), ref.step()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), n
    assert int(opt.skipped_steps) == 3 and all(int(st["step"]) == 4 for st in opt.state.values())


def test_skip_on_the_first_step_leaves_parameters_and_counts_unchanged():
    model = _model()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _opt(model, on_nonfinite="skip")
    _grads(model, 0)
    model[0].bias.grad[0] = float("nan")
    opt.step()
    assert all(torch.equal(p, w0[n]) for n, p in model.named_parameters())
    assert all(int(st["step"]) == 0 and not st["momentum_buffer" if "momentum_buffer" in st else "exp_avg"].any()
               for st in opt.state.values())
    assert int(opt.skipped_steps) == 1


@pytest.mark.filterwarnings("ignore::weightgeom.optim.muon.FarRetractionWarning")
def test_skip_with_a_manifold_group_decides_on_the_host_and_changes_nothing(monkeypatch):
    """A manifold group syncs anyway (dual ascent): "skip" reads its flag once there and returns before anything."""
    torch.manual_seed(0)
    model = _model()
    mats = [p for p in model.parameters() if p.ndim == 2]
    opt = Muon([{"params": mats[:2], "manifold": "stiefel", "dual": {"steps": 3}},
                {"params": mats[2:]},
                {"params": [p for p in model.parameters() if p.ndim != 2], "algorithm": "adamw"}],
               on_nonfinite="skip")
    _grads(model, 0)
    opt.step()
    before = _snapshot(model, opt)
    _grads(model, 1)
    model[5].weight.grad[0, 0] = float("nan")
    reads, _ = _count_syncs(monkeypatch, opt.step)
    assert reads == 1 and _snapshot(model, opt) == before and int(opt.skipped_steps) == 1


def test_on_nonfinite_is_validated_and_in_the_config():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"on_nonfinite='ignore'"):
        Muon([p], on_nonfinite="ignore")
    with pytest.raises(ValueError, match="on_nonfinite"):  # optimizer-wide, not a group key
        Muon([{"params": [p], "on_nonfinite": "skip"}])
    assert MuonConfig().on_nonfinite == "raise"
    assert MuonConfig(on_nonfinite="skip").kwargs()["on_nonfinite"] == "skip"
    with pytest.raises(ValueError, match="on_nonfinite"):
        from_dict(MuonConfig, {"on_nonfinite": "ignore"})


def test_integer_step_counters_of_an_earlier_checkpoint_still_load(monkeypatch):
    """Step counters are 0-dim device tensors now; a state dict holding Python ints (as earlier versions saved it)
    loads and continues exactly like the optimizer it came from."""
    torch.manual_seed(0)
    model = _model()
    opt = _opt(model)
    _grads(model, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())  # as a checkpoint would: no tensor shared with ``opt``
    for st in sd["state"].values():
        st["step"] = int(st["step"])
    model2 = copy.deepcopy(model)
    opt2 = _opt(model2)
    opt2.load_state_dict(sd)
    _grads(model, 1), _grads(model2, 1)
    opt.step(), opt2.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    assert all(torch.is_tensor(st["step"]) and int(st["step"]) == 2 for st in opt2.state.values())


@pytest.mark.cuda
def test_cuda_step_runs_under_sync_debug_mode_error():
    model = _model().cuda()
    opt = _opt(model, on_nonfinite="skip")
    for p in model.parameters():  # a first step outside the debug mode: msign's CUDA graphs are captured here (a
        p.grad = torch.randn_like(p)  # capture synchronizes once); the steps below replay them, which never syncs
    opt.step()
    for seed in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        if seed == 2:
            model[0].weight.grad[0, 0] = float("nan")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert int(opt.skipped_steps) == 1 and opt.skipped_steps.device.type == "cuda"


@pytest.mark.cuda
def test_cuda_compiled_step_with_inductor_matches_eager():
    """On a GPU, torch.compile(opt.step, fullgraph=True) with the default (inductor) backend: no graph break, at most
    two compilations, and 3 steps equal the eager optimizer's (float32 msign, IEEE matmuls) within 1e-5."""
    torch.manual_seed(0)
    model = _model().cuda()
    ref_model = copy.deepcopy(model)
    opt, ref = _opt(model, on_nonfinite="skip"), _opt(ref_model, on_nonfinite="skip")
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(opt.step, fullgraph=True)
    for seed in range(3):
        _grads(model, seed), _grads(ref_model, seed)
        step(), ref.step()
        for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=n)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()
