"""Muon as a drop-in for torch.optim.Muon, tested the way torch tests its own optimizers.

The inputs are torch's: the ``OptimizerInfo`` entry for ``torch.optim.Muon`` in the installed torch's
``torch.testing._internal.common_optimizers.optim_db`` (its ``optim_inputs_func`` and ``optim_error_inputs_func``).
The properties are those of torch's ``TestOptimRenewed`` (test/test_optim.py; our own code): state-dict determinism,
a load into a fresh optimizer that continues equal (also with named parameters and after a ``weights_only``
save/load), step / state-dict / load-state-dict pre- and post-hooks, deepcopy, a tensor lr, an LR scheduler, a no-op
step without gradients — each run on torch's Muon beside ours. ``Muon.torch_defaults`` steps bit for bit as
torch.optim.Muon; state dicts cross both ways. The deliberate differences (docs/api/optim.md) are asserted as such.
Tiny matrices, few steps.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_optim_db import common_optimizers
from weightgeom.optim import Muon
from weightgeom.optim.state_compat import TORCH_MUON, to_torch_muon

_INFO = next(o for o in common_optimizers.optim_db if o.optim_cls is torch.optim.Muon)
INPUTS = _INFO.optim_inputs_func(device="cpu", dtype=torch.float32)
ERROR_INPUTS = _INFO.optim_error_inputs_func(device="cpu", dtype=torch.float32)
_SHAPES = ((6, 4), (4, 6), (5, 5), (6, 4))  # tall, wide, square, and two of one shape (a batched bucket)


def _kwargs(inp) -> dict:
    """torch's input kwargs, a tensor lr copied (each optimizer gets its own)."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inp.kwargs.items()}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in _SHAPES]


def _grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _train(opt, params, steps: int, start: int = 0) -> None:
    for k in range(start, start + steps):
        _grads(params, k)
        opt.step()


def _pair(inp, ours=Muon):
    """(torch.optim.Muon, ours) over equal parameters, both with torch's input kwargs."""
    tp, op = _params(), _params()
    return (torch.optim.Muon(tp, **_kwargs(inp)), tp), (ours(op, **_kwargs(inp)), op)


def _ids(inp) -> str:
    return inp.desc.replace(" ", "-")


# ---- the named setting: torch's defaults and arithmetic ----------------------------------------------------------
@pytest.mark.parametrize("inp", INPUTS, ids=_ids)
def test_torch_defaults_step_as_torch_muon(inp):
    (t, tp), (o, op) = _pair(inp, ours=Muon.torch_defaults)
    _train(t, tp, 3)
    _train(o, op, 3)
    # to rounding: bitwise for torch's default 5 steps; with 6, a batched bucket's bf16 bmm may round one entry of
    # the direction differently from torch's per-matrix mm (measured: ≤ 6e-7 after 3 steps at lr 1e-3)
    for a, b in zip(tp, op):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=2e-6)
    for a, b in zip(tp, op):
        torch.testing.assert_close(t.state[a]["momentum_buffer"], o.state[b]["momentum_buffer"], rtol=0, atol=2e-6)


def test_torch_defaults_are_torchs():
    import inspect

    sig = inspect.signature(torch.optim.Muon.__init__).parameters
    for key, value in TORCH_MUON.items():
        want = sig[key].default
        assert value == ("original" if want is None and key == "adjust_lr_fn" else want), key
    group = Muon.torch_defaults(_params()).param_groups[0]
    assert {k: group[k] for k in TORCH_MUON} == TORCH_MUON


def test_ns_coefficients_keyword_and_group_key_step_as_torch():
    coeffs = (3.4, -4.7, 2.0)
    tp, op, gp = _params(), _params(), _params()
    t = torch.optim.Muon(tp, lr=0.02, weight_decay=0.0, ns_coefficients=coeffs, ns_steps=3, eps=1e-6)
    o = Muon(op, lr=0.02, ns_coefficients=coeffs, ns_steps=3, eps=1e-6)
    g = Muon([{"params": gp, "ns_coefficients": list(coeffs), "ns_steps": 3, "eps": 1e-6}], lr=0.02)
    for opt, ps in ((t, tp), (o, op), (g, gp)):
        _train(opt, ps, 3)
    for a, b, c in zip(tp, op, gp):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert "Newton–Schulz (3.4, -4.7, 2.0), steps 3" in o.summary()


def test_ns_coefficients_refused_where_they_cannot_apply():
    p = torch.nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"ns_coefficients=.*manifold group"):
        Muon([p], manifold="stiefel", ns_coefficients=(3.4, -4.7, 2.0))
    for bad in ((3.4, -4.7), (3.4, float("nan"), 2.0), "abc"):
        with pytest.raises(ValueError, match="ns_coefficients"):
            Muon([p], ns_coefficients=bad)
    with pytest.raises(ValueError, match="eps"):
        Muon([p], eps=0.0)


# ---- eps: torch's meaning; the AdamW ε is adamw_eps, the old spelling loads with a deprecation -------------------
def test_old_adamw_eps_spellings_load_with_one_deprecation():
    w, b = torch.nn.Parameter(torch.randn(6, 4)), torch.nn.Parameter(torch.randn(4))
    with pytest.warns(DeprecationWarning, match="old spelling of 'adamw_eps'"):
        opt = Muon([{"params": [w]}, {"params": [b], "algorithm": "adamw", "eps": 1e-6}])
    assert opt.param_groups[1]["adamw_eps"] == 1e-6 and opt.param_groups[1]["eps"] == TORCH_MUON["eps"]
    with pytest.warns(DeprecationWarning, match="old spelling"):
        assert Muon([b], algorithm="adamw", eps=1e-5).param_groups[0]["adamw_eps"] == 1e-5
    with pytest.warns(DeprecationWarning, match="adamw_eps"):
        Muon([{"params": [w]}, {"params": [b], "algorithm": "adamw"}], eps=1e-5)
    # a checkpoint from before adamw_eps: its groups carry the AdamW ε as 'eps'
    _train(opt, [w, b], 1)
    old = copy.deepcopy(opt.state_dict())
    for g in old["param_groups"]:
        del g["adamw_eps"]
        g["eps"] = 1e-5
    fresh = Muon([{"params": [w]}, {"params": [b], "algorithm": "adamw", "adamw_eps": 1e-8}])
    with pytest.warns(DeprecationWarning, match="checkpoint from before 'adamw_eps'"):
        fresh.load_state_dict(old)
    assert fresh.param_groups[1]["adamw_eps"] == 1e-5 and fresh.param_groups[1]["eps"] == TORCH_MUON["eps"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's spelling and checkpoints: no warning
        again = Muon([{"params": [w]}, {"params": [b], "algorithm": "adamw", "adamw_eps": 1e-8}], eps=1e-6)
        again.load_state_dict(copy.deepcopy(fresh.state_dict()))


# ---- state dicts across torch.optim.Muon and Muon ------------------------------------------------------------------
@pytest.mark.parametrize("ours_kwargs", [{}, {"manifold": "stiefel"}], ids=["plain", "stiefel"])
def test_torch_state_dict_loads_into_muon_with_its_momentum(ours_kwargs):
    tp = _params()
    t = torch.optim.Muon(tp, lr=0.02)
    _train(t, tp, 2)
    op = [torch.nn.Parameter(p.detach().clone()) for p in tp]
    o = Muon(op, lr=0.5, **ours_kwargs)
    o.load_state_dict(copy.deepcopy(t.state_dict()))
    for a, b in zip(tp, op):
        assert torch.equal(o.state[b]["momentum_buffer"], t.state[a]["momentum_buffer"])
    assert o.param_groups[0]["lr"] == 0.02  # hyperparameters come from the state dict, as torch loads them
    if not ours_kwargs:  # the same arithmetic: both continue equal
        _train(t, tp, 2, start=2)
        _train(o, op, 2, start=2)
        assert all(torch.equal(a, b) for a, b in zip(tp, op))
    else:
        _train(o, op, 1, start=2)
        assert o.param_groups[0]["ns_coefficients"] is None  # a manifold group keeps its converging msign


def test_muon_state_dict_loads_into_torch_muon_and_both_continue_equal():
    op = _params()
    o = Muon.torch_defaults(op, lr=0.02)
    _train(o, op, 2)
    tp = [torch.nn.Parameter(p.detach().clone()) for p in op]
    t = torch.optim.Muon(tp)
    t.load_state_dict(copy.deepcopy(o.state_dict()))  # its plain state_dict(), as it is
    _train(t, tp, 2, start=2)
    _train(o, op, 2, start=2)
    assert all(torch.equal(a, b) for a, b in zip(tp, op))
    # a default (Polar Express) Muon through to_torch_muon: the momentum and hyperparameters carry over
    dp = _params()
    d = Muon(dp, lr=0.03, weight_decay=0.01)
    _train(d, dp, 2)
    t2 = torch.optim.Muon([torch.nn.Parameter(p.detach().clone()) for p in dp])
    t2.load_state_dict(to_torch_muon(d.state_dict()))
    group = t2.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["ns_coefficients"]) == (0.03, 0.01, TORCH_MUON["ns_coefficients"])
    for a, b in zip(dp, t2.param_groups[0]["params"]):
        assert torch.equal(t2.state[b]["momentum_buffer"], d.state[a]["momentum_buffer"])
    with pytest.raises(ValueError, match="plain Muon groups"):
        to_torch_muon(Muon([torch.nn.Parameter(torch.randn(4))], algorithm="adamw").state_dict())


# ---- TestOptimRenewed's properties, on torch's inputs, torch's Muon beside ours ------------------------------------
def _both(inp):
    (t, tp), (o, op) = _pair(inp)
    return [(t, tp, lambda ps: torch.optim.Muon(ps, **_kwargs(inp))), (o, op, lambda ps: Muon(ps, **_kwargs(inp)))]


@pytest.mark.parametrize("inp", INPUTS, ids=_ids)
def test_state_dict_deterministic_and_a_fresh_load_continues_equal(inp):
    for opt, ps, make in _both(inp):
        _train(opt, ps, 2)
        sd = opt.state_dict()
        assert str(sd) == str(opt.state_dict())  # deterministic
        clone = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        fresh = make(clone)
        fresh.load_state_dict(copy.deepcopy(sd))
        _train(opt, ps, 2, start=2)
        _train(fresh, clone, 2, start=2)
        assert all(torch.equal(a, b) for a, b in zip(ps, clone)), type(opt)
        torch.testing.assert_close(fresh.state_dict()["state"], opt.state_dict()["state"], rtol=0, atol=0)


@pytest.mark.parametrize("inp", INPUTS[:2], ids=_ids)
def test_named_and_weights_only_state_dicts(inp):
    for cls in (torch.optim.Muon, Muon):
        ps = _params()
        opt = cls([(f"w{i}", p) for i, p in enumerate(ps)], **_kwargs(inp))
        _train(opt, ps, 2)
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        buf.seek(0)
        sd = torch.load(buf, weights_only=True)
        assert sd["param_groups"][0]["param_names"] == [f"w{i}" for i in range(len(ps))]
        clone = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        fresh = cls([(f"w{i}", p) for i, p in enumerate(clone)], **_kwargs(inp))
        fresh.load_state_dict(sd)
        _train(opt, ps, 1, start=2)
        _train(fresh, clone, 1, start=2)
        assert all(torch.equal(a, b) for a, b in zip(ps, clone)), cls


def _hook_calls(cls) -> list[str]:
    """The hooks that fire, in order, over two steps and a state-dict round trip of a ``cls`` optimizer."""
    calls: list[str] = []
    ps = _params()
    opt = cls(ps)

    def note(what: str, returns: int | None = None):
        def hook(*args):
            if what.startswith("global") and args[0] is not opt:
                return None
            calls.append(what)
            return None if returns is None else args[returns]
        return hook

    handles = [opt.register_step_pre_hook(note("step_pre")), opt.register_step_post_hook(note("step_post")),
               opt.register_state_dict_pre_hook(note("sd_pre")), opt.register_state_dict_post_hook(note("sd_post", 1)),
               opt.register_load_state_dict_pre_hook(note("load_pre", 1)),
               opt.register_load_state_dict_post_hook(note("load_post")),
               register_optimizer_step_pre_hook(note("global_pre")),
               register_optimizer_step_post_hook(note("global_post"))]
    try:
        _train(opt, ps, 2)
        opt.load_state_dict(opt.state_dict())
    finally:
        for h in handles:
            h.remove()
    return calls


def test_every_hook_kind_fires_once_per_call_as_for_torch():
    ours = _hook_calls(Muon)
    assert ours == _hook_calls(torch.optim.Muon)
    assert ours.count("step_pre") == ours.count("global_post") == 2 and ours.count("load_post") == 1


@pytest.mark.parametrize("inp", INPUTS[:3], ids=_ids)
def test_deepcopy_keeps_every_public_attribute_and_steps_alike(inp):
    for opt, ps, _ in _both(inp):
        _train(opt, ps, 1)
        dup = copy.deepcopy(opt)
        public = {k for k in vars(opt) if not k.startswith("_")}
        assert public == {k for k in vars(dup) if not k.startswith("_")}, type(opt)
        clone = dup.param_groups[0]["params"]
        _train(opt, ps, 1, start=1)
        _train(dup, clone, 1, start=1)
        assert all(torch.equal(a, b) for a, b in zip(ps, clone)), type(opt)


def test_tensor_lr_and_a_scheduler_follow_torch():
    tp, op = _params(), _params()
    t = torch.optim.Muon(tp, lr=torch.tensor(0.02))
    o = Muon.torch_defaults(op, lr=torch.tensor(0.02))
    scheds = [torch.optim.lr_scheduler.StepLR(x, step_size=1, gamma=0.5) for x in (t, o)]
    for k in range(3):
        for opt, ps, sched in ((t, tp, scheds[0]), (o, op, scheds[1])):
            _grads(ps, k)
            opt.step()
            sched.step()
        assert float(t.param_groups[0]["lr"]) == float(o.param_groups[0]["lr"])
        assert all(torch.equal(a, b) for a, b in zip(tp, op))


@pytest.mark.parametrize("inp", INPUTS, ids=_ids)
def test_a_step_without_gradients_changes_nothing(inp):
    for opt, ps, _ in _both(inp):
        before = [p.detach().clone() for p in ps]
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, ps)) and not opt.state, type(opt)


# ---- torch's error inputs: the same refusal, or a deliberate difference ---------------------------------------------
# desc → (error type, what our message says, why): refused at construction, where torch warns or raises at the step.
DELIBERATE = {
    "a param group cannot have duplicate parameters": (
        ValueError, "listed twice", "torch only warns, then steps the parameter twice per step"),
    "does not support complex parameters": (
        ValueError, "complex64", "refused at construction (torch: at the first step), before any training ran"),
}


@pytest.mark.parametrize("err", ERROR_INPUTS, ids=lambda e: _ids(e.optimizer_error_input))
def test_error_inputs_refused_as_torch_or_as_documented(err):
    inp = err.optimizer_error_input

    def run(cls):
        params = inp.params if inp.params is not None else [torch.nn.Parameter(torch.randn(2, 3))]
        with warnings.catch_warnings():
            warnings.simplefilter("error" if err.error_type is UserWarning else "ignore")
            opt = cls(params, **inp.kwargs)
            if err.error_on == common_optimizers.OptimizerErrorEnum.STEP_ERROR:
                opt.step()

    with pytest.raises(err.error_type, match=err.error_regex):  # torch's own behaviour on its input
        run(torch.optim.Muon)
    if inp.desc in DELIBERATE:
        kind, words, _why = DELIBERATE[inp.desc]
        with pytest.raises(kind, match=words):
            run(Muon)
    else:
        with pytest.raises(err.error_type):
            run(Muon)
