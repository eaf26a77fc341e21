"""Magnitude–direction decoupling (the MD paper): chain rule vs autograd, reduction to the projected base optimizer,
sphere invariants, checkpoints, every option combination, torch.optim citizenship and bad input."""

from __future__ import annotations

import copy
import io
import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hostile_cases.optim import assert_unchanged, snapshot
from weightgeom.optim.functional import NonFiniteGradientError
from weightgeom.optim.magnitude_direction import (
    GAINS,
    PARAMETERIZATIONS,
    SPHERES,
    MagnitudeDirection,
    compose,
    gain_chain,
    gain_chain_log,
    gain_init,
    gain_value,
    sphere_norm,
    split_gradient,
    split_gradient_log,
)
from weightgeom.optim.md_functional import GAIN_MAX, GAIN_MIN

# float64 chain rule vs autograd: the two compute the same sums in a different order; measured max |diff| ≈ 4e-16 on
# these sizes, so 1e-12 leaves three orders of margin while still catching any missing factor.
GRAD_TOL = 1e-12
# float64 trajectories that should be identical up to summation order (measured: bitwise equal with AdamW).
TRAJ_TOL = 1e-12
# float32 sphere invariant after 200 large steps: one rescale per step leaves ‖Ŵ‖/c − 1 at rounding level;
# measured ≤ 2e-7, tolerance 1e-5.
SPHERE_TOL = 1e-5


def _gain_shapes(gains, m, n):
    return {"row+col": ((m, 1), (1, n)), "row": ((m, 1), None), "col": (None, (1, n)), "scalar": ((1, 1), None),
            "none": (None, None)}[gains]


def _mlp(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _batch(dtype=torch.float64, n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=dtype)
    y = torch.sin(x[:, :3] * 2.0) + 0.5 * x[:, 3:]
    return x, y


def _loss(model, x, y):
    return F.mse_loss(model(x), y)


# ---------------------------------------------------------------------------------------------------------- pure maths
@pytest.mark.parametrize("gains", GAINS)
@pytest.mark.parametrize("param", PARAMETERIZATIONS)
def test_split_gradient_matches_autograd(gains, param):
    torch.manual_seed(3)
    m, n = 5, 7
    D = torch.randn(m, n, dtype=torch.float64, requires_grad=True)
    X = torch.randn(n, 4, dtype=torch.float64)
    shapes = _gain_shapes(gains, m, n)
    thetas = [None if s is None else (gain_init(s, param, torch.float64) + 0.3 * torch.randn(s, dtype=torch.float64))
              .requires_grad_() for s in shapes]
    gammas = [None if t is None else gain_value(t, param) for t in thetas]
    W = compose(D, *gammas)
    loss = torch.sin(W @ X).pow(2).sum()
    G, = torch.autograd.grad(loss, W, retain_graph=True)
    leaves = [D, *[t for t in thetas if t is not None]]
    auto = torch.autograd.grad(loss, leaves)
    g_row, g_col, Gd = split_gradient(G, D.detach(), *[None if g is None else g.detach() for g in gammas])
    assert torch.allclose(Gd, auto[0], atol=GRAD_TOL, rtol=0)
    mine = []
    for t, g in zip(thetas, (g_row, g_col)):
        if t is not None:
            mine.append(gain_chain(t.detach(), g, param))
    for a, b in zip(auto[1:], mine):
        assert torch.allclose(a, b, atol=GRAD_TOL, rtol=0)
    # the log-gain form used by the wrapper for softplus/exp gives the same numbers
    s_row, s_col, Gd2 = split_gradient_log(G, D.detach(), *[None if g is None else g.detach() for g in gammas])
    assert torch.allclose(Gd2, auto[0], atol=GRAD_TOL, rtol=0)
    mine = [gain_chain_log(t.detach(), s, param) for t, s in zip(thetas, (s_row, s_col)) if t is not None]
    for a, b in zip(auto[1:], mine):
        assert torch.allclose(a, b, atol=GRAD_TOL, rtol=0)


@pytest.mark.parametrize("param", PARAMETERIZATIONS)
def test_gain_init_is_exactly_one(param):
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(gain_value(gain_init((4,), param, dtype), param), torch.ones(4, dtype=dtype))


# ------------------------------------------------------------------------------ wrapper vs explicit reparameterisation
class RecordingSGD(torch.optim.SGD):
    """SGD that records what it was handed (p.data, p.grad) at each step."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.records = []

    def step(self, closure=None):
        self.records.append({p: (p.detach().clone(), p.grad.clone()) for g in self.param_groups for p in g["params"]
                             if p.grad is not None})
        return super().step(closure)


class Reparam(nn.Module):
    """Explicit W = diag(φ(θ_r)) Ŵ diag(φ(θ_c)) for every Linear of an MLP (autograd reference)."""

    def __init__(self, model, md):
        super().__init__()
        self.model = model
        self.md = md
        self.leaves = {}
        for lin in (m for m in model if isinstance(m, nn.Linear)):
            st = md.state[lin.weight]
            D = st["direction"].clone().requires_grad_()
            tr = st["gain_row"].clone().requires_grad_() if "gain_row" in st else None
            tc = st["gain_col"].clone().requires_grad_() if "gain_col" in st else None
            self.leaves[lin.weight] = (D, tr, tc)

    def forward(self, x):
        h = x
        for mod in self.model:
            if isinstance(mod, nn.Linear):
                D, tr, tc = self.leaves[mod.weight]
                gr = None if tr is None else gain_value(tr, self.md.parameterization).reshape(-1, 1)
                gc = None if tc is None else gain_value(tc, self.md.parameterization).reshape(1, -1)
                h = F.linear(h, compose(D, gr, gc), mod.bias)
            else:
                h = mod(h)
        return h


@pytest.mark.parametrize("gains,param", [("row+col", "softplus"), ("scalar", "exp"), ("col", "direct"),
                                         ("row", "softplus")])
def test_wrapper_gradients_match_explicit_reparameterisation(gains, param):
    model = _mlp()
    base = RecordingSGD(model.parameters(), lr=0.05)
    md = MagnitudeDirection(base, gains=gains, parameterization=param, gain_lr=0.05, model=model)
    x, y = _batch()
    for _ in range(4):  # later steps have non-trivial gains and directions
        ref = Reparam(model, md)
        ref_loss = _loss(ref, x, y)
        ref_loss.backward()
        md.zero_grad()
        loss = _loss(model, x, y)
        assert torch.allclose(loss, ref_loss, atol=GRAD_TOL, rtol=0)
        loss.backward()
        md.step()
        rec = base.records[-1]
        for w, (D, tr, tc) in ref.leaves.items():
            seen_data, seen_grad = rec[w]
            assert torch.allclose(seen_data, D.detach(), atol=GRAD_TOL, rtol=0)  # the base stepped Ŵ
            assert torch.allclose(seen_grad, D.grad, atol=GRAD_TOL, rtol=0)  # ... with ∂L/∂Ŵ
            st = md.state[w]
            for key, t in (("gain_row", tr), ("gain_col", tc)):
                if t is not None:
                    assert torch.allclose(st[key].grad, t.grad, atol=GRAD_TOL, rtol=0)
        for lin in (m for m in model if isinstance(m, nn.Linear)):
            assert lin.weight.grad is not None  # the model's own gradient is restored after the step


# ------------------------------------------------------------------------ reduction to the projected base optimizer
def _project_ref(W, c, sphere):
    if sphere == "frobenius":
        return W * (c / W.norm())
    dim = 1 if sphere == "row" else 0
    return W * (c / W.norm(dim=dim, keepdim=True))


@pytest.mark.parametrize("sphere", SPHERES)
def test_gain_lr_zero_equals_projected_adamw(sphere):
    model = _mlp()
    ref = copy.deepcopy(model)
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0), sphere=sphere,
                            gain_lr=0.0, model=model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-2, weight_decay=0.0)
    mats = [(a.weight, b.weight) for a, b in zip(model, ref) if isinstance(a, nn.Linear)]
    radii = [sphere_norm(w.detach(), sphere) for _, w in mats]
    x, y = _batch()
    for _ in range(15):
        for opt, mod in ((md, model), (ref_opt, ref)):
            opt.zero_grad()
            _loss(mod, x, y).backward()
            opt.step()
        with torch.no_grad():
            for (_, w), c in zip(mats, radii):
                w.copy_(_project_ref(w, c, sphere))
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(a, b, atol=TRAJ_TOL, rtol=0)
        for w, _ in mats:
            assert torch.allclose(md.direction(w), w)  # γ = 1: Ŵ is W


# ---------------------------------------------------------------------------------------------------- sphere invariant
@pytest.mark.parametrize("sphere", SPHERES)
def test_direction_stays_on_sphere(sphere):
    model = _mlp(torch.float32)
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=5e-2), sphere=sphere, gain_lr=5e-2,
                            model=model)
    mats = [m.weight for m in model if isinstance(m, nn.Linear)]
    r0 = [sphere_norm(w.detach(), sphere) for w in mats]
    x, y = _batch(torch.float32)
    for _ in range(200):
        md.zero_grad()
        _loss(model, x, y).backward()
        md.step()
    for w, r in zip(mats, r0):
        D = md.direction(w)
        assert torch.allclose(sphere_norm(D, sphere), r, rtol=SPHERE_TOL, atol=0)
        assert torch.equal(compose(D, *md.gain_values(w)), w.detach())  # the model sees γ_r Ŵ γ_c exactly
        gr, gc = md.gain_values(w)
        assert not torch.equal(gr, torch.ones_like(gr))  # gains did move


# --------------------------------------------------------------------------------------------------------- checkpoints
def _run(model, md, sched, x, y, steps):
    for _ in range(steps):
        md.zero_grad()
        _loss(model, x, y).backward()
        md.step()
        sched.step()


def _make(seed=0, dtype=torch.float32):
    model = _mlp(dtype, seed)
    base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    md = MagnitudeDirection(base, gain_lr=3e-2, model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(md, lambda s: 1.0 / (1 + 0.1 * s))
    return model, md, sched


@pytest.mark.parametrize("model_first", [True, False])
def test_checkpoint_round_trip_continues_identically(model_first):
    x, y = _batch(torch.float32)
    model, md, sched = _make()
    _run(model, md, sched, x, y, 5)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": md.state_dict(), "sched": sched.state_dict()}, buf)
    _run(model, md, sched, x, y, 5)

    model2, md2, sched2 = _make(seed=123)  # different init: everything must come from the checkpoint
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    if model_first:
        model2.load_state_dict(ck["model"])
        md2.load_state_dict(ck["opt"])
    else:
        md2.load_state_dict(ck["opt"])
        model2.load_state_dict(ck["model"])
    sched2.load_state_dict(ck["sched"])
    _run(model2, md2, sched2, x, y, 5)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for g1, g2 in zip(md.param_groups, md2.param_groups):
        assert g1["lr"] == g2["lr"]
    for w1, w2 in zip(md._decoupled, md2._decoupled):
        for key in ("direction", "radius", "gain_row", "gain_col"):
            assert torch.equal(md.state[w1][key], md2.state[w2][key])


def test_state_dict_contents_and_mismatch():
    model, md, _ = _make()
    sd = md.state_dict()
    assert set(sd) == {"state", "param_groups"}  # torch's layout: MD's state in it
    *base_groups, gains = sd["param_groups"]
    assert base_groups == md.base_optimizer.state_dict()["param_groups"]
    assert gains["params"] == [] and gains["md_role"] == "gains" and gains["md_options"]["gains"] == "row+col"
    ids = [i for g in base_groups for i in g["params"]]
    decoupled = [i for i, q in zip(ids, (q for g in md.base_optimizer.param_groups for q in g["params"]))
                 if any(q is p for p in md._decoupled)]
    assert decoupled and all({"md.direction", "md.radius", "md.gain_row", "md.gain_col"} <= set(sd["state"][i])
                             for i in decoupled)
    assert not any(k.startswith("md.") for i in set(ids) - set(decoupled) for k in sd["state"].get(i, {}))
    other = MagnitudeDirection(torch.optim.AdamW(_mlp(torch.float32).parameters()), gains="row")
    with pytest.raises(ValueError, match="gains"):
        other.load_state_dict(sd)
    with pytest.raises(ValueError, match="expected a MagnitudeDirection.state_dict"):
        md.load_state_dict(md.base_optimizer.state_dict())


# ---------------------------------------------------------------------------------------------- every option trains
def test_every_option_combination_trains():
    torch.manual_seed(0)
    x, y = _batch(torch.float32, n=64)
    failures = []
    for gains, param, sphere in itertools.product(GAINS, PARAMETERIZATIONS, SPHERES):
        model = _mlp(torch.float32)
        md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=3e-2), gains=gains, parameterization=param,
                                sphere=sphere, gain_lr=3e-2, model=model)
        with torch.no_grad():
            l0 = _loss(model, x, y).item()
        for _ in range(20):
            md.zero_grad()
            loss = _loss(model, x, y)
            loss.backward()
            md.step()
        l1 = _loss(model, x, y).item()
        if not (math.isfinite(l1) and l1 < 0.7 * l0):
            failures.append((gains, param, sphere, l0, l1))
    assert not failures, failures


class TinyLM(nn.Module):
    def __init__(self, vocab=16, d=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        return self.lm_head(self.ln(torch.tanh(self.fc(self.wte(idx)))))


@pytest.mark.parametrize("embeddings", ["exclude", "unit_rows", "decouple"])
def test_embeddings_modes(embeddings):
    model = TinyLM()
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=3e-2), embeddings=embeddings, model=model,
                            gain_lr=1e-2)
    expect = {"exclude": ["fc.weight", "lm_head.weight"], "unit_rows": ["fc.weight", "lm_head.weight"],
              "decouple": ["wte.weight", "fc.weight", "lm_head.weight"]}[embeddings]
    assert md.decoupled_names == expect
    assert md.unit_row_names == (["wte.weight"] if embeddings == "unit_rows" else [])
    idx = torch.randint(0, 16, (64,))
    losses = []
    for _ in range(25):
        md.zero_grad()
        loss = F.cross_entropy(model(idx), idx)
        loss.backward()
        md.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    if embeddings == "unit_rows":
        norms = model.wte.weight.norm(dim=1)
        assert torch.allclose(norms, torch.ones_like(norms), atol=1e-6)


def test_names_from_param_names_and_explicit_selection():
    model = TinyLM()
    base = torch.optim.AdamW(model.named_parameters(), lr=1e-2)  # torch ≥ 2.6: groups carry "param_names"
    md = MagnitudeDirection(base)  # no model: embeddings recognised by name
    assert md.decoupled_names == ["fc.weight", "lm_head.weight"]
    md2 = MagnitudeDirection(torch.optim.AdamW(model.parameters()), params=["wte.*", model.fc.weight], model=model)
    assert md2.decoupled_names == ["wte.weight", "fc.weight"]
    md3 = MagnitudeDirection(torch.optim.AdamW(model.parameters()), exclude=["lm_head.*"], model=model)
    assert md3.decoupled_names == ["fc.weight"]


# ------------------------------------------------------------------------------------------ torch.optim citizenship
def test_weight_decay_is_overridden_on_decoupled_params_only():
    model = TinyLM()
    base = torch.optim.AdamW([{"params": [model.fc.weight, model.fc.bias], "weight_decay": 0.1},
                              {"params": [model.lm_head.weight], "weight_decay": 0.2},
                              {"params": [model.wte.weight, *model.ln.parameters()], "weight_decay": 0.0}], lr=1e-2)
    md = MagnitudeDirection(base, model=model)
    assert sorted(md.weight_decay_overridden) == ["fc.weight", "lm_head.weight"]
    wd = {id(p): g["weight_decay"] for g in base.param_groups for p in g["params"]}
    assert wd[id(model.fc.weight)] == 0.0 and wd[id(model.lm_head.weight)] == 0.0
    assert wd[id(model.fc.bias)] == 0.1  # split off into its own group, decay kept
    assert len(base.param_groups) == 4
    assert base.param_groups[-1]["lr"] == 1e-2


def test_param_groups_schedulers_and_zero_grad():
    model, md, _ = _make()
    groups = md.param_groups
    assert groups[-1]["md_role"] == "gains" and groups[-1]["lr"] == 3e-2
    assert all(g is h for g, h in zip(groups, md.base_optimizer.param_groups))
    assert groups[-1]["params"] == []  # the gains θ are not model parameters: they live in ``state``
    thetas = [md.state[p][k] for p in md._decoupled for k in ("gain_row", "gain_col")]
    assert len(thetas) == 6  # 3 matrices × (row, col)
    sched = torch.optim.lr_scheduler.LambdaLR(md, [lambda s: 0.5] * (len(groups) - 1) + [lambda s: 0.1])
    x, y = _batch(torch.float32)
    _loss(model, x, y).backward()
    md.step()
    sched.step()
    assert [g["lr"] for g in md.param_groups] == pytest.approx([5e-3] * (len(groups) - 1) + [3e-3])
    assert all(t.grad is not None for t in thetas)  # ∂L/∂θ of the step, for inspection
    md.zero_grad()
    assert all(p.grad is None for g in md.param_groups for p in g["params"])
    # the groups stay live after the base optimizer replaces its group dicts (load_state_dict)
    md.base_optimizer.load_state_dict(md.base_optimizer.state_dict())
    assert md.param_groups[0] is md.base_optimizer.param_groups[0]


def test_closure_and_params_without_grad():
    model = _mlp(torch.float32)
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
    x, y = _batch(torch.float32)
    w_last = model[4].weight.detach().clone()

    def closure():
        md.zero_grad()
        loss = F.mse_loss(model[:4](x), y[:, :1].expand(-1, 5))  # last layer gets no gradient
        loss.backward()
        return loss

    loss = md.step(closure)
    assert torch.is_tensor(loss)
    assert torch.equal(model[4].weight, w_last)


def test_external_change_of_w_is_adopted():
    model = _mlp(torch.float32)
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), gain_lr=1e-2, model=model)
    x, y = _batch(torch.float32)
    for _ in range(3):
        md.zero_grad()
        _loss(model, x, y).backward()
        md.step()
    w = model[0].weight
    r0 = md.state[w]["radius"].clone()
    with torch.no_grad():
        w.mul_(2.0)  # e.g. a user re-scales or reloads weights
    md.zero_grad()
    _loss(model, x, y).backward()
    md.step()
    assert torch.allclose(md.state[w]["radius"], 2 * r0, rtol=1e-5)


class StiefelSGD(torch.optim.Optimizer):
    """Test stand-in for a manifold-Muon group: Riemannian SGD + polar retraction; group key manifold='stiefel'."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr, "manifold": "stiefel"})

    @torch.no_grad()
    def step(self, closure=None):
        from weightgeom.manifolds import get

        for g in self.param_groups:
            M = get(g["manifold"])
            for p in g["params"]:
                if p.grad is not None:
                    p.copy_(M.retract(p - g["lr"] * M.proj_tangent(M.retract(p), p.grad)))


def test_norm_fixing_manifold_group_is_stepped_on_scaled_point():
    from weightgeom.manifolds import get

    torch.manual_seed(0)
    lin = nn.Linear(6, 10, bias=False).double()
    md = MagnitudeDirection(StiefelSGD(lin.parameters(), lr=0.1), gain_lr=1e-2, model=lin)
    c = lin.weight.detach().norm()
    x = torch.randn(16, 6, dtype=torch.float64)
    for _ in range(5):
        md.zero_grad()
        lin(x).pow(2).mean().backward()
        md.step()
    D = md.direction(lin.weight)
    assert torch.allclose(D.norm(), c, rtol=1e-12)
    assert get("stiefel").check(D / (c / math.sqrt(6)), tol=1e-10)
    with pytest.raises(ValueError, match="sphere='frobenius'"):
        MagnitudeDirection(StiefelSGD(nn.Linear(4, 5).parameters(), lr=0.1), sphere="row")


# --------------------------------------------------------------------------------------------------------- bad input
def test_bad_input_names_the_parameter():
    model = TinyLM()
    with pytest.raises(ValueError, match=r"'fc\.bias'.*only 2-D"):
        MagnitudeDirection(torch.optim.AdamW(model.parameters()), params=["fc.bias"], model=model)
    with torch.no_grad():
        model.fc.weight.zero_()
    with pytest.raises(ValueError, match=r"'fc\.weight' has zero norm"):
        MagnitudeDirection(torch.optim.AdamW(model.parameters()), model=model)
    model = TinyLM()
    with torch.no_grad():
        model.fc.weight[2].zero_()
    with pytest.raises(ValueError, match=r"'fc\.weight' has a zero row"):
        MagnitudeDirection(torch.optim.AdamW(model.parameters()), sphere="row", model=model)
    base = torch.optim.AdamW(model.parameters())
    for kw, msg in [({"gains": "both"}, "gains"), ({"parameterization": "relu"}, "parameterization"),
                    ({"sphere": "spectral"}, "sphere"), ({"embeddings": "yes"}, "embeddings"),
                    ({"gain_lr": -1.0}, "gain_lr"), ({"params": ["nope"]}, "nope"),
                    ({"params": [torch.zeros(3, 3)]}, "not a parameter")]:
        with pytest.raises(ValueError, match=msg):
            MagnitudeDirection(base, model=model, **kw)
    with pytest.raises(TypeError):
        MagnitudeDirection(MagnitudeDirection(torch.optim.AdamW(TinyLM().parameters())))
    with pytest.raises(TypeError):
        MagnitudeDirection(object())


# --------------------------------------------------------------------------------------- a step is all or nothing
def _fused_or_skip(fused):
    from weightgeom import kernels

    if fused and kernels.load_kernel("md_adam") is None:
        pytest.skip(f"md kernel unavailable: {kernels.unavailable_reason('md_adam')}")


def _md32(fused, seed=0, gain_lr=5e-2, **kw):
    model = _mlp(torch.float32, seed)
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), gain_lr=gain_lr, model=model,
                            fused=fused, **kw)
    return model, md


def _steps(model, md, n, seed=1, poison=None):
    x, y = _batch(torch.float32, seed=seed)
    for _ in range(n):
        md.zero_grad()
        _loss(model, x, y).backward()
        if poison is not None:
            poison()
        md.step()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("which", ["4.weight", "0.weight", "4.bias"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_refused_without_a_trace(fused, which, bad):
    """NaN/Inf in any gradient (the last or first decoupled matrix, or a bias MD leaves to the base): refused naming
    the parameter, W / Ŵ / gains / their Adam state / the base AdamW state bit-identical, and the next good step is
    exactly the step of an optimizer that never saw the bad one."""
    _fused_or_skip(fused)
    (model, md), (ref, ref_md) = _md32(fused), _md32(fused)
    for mod, opt in ((model, md), (ref, ref_md)):
        _steps(mod, opt, 2)
    assert set(md._path.values()) == {"fused" if fused else "eager (fused=False)"}
    param = dict(model.named_parameters())[which]
    before = snapshot(md, model)
    with pytest.raises(NonFiniteGradientError, match=rf"'{which}' \(shape .*\) contains NaN/Inf; step refused"):
        _steps(model, md, 1, seed=2, poison=lambda: param.grad.view(-1).__setitem__(-1, bad))
    assert_unchanged(before, snapshot(md, model))
    for mod, opt in ((model, md), (ref, ref_md)):
        _steps(mod, opt, 1, seed=3)
    assert_unchanged(snapshot(ref_md, ref), snapshot(md, model))


def test_gain_value_is_clamped_away_from_zero_and_infinity():
    theta = torch.tensor([-1000.0, -92.0, -69.0, 0.0, 1000.0])
    for param in ("softplus", "exp"):
        g = gain_value(theta, param)
        assert float(g.min()) == pytest.approx(GAIN_MIN) and bool(torch.isfinite(g).all())
        assert float(g.max()) == pytest.approx(GAIN_MAX if param == "exp" else 1000.0)
    direct = gain_value(torch.tensor([0.0, 1e-30, -1e-40, -0.5, 3.0, -1e9]), "direct")
    expected = torch.tensor([GAIN_MIN, GAIN_MIN, -GAIN_MIN, -0.5, 3.0, -GAIN_MAX])
    assert torch.equal(direct, expected)


def _theta_for(value, param):
    if param == "direct":
        return value
    if value == 0.0:
        return -1000.0  # φ(θ) underflows to exactly 0
    return math.log(math.expm1(value)) if param == "softplus" else math.log(value)


@pytest.mark.parametrize("fused,param", [(False, p) for p in PARAMETERIZATIONS] + [(True, "softplus"), (True, "exp")])
@pytest.mark.parametrize("value", [1e-30, 0.0, 1e-40])  # 1e-40: subnormal in float32
def test_tiny_gains_never_make_w_nonfinite(fused, param, value):
    """Gains driven to 1e-30, 0 or a subnormal: W stays finite and equal to γ_r Ŵ γ_c with γ ≥ GAIN_MIN — after
    steps, after an outside edit of W (Ŵ re-derived as W/γ), and after a checkpoint load whose W differs."""
    _fused_or_skip(fused)
    # direct gains: frozen, or one Adam step (≈ gain_lr) would carry θ = 1e-30 far from 0 at once
    gain_lr = 0.0 if param == "direct" else 5e-2
    model, md = _md32(fused, parameterization=param, gain_lr=gain_lr)
    _steps(model, md, 1)

    def consistent(opt, mod):
        for w in opt._decoupled:
            gr, gc = opt.gain_values(w)
            assert bool(torch.isfinite(w).all()), f"{opt._name[w]}: {int((~torch.isfinite(w)).sum())} NaN/Inf"
            assert min(float(gr.abs().min()), float(gc.abs().min())) >= GAIN_MIN * (1 - 1e-6)
            torch.testing.assert_close(w.detach(), compose(opt.direction(w), gr, gc), rtol=1e-5, atol=0)

    with torch.no_grad():
        for w in md._decoupled:
            md.state[w]["gain_row"].fill_(_theta_for(value, param))
        md.state[md._decoupled[-1]]["gain_col"].fill_(_theta_for(value, param))
    _steps(model, md, 2)
    consistent(md, model)
    with torch.no_grad():
        model[2].weight.mul_(1.5)  # outside edit → Ŵ = W / γ_r / γ_c at the next step
    _steps(model, md, 2)
    consistent(md, model)
    if fused:
        assert set(md._path.values()) == {"fused"}
    saved = copy.deepcopy(md.state_dict())
    model2, md2 = _md32(fused, seed=5, parameterization=param, gain_lr=gain_lr)  # W differs from the checkpoint's
    md2.load_state_dict(saved)
    _steps(model2, md2, 2)
    consistent(md2, model2)


def test_load_state_dict_refuses_what_cannot_give_a_finite_w():
    model, md = _md32(False)
    _steps(model, md, 2)
    good = copy.deepcopy(md.state_dict())
    other_model, other = _md32(False, seed=4)
    _steps(other_model, other, 1)
    nonfinite = "holds 1 NaN/Inf value\\(s\\) of \\d+;.*"
    pids = [i for g in good["param_groups"][:-1] for i in g["params"]]
    second = pids[next(i for i, q in enumerate(q for g in md.base_optimizer.param_groups for q in g["params"])
                       if q is md._decoupled[1])]
    for key, value, msg in [("md.gain_col", float("nan"), f"state 'md.gain_col' {nonfinite}"),
                            ("md.gain_row", float("-inf"), f"state 'md.gain_row' {nonfinite}"),
                            ("md.direction", float("inf"), f"state 'md.direction' {nonfinite}"),
                            ("md.gain_row.exp_avg", float("nan"), f"state 'md.gain_row.exp_avg' {nonfinite}"),
                            ("md.gain_col.exp_avg_sq", float("inf"), f"state 'md.gain_col.exp_avg_sq' {nonfinite}"),
                            ("md.radius", 0.0, "radius must be > 0; ")]:
        bad = copy.deepcopy(good)
        bad["state"][second][key].view(-1)[0] = value
        before = snapshot(other, other_model)
        with pytest.raises(ValueError, match=rf"checkpoint entry '2\.weight'.? {msg}nothing was loaded"):
            other.load_state_dict(bad)
        assert_unchanged(before, snapshot(other, other_model))


@pytest.mark.parametrize("edit,msg", [
    ("nan", "'2\\.weight' was changed outside the optimizer and now holds NaN/Inf"),
    ("zero", "'2\\.weight' was changed outside the optimizer and now has zero norm"),
    ("huge", "cannot re-derive the direction of '2\\.weight' from its changed weight: W / gains overflows "
             "torch.float32 \\(smallest gain 1e-06\\)"),
])
def test_outside_edit_without_a_direction_is_refused_without_a_trace(edit, msg):
    model, md = _md32(False)
    _steps(model, md, 2)
    with torch.no_grad():
        if edit == "nan":
            model[2].weight[1, 1] = float("nan")
        elif edit == "zero":
            model[2].weight.zero_()
        else:  # finite, but W / γ_r / γ_c with gains at the floor (1e-6 each) exceeds float32
            md.state[model[2].weight]["gain_row"].fill_(-1000.0)
            model[2].weight.fill_(1e33)  # / 1e-6 = 1e39 > float32's max (1e30 re-derives: its norm is summed in f64)
    for q in model.parameters():  # finite gradients (a backward through a NaN weight would poison them all)
        q.grad = torch.full_like(q, 0.1)
    before = snapshot(md, model)
    with pytest.raises(ValueError, match=rf"{msg}.*; step refused, nothing was changed"):
        md.step()
    assert_unchanged(before, snapshot(md, model))


# ------------------------------------------------------------------------------------------------ Muon / manifold Muon
def _muon_groups(model):
    mats = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    rest = [(n, p) for n, p in model.named_parameters() if p.ndim != 2]
    return [{"params": [p for _, p in mats], "names": [n for n, _ in mats]},
            {"params": [p for _, p in rest], "names": [n for n, _ in rest], "algorithm": "adamw", "lr": 1e-2}]


def test_gain_lr_zero_equals_projected_muon():
    from weightgeom.optim import Muon

    model = _mlp()
    ref = copy.deepcopy(model)
    md = MagnitudeDirection(Muon(_muon_groups(model), lr=0.05), gain_lr=0.0, model=model)
    ref_opt = Muon(_muon_groups(ref), lr=0.05)
    mats = [m.weight for m in ref if isinstance(m, nn.Linear)]
    radii = [w.detach().norm() for w in mats]
    x, y = _batch()
    for _ in range(8):
        for opt, mod in ((md, model), (ref_opt, ref)):
            opt.zero_grad()
            _loss(mod, x, y).backward()
            opt.step()
        with torch.no_grad():
            for w, c in zip(mats, radii):
                w.mul_(c / w.norm())
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(a, b, atol=TRAJ_TOL, rtol=0)


# Manifold points after Muon's polar-express retraction in float64 are accurate to ~1e-9 (measured); the sphere is
# exact to rounding.
MANIFOLD_TOL = 1e-6


@pytest.mark.parametrize("manifold,split", [("stiefel", None), ("stiefel", 3), ("oblique", None), ("dgram", None)])
def test_manifold_muon_groups_under_md(manifold, split):
    from weightgeom.manifolds import get
    from weightgeom.optim import Muon

    torch.manual_seed(0)
    lin = nn.Linear(8, 12, bias=False).double()  # (12, 8): split=3 → three (4, 8) blocks
    c = lin.weight.detach().norm()
    base = Muon([{"params": [lin.weight], "names": ["w"], "manifold": manifold, "split": split}], lr=0.05)
    md = MagnitudeDirection(base, gain_lr=1e-2, model=lin)
    x = torch.randn(16, 8, dtype=torch.float64)
    for _ in range(4):
        md.zero_grad()
        (lin(x) - 1).pow(2).mean().backward()
        md.step()
    D = md.direction(lin.weight)
    assert torch.allclose(D.norm(), c, rtol=1e-12)
    M = get(manifold)
    blocks = D.unflatten(0, (split, -1)) if split else D
    if manifold == "dgram":  # scale-invariant: Ŵ itself is on DGram ∩ sphere
        assert M.check(blocks, tol=MANIFOLD_TOL)
    else:  # norm-fixing: Ŵ = s·Q, κ² = Σ_blocks min(rows, cols)
        kappa = math.sqrt((split or 1) * min(blocks.shape[-2:]))
        assert M.check(blocks / (c / kappa), tol=MANIFOLD_TOL)
    assert torch.equal(compose(D, *md.gain_values(lin.weight)), lin.weight.detach())


class RebindingSGD(torch.optim.Optimizer):
    """A base optimizer that rebinds ``p.data`` instead of writing in place (the wrapper must still see the step)."""

    def __init__(self, params, lr, fail=False):
        super().__init__(params, {"lr": lr})
        self.fail = fail

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data = p.data - g["lr"] * p.grad
        if self.fail:
            raise RuntimeError("base failed")


def test_base_that_rebinds_data_and_failing_base():
    model = _mlp()
    ref = copy.deepcopy(model)
    md = MagnitudeDirection(RebindingSGD(model.parameters(), lr=0.1), gain_lr=0.0, model=model)
    ref_md = MagnitudeDirection(torch.optim.SGD(ref.parameters(), lr=0.1), gain_lr=0.0, model=ref)
    x, y = _batch()
    for _ in range(3):
        for opt, mod in ((md, model), (ref_md, ref)):
            opt.zero_grad()
            _loss(mod, x, y).backward()
            opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, atol=TRAJ_TOL, rtol=0)
    # a base step that raises leaves every decoupled W = γ_r Ŵ γ_c (its storage served as scratch)
    model = _mlp()
    md = MagnitudeDirection(RebindingSGD(model.parameters(), lr=0.1, fail=True), gain_lr=0.1, model=model)
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match="base failed"):
        md.step()
    for w in md._decoupled:
        assert torch.equal(compose(md.direction(w), *md.gain_values(w)), w.detach())
        assert w.grad is not None and w.data_ptr() != md.direction(w).data_ptr()


# CUDA vs CPU float32 AdamW-MD after 5 steps: different reduction orders only. NOT measured (no GPU in the session
# that wrote it): set to ~100× float32 rounding of O(1) weights; re-measure on the first GPU run.
CUDA_TOL = 1e-5


@pytest.mark.cuda
def test_cuda_matches_cpu_and_muon_runs():
    from weightgeom.optim import Muon

    x, y = _batch(torch.float32)
    outs = []
    for device in ("cpu", "cuda"):
        model = _mlp(torch.float32).to(device)
        md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), gain_lr=1e-2, model=model)
        for _ in range(5):
            md.zero_grad()
            _loss(model, x.to(device), y.to(device)).backward()
            md.step()
        outs.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=CUDA_TOL, rtol=0)
    model = _mlp(torch.float32).cuda()
    md = MagnitudeDirection(Muon(_muon_groups(model), lr=0.02), gain_lr=1e-2, model=model)
    r0 = [md.state[p]["radius"].clone() for p in md._decoupled]
    for _ in range(5):
        md.zero_grad()
        _loss(model, x.cuda(), y.cuda()).backward()
        md.step()
    for p, r in zip(md._decoupled, r0):
        assert torch.isfinite(p).all()
        assert torch.allclose(md.direction(p).norm(), r.reshape(()), rtol=SPHERE_TOL)


def test_exclude_pattern_matching_nothing_is_refused():
    """``exclude`` takes names or fnmatch globs over the whole name: a regex-looking or misspelt pattern that matches
    no parameter is an error, never a silent no-op."""
    from weightgeom.models import build_model

    model = build_model("gpt", n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8)
    base = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"exclude pattern 'attn' matches no parameter name"):
        MagnitudeDirection(base, model=model, exclude=["attn"])
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-3), model=model, exclude=["*attn*"])
    assert md is not None


@pytest.mark.parametrize("gains,param", [("row+col", "softplus"), ("scalar", "exp"), ("col", "direct"),
                                         ("row", "softplus")])
def test_batched_gain_maps_equal_one_call_per_gain(monkeypatch, gains, param):
    """Off the CPU the gains' φ and chain rule run once over a bucket's stacked θ (``md_core._per_tensor``); run that
    path on the CPU: 4 eager steps over AdamW match the one-call-per-gain path to float64 rounding — each θ gets its
    own gradient and value back."""
    from weightgeom.optim import md_core

    x, y = _batch()
    out = {}
    for batched in (False, True):
        monkeypatch.setattr(md_core, "_per_tensor", lambda b, batched=batched: not batched)
        model = _mlp()
        md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), gains=gains, parameterization=param,
                                gain_lr=3e-2, model=model, fused=False)
        for _ in range(4):
            md.zero_grad()
            _loss(model, x, y).backward()
            md.step()
        out[batched] = [p.detach().clone() for p in model.parameters()]
        gains_now = [md.gain_values(p) for p in md._decoupled]
        assert all(g is None or torch.isfinite(g).all() for pair in gains_now for g in pair)
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("base", ["adamw", "sgd", "stiefel"])
def test_eager_batched_buckets_equal_one_matrix_per_bucket(monkeypatch, base):
    """Off the CPU the eager step batches same-shape matrices (``md_core._alone``: stacked, the base stepping rows of
    the stack, the finish in place then written back); run that path on the CPU: 3 float64 steps over three same-shape
    matrices and one other equal the CPU's one-matrix buckets to rounding, every state tensor included."""
    from weightgeom.optim import Muon, md_core

    out = {}
    for batched in (False, True):
        monkeypatch.setattr(md_core, "_alone", lambda p, eager, batched=batched: eager and not batched)
        monkeypatch.setattr(md_core, "_per_tensor", lambda b, batched=batched: not batched)
        g = torch.Generator().manual_seed(3)
        ps = [nn.Parameter(torch.randn(8, 6, generator=g, dtype=torch.float64)) for _ in range(3)]
        ps.append(nn.Parameter(torch.randn(5, 7, generator=g, dtype=torch.float64)))
        if base == "adamw":
            opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
        elif base == "sgd":
            opt = torch.optim.SGD(ps, lr=1e-2, momentum=0.9, maximize=True)
        else:
            opt = Muon([{"params": ps, "manifold": "stiefel"}], lr=0.02, msign_dtype=torch.float64)
        md = MagnitudeDirection(opt, params=ps, fused=False, gain_lr=3e-2)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
            md.step()
        out[batched] = [p.detach().clone() for p in ps] + [t.clone() for p in ps for t in md.state[p].values()]
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_gains_of_a_matrix_without_gradient_do_not_move_on_a_stale_grad():
    """model.zero_grad() (not the optimizer's) clears the matrices' gradients but not the gains' θ.grad: a matrix with
    no gradient in a step must keep its gains (they moved by gain_lr on last step's θ.grad while W stayed put)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    md = MagnitudeDirection(torch.optim.AdamW(m.parameters(), lr=1e-2), model=m, fused=False, gain_lr=0.1)
    m(torch.randn(8, 4)).sum().backward()
    md.step()
    m.zero_grad(set_to_none=True)
    m[1](torch.randn(8, 4)).sum().backward()  # only the second matrix has a gradient now
    st0 = md.state[m[0].weight]
    before = (st0["gain_row"].clone(), st0["gain_col"].clone(), m[0].weight.detach().clone())
    moved = md.state[m[1].weight]["gain_row"].clone()
    md.step()
    assert torch.equal(st0["gain_row"], before[0]) and torch.equal(st0["gain_col"], before[1])
    assert torch.equal(m[0].weight, before[2])
    assert not torch.equal(md.state[m[1].weight]["gain_row"], moved)


@pytest.mark.parametrize("base", ["adamw", "adamw-foreach", "muon", "stiefel"])
def test_compiled_step_equals_eager(base):
    """torch.compile(md.step) (graph breaks allowed), three same-shape matrices, 3 steps: the eager step to rounding
    (the trace runs the host-free path, batched: tests/test_compiled_md.py; measured ≤ 1.5e-8). Before, dynamo
    replayed one matrix's traced pass for the next (over AdamW's fused C path: 3.3e-3 off)."""
    from compiled_steps import assert_compiled_equals_eager
    from weightgeom.optim import Muon

    g = torch.Generator().manual_seed(2)
    init = [0.02 * torch.randn(256, 64, generator=g) for _ in range(3)]
    grads = [[1e-2 * torch.randn(256, 64, generator=g) for _ in init] for _ in range(3)]
    bases = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
             "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
             "muon": lambda ps: Muon(ps, lr=0.02, msign_dtype=torch.float32, ns_steps=8),
             "stiefel": lambda ps: Muon([{"params": ps, "manifold": "stiefel"}], lr=0.02,
                                        msign_dtype=torch.float32, ns_steps=8)}
    assert_compiled_equals_eager(lambda ps: MagnitudeDirection(bases[base](ps)), init, grads, atol=1e-6)
