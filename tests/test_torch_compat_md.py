"""MagnitudeDirection over AdamW as a drop-in torch optimizer, tested the way torch tests its own optimizers.

The inputs are the ``OptimizerInfo`` inputs the installed torch ships for AdamW
(``torch.testing._internal.common_optimizers.optim_db``: default, non-default lr, weight decay, maximize, amsgrad —
all five); the properties are those torch's generic optimizer suite checks for every optimizer: the state dict's
layout and determinism, loading into a fresh optimizer and continuing equal, older state dicts, a ``weights_only``
save/load round trip, state-dict and step hooks (a global step hook once per step), deepcopy, a tensor lr, LR
schedulers, no-op steps, ``maximize``, and parameters built on the meta device. Each test runs plain AdamW
(``kind="adamw"``, the control) and MD(AdamW) (``kind="md"``) through the same code.
"""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import pytest
import torch

from torch_optim_db import common_optimizers
from weightgeom.optim import MagnitudeDirection

_ADAMW = next(o for o in common_optimizers.optim_db if o.optim_cls is torch.optim.AdamW)
INPUTS = _ADAMW.optim_inputs_func(device="cpu", dtype=torch.float32)
KINDS = ("adamw", "md")


def _ids(inputs) -> list[str]:
    return [i.desc.replace(" ", "-") for i in inputs]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _opt(kind: str, model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    base = torch.optim.AdamW(model.parameters(), **kwargs)
    return base if kind == "adamw" else MagnitudeDirection(base, model=model, gain_lr=0.05)


_X = torch.linspace(-1, 1, 24).reshape(6, 4)


def _loss(model: torch.nn.Module) -> torch.Tensor:
    return (model(_X) - 0.5).pow(2).sum()


def _train(opt: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        _loss(model).backward()
        opt.step()


def _same(a: Any, b: Any, where: str = "sd") -> None:
    """Bitwise equality of nested state (dicts, lists, tensors, numbers)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _params_equal(m1: torch.nn.Module, m2: torch.nn.Module) -> None:
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(a, b), n


def _primed(kind: str, kwargs: dict[str, Any], steps: int = 3):
    model = _model()
    opt = _opt(kind, model, kwargs)
    _train(opt, model, steps)
    return model, opt


def _fresh_copy(kind: str, model: torch.nn.Module, kwargs: dict[str, Any]):
    """Equal but not identical parameters, and a new optimizer over them."""
    model2 = copy.deepcopy(model)
    return model2, _opt(kind, model2, kwargs)


# ------------------------------------------------------------------------------------------------------- state dicts
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("inp", INPUTS, ids=_ids(INPUTS))
def test_state_dict_layout_load_and_determinism(kind, inp):
    model, opt = _primed(kind, inp.kwargs)
    sd = opt.state_dict()
    assert {"state", "param_groups"} <= set(sd)  # torch's layout, read by sd["state"] / sd["param_groups"] consumers
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    assert ids == list(range(len(list(model.parameters()))))  # the model's parameters, in order, nothing else
    assert set(sd["state"]) <= set(ids) and all(isinstance(v, dict) for v in sd["state"].values())
    assert sd["param_groups"][0]["lr"] == inp.kwargs.get("lr", 1e-3)
    saved, loaded = copy.deepcopy(sd), copy.deepcopy(sd)
    model2, opt2 = _fresh_copy(kind, model, inp.kwargs)
    opt2.load_state_dict(loaded)
    _same(saved, loaded)  # loading did not modify the state dict
    _same(opt.state_dict(), opt2.state_dict())  # deterministic with equal, not identical, parameters
    for _ in range(3):
        _train(opt, model, 1)
        _train(opt2, model2, 1)
        _params_equal(model, model2)
    _same(opt.state_dict(), opt2.state_dict())


def _older_md_part(md) -> dict:
    """MD's own part as the older layouts saved it under "md": options, names, per decoupled matrix (by position)
    its tensors and the gains' Adam state as ``gain_row_adam``/``gain_col_adam``, the gains group without params."""
    state = {}
    for i, p in enumerate(md._decoupled):
        st = md.state[p]
        entry = {k: st[k] for k in ("direction", "radius", "gain_row", "gain_col") if k in st}
        for key in ("gain_row", "gain_col"):
            if key in st and md.state.get(st[key]):
                entry[f"{key}_adam"] = dict(md.state[st[key]])
        state[i] = entry
    return {"options": {"gains": md.gains, "parameterization": md.parameterization, "sphere": md.sphere,
                        "embeddings": md.embeddings, "embedding_radius": md.embedding_radius},
            "names": md.decoupled_names, "unit_rows": md.unit_row_names, "state": state,
            "gain_group": {k: v for k, v in md.param_groups[-1].items() if k != "params"}}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("inp", INPUTS[:1] + INPUTS[3:4], ids=_ids(INPUTS[:1] + INPUTS[3:4]))
def test_older_state_dicts_load(kind, inp):
    """Groups saved before ``maximize``/``foreach``/``differentiable`` existed, a ``step`` saved as a number, and
    (MD) the two older layouts (MD's part under "md", beside the base's or nested with it): each loads and the
    optimizer continues as the original."""
    model, opt = _primed(kind, inp.kwargs)
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        for key in ("foreach", "differentiable", "fused", "capturable"):
            group.pop(key, None)
    for st in sd["state"].values():
        st["step"] = float(st["step"])
    variants = [sd]
    if kind == "md":  # the two layouts MD's state_dict() wrote before its state moved into torch's "state"
        base, own = copy.deepcopy((opt.base_optimizer.state_dict(), _older_md_part(opt)))
        variants += [{**base, "md": own}, {"base": base, "md": own}]
    for variant in variants:
        model2, opt2 = _fresh_copy(kind, model, inp.kwargs)
        opt2.load_state_dict(copy.deepcopy(variant))  # as torch's, the loaded state may share the dict's tensors
        m1, o1 = copy.deepcopy((model, opt))
        _train(o1, m1, 2)
        _train(opt2, model2, 2)
        _params_equal(m1, model2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("inp", INPUTS, ids=_ids(INPUTS))
def test_weights_only_save_load(kind, inp):
    model, opt = _primed(kind, inp.kwargs)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    model2, opt2 = _fresh_copy(kind, model, inp.kwargs)
    opt2.load_state_dict(loaded)
    _train(opt, model, 2)
    _train(opt2, model2, 2)
    _params_equal(model, model2)


# ------------------------------------------------------------------------------------------------------------- hooks
@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_hooks_run(kind):
    model, opt = _primed(kind, {})
    calls: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))

    def post(o, sd):
        calls.append("post")
        sd["param_groups"][0]["tag"] = "saved"
        return sd

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert calls == ["pre", "post"] and sd["param_groups"][0]["tag"] == "saved"
    del sd["param_groups"][0]["tag"]

    def load_pre(o, sd):
        calls.append("load-pre")
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = 0.0123  # what the pre-hook returns is what gets loaded
        return sd

    seen = []
    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: seen.append(o.param_groups[0]["lr"]))
    opt.load_state_dict(sd)
    assert calls[-1] == "load-pre" and seen == [0.0123]


@pytest.mark.parametrize("kind", KINDS)
def test_step_hooks_fire_once_per_step(kind):
    """torch's order — global pre (0), the optimizer's pre (1), its post (2), global post (5) — once per step: MD's
    inner base step does not fire the global hooks again; hooks registered on the base still run, once."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model = _model()
    opt = _opt(kind, model, {})
    data: list[int] = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: data.append(0)),
               register_optimizer_step_post_hook(lambda o, a, k: data.append(5)),
               opt.register_step_pre_hook(lambda o, a, k: data.append(1)),
               opt.register_step_post_hook(lambda o, a, k: data.append(2))]
    if kind == "md":
        handles += [opt.base_optimizer.register_step_pre_hook(lambda o, a, k: data.append(3)),
                    opt.base_optimizer.register_step_post_hook(lambda o, a, k: data.append(4))]
    try:
        _train(opt, model, 1)
        assert data == ([0, 1, 3, 4, 2, 5] if kind == "md" else [0, 1, 2, 5])
        for h in handles[2:]:
            h.remove()
        _train(opt, model, 1)
        assert data[-2:] == [0, 5]
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------------------------------- the step itself
@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy(kind):
    model, opt = _primed(kind, {"lr": 0.01})
    m2, o2 = copy.deepcopy((model, opt))
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public == {k for k in vars(o2) if not k.startswith("_")}
    _train(opt, model, 2)
    _train(o2, m2, 2)
    _params_equal(model, m2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("inp", INPUTS, ids=_ids(INPUTS))
def test_tensor_lr(kind, inp):
    """A 0-dim tensor lr trains as the same float lr does."""
    kwargs = dict(inp.kwargs)
    lr = kwargs.pop("lr", 1e-3)
    m1, m2 = _model(), _model()
    o1, o2 = _opt(kind, m1, {**kwargs, "lr": lr}), _opt(kind, m2, {**kwargs, "lr": torch.tensor(lr)})
    _train(o1, m1, 3)
    _train(o2, m2, 3)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", KINDS)
def test_scheduler_over_the_optimizer(kind):
    """An LR scheduler built on the optimizer schedules every group (MD: the base's and the gains'), warns of
    nothing (no 'lr_scheduler.step() before optimizer.step()'), and its state round-trips with the optimizer's."""
    model = _model()
    opt = _opt(kind, model, {"lr": 0.01})
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            _train(opt, model, 1)
            sched.step()
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs[0] == pytest.approx(0.0025)
    if kind == "md":
        assert lrs[-1] == pytest.approx(0.05 / 4)  # the gains group, scheduled too
    model2, opt2 = _fresh_copy(kind, model, {"lr": 0.01})
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    sched2.load_state_dict(sched.state_dict())
    for _ in range(3):
        for o, m, s in ((opt, model, sched), (opt2, model2, sched2)):
            _train(o, m, 1)
            s.step()
    _params_equal(model, model2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("inp", INPUTS, ids=_ids(INPUTS))
def test_step_without_gradients_is_a_noop(kind, inp):
    model, opt = _primed(kind, inp.kwargs)
    before = copy.deepcopy((list(model.parameters()), opt.state_dict()))
    opt.zero_grad(set_to_none=True)
    opt.step()
    _same(before, (list(model.parameters()), opt.state_dict()))


@pytest.mark.parametrize("kind", KINDS)
def test_maximize_goes_up(kind):
    """``maximize=True`` on the base: the loss rises as under AdamW(maximize); the gains ascend too — their first
    step is exactly the negative of the minimizing one (Adam's first step is odd in the gradient)."""
    inp = next(i for i in INPUTS if i.kwargs.get("maximize"))
    model = _model()
    opt = _opt(kind, model, inp.kwargs)
    with torch.no_grad():
        l0 = float(_loss(model))
    _train(opt, model, 5)
    with torch.no_grad():
        assert float(_loss(model)) > l0
    if kind == "md":
        ups, downs = _model(), _model()
        up, down = _opt("md", ups, {"maximize": True}), _opt("md", downs, {})
        theta0 = up.state[ups[0].weight]["gain_row"].clone()
        _train(up, ups, 1)
        _train(down, downs, 1)
        delta_up = up.state[ups[0].weight]["gain_row"] - theta0
        delta_down = down.state[downs[0].weight]["gain_row"] - theta0
        assert delta_up.abs().max() > 0
        torch.testing.assert_close(delta_up, -delta_down, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_built_over_meta_parameters(kind):
    """Deferred initialisation: the optimizer is built over meta-device parameters, the model then gets its values
    (``to_empty`` keeping the parameter objects, then an init); it trains as one built over the initialised model."""
    with torch.device("meta"):
        model = _model()
    opt = _opt(kind, model, {"lr": 0.01})
    if kind == "md":
        with pytest.raises(ValueError, match=r"'0\.weight' is still on the meta device; .*nothing was changed"):
            opt.step()
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    ref = _model()
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(q)
    ref_opt = _opt(kind, ref, {"lr": 0.01})
    _train(opt, model, 3)
    _train(ref_opt, ref, 3)
    _params_equal(model, ref)
