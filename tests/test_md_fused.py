"""The C backend of MagnitudeDirection's core (md_fused): the kernels against their float64 torch reference, the C
backend against the torch backend (one table, ``BACKEND_ROWS``), checkpoints across paths, fallbacks and errors."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from weightgeom import kernels
from weightgeom.optim import md_fused
from weightgeom.optim.magnitude_direction import MagnitudeDirection, gain_init, sphere_norm
from weightgeom.optim.md_functional import (
    adam_update_,
    compose,
    gain_chain_log,
    gain_grad_limit,
    gain_value,
    project_to_sphere_,
    split,
    split_gradient_log,
)

# Kernel ÷ float64 reference, relative to the largest entry, over the cases below (AMX Xeon): float64 ≤ 2.1e-15
# (summation order, √v·(1/√bc2) for √v/√bc2); float32 ≤ 1.3e-6 (the reference computes in float64). The limits leave
# ~500× and ~15× headroom; a 0.1 % error in one gain gradient fails them.
KERNEL_TOL = {torch.float64: 1e-12, torch.float32: 2e-5}
# Fused wrapper ÷ eager wrapper after STEPS steps (other op order; the eager path takes norms in float32): measured
# float64 ≤ 1.4e-14, float32 ≤ 1.3e-6.
PATH_TOL = {torch.float64: 1e-10, torch.float32: 5e-5}
STEPS = 4

needs_kernel = pytest.mark.skipif(kernels.load_kernel("md_adam") is None,
                                  reason=f"md kernel unavailable: {kernels.unavailable_reason('md_adam')}")

GAIN_KINDS = ["row+col", "row", "col", "scalar", "none"]
SPHERES = ["frobenius", "row", "col"]
PARAMS = ["softplus", "exp"]


def fused_step_reference(
    G: torch.Tensor,
    D: torch.Tensor,
    W: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    step_size: float,
    bc2_sqrt: float,
    eps: float,
    decay: float = 1.0,
    l2: float = 0.0,
    gain_row: tuple | None = None,
    gain_col: tuple | None = None,
    parameterization: str = "softplus",
    gain_lr: float = 0.0,
    gain_betas: tuple[float, float] = (0.9, 0.95),
    gain_eps: float = 1e-8,
    sphere: str = "frobenius",
    radius: torch.Tensor | None = None,
) -> None:
    """Slow float64 reference of the fused MD step over Adam(W) (``weightgeom.kernels.md_adam_step``), built from
    ``md_functional``'s functions; same arguments, same in-place updates (computed in float64, written back in each
    dtype).

    Order: log-gain split of G (old Ŵ and gains); torch's Adam(W) step of Ŵ with Ĝ (+ ``l2``·Ŵ, × ``decay``); each
    gain's Adam step at ``gain_lr`` (``gain_row``/``gain_col`` = (θ, exp_avg, exp_avg_sq, step t, grad out)); Ŵ on its
    sphere of ``radius``; W = γ_r Ŵ γ_c with the new gains.
    """
    d = D.double()
    thetas = [None if g is None else g[0].double() for g in (gain_row, gain_col)]
    gr = None if thetas[0] is None else gain_value(thetas[0], parameterization).reshape(-1, 1)
    gc = None if thetas[1] is None else gain_value(thetas[1], parameterization).reshape(1, -1)
    s_row, s_col, gh = split_gradient_log(G.double(), d, gr, gc)
    big = torch.finfo(G.dtype).max  # the kernel's Ĝ saturates in its own dtype
    gh = gh.clamp(-big, big)
    e = gh + l2 * d
    m = exp_avg.double().lerp(e, 1 - beta1)
    v = exp_avg_sq.double() * beta2 + (1 - beta2) * e * e
    x = d * decay - step_size * (m / (v.sqrt() / bc2_sqrt + eps))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    for gain, theta, s in ((gain_row, thetas[0], s_row), (gain_col, thetas[1], s_col)):
        if gain is None:
            continue
        ga, gv = gain[1].double(), gain[2].double()
        lim = gain_grad_limit(gain[0].dtype)  # the kernel clamps at its own dtype's limit
        grad = gain_chain_log(theta, s.reshape(theta.shape), parameterization).clamp(-lim, lim)
        if len(gain) > 4 and gain[4] is not None:
            gain[4].copy_(grad)
        adam_update_(theta, grad, ga, gv, int(gain[3]), gain_lr, gain_betas, gain_eps, grad_limit=lim)
        for dst, src in zip(gain[:3], (theta, ga, gv)):
            dst.copy_(src)
    shape = {"frobenius": (1, 1), "row": (-1, 1), "col": (1, -1)}[sphere]
    project_to_sphere_(x, radius.double().reshape(shape), sphere)
    gr = None if thetas[0] is None else gain_value(thetas[0], parameterization).reshape(-1, 1)
    gc = None if thetas[1] is None else gain_value(thetas[1], parameterization).reshape(1, -1)
    W.copy_(compose(x, gr, gc))
    D.copy_(x)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    scale = max(float(b.abs().max()), 1e-30)
    err = float((a.double() - b.double()).abs().max()) / scale
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def _case(m: int, n: int, gains: str, param: str, sphere: str, dtype: torch.dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype)
    radius = sphere_norm(D, sphere).reshape(-1).clone()
    shapes = {"row+col": ((m,), (n,)), "row": ((m,), None), "col": (None, (n,)), "scalar": ((1,), None),
              "none": (None, None)}[gains]
    gain = []
    for shape in shapes:
        if shape is None:
            gain.append(None)
            continue
        theta = gain_init(shape, param, dtype=dtype) + 0.3 * torch.randn(shape, generator=g, dtype=dtype)
        gain.append([theta, torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), 0.0,
                     torch.zeros(shape, dtype=dtype)])
    return {"G": None, "D": D, "W": torch.empty_like(D), "M": torch.zeros_like(D), "V": torch.zeros_like(D),
            "gain": gain, "radius": radius, "gen": g}


def _clone_case(c: dict) -> dict:
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in c.items() if k not in ("gain", "gen")}
    out["gain"] = [None if x is None else [t.clone() if isinstance(t, torch.Tensor) else t for t in x]
                   for x in c["gain"]]
    return out


def _run(fn, c: dict, G: torch.Tensor, t: int, param: str, sphere: str, decay: float, l2: float) -> None:
    b1, b2, lr = 0.9, 0.99, 3e-2
    for x in c["gain"]:
        if x is not None:
            x[3] = float(t)
    fn(G, c["D"], c["W"], c["M"], c["V"], beta1=b1, beta2=b2, step_size=lr / (1 - b1**t),
       bc2_sqrt=(1 - b2**t) ** 0.5, eps=1e-8, decay=decay, l2=l2,
       gain_row=None if c["gain"][0] is None else tuple(c["gain"][0]),
       gain_col=None if c["gain"][1] is None else tuple(c["gain"][1]), parameterization=param, gain_lr=5e-2,
       gain_betas=(0.9, 0.95), gain_eps=1e-8, sphere=sphere, radius=c["radius"])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gains,param,sphere", list(itertools.product(GAIN_KINDS, PARAMS, SPHERES)))
def test_kernel_matches_float64_reference(gains, param, sphere, dtype):
    tol = KERNEL_TOL[dtype]
    for (m, n), (decay, l2) in zip([(1, 5), (7, 3), (33, 17), (130, 70)], [(1.0, 0.0), (0.99, 0.0), (1.0, 0.1),
                                                                          (0.995, 0.0)]):
        fast = _case(m, n, gains, param, sphere, dtype)
        ref = _clone_case(fast)
        for t in range(1, 4):
            G = torch.randn(m, n, generator=fast["gen"], dtype=torch.float64).to(dtype)
            _run(kernels.md_adam_step, fast, G, t, param, sphere, decay, l2)
            _run(fused_step_reference, ref, G, t, param, sphere, decay, l2)
        for key in ("D", "W", "M", "V"):
            _close(fast[key], ref[key], tol)
        for a, b in zip(fast["gain"], ref["gain"]):
            if a is not None:
                for x, y in zip(a[:3] + a[4:], b[:3] + b[4:]):
                    _close(x, y, tol)
        # the direction is on its sphere
        _close(sphere_norm(fast["D"].double(), sphere).reshape(-1), fast["radius"].double(), tol)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_is_deterministic(threads):
    """Same inputs, same thread count → bitwise the same outputs (column sums are added in thread order, not in the
    order threads finish), so a resumed run continues bit-identically."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = []
        for _ in range(2):
            c = _case(301, 257, "row+col", "softplus", "col", torch.float32, seed=3)
            for t in range(1, 4):
                G = torch.randn(301, 257, generator=c["gen"])
                _run(kernels.md_adam_step, c, G, t, "softplus", "col", 1.0, 0.0)
            outs.append([c["D"], c["W"], c["M"], c["V"], *c["gain"][0][:3], *c["gain"][1][:3]])
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(old)


@needs_kernel
def test_kernel_rejects_bad_tensors_with_their_name():
    c = _case(4, 3, "row+col", "softplus", "frobenius", torch.float32)
    G = torch.randn(4, 3)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        kernels.md_adam_step(G, c["D"], c["W"], c["M"], c["V"].double(), beta1=0.9, beta2=0.99, step_size=1e-3,
                             bc2_sqrt=0.1, eps=1e-8, radius=c["radius"])
    with pytest.raises(ValueError, match="G must be .*non-contiguous"):
        kernels.md_adam_step(torch.randn(3, 4).T, c["D"], c["W"], c["M"], c["V"], beta1=0.9, beta2=0.99,
                             step_size=1e-3, bc2_sqrt=0.1, eps=1e-8, radius=c["radius"])
    with pytest.raises(ValueError, match="gain_row"):
        kernels.md_adam_step(G, c["D"], c["W"], c["M"], c["V"], beta1=0.9, beta2=0.99, step_size=1e-3,
                             bc2_sqrt=0.1, eps=1e-8, gain_row=(torch.zeros(5), torch.zeros(5), torch.zeros(5), 1.0,
                                                               torch.zeros(5)), radius=c["radius"])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_finiteness_scan(dtype):
    """``kernels.any_nonfinite``: exact at every position (threaded sizes included), no overflow on huge finite
    values, and what ``first_nonfinite`` finds with it is what it finds without it."""
    from weightgeom.optim.functional import first_nonfinite

    for n in (1, 7, 5000, 300_001):
        for pos in sorted({0, n // 2, n - 1}):
            for bad in (float("nan"), float("inf"), float("-inf")):
                t = torch.randn(n, dtype=dtype)
                assert not kernels.any_nonfinite(t)
                t[pos] = bad
                assert kernels.any_nonfinite(t), (n, pos, bad)
    assert not kernels.any_nonfinite(torch.full((9,), torch.finfo(dtype).max, dtype=dtype))
    assert not kernels.any_nonfinite(torch.empty(0, dtype=dtype))
    with pytest.raises(ValueError, match="float32 and float64"):
        kernels.any_nonfinite(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="non-contiguous"):
        kernels.any_nonfinite(torch.zeros(4, 3, dtype=dtype).T)
    mixed = [torch.randn(4, 3, dtype=dtype), torch.randn(5).bfloat16(), torch.randn(6, 2, dtype=dtype).T,
             torch.randn(8, dtype=dtype)]
    for i in range(len(mixed)):
        ts = [t.clone() for t in mixed]
        ts[i][(1,) * ts[i].ndim] = float("nan") if i % 2 else float("inf")
        assert first_nonfinite(ts, cpu_scan=kernels.any_nonfinite) == first_nonfinite(ts) == i


@needs_kernel
@pytest.mark.parametrize("base,fused,scans", [("adamw", None, True), ("adamw", True, True), ("adamw", False, False),
                                              ("muon", None, True), ("muon", False, False)])
def test_md_checks_gradients_with_the_c_scan_where_it_uses_the_kernel(monkeypatch, base, fused, scans):
    model = _model(torch.float32)
    md = _make(base, model, fused) if base == "adamw" else _make_other(base, model, fused)
    seen = []
    real = kernels.any_nonfinite
    monkeypatch.setattr(kernels, "any_nonfinite", lambda t: seen.append(tuple(t.shape)) or real(t))
    _train(md, model, 1)
    assert sorted(seen) == (sorted(tuple(p.shape) for p in model.parameters()) if scans else [])


def test_kernel_clamps_gains_like_torch():
    """The C kernel's gain bounds are md_functional's (one set of numbers, two languages)."""
    import re
    from importlib import resources

    from weightgeom.optim.md_functional import GAIN_MAX, GAIN_MIN

    source = resources.files("weightgeom.kernels").joinpath("md_adam.c").read_text()
    defined = dict(re.findall(r"^#define (GAIN_MIN|GAIN_MAX) (\S+)$", source, re.MULTILINE))
    assert {k: float(v) for k, v in defined.items()} == {"GAIN_MIN": GAIN_MIN, "GAIN_MAX": GAIN_MAX}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("param", PARAMS)
def test_kernel_with_extreme_gains_writes_the_clamped_composition(param, dtype):
    """θ where φ(θ) underflows to 0, is subnormal, is 1e-30 or overflows: the kernel's W is γ_r Ŵ γ_c with γ clamped
    to [GAIN_MIN, GAIN_MAX], entry by entry (finite), and agrees with the float64 reference."""
    from weightgeom.optim.md_functional import GAIN_MAX, GAIN_MIN, gain_value

    fast = _case(6, 5, "row+col", param, "row", dtype)
    extremes = torch.tensor([-1000.0, -92.0, -69.0, 0.5, 1000.0, 120.0], dtype=dtype)
    fast["gain"][0][0].copy_(extremes)
    fast["gain"][1][0].copy_(extremes[[1, 2, 3, 4, 0]])
    ref = _clone_case(fast)
    G = torch.randn(6, 5, generator=fast["gen"], dtype=torch.float64).to(dtype)
    _run(kernels.md_adam_step, fast, G, 1, param, "row", 1.0, 0.0)
    _run(fused_step_reference, ref, G, 1, param, "row", 1.0, 0.0)
    assert bool(torch.isfinite(fast["W"]).all())
    gr, gc = (gain_value(g[0].double(), param) for g in fast["gain"])
    assert float(min(gr.min(), gc.min())) == pytest.approx(GAIN_MIN)
    assert float(max(gr.max(), gc.max())) == pytest.approx(GAIN_MAX) if param == "exp" else 990 < float(gr.max())
    expected = gr.reshape(-1, 1) * fast["D"].double() * gc.reshape(1, -1)
    torch.testing.assert_close(fast["W"].double(), expected, rtol=KERNEL_TOL[dtype], atol=0)
    torch.testing.assert_close(fast["W"].double(), ref["W"].double(), rtol=KERNEL_TOL[dtype], atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# The wrapper: fused steps equal eager steps.
# ---------------------------------------------------------------------------------------------------------------------
def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 9), torch.nn.Tanh(),
                               torch.nn.Linear(9, 3)).to(dtype)


def _train(md: MagnitudeDirection, model: torch.nn.Module, steps: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(32, 12, generator=g, dtype=torch.float64).to(dtype)
        y = torch.randn(32, 3, generator=g, dtype=torch.float64).to(dtype)
        md.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        md.step()


def _make(kind: str, model: torch.nn.Module, fused, **md_kw) -> MagnitudeDirection:
    if kind == "adamw":
        base = torch.optim.AdamW(model.parameters(), lr=2e-2, betas=(0.9, 0.98), weight_decay=0.1)
    elif kind == "adam-l2":
        base = torch.optim.Adam(model.parameters(), lr=2e-2, weight_decay=0.0)
    else:
        base = torch.optim.AdamW(model.parameters(), lr=2e-2, fused=True)
    md = MagnitudeDirection(base, model=model, fused=fused, gain_lr=3e-2, **md_kw)
    if kind == "adam-l2":  # coupled weight decay set after construction (MD zeroes it at construction)
        for group in base.param_groups:
            group["weight_decay"] = 0.05
    return md


def _assert_same(md_a, model_a, md_b, model_b, tol):
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        _close(pa.detach(), pb.detach(), tol)
    for pa, pb in zip(md_a._decoupled, md_b._decoupled):
        sa, sb = md_a.state[pa], md_b.state[pb]
        _close(sa["direction"], sb["direction"], tol)
        for key in ("gain_row", "gain_col"):
            if key in sa:
                _close(sa[key], sb[key], tol)
                _close(sa[key].grad, sb[key].grad, max(tol, 1e-9))
        ba, bb = md_a.base_optimizer.state[pa], md_b.base_optimizer.state[pb]
        for key in ("exp_avg", "exp_avg_sq"):
            _close(ba[key], bb[key], tol)
        assert float(ba["step"]) == float(bb["step"])


def _default_and_torch_runs(make, base: str, dtype: torch.dtype, **md_kw) -> list[tuple]:
    """(MD, model) after STEPS training steps with fused=None (MD's default path) and with fused=False (torch)."""
    runs = []
    for fused in (None, False):
        model = _model(dtype)
        md = make(base, model, fused, **md_kw)
        _train(md, model, STEPS)
        runs.append((md, model))
    return runs


@needs_kernel
def test_checkpoint_moves_between_fused_and_eager():
    model = _model(torch.float64)
    md = _make("adamw", model, None)
    _train(md, model, 3)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": md.state_dict()})
    _train(md, model, 3, seed=7)  # fused continuation
    model2 = _model(torch.float64, seed=5)
    md2 = _make("adamw", model2, False)
    model2.load_state_dict(ckpt["model"])
    md2.load_state_dict(ckpt["opt"])
    _train(md2, model2, 3, seed=7)  # eager continuation from the fused checkpoint
    _assert_same(md, model, md2, model2, PATH_TOL[torch.float64])


@needs_kernel
@pytest.mark.parametrize("base,fused,path", [("adamw", True, "fused"), ("muon", None, "eager-C")])
def test_c_paths_bump_the_weight_version_for_autograd(base, fused, path):
    """The kernels write W through a pointer; autograd must still refuse a backward through a graph that saved the
    old W, as after an in-place torch op."""
    model = _model(torch.float32)
    md = _make(base, model, fused) if base == "adamw" else _make_other(base, model, fused)
    x = torch.randn(4, 12, requires_grad=True)
    torch.nn.functional.mse_loss(model(x), torch.zeros(4, 3)).backward()
    w = model[0].weight
    before = w._version
    out = model(x).sum()  # saves W for the gradient of x
    md.step()
    assert w._version > before and md._path[w].startswith(path)
    with pytest.raises(RuntimeError, match="inplace"):
        out.backward()


@needs_kernel
def test_summary_says_which_path_and_why():
    model = _model(torch.float32)
    base = torch.optim.AdamW([{"params": [model[0].weight], "amsgrad": True},
                              {"params": [p for p in model.parameters() if p is not model[0].weight]}], lr=1e-2)
    md = MagnitudeDirection(base, model=model)
    _train(md, model, 1)
    table = md.summary()
    assert "eager-C (the base group has amsgrad=True)" in table  # its passes in C around torch's amsgrad step
    assert table.count(" fused") == 2


def test_fused_true_refuses_what_it_cannot_run():
    from weightgeom.optim.muon import Muon

    model = _model(torch.float32)
    with pytest.raises(ValueError, match="fused=True cannot run: the base optimizer is Muon"):
        MagnitudeDirection(Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02), model=model, fused=True)
    with pytest.raises(ValueError, match="fused must be None, True or False"):
        MagnitudeDirection(torch.optim.AdamW(model.parameters()), model=model, fused="yes")
    if kernels.load_kernel("md_adam") is not None:
        md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, fused=True,
                                parameterization="direct")
        with pytest.raises(ValueError, match=r"'0.weight' cannot take the fused path: parameterization 'direct'"):
            _train(md, model, 1)
        # nothing half-done: the model still holds γ_r Ŵ γ_c
        W = model[0].weight.detach()
        gr, gc = md.gain_values(model[0].weight)
        torch.testing.assert_close(W, gr * md.direction(model[0].weight) * gc)


@needs_kernel
def test_fused_true_refuses_before_stepping_any_matrix():
    """fused=True with one matrix the kernel cannot take (an amsgrad group) and one it can: refused naming the first,
    and the other was not stepped either (the path of every matrix is decided before anything changes)."""
    from hostile_cases.optim import assert_unchanged, snapshot

    model = _model(torch.float32)
    first, last = model[0].weight, model[2].weight
    rest = [p for p in model.parameters() if p is not first and p is not last]
    base = torch.optim.AdamW([{"params": [first, *rest]}, {"params": [last], "amsgrad": True}], lr=1e-2)
    md = MagnitudeDirection(base, model=model, fused=True)
    model(torch.randn(8, model[0].in_features)).pow(2).mean().backward()
    before = snapshot(md, model)
    with pytest.raises(ValueError, match=r"'2\.weight' cannot take the fused path: the base group has amsgrad=True; "
                                         r"step refused, nothing was changed"):
        md.step()
    assert_unchanged(before, snapshot(md, model))


@pytest.fixture
def no_kernel(monkeypatch, tmp_path):
    """A fresh kernel cache and a compiler that fails: the kernel is unavailable for the test."""
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    kernels._reset()
    yield
    monkeypatch.undo()
    kernels._reset()


def test_without_a_compiler_the_eager_path_runs(no_kernel):
    assert kernels.load_kernel("md_adam") is None
    assert "failed" in kernels.unavailable_reason("md_adam") or "does not run" in kernels.unavailable_reason("md_adam")
    model = _model(torch.float64)
    md = _make("adamw", model, None)
    _train(md, model, 2)
    assert all(path.startswith("eager (the C kernel is unavailable") for path in md._path.values())
    with pytest.raises(ValueError, match="fused=True cannot run: the C kernel is unavailable"):
        _make("adamw", _model(torch.float64), True)


def test_an_unwritable_cache_means_no_kernel_not_a_crash(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(blocker / "sub"))
    monkeypatch.setattr(kernels.tempfile, "gettempdir", lambda: str(blocker))
    kernels._reset()
    try:
        if kernels._compiler() is None:
            pytest.skip("no C compiler")
        assert kernels.load_kernel("md_adam") is None
        assert "failed" in kernels.unavailable_reason("md_adam")
    finally:
        monkeypatch.undo()
        kernels._reset()


@needs_kernel
def test_a_compiler_without_openmp_gets_the_single_threaded_kernel(monkeypatch, tmp_path):
    cc = tmp_path / "cc-no-openmp"
    cc.write_text('#!/bin/sh\ncase "$*" in *-fopenmp*) echo "unsupported option -fopenmp" >&2; exit 1;; esac\n'
                  f'exec {kernels._compiler()} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    kernels._reset()
    try:
        assert kernels.load_kernel("md_adam") is not None
        assert not kernels.uses_openmp("md_adam")
        test_kernel_matches_float64_reference("row+col", "softplus", "col", torch.float32)
    finally:
        monkeypatch.undo()
        kernels._reset()
    assert kernels.uses_openmp("md_adam")


def test_kernels_can_be_disabled(monkeypatch):
    monkeypatch.setenv("WEIGHTGEOM_NO_KERNELS", "1")
    kernels._reset()
    try:
        assert kernels.load_kernel("md_adam") is None
        assert kernels.unavailable_reason("md_adam") == "disabled by WEIGHTGEOM_NO_KERNELS"
    finally:
        monkeypatch.delenv("WEIGHTGEOM_NO_KERNELS")
        kernels._reset()


@needs_kernel
def test_kernel_is_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path))
    kernels._reset()
    try:
        assert kernels.load_kernel("md_adam") is not None
        built = list((tmp_path / "kernels").glob("md_adam-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        kernels._reset()
        assert kernels.load_kernel("md_adam") is not None
        assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        monkeypatch.undo()
        kernels._reset()


def test_eligibility_reasons():
    p = torch.nn.Parameter(torch.randn(3, 4))
    G = torch.randn(3, 4)
    adamw = torch.optim.AdamW([p])
    group = adamw.param_groups[0]
    assert md_fused.fusable(torch.optim.SGD([p], lr=0.1), group, p, G, "row+col", "softplus", False).startswith(
        "the base optimizer is SGD")
    assert md_fused.fusable(adamw, {**group, "maximize": True}, p, G, "row+col", "softplus", False) == \
        "the base group has maximize=True"
    assert "direct" in md_fused.fusable(adamw, group, p, G, "row", "direct", False)
    assert md_fused.fusable(adamw, group, p, G, "none", "direct", False) in (None, md_fused.fusable(
        adamw, group, p, G, "none", "softplus", False))
    assert "dtype" in md_fused.fusable(adamw, group, p.bfloat16(), G.bfloat16(), "row", "exp", False)
    assert "contiguous" in md_fused.fusable(adamw, group, p, torch.randn(4, 3).T, "row", "exp", False)
    assert "norm-fixing" in md_fused.fusable(adamw, group, p, G, "row", "exp", True)


@pytest.mark.parametrize("fused", [None, False])
def test_the_models_weights_win_after_an_outside_edit(fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(), torch.nn.Linear(300, 40))
    md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, gain_lr=0.05, fused=fused)
    for _ in range(30):  # enough steps for torch's softplus and the kernel's to disagree in a last bit somewhere
        md.zero_grad()
        model(torch.randn(32, 64)).pow(2).mean().backward()
        md.step()
    p = model[0].weight
    D0, r0 = md.direction(p).clone(), md.state[p]["radius"].clone()
    with torch.no_grad():
        p.copy_(p.detach().clone())  # same values, new version (as after loading the same checkpoint)
    md._resync(p)
    # kept bit for bit, although torch's γ may differ from the kernel's by 1 ulp
    assert torch.equal(md.direction(p), D0)
    with torch.no_grad():
        p.mul_(1.5)  # a real change: Ŵ is re-derived from W and the radius re-measured
    md._resync(p)
    torch.testing.assert_close(md.direction(p), 1.5 * D0, rtol=1e-5, atol=0)
    torch.testing.assert_close(md.state[p]["radius"], 1.5 * r0, rtol=1e-5, atol=0)


def test_md_overhead_benchmark_runs_and_reports_the_path(tmp_path, capsys):
    """`weightgeom bench md_overhead` on one AdamW implementation, 1 timed step: the rows, the path, the JSON."""
    import json

    from weightgeom.cli import main

    out = tmp_path / "md.json"
    code = main(["bench", "md_overhead", "--base", "adamw", "--adamw-impl", "fused", "--md-path", "fused,eager",
                 "--iters", "1", "--warmup", "0", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "adamw(fused)" in text
    rows = json.loads(out.read_text())["results"]
    assert [r["adamw_impl"] for r in rows] == ["fused", "fused"]
    expected = "fused" if kernels.load_kernel("md_adam") is not None else "eager"
    assert [r["md_path"] for r in rows] == [expected, "eager"]
    assert all(r["base_ms"] > 0 and r["md_ms"] > 0 for r in rows)
    assert main(["bench", "md_overhead", "--adamw-impl", "nope"]) == 2


# ---- the C passes around any other base (Muon, SGD, Adam with amsgrad, ...) -----------------------------------------


def _make_other(kind: str, model: torch.nn.Module, fused, **md_kw) -> MagnitudeDirection:
    from weightgeom.optim import Muon

    if kind == "muon":
        mats = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
        rest = [(n, p) for n, p in model.named_parameters() if p.ndim != 2]
        base = Muon([{"params": [p for _, p in mats], "names": [n for n, _ in mats], "msign_dtype": torch.float64
                      if next(model.parameters()).dtype == torch.float64 else torch.float32},
                     {"params": [p for _, p in rest], "names": [n for n, _ in rest], "algorithm": "adamw",
                      "lr": 1e-2}], lr=0.05)
    else:
        base = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    return MagnitudeDirection(base, model=model, fused=fused, gain_lr=3e-2, **md_kw)


F32, F64 = torch.float32, torch.float64
# The one equivalence test of md_core's two backends: MD's default (fused=None: the C kernels — the fused Adam pass
# over Adam/AdamW, the split and finish passes around any other base) against fused=False (the torch backend), after
# STEPS steps. All pairs of base × gains × parameterization × sphere × dtype (rows: base, gains, param, sphere, dtype).
BACKEND_ROWS = [
    ("adamw", "row+col", "softplus", "frobenius", F64), ("adamw", "row", "exp", "row", F32),
    ("adamw", "scalar", "exp", "col", F64), ("adam-l2", "col", "softplus", "col", F32),
    ("adam-l2", "none", "direct", "row", F64), ("adam-l2", "row+col", "exp", "frobenius", F32),
    ("adamw-fused", "scalar", "softplus", "row", F32), ("adamw-fused", "row+col", "exp", "col", F64),
    ("adamw-fused", "none", "softplus", "frobenius", F32), ("sgd", "row+col", "softplus", "frobenius", F32),
    ("sgd", "scalar", "exp", "frobenius", F64), ("sgd", "col", "softplus", "col", F64),
    ("sgd", "row", "exp", "row", F32),
    ("muon", "row", "exp", "row", F64), ("muon", "none", "softplus", "col", F32),
    ("muon", "row+col", "softplus", "frobenius", F32), ("muon", "col", "exp", "col", F64),
    ("muon", "scalar", "softplus", "row", F32),
]
# C backend ÷ torch backend, relative to the largest entry (the C passes sum in float64, torch's reductions in their
# dtype; the fused pass has its own op order): measured float64 ≤ 2.6e-15, float32 ≤ 1.3e-6 (AMX Xeon).
BACKEND_TOL = {F64: 1e-10, F32: 5e-5}


@needs_kernel
@pytest.mark.parametrize("base,gains,param,sphere,dtype", BACKEND_ROWS)
def test_c_backend_equals_the_torch_backend(base, gains, param, sphere, dtype):
    adam = base.startswith("adam")
    runs = _default_and_torch_runs(_make if adam else _make_other, base, dtype, gains=gains, parameterization=param,
                                   sphere=sphere)
    (md_c, model_c), (md_t, model_t) = runs
    want = "fused" if adam else "eager-C (the base optimizer is "
    assert all(path.startswith(want) for path in md_c._path.values()), md_c._path
    assert all(path == "eager (fused=False)" for path in md_t._path.values())
    tol = BACKEND_TOL[dtype]
    for pa, pb in zip(model_c.parameters(), model_t.parameters()):
        _close(pa.detach(), pb.detach(), tol)
    for pa, pb in zip(md_c._decoupled, md_t._decoupled):
        sa, sb = md_c.state[pa], md_t.state[pb]
        _close(sa["direction"], sb["direction"], tol)
        norms = sphere_norm(sa["direction"], sphere)  # Ŵ on its sphere
        _close(norms, sa["radius"].reshape(norms.shape), 1e-12 if dtype == F64 else 1e-6)
        for key in ("gain_row", "gain_col"):
            if key in sa:
                _close(sa[key], sb[key], tol)
                _close(sa[key].grad, sb[key].grad, max(tol, 1e-9))
                assert float(md_c.state[sa[key]]["step"]) == STEPS  # the gains' Adam advanced once per step
        if adam:  # the base's own Adam state, advanced by the fused pass as by torch
            ba, bb = md_c.base_optimizer.state[pa], md_t.base_optimizer.state[pb]
            for key in ("exp_avg", "exp_avg_sq"):
                _close(ba[key], bb[key], tol)
            assert float(ba["step"]) == float(bb["step"])
        else:  # the model's weight is exactly γ_r Ŵ γ_c of the state (the next step must not see an outside edit)
            assert torch.equal(compose_of(md_c, pa), pa.detach())


def compose_of(md: MagnitudeDirection, p: torch.Tensor) -> torch.Tensor:
    from weightgeom.optim.md_functional import compose

    return compose(md.state[p]["direction"], *md.gain_values(p))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(37, 53), (1, 5), (5, 1), (300, 2000)])
def test_split_and_finish_kernels_match_the_torch_functions(shape, dtype):
    """kernels.md_split / md_finish against md_functional's split_gradient_log, project_to_sphere_ and compose: Ĝ and
    the recomposition bit for bit where no sum is involved, the sums to float32/float64 rounding."""
    from weightgeom.optim.md_functional import compose, project_to_sphere_, split_gradient_log

    g = torch.Generator().manual_seed(1)
    m, n = shape
    G, D = (torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    gr, gc = (torch.rand(k, generator=g, dtype=torch.float64).to(dtype) + 0.5 for k in (m, n))
    rel = 1e-12 if dtype == torch.float64 else 2e-5
    for a, b in [(gr, gc), (gr, None), (None, gc)]:
        out = torch.empty_like(G)
        s_r, s_c = kernels.md_split(G, D, a, b, out, a is not None, b is not None)
        e_r, e_c, Gd = split_gradient_log(G, D, None if a is None else a.reshape(-1, 1),
                                          None if b is None else b.reshape(1, -1))
        assert torch.equal(out, Gd)
        for got, want in ((s_r, e_r), (s_c, e_c)):
            if want is not None:
                _close(got, want.reshape(-1), rel)
    for sphere, radius in [("frobenius", torch.tensor([[3.0]])), ("row", torch.rand(m, 1, generator=g) + 1),
                           ("col", torch.rand(1, n, generator=g) + 1)]:
        radius = radius.to(dtype)
        D1, W1 = D.clone(), torch.empty_like(D)
        kernels.md_finish(D1, W1, sphere, radius, gr, gc)
        D2 = project_to_sphere_(D.clone(), radius, sphere)
        _close(D1, D2, rel)
        _close(W1, compose(D2, gr.reshape(-1, 1), gc.reshape(1, -1)), rel)
        assert torch.equal(W1, compose(D1, gr.reshape(-1, 1), gc.reshape(1, -1)))  # W from the kernel's own Ŵ


@needs_kernel
def test_split_and_finish_kernels_name_a_bad_tensor():
    D = torch.randn(6, 4)
    with pytest.raises(ValueError, match="gain_row must be a contiguous CPU torch.float32 tensor of 6 elements"):
        kernels.md_split(torch.randn(6, 4), D, torch.ones(5), None, torch.empty(6, 4), True, False)
    with pytest.raises(ValueError, match="G must be a contiguous"):
        kernels.md_split(torch.randn(4, 6).mT, D, None, None, torch.empty(6, 4), False, False)
    with pytest.raises(ValueError, match="radius must be a contiguous CPU torch.float32 tensor of 4 elements"):
        kernels.md_finish(D, torch.empty(6, 4), "col", torch.ones(6), None, None)
    with pytest.raises(ValueError, match="sphere 'ball' is not supported"):
        kernels.md_finish(D, torch.empty(6, 4), "ball", torch.ones(1), None, None)


def test_frobenius_sphere_norm_is_accurate_on_large_float32_matrices():
    """torch's float32 vector_norm of a 768×3072 matrix on the CPU is 4e-5 low (float32 accumulation); the sphere's
    norm must not be (the radius inherited that error at every step)."""
    D = torch.randn(768, 3072, generator=torch.Generator().manual_seed(0))
    ref = float(D.double().norm())
    assert abs(float(sphere_norm(D, "frobenius")) / ref - 1) < 1e-6


@pytest.mark.parametrize("std", [3e-5, 1e-4, 0.3])
def test_frobenius_sphere_norm_of_float16_is_computed_in_float32(std):
    """Hostile trial: the summed square in float16 overflowed above a norm of 256 (radius inf, W all NaN after one
    step) and lost the squares of entries below 2.4e-4 (a 28 % low radius; 'zero norm' refused at std 3e-5)."""
    D = (std * torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))).half()
    got = sphere_norm(D, "frobenius")
    assert got.dtype == torch.float16
    assert abs(float(got) / float(D.double().norm()) - 1) < 2e-3


def test_torch_backend_splits_into_a_kept_buffer_and_the_models_storage():
    """The eager torch backend (fused=False) of a one-matrix bucket writes Ĝ into the matrix's kept buffer — what the
    base steps with, the same storage at every step — and the products Ŵ ⊙ Ĝ into W's storage (recomposed after),
    as the C backend does, instead of allocating them; ``split`` with those buffers equals ``split`` without, bitwise
    (log-gain and plain forms, float32 and bfloat16)."""
    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.extend(p.grad.data_ptr() for g in self.param_groups for p in g["params"])
            return super().step(closure)

    w = torch.nn.Parameter(torch.randn(12, 8, generator=torch.Generator().manual_seed(0)))
    md = MagnitudeDirection(Recording([w], lr=0.1), fused=False, gain_lr=1e-2)
    for k in range(3):
        w.grad = torch.randn(12, 8, generator=torch.Generator().manual_seed(k))
        md.step()
    assert md._path[w] == "eager (fused=False)" and seen == [md._buffers[w].data_ptr()] * 3
    assert torch.equal(compose(md.direction(w), *md.gain_values(w)), w.detach())
    g = torch.Generator().manual_seed(1)
    for dtype, log in itertools.product((torch.float32, torch.bfloat16), (True, False)):
        G, D = (torch.randn(2, 24, 16, generator=g).to(dtype) for _ in range(2))
        gr, gc = torch.rand(2, 24, 1, generator=g) + 0.5, torch.rand(2, 1, 16, generator=g) + 0.5
        want = split(G, D, gr, gc, log)
        got = split(G, D, gr, gc, log, out=torch.empty_like(G), scratch=torch.empty_like(G))
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (dtype, log)


@needs_kernel
def test_eager_c_survives_a_gradient_whose_layout_changes():
    """Hostile trial: the Ĝ buffer copied the first gradient's strides (a transposed one), and every later step with
    a row-major gradient raised from the C kernel; now the buffer is row-major and the later steps take the C path."""
    from weightgeom.optim import Muon

    runs = []
    for fused in (None, False):
        w = torch.nn.Parameter(torch.randn(8, 5, generator=torch.Generator().manual_seed(0)))
        md = MagnitudeDirection(Muon([{"params": [w], "names": ["w"], "msign_dtype": torch.float32}], lr=0.05),
                                fused=fused, gain_lr=3e-2)
        g = torch.Generator().manual_seed(1)
        for k in range(3):
            G = torch.randn(8, 5, generator=g)
            w.grad = G.t().contiguous().t() if k == 0 else G
            md.step()
        runs.append((w.detach().clone(), md._path[w]))
    assert runs[0][1].startswith("eager-C")
    _close(runs[0][0], runs[1][0], 1e-5)


@needs_kernel
@pytest.mark.parametrize("shape,sphere", [((0, 5), "row"), ((5, 0), "col")])
def test_an_empty_matrix_steps_on_the_torch_passes(shape, sphere):
    """Hostile trial: an empty decoupled matrix reached md_finish (an empty radius has no data pointer: 'radius is
    required') after the base step had changed the other matrices; it now takes the torch passes, and the step runs."""
    a = torch.nn.Parameter(torch.randn(4, 5, generator=torch.Generator().manual_seed(0)))
    e = torch.nn.Parameter(torch.zeros(shape))
    md = MagnitudeDirection(torch.optim.SGD([a, e], lr=0.1, momentum=0.9), sphere=sphere, gain_lr=1e-2)
    for _ in range(2):
        a.grad, e.grad = torch.randn(4, 5), torch.zeros(shape)
        md.step()
    assert md._path[a].startswith("eager-C") and md._path[e].startswith("eager (")


@needs_kernel
@pytest.mark.parametrize("huge", [1e30, 3e38])
def test_fused_path_clamps_a_huge_gain_gradient_like_the_eager_path(huge):
    """A finite float32 gradient so large that the log-gain sums overflow: the fused kernel's gain Adam clamps the gain
    gradient to md_functional.gain_grad_limit, as the eager path's adam_update_ does — W, gains and moments finite (W
    was NaN at 3e38 before), and the two paths agree."""
    runs = []
    for fused in (None, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        md = MagnitudeDirection(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model, fused=fused, gain_lr=3e-2)
        for p in model.parameters():
            p.grad = torch.full_like(p, huge)
        md.step()
        w = model[0].weight
        assert md._path[w] == ("fused" if fused is None else "eager (fused=False)")
        tensors = [w.detach(), *[t for t in md.gain_values(w) if t is not None],
                   *[v for st in md.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]]
        assert all(bool(torch.isfinite(t).all()) for t in tensors)
        runs.append(w.detach().clone())
    _close(runs[0], runs[1], 1e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_gain_adam_equals_one_by_one(dtype, device):
    """adam_update_many_ (the gains' Adam in multi-tensor kernels, what MD's eager path runs) is bitwise
    adam_update_ applied to each θ, and leaves each grad as the gains step with it: NaN → 0, clamped to the limit."""
    from weightgeom.optim.md_functional import adam_update_, adam_update_many_, gain_grad_limit

    g = torch.Generator().manual_seed(4)
    shapes = [(7,), (5, 1), (1, 9), (3,)]
    lim = gain_grad_limit(dtype)
    thetas = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    grads = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    grads[1][2, 0] = float("nan")
    grads[2][0, 3] = torch.finfo(dtype).max
    grads[3][1] = -torch.finfo(dtype).max
    m = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    v = [torch.rand(s, generator=g, dtype=dtype) for s in shapes]
    thetas, grads, m, v = ([t.to(device) for t in ts] for ts in (thetas, grads, m, v))
    ref = [(t.clone(), gr.nan_to_num(nan=0.0).clamp(-lim, lim), a.clone(), b.clone())
           for t, gr, a, b in zip(thetas, grads, m, v)]
    for t, gr, a, b in ref:
        adam_update_(t, gr, a, b, 3, 0.01, (0.9, 0.95), 1e-8)
    adam_update_many_(thetas, grads, m, v, 3, 0.01, (0.9, 0.95), 1e-8)
    for (t, gr, a, b), t2, gr2, a2, b2 in zip(ref, thetas, grads, m, v):
        assert torch.equal(t, t2) and torch.equal(gr, gr2) and torch.equal(a, a2) and torch.equal(b, b2)


def test_batched_gain_adam_refuses_mixed_lists_before_touching_anything():
    from weightgeom.optim.md_functional import adam_update_many_

    t32, t64 = torch.zeros(3), torch.zeros(3, dtype=torch.float64)
    g32, g64 = torch.tensor([float("nan"), 1.0, 2.0]), torch.tensor([1e300, 1.0, 2.0], dtype=torch.float64)
    before = (g32.clone(), g64.clone())
    with pytest.raises(ValueError, match="one device and dtype"):
        adam_update_many_([t32, t64], [g32, g64], [torch.zeros(3), torch.zeros(3, dtype=torch.float64)],
                          [torch.zeros(3), torch.zeros(3, dtype=torch.float64)], 1, 0.1)
    with pytest.raises(ValueError, match="step=0"):
        adam_update_many_([t32], [g32], [torch.zeros(3)], [torch.zeros(3)], 0, 0.1)
    assert torch.equal(g32.nan_to_num(), before[0].nan_to_num()) and torch.equal(g64, before[1])
    assert not t32.any() and not t64.any()
