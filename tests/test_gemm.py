"""IEEE float32 products through oneDNN (``weightgeom.linalg.gemm``) and the constraint products' per-device choice.

Tables of shapes and cases drive the checks: with ``onednn=True`` eligible products go to oneDNN and agree
with float64 like an IEEE float32 product; everything else is bitwise ``torch.matmul`` / ``addmm``; the choice among
``ieee`` / ``ieee_onednn`` / ``split_bf16`` follows the probe's timings and the environment.
"""

from __future__ import annotations

import pytest
import torch

from weightgeom import manifolds
from weightgeom.linalg import autotune, gemm
from weightgeom.linalg.gemm import ONEDNN_MIN_DIM, ieee_addmm, ieee_mm
from weightgeom.optim import Muon

needs_onednn = pytest.mark.skipif(not gemm.onednn_available("cpu"),
                                  reason=f"no oneDNN float32 linear: {gemm.unavailable_reason()}")

# An IEEE float32 product's error against float64, relative to max (|A|·|B|): k·2⁻²⁴ at worst, ~1e-7 measured.
IEEE_REL = 2e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel_err(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor, Cin: torch.Tensor | None = None,
             alpha: float = 1.0) -> float:
    want = alpha * (A.double() @ B.double())
    if Cin is not None:
        want = want + Cin.double()
    scale = float((A.double().abs() @ B.double().abs()).abs().max()) * max(1.0, abs(alpha))
    return float((C.double() - want).abs().max()) / max(scale, 1e-300)


@pytest.fixture
def calls(monkeypatch):
    """The oneDNN op wrapped to count its calls (the list)."""
    got: list[tuple] = []
    assert gemm._load() is not None
    real = gemm._op
    monkeypatch.setattr(gemm, "_op", lambda *a: got.append(tuple(a[0].shape)) or real(*a))
    return got


# (name, A factory, B factory): every one of these goes to oneDNN (dims ≥ ONEDNN_MIN_DIM)
def _t(shape, seed):
    return torch.randn(*shape, generator=_gen(seed))


ELIGIBLE = [
    ("square", lambda: _t((64, 64), 1), lambda: _t((64, 64), 2)),
    ("tall@small", lambda: _t((300, 48), 3), lambda: _t((48, 40), 4)),
    ("XtA (transposed view)", lambda: _t((256, 96), 5).mT, lambda: _t((256, 80), 6)),
    ("B transposed view", lambda: _t((70, 50), 7), lambda: _t((33, 50), 8).mT),
    ("sliced rows", lambda: _t((100, 64), 9)[10:90], lambda: _t((64, 32), 10)),
    ("batched", lambda: _t((3, 40, 36), 11), lambda: _t((3, 36, 50), 12)),
    ("broadcast B", lambda: _t((2, 40, 36), 13), lambda: _t((36, 50), 14)),
    ("large scale", lambda: 1e15 * _t((40, 40), 15), lambda: 1e15 * _t((40, 40), 16)),
]


@needs_onednn
@pytest.mark.parametrize("name,fa,fb", ELIGIBLE, ids=[c[0] for c in ELIGIBLE])
def test_ieee_mm_through_onednn_is_an_ieee_product(name, fa, fb, calls):
    A, B = fa(), fb()
    C = ieee_mm(A, B, onednn=True)
    assert calls, "not sent to oneDNN"
    assert C.shape == torch.matmul(A, B).shape and C.dtype == torch.float32 and C.is_contiguous()
    assert _rel_err(C, A, B) < IEEE_REL


@needs_onednn
def test_a_batch_gets_the_bits_of_its_matrices_alone(calls):
    A, B = _t((4, 50, 40), 20), _t((4, 40, 60), 21)
    C = ieee_mm(A, B, onednn=True)
    alone = [ieee_mm(A[i], B[i], onednn=True) for i in range(4)]
    D = ieee_addmm(_t((4, 50, 60), 22), A, B, alpha=-2.0, onednn=True)
    alone_d = [ieee_addmm(_t((4, 50, 60), 22)[i], A[i], B[i], alpha=-2.0, onednn=True) for i in range(4)]
    assert all(torch.equal(C[i], alone[i]) for i in range(4))
    assert all(torch.equal(D[i], alone_d[i]) for i in range(4))


# (name, A, B, onednn asked?): each of these is torch's own product, bitwise
NOT_ELIGIBLE = [
    ("not asked", lambda: _t((64, 64), 30), lambda: _t((64, 64), 31), False),
    ("matrix-vector", lambda: _t((64, 64), 32), lambda: _t((64, 1), 33), True),
    (f"inner dim < {ONEDNN_MIN_DIM}", lambda: _t((64, ONEDNN_MIN_DIM - 1), 34),
     lambda: _t((ONEDNN_MIN_DIM - 1, 64), 35), True),
    ("float64", lambda: _t((64, 64), 36).double(), lambda: _t((64, 64), 37).double(), True),
    ("bfloat16", lambda: _t((64, 64), 38).bfloat16(), lambda: _t((64, 64), 39).bfloat16(), True),
    ("1-D B", lambda: _t((64, 64), 40), lambda: _t((64,), 41), True),
    # layouts oneDNN cannot describe (it raised "could not construct a memory descriptor"): torch's product
    ("B sliding-window view", lambda: _t((64, 48), 43), lambda: _t((20000,), 44).unfold(0, 50, 1)[:48], True),
    ("B interleaved strides", lambda: _t((64, 48), 45), lambda: _t((20000,), 46).as_strided((48, 50), (3, 101)), True),
    ("B.mT interleaved", lambda: _t((64, 48), 47), lambda: _t((20000,), 48).as_strided((48, 50), (101, 3)), True),
    ("A sliding-window view", lambda: _t((20000,), 49).unfold(0, 48, 1)[:64], lambda: _t((48, 50), 52), True),
    ("stride-0 rows", lambda: _t((1, 48), 53).expand(64, 48), lambda: _t((48, 50), 54), True),
]


@pytest.mark.parametrize("name,fa,fb,inside", NOT_ELIGIBLE, ids=[c[0] for c in NOT_ELIGIBLE])
def test_other_products_are_torchs_bitwise(name, fa, fb, inside, monkeypatch):
    seen: list[int] = []
    if gemm._load() is not None:
        real = gemm._op
        monkeypatch.setattr(gemm, "_op", lambda *a: seen.append(1) or real(*a))
    A, B = fa(), fb()
    C = ieee_mm(A, B, onednn=inside)
    if B.ndim == 2:
        Cin = torch.randn(C.shape, generator=_gen(42)).to(C.dtype)
        D = ieee_addmm(Cin, A, B, alpha=0.5, onednn=inside)
        assert torch.equal(D, torch.addmm(Cin, A, B, alpha=0.5))
    assert torch.equal(C, A @ B) and not seen


def test_forward_mode_tangents_are_kept():
    """oneDNN's op has no forward derivative: a dual or torch.func-wrapped factor takes torch's product (the
    tangent was silently zero); also through a manifold projection and an addmm with a dual C."""
    import torch.autograd.forward_ad as fwAD

    A, B, dA = _t((64, 48), 55), _t((48, 40), 56), _t((64, 48), 57)
    _, tangent = torch.func.jvp(lambda a: ieee_mm(a, B, onednn=True), (A,), (dA,))
    assert torch.allclose(tangent, dA @ B, rtol=1e-5, atol=1e-5)
    with fwAD.dual_level():
        C = fwAD.make_dual(_t((64, 40), 58), _t((64, 40), 59))
        out = fwAD.unpack_dual(ieee_addmm(C, A, B, alpha=-1.0, onednn=True))
        assert out.tangent is not None and torch.equal(out.tangent, fwAD.unpack_dual(C).tangent)
    W = manifolds.get("stiefel").random_point(256, 64).float()
    G, dW = _t((256, 64), 60), 1e-3 * _t((256, 64), 61)
    _, t1 = torch.func.jvp(lambda w: manifolds.get("stiefel").proj_tangent(w, G, "ieee_onednn"), (W,), (dW,))
    _, t0 = torch.func.jvp(lambda w: manifolds.get("stiefel").proj_tangent(w, G), (W,), (dW,))
    assert float(t0.norm()) > 0 and torch.allclose(t1, t0, rtol=1e-4, atol=1e-6)


def test_an_addmm_whose_c_autograd_tracks_is_torchs():
    A, B = _t((64, 48), 62), _t((48, 40), 63)
    C = _t((64, 40), 64).requires_grad_()
    D = ieee_addmm(C, A, B, alpha=-1.0, onednn=True)
    assert torch.equal(D, torch.addmm(C, A, B, alpha=-1.0))
    D.sum().backward()
    assert torch.equal(C.grad, torch.ones(64, 40))


@needs_onednn
def test_alpha_zero_leaves_c_as_torch_does(calls):
    A, B, Cin = _t((64, 48), 65), _t((48, 40), 66), _t((64, 40), 67)
    A[0, 0] = float("nan")
    A[1, 1] = float("inf")
    for inplace in (False, True):
        C = Cin.clone()
        D = ieee_addmm(C, A, B, alpha=0.0, inplace=inplace, onednn=True)
        assert torch.equal(D, Cin) and (D is C) == inplace
    assert not calls


@needs_onednn
def test_inplace_writes_c_on_every_path(calls):
    """inplace: the result in C whether oneDNN runs (k ≥ ONEDNN_MIN_DIM) or torch's batched addmm (k below)."""
    for k in (ONEDNN_MIN_DIM + 16, ONEDNN_MIN_DIM // 2):
        A, B, Cin = _t((3, 40, k), 68), _t((3, k, 36), 69), _t((3, 40, 36), 70)
        C = Cin.clone()
        D = ieee_addmm(C, A, B, alpha=-1.0, inplace=True, onednn=True)
        assert D is C and _rel_err(C, A, B, Cin, -1.0) < IEEE_REL


@needs_onednn
def test_results_stay_on_the_inputs_device_whatever_the_default(calls):
    A, B = _t((2, 40, 36), 71), _t((2, 36, 50), 72)
    torch.set_default_device("meta")
    try:
        C = ieee_mm(A, B, onednn=True)
    finally:
        torch.set_default_device(None)
    assert C.device.type == "cpu" and calls and _rel_err(C, A, B) < IEEE_REL


@needs_onednn
def test_the_self_test_runs_on_the_cpu_whatever_the_default(monkeypatch):
    monkeypatch.setattr(gemm, "_op", None)  # looked at again
    torch.set_default_device("meta")
    try:
        ok = gemm.onednn_available("cpu")
    finally:
        torch.set_default_device(None)
    assert ok and gemm.unavailable_reason() == ""


@needs_onednn
def test_mkldnn_disabled_by_the_user_is_respected(calls):
    A, B = _t((64, 64), 73), _t((64, 64), 74)
    with torch.backends.mkldnn.flags(enabled=False):
        C = ieee_mm(A, B, onednn=True)
    assert torch.equal(C, A @ B) and not calls


def test_autograd_tracked_factors_keep_torchs_product_and_gradient():
    A = _t((64, 64), 50).requires_grad_()
    B = _t((64, 64), 51)
    C = ieee_mm(A, B, onednn=True)
    assert torch.equal(C, A @ B)
    C.sum().backward()
    assert A.grad is not None and torch.equal(A.grad, torch.ones(64, 64) @ B.mT)


ADDMM = [  # (alpha, inplace)
    (1.0, False), (-1.0, False), (2.0, False), (0.3, False), (1.0, True), (-1.0, True), (2.0, True),
]


@needs_onednn
@pytest.mark.parametrize("alpha,inplace", ADDMM, ids=[f"alpha={a},inplace={i}" for a, i in ADDMM])
def test_ieee_addmm_through_onednn(alpha, inplace, calls):
    A, B = _t((300, 64), 60), _t((64, 64), 61)
    Cin = _t((300, 64), 62)
    C = Cin.clone()
    v = C._version
    D = ieee_addmm(C, A, B, alpha=alpha, inplace=inplace, onednn=True)
    assert calls
    assert _rel_err(D, A, B, Cin, alpha) < IEEE_REL
    if inplace:
        assert D is C and C._version > v  # written through torch: a saved-for-backward C would be caught
    else:
        assert torch.equal(C, Cin)  # C untouched


@needs_onednn
def test_ieee_addmm_with_a_broadcast_c_falls_back_to_torch(calls):
    A, B, c = _t((100, 64), 63), _t((64, 48), 64), _t((1, 48), 65)
    D = ieee_addmm(c, A, B, onednn=True)
    assert torch.equal(D, torch.addmm(c, A, B)) and not calls


@needs_onednn
def test_onednn_products_follow_full_precision_not_the_process_mode():
    """oneDNN's float32 linear reads torch.backends.mkldnn.matmul.fp32_precision (bf16 arithmetic on AMX/AVX512-BF16
    CPUs when a script asked for 'medium'): ieee_mm runs inside full_precision, so it stays IEEE and the mode stays."""
    A, B = _t((256, 256), 70), _t((256, 256), 71)
    before = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        C = ieee_mm(A, B, onednn=True)
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = before
    assert _rel_err(C, A, B) < IEEE_REL


# ---- the per-device choice -------------------------------------------------------------------------------------
PICKS = [  # probe seconds per kind → the kind
    ({"ieee": 10.0}, "ieee"),
    ({"ieee": 10.0, "ieee_onednn": 5.0}, "ieee_onednn"),
    ({"ieee": 10.0, "ieee_onednn": 8.5}, "ieee"),  # not a clear gain: torch's BLAS (the bits a user had)
    ({"ieee": 10.0, "ieee_onednn": 9.5, "split_bf16": 6.0}, "split_bf16"),  # AMX Xeon
    ({"ieee": 10.0, "ieee_onednn": 5.0, "split_bf16": 6.0}, "ieee_onednn"),  # split vs the faster IEEE
    ({"ieee": 10.0, "ieee_onednn": 5.0, "split_bf16": 3.0}, "split_bf16"),
    ({"ieee": 8.6, "ieee_onednn": 5.5, "split_bf16": 19.2}, "ieee_onednn"),  # measured: AMD EPYC, AVX512-BF16
    ({"ieee": 10.0, "split_bf16": 7.5}, "ieee"),
]


@pytest.mark.parametrize("seconds,kind", PICKS, ids=[str(p[0]) for p in PICKS])
def test_the_products_kind_follows_the_probe(seconds, kind):
    assert autotune._pick_products(seconds) == kind


@pytest.fixture
def measured(monkeypatch):
    """The msign choice forced (no benchmark), the products' probe replaced by given timings."""
    monkeypatch.setenv(autotune.ENV_VAR, "float32:5")
    monkeypatch.delenv(autotune.PRODUCTS_ENV_VAR, raising=False)
    monkeypatch.delenv(autotune.SPLIT_ENV_VAR, raising=False)
    box = {"seconds": {"ieee": 10.0, "ieee_onednn": 5.0}}
    monkeypatch.setattr(autotune, "_measure_products",
                        lambda device: (autotune._pick_products(box["seconds"]), dict(box["seconds"])))
    monkeypatch.setattr(autotune, "_products_available", lambda kind, device: True)
    autotune.clear_msign_choices()
    yield box
    autotune.clear_msign_choices()


ENV = [  # (WEIGHTGEOM_PRODUCTS, WEIGHTGEOM_SPLIT_PRODUCTS, probe seconds, the kind)
    (None, None, {"ieee": 10.0, "ieee_onednn": 5.0}, "ieee_onednn"),
    ("ieee", None, {"ieee": 10.0, "ieee_onednn": 5.0}, "ieee"),
    ("split_bf16", None, {"ieee": 10.0, "ieee_onednn": 5.0}, "split_bf16"),
    ("auto", None, {"ieee": 10.0, "ieee_onednn": 5.0}, "ieee_onednn"),
    (None, "1", {"ieee": 10.0, "ieee_onednn": 5.0}, "split_bf16"),
    (None, "0", {"ieee": 10.0, "ieee_onednn": 9.9, "split_bf16": 3.0}, "ieee"),
    (None, "0", {"ieee": 10.0, "ieee_onednn": 5.0, "split_bf16": 3.0}, "ieee_onednn"),
    ("ieee_onednn", "1", {"ieee": 10.0}, "ieee_onednn"),  # the newer variable wins
]


@pytest.mark.parametrize("products,split,seconds,kind", ENV, ids=[f"{e[0]}-{e[1]}-{len(e[2])}" for e in ENV])
def test_the_environment_forces_or_limits_the_kind(products, split, seconds, kind, measured, monkeypatch):
    measured["seconds"] = seconds
    if products is not None:
        monkeypatch.setenv(autotune.PRODUCTS_ENV_VAR, products)
    if split is not None:
        monkeypatch.setenv(autotune.SPLIT_ENV_VAR, split)
    assert autotune.products_for("cpu") == kind
    assert autotune.split_products_for("cpu") == (kind == "split_bf16")


@pytest.mark.parametrize("var,value", [(autotune.PRODUCTS_ENV_VAR, "fast"), (autotune.PRODUCTS_ENV_VAR, "IEEE"),
                                       (autotune.SPLIT_ENV_VAR, "yes")])
def test_an_invalid_environment_value_is_refused_naming_the_variable(var, value, measured, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        autotune.products_for("cpu")
    with pytest.raises(ValueError, match=var):
        Muon([torch.nn.Parameter(torch.randn(64, 32))], manifold="stiefel")


def test_a_kind_not_available_here_falls_back_to_ieee(monkeypatch):
    monkeypatch.setattr(autotune, "onednn_available", lambda device="cpu": False)
    monkeypatch.setattr(autotune, "split_available", lambda device="cpu": False)
    monkeypatch.setenv(autotune.PRODUCTS_ENV_VAR, "ieee_onednn")
    assert autotune.products_for("cpu") == "ieee"
    monkeypatch.setenv(autotune.PRODUCTS_ENV_VAR, "split_bf16")
    assert autotune.products_for("cpu") == "ieee"
    try:
        for kind in autotune.PRODUCTS:
            assert autotune.adopt_msign_choice("cpu", torch.float32, 5, kind).products == "ieee"
    finally:
        autotune.clear_msign_choices()
    with pytest.raises(ValueError, match="products='fast'"):
        autotune.adopt_msign_choice("cpu", torch.float32, 5, "fast")


def test_a_gpu_never_takes_a_cpu_kind(monkeypatch):
    monkeypatch.setenv(autotune.PRODUCTS_ENV_VAR, "ieee_onednn")
    assert autotune.products_for("cuda:0") == "ieee"


def test_an_unknown_products_kind_is_refused():
    with pytest.raises(ValueError, match="products='fast'"):
        manifolds.get("stiefel").proj_tangent(torch.eye(4, 2), torch.ones(4, 2), products="fast")


# ---- manifold Muon with its constraint products through oneDNN ---------------------------------------------------
@needs_onednn
@pytest.mark.parametrize("name", ["stiefel", "dgram", "oblique"])
def test_manifold_muon_through_onednn_matches_torchs_blas(name, monkeypatch, calls):
    """4 steps of 512×256, 256×512 and 256² matrices with the products forced through oneDNN and through torch's
    BLAS (a float32 msign, so only the constraint products differ): the weights agree to 1e-5 relative, stay on the
    manifold (1e-6), tangent residual ≤ 1e-6, and oneDNN was called (torch's BLAS run: never)."""
    g = _gen(90)
    shapes = [(512, 256), (256, 512), (256, 256)]
    init = [0.02 * torch.randn(s, generator=g) for s in shapes]
    grads = [[1e-3 * torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    runs = {}
    for kind in ("ieee_onednn", "ieee"):
        monkeypatch.setenv(autotune.PRODUCTS_ENV_VAR, kind)
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        opt = Muon([{"params": ps, "names": [f"w{i}" for i in range(3)]}], lr=0.02, manifold=name,
                   msign_dtype=torch.float32, ns_steps=8)
        assert opt._products_for(ps[0].detach()) == kind and f"constraint products on cpu: {kind}" in opt.summary()
        calls.clear()
        for step in grads:
            for p, gr in zip(ps, step):
                p.grad = gr.clone()
            opt.step()
        assert bool(calls) == (kind == "ieee_onednn"), calls
        assert max(s["tangent_residual"] for s in opt.last_stats.values()) <= 1e-6
        for p in ps:
            assert manifolds.get(name).check(p.detach(), tol=1e-6)
        runs[kind] = [p.detach().clone() for p in ps]
    for a, b in zip(runs["ieee_onednn"], runs["ieee"]):
        assert float((a - b).norm() / b.norm()) < 1e-5


def test_the_probe_measures_every_kind_available_here():
    kind, seconds = autotune._measure_products(torch.device("cpu"))
    want = {"ieee"} | ({"ieee_onednn"} if gemm.onednn_available() else set()) | \
        ({"split_bf16"} if autotune.split_available("cpu") else set())
    if want == {"ieee"}:
        assert (kind, seconds) == ("ieee", {})
    else:
        assert set(seconds) == want and all(v > 0 for v in seconds.values())
        assert kind == autotune._pick_products(seconds)
