"""Split-bf16 products (weightgeom.linalg.split), the constraint-product helpers that use them, the C Lanczos and split
kernels (kernels/linalg.c), blocked layout copies, and manifold Muon with the split on and off."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from weightgeom import kernels, manifolds
from weightgeom.linalg import autotune, column_norms, layout, msign
from weightgeom.linalg import split as S
from weightgeom.manifolds.base import (
    SPLIT_MIN_DIM,
    Products,
    constraint_addmm,
    constraint_gram,
    constraint_mm,
    products_of,
    small_mm,
)
from weightgeom.manifolds.dgram import dgram_retract_column_polar
from weightgeom.manifolds.stiefel import polar_near
from weightgeom.optim import Muon
from weightgeom.optim.manifold_muon import LANCZOS_BREAKDOWN, _lanczos_coefficients, spectral_norm_estimate

# The MKL routine ships in torch's x86 CPU library; elsewhere the split falls back to IEEE products (tested below
# with the routine hidden), so the tests that need the routine itself say why they cannot run.
needs_split = pytest.mark.skipif(not S.split_available("cpu"), reason=f"no split-bf16 products: "
                                 f"{S.unavailable_reason()}")
needs_kernel = pytest.mark.skipif(kernels.load_kernel("linalg") is None,
                                  reason=f"no C kernel: {kernels.unavailable_reason('linalg')}")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _two_steps(calls: list, manifold: str, seed: int) -> None:
    """Two manifold-Muon steps of a 512×256 parameter with its constraint products split-bf16 (whatever this CPU's
    choice), ``calls`` cleared before each (it keeps the last step's)."""
    p = torch.nn.Parameter(0.02 * torch.randn(512, 256, generator=_gen(seed)))
    old = os.environ.get(autotune.PRODUCTS_ENV_VAR)
    os.environ[autotune.PRODUCTS_ENV_VAR] = "split_bf16"  # read when the group is added
    try:
        opt = Muon([p], lr=0.02, manifold=manifold)
    finally:
        if old is None:
            os.environ.pop(autotune.PRODUCTS_ENV_VAR)
        else:
            os.environ[autotune.PRODUCTS_ENV_VAR] = old
    assert opt._products_for(p.detach()) == "split_bf16"
    for _ in range(2):
        p.grad = 1e-3 * torch.randn(512, 256, generator=_gen(seed + 1))
        calls.clear()
        opt.step()


@contextlib.contextmanager
def _counting(name: str) -> Iterator[list[int]]:
    """``kernels.<name>`` wrapped to count its calls (the list yielded), restored on exit (also when the body replaced
    it, e.g. by ``lambda *a, **k: None`` to take its callers' torch path)."""
    calls: list[int] = []
    real = getattr(kernels, name)
    setattr(kernels, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    try:
        yield calls
    finally:
        setattr(kernels, name, real)


def _within_bound(C: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> bool:
    """|C − AB| ≤ (SPLIT_REL_ERROR + k·2⁻²⁴)·(|A|·|B|) entrywise (AB in float64; k the inner dimension)."""
    ref = A.double() @ B.double()
    bound = (S.SPLIT_REL_ERROR + A.shape[-1] * 2.0**-24) * (A.double().abs() @ B.double().abs())
    return bool(((C.double() - ref).abs() <= bound).all())


# ---- split_bf16 ------------------------------------------------------------------------------------------------------
def test_split_pieces_reconstruct_to_2_pow_minus_17():
    X = torch.randn(300, 200, generator=_gen()) * torch.logspace(-6, 6, 200)
    hi, lo = S.split_bf16(X)
    assert hi.dtype == lo.dtype == torch.bfloat16
    err = ((hi.double() + lo.double() - X.double()).abs() / X.double().abs()).max()
    assert err <= 2.0**-17
    assert torch.equal(hi, X.bfloat16())  # hi is torch's own rounding


@needs_kernel
def test_split_kernel_and_torch_path_give_the_same_bits(monkeypatch):
    X = torch.randn(513, 257, generator=_gen(1))
    # rounding up to ±inf, a subnormal, a signed zero, ±inf, NaN
    X[0, :7] = torch.tensor([3.4e38, -3.4e38, 1e-40, -0.0, float("inf"), float("-inf"), float("nan")])
    hi_k, lo_k = kernels.split_bf16_kernel(X)
    hi_only, none = kernels.split_bf16_kernel(X, lo=False)  # hi alone: the same hi
    assert none is None and S.split_bf16(X, lo=False)[1] is None
    monkeypatch.setattr(kernels, "load_kernel", lambda name="md_adam": None)
    hi_t, lo_t = S.split_bf16(X)
    for k, t in ((hi_k, hi_t), (lo_k, lo_t), (hi_only, hi_t)):  # bit for bit, but NaN (its sign and payload vary)
        nan = t.isnan()
        assert torch.equal(k.isnan(), nan)
        assert torch.equal(k.view(torch.int16)[~nan], t.view(torch.int16)[~nan])


def test_split_of_a_transposed_view_is_the_transposed_split():
    X = torch.randn(64, 300, generator=_gen(2))
    hi, lo = S.split_bf16(X.mT)
    hi2, lo2 = S.split_bf16(X)
    assert hi.shape == (300, 64) and torch.equal(hi, hi2.mT) and torch.equal(lo, lo2.mT)


def test_split_memo_is_the_callers_and_sees_in_place_changes():
    X = torch.randn(50, 40, generator=_gen(3))
    memo: dict = {}
    a = S.split_bf16(X, memo=memo)
    assert S.split_bf16(X, memo=memo)[0] is a[0]  # remembered
    X.add_(1.0)  # a new version: split again
    b = S.split_bf16(X, memo=memo)
    assert b[0] is not a[0] and torch.equal(b[0], X.bfloat16())
    c = S.split_bf16(X)
    assert c[0] is not b[0]  # without a memo nothing is remembered


def test_constraint_products_are_a_value_with_a_memo_per_call():
    """The products' kind is an argument, not a mode: a kind name gets a fresh ``Products`` (its own memo) per call,
    a caller's ``Products`` passes through (its memo shared by its products), an unknown kind is refused."""
    a, b = Products("split_bf16"), products_of("split_bf16")
    assert a.memo == {} and b.memo == {} and a.memo is not b.memo and products_of(a) is a
    assert Products("ieee").memo is None and not Products("ieee").split and products_of("ieee_onednn").onednn
    assert a.split == S.split_available()
    with pytest.raises(ValueError, match="products='fast'"):
        Products("fast")


# ---- split_matmul / bf16_gemm_ -----------------------------------------------------------------------------------
SHAPES = [((96, 64), (64, 80)), ((300, 257), (257, 31)), ((1, 5), (5, 1)), ((2, 40, 30), (2, 30, 20))]


@needs_split
@pytest.mark.parametrize("sa,sb", SHAPES)
@pytest.mark.parametrize("layout_a", ["row", "transposed"])
def test_split_matmul_matches_float64(sa, sb, layout_a):
    g = _gen(4)
    A = torch.randn(*sa, generator=g)
    if layout_a == "transposed":
        A = A.mT.contiguous().mT
    B = torch.randn(*sb, generator=g) * 1e-3
    C = S.split_matmul(A, B)
    assert _within_bound(C, A, B)
    assert not torch.equal(C, A @ B) or A.shape[-1] < 3  # the split really ran
    Bb = B.bfloat16()  # an exactly-bf16 factor: its lo piece is skipped, the product is as accurate
    assert _within_bound(S.split_matmul(A, (Bb, None)), A, Bb.float())


@needs_split
def test_split_matmul_accumulates_with_alpha_and_beta():
    g = _gen(5)
    A, B, C = torch.randn(70, 50, generator=g), torch.randn(50, 60, generator=g), torch.randn(70, 60, generator=g)
    out = S.split_matmul(A, B, out=C.clone(), alpha=-0.5, beta=2.0)
    ref = 2.0 * C.double() - 0.5 * (A.double() @ B.double())
    bound = 0.5 * (S.SPLIT_REL_ERROR + 50 * 2.0**-24) * (A.double().abs() @ B.double().abs()) + 1e-6 * C.abs()
    assert bool(((out.double() - ref).abs() <= bound).all())


@needs_split
def test_bf16_gemm_refuses_bad_operands_and_handles_empty():
    a, b = torch.randn(4, 3).bfloat16(), torch.randn(3, 2).bfloat16()
    for C, A, B in [(torch.empty(4, 2, dtype=torch.bfloat16), a, b), (torch.empty(4, 3), a, b),
                    (torch.empty(4, 2), a.float(), b), (torch.empty(2, 4).mT, a, b)]:
        with pytest.raises(ValueError, match="bf16_gemm_"):
            S.bf16_gemm_(C, A, B)
    C = torch.full((4, 2), 3.0)
    S.bf16_gemm_(C, torch.empty(4, 0, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.bfloat16), beta=0.5)
    assert torch.equal(C, torch.full((4, 2), 1.5))
    C = torch.full((4, 2), float("nan"))
    S.bf16_gemm_(C, a, b)  # β = 0 ignores C
    assert torch.isfinite(C).all()


def test_split_matmul_falls_back_to_ieee_without_the_routine(monkeypatch):
    monkeypatch.setattr(S, "_load", lambda: None)
    g = _gen(6)
    A, B = torch.randn(30, 20, generator=g), torch.randn(20, 10, generator=g)
    assert not S.split_available()
    torch.testing.assert_close(S.split_matmul(A, B), A @ B, rtol=1e-6, atol=1e-6)


# ---- constraint products ---------------------------------------------------------------------------------------------
@needs_split
def test_constraint_products_split_only_large_cpu_float32_matrices():
    g = _gen(7)
    n = SPLIT_MIN_DIM
    X, A = torch.randn(2 * n, n, generator=g) / n, torch.randn(2 * n, n, generator=g) / n
    L = torch.randn(n, n, generator=g) * 1e-3
    small_X = X[:, : n - 1]
    sp = "split_bf16"
    S_split = constraint_mm(X.mT, A, products=sp)
    P_split = constraint_addmm(A, X, L, alpha=-1.0, products=sp)
    G_split = constraint_gram(X, products=sp)
    # below SPLIT_MIN_DIM, and in float64: exactly the IEEE products
    assert torch.equal(constraint_mm(small_X.mT, A[:, : n - 1], products=sp), small_X.mT @ A[:, : n - 1])
    assert torch.equal(constraint_gram(X.double(), products=sp), X.double().mT @ X.double())
    assert not torch.equal(S_split, X.mT @ A)  # the split really ran
    assert _within_bound(S_split, X.mT, A)
    ref = A.double() - X.double() @ L.double()
    assert float((P_split.double() - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
    assert torch.equal(G_split.diagonal(), column_norms(X, squared=True))  # the diagonal summed from X itself
    assert _within_bound(G_split, X.mT, X)


@needs_split
def test_small_products_keep_the_identity_part_exact():
    """``small=True``: C + α·A·B with B = diag + small off-diagonal — the diagonal as an exact column scaling."""
    g = _gen(8)
    n = SPLIT_MIN_DIM
    X = torch.randn(2 * n, n, generator=g)
    F = 1e-4 * torch.randn(n, n, generator=g)
    F.diagonal().copy_(torch.linspace(-0.3, 0.3, n))
    out = constraint_addmm(X, X, F, small=True, products="split_bf16")
    E = 1e-3 * torch.randn(n, n, generator=g)
    E2 = small_mm(E, E, "split_bf16")
    ref = X.double() + X.double() @ F.double()
    assert float((out.double() - ref).abs().max() / ref.abs().max()) <= 1e-5
    assert float((E2.double() - E.double() @ E.double()).abs().max()) <= 1e-2 * float((E @ E).abs().max())


# ---- manifold Muon, split on and off -------------------------------------------------------------------------------
@needs_split
@pytest.mark.parametrize("name", ["stiefel", "dgram"])
def test_manifold_muon_with_split_products_stays_tangent_and_on_the_manifold(name, monkeypatch):
    """512×256, 256×512 and 256² matrices, 6 steps with the split forced on (the per-device msign, and a float32 one)
    and off: the split runs' tangent residual ≤ 1e-6 and weights on the manifold to 2e-6; with a float32 msign the
    split run's weights within 1e-5 (relative) of the IEEE run's."""
    g = _gen(9)
    shapes = [(512, 256), (256, 512), (256, 256)]
    init = [0.02 * torch.randn(s, generator=g) for s in shapes]
    grads = [[1e-3 * torch.randn(s, generator=g) for s in shapes] for _ in range(6)]
    runs = {}
    gemms = []
    real = S.bf16_gemm_
    monkeypatch.setattr(S, "bf16_gemm_", lambda *a, **k: gemms.append(1) or real(*a, **k))
    for flag, dtype in (("1", None), ("1", torch.float32), ("0", torch.float32)):
        monkeypatch.setenv(autotune.SPLIT_ENV_VAR, flag)
        ps = [torch.nn.Parameter(w.clone()) for w in init]
        opt = Muon([{"params": ps, "names": [f"w{i}" for i in range(3)]}], lr=0.02, manifold=name,
                   msign_dtype=dtype)
        assert (opt._products_for(ps[0].detach()) == "split_bf16") == (flag == "1")
        for gr in grads:
            for p, x in zip(ps, gr):
                p.grad = x
            gemms.clear()
            opt.step()
            # the split ran for every matrix (the 512×256 one is stepped in place: a parameter, requires_grad)
            assert (len(gemms) >= 3 * 4) == (flag == "1")
            res = max(s["tangent_residual"] for s in opt.last_stats.values())
            assert res <= 1e-6
        runs[flag, dtype] = [p.detach().clone() for p in ps]
    man = manifolds.get(name)
    for a in runs["1", None] + runs["1", torch.float32]:  # the split's floor: max |cos| 4–9e-7 (IEEE: ~1e-7)
        assert man.check(a, tol=2e-6), man.check(a, tol=2e-6).reason
    # with a float32 msign (a bf16 one would turn differences of 1e-7 into bf16 rounding flips) the split run follows
    # the IEEE one
    for a, b in zip(runs["1", torch.float32], runs["0", torch.float32]):
        assert float((a - b).norm() / b.norm()) <= 1e-5


def test_split_env_var_is_validated_and_zero_turns_the_split_off(monkeypatch):
    monkeypatch.setenv(autotune.SPLIT_ENV_VAR, "yes")
    with pytest.raises(ValueError, match="WEIGHTGEOM_SPLIT_PRODUCTS"):
        autotune.split_products_for("cpu")
    monkeypatch.setenv(autotune.SPLIT_ENV_VAR, "0")
    assert not autotune.split_products_for("cpu")
    monkeypatch.setenv(autotune.SPLIT_ENV_VAR, "1")
    assert autotune.split_products_for("cpu") == S.split_available("cpu")


def test_products_choice_is_measured_cached_and_adopted(tmp_path, monkeypatch):
    monkeypatch.delenv(autotune.ENV_VAR, raising=False)
    monkeypatch.delenv(autotune.SPLIT_ENV_VAR, raising=False)
    monkeypatch.setenv("WEIGHTGEOM_CACHE_DIR", str(tmp_path))
    autotune.clear_msign_choices()
    try:
        for faster in (True, False):
            monkeypatch.setattr(autotune, "_measure_products",
                                lambda device, f=faster: ("split_bf16" if f and S.split_available() else "ieee",
                                                          {"ieee": 1.0, "split_bf16": 0.5 if f else 0.9}))
            autotune.clear_msign_choices()
            for p in (tmp_path / "msign").glob("*.json"):
                p.unlink()
            c = autotune.msign_choice("cpu")
            assert c.products == ("split_bf16" if faster and S.split_available() else "ieee")
            assert "constraint products" in c.describe()
            assert autotune.split_products_for("cpu") == (c.products == "split_bf16")
            autotune.clear_msign_choices()
            assert autotune.msign_choice("cpu").products == c.products  # from the disk cache
        adopted = autotune.adopt_msign_choice("cpu", torch.float32, 5, "split_bf16")
        assert adopted.products == ("split_bf16" if S.split_available() else "ieee")
        with pytest.raises(ValueError, match="products"):
            autotune.adopt_msign_choice("cpu", torch.float32, 5, "tf32")
    finally:
        autotune.clear_msign_choices()


# ---- the C Lanczos recurrence ----------------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spectrum", ["gaussian", "cluster", "identity"])
def test_lanczos_kernel_matches_the_torch_recurrence(dtype, spectrum):
    n, k = 96, 24
    g = _gen(10)
    if spectrum == "identity":  # an invariant subspace at once: both break down after the first step
        G = torch.eye(n, dtype=dtype)
    else:
        A = torch.randn(3 * n, n, generator=g, dtype=torch.float64)
        if spectrum == "cluster":
            U, _, Vh = torch.linalg.svd(A, full_matrices=False)
            A = U @ torch.diag(torch.cat([torch.tensor([1.05, 1.02]), torch.ones(n - 2)]).double()) @ Vh
        G = A.mT @ A
        G = (G / G.diagonal().max()).to(dtype)
    v = torch.randn(n, 1, generator=g, dtype=torch.float64).to(dtype)
    v = v / v.norm()
    noise = LANCZOS_BREAKDOWN * torch.finfo(dtype).eps * n**0.5
    ours = kernels.lanczos(G.contiguous(), v.reshape(-1).contiguous(), k, noise)
    # the torch recurrence on the same matrix (its near-square path multiplies by GᵀG: use a Gram factor instead)
    L = torch.linalg.cholesky(G.double() + 1e-12 * torch.eye(n, dtype=torch.float64)).mT.to(dtype)
    ref, unit = _lanczos_coefficients(torch.cat([L, torch.zeros_like(L)]), v, k=k, gram_dtype=None)
    ref = ref * unit.reshape(()).double()
    def top(c: torch.Tensor) -> torch.Tensor:
        off = c[k:2 * k - 1]
        return torch.linalg.eigvalsh(torch.diag_embed(c[:k]) + torch.diag_embed(off, 1) + torch.diag_embed(off, -1))[-1]

    tol = 1e-4 if dtype == torch.float32 else 1e-10
    assert abs(float(top(ours) - top(ref))) <= tol * float(top(ref))
    if spectrum == "identity":
        assert torch.equal(ours[k:], torch.zeros(k, dtype=torch.float64))


@needs_kernel
def test_spectral_norm_estimate_same_with_and_without_the_kernel(monkeypatch):
    A = torch.randn(2, 600, 200, generator=_gen(11))
    with_kernel = spectral_norm_estimate(A)
    monkeypatch.setattr(kernels, "load_kernel", lambda name="md_adam": None)
    without = spectral_norm_estimate(A)
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=0)
    exact = torch.linalg.matrix_norm(A.double(), ord=2).reshape(2, 1, 1)
    assert float(((with_kernel.double() - exact) / exact).abs().max()) <= 1e-3


# ---- layout copies and DGram's scaled retraction ------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(300, 700), (700, 300), (3, 400, 300), (10, 20)])
def test_blocked_copy_equals_copy(shape):
    src = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=_gen(12)).mT
    dst = torch.empty(shape)
    assert layout.copy_(dst, src) is dst and torch.equal(dst, src)
    back = torch.empty(*shape[:-2], shape[-1], shape[-2]).mT  # a transposed destination
    assert layout.copy_(back, dst) is back and torch.equal(back, dst)
    assert torch.equal(layout.stacked([src, src + 1]), torch.stack([src, src + 1]))


def test_scaled_polar_near_is_the_normalised_one():
    """polar_near(Z, scale=d) = polar_near(Z/d)·d — DGram's column-polar retraction without forming Z/d."""
    g = _gen(13)
    Q, _ = torch.linalg.qr(torch.randn(200, 50, generator=g, dtype=torch.float64))
    d = torch.exp(torch.randn(1, 50, generator=g, dtype=torch.float64))
    Z = (Q + 1e-3 * torch.randn(200, 50, generator=g, dtype=torch.float64)) * d
    norms = Z.norm(dim=0, keepdim=True)
    torch.testing.assert_close(polar_near(Z, scale=norms), polar_near(Z / norms) * norms, rtol=1e-12, atol=1e-14)
    R = dgram_retract_column_polar(Z)
    assert manifolds.get("dgram").check(R, tol=1e-12)
    torch.testing.assert_close(R.norm(dim=0, keepdim=True), norms, rtol=1e-12, atol=0)


# ---- hostile inputs (each failed before its fix) ---------------------------------------------------------------------
@needs_split
@pytest.mark.parametrize("repoint", ["set_", "resize_", "data"])
def test_memo_never_hands_out_another_tensors_pieces(repoint):
    """A tensor re-pointed to other memory while a memo is in use: its old address may be reused by a new tensor of the
    same shape and version; the memo keys on the storage object (kept alive), so the new tensor is split afresh."""
    B = torch.randn(300, 300, generator=_gen(20))
    memo: dict = {}
    for _ in range(10):
        X = torch.randn(300, 300)
        S.split_matmul(X, B, memo=memo)
        if repoint == "set_":
            X.set_(torch.empty(0))
        elif repoint == "resize_":
            X.resize_(1000, 1000)
        else:
            X.data = torch.empty(0)
        Z = torch.randn(300, 300)
        assert _within_bound(S.split_matmul(Z, B, memo=memo), Z, B)


@needs_split
def test_split_matmul_broadcasts_like_matmul_and_handles_empty_and_other_dtypes():
    g = _gen(21)
    A, B = torch.randn(4, 5, generator=g), torch.randn(3, 5, 6, generator=g)
    out = S.split_matmul(A, B)
    assert out.shape == (3, 4, 6) and _within_bound(out, A.expand(3, 4, 5), B)
    assert S.split_matmul(torch.randn(2, 1, 4, 5), torch.randn(3, 5, 2)).shape == (2, 3, 4, 2)
    assert torch.equal(S.split_matmul(torch.randn(4, 0), torch.randn(0, 3)), torch.zeros(4, 3))
    assert S.split_matmul(torch.randn(0, 5), torch.randn(5, 3)).shape == (0, 3)
    D = torch.randn(50, 50, dtype=torch.float64, generator=g)
    r = S.split_matmul(D, D)  # not float32: the IEEE product in its dtype
    assert r.dtype == torch.float64 and torch.allclose(r, D @ D, rtol=1e-12, atol=1e-12)
    M = torch.empty(300, 300, device="meta")  # not on the CPU: torch's product, never a pointer to MKL
    assert S.split_matmul(M, M).device.type == "meta"
    with pytest.raises(ValueError, match="CPU"):
        S.bf16_gemm_(torch.empty(3, 3, device="meta"), torch.empty(3, 3, dtype=torch.bfloat16),
                     torch.empty(3, 3, dtype=torch.bfloat16))
    R = torch.randn(40, 30, requires_grad=True)  # autograd: the differentiable IEEE product
    S.split_matmul(R, R.mT).sum().backward()
    assert R.grad is not None and torch.isfinite(R.grad).all()


@needs_split
def test_split_products_keep_extreme_values_finite_or_infinite_like_ieee():
    big = S.split_matmul(torch.full((1, 1), 3.4e38), torch.full((1, 1), 0.25))
    assert torch.isfinite(big).all() and abs(float(big) / 8.5e37 - 1) < 1e-5
    inf = S.split_matmul(torch.tensor([[float("inf"), 1.0]]), torch.tensor([[2.0], [1.0]]))
    assert float(inf) == float("inf")
    hi, lo = S.split_bf16(torch.tensor([3.4e38, -float("inf")]))
    assert torch.isfinite(hi).all() and float(lo[1]) == -float("inf")


@needs_split
def test_proj_tangent_broadcasts_under_split_products():
    for name in ("stiefel", "dgram"):
        man = manifolds.get(name)
        X = man.retract(torch.randn(600, 300, generator=_gen(22)))
        A = torch.randn(3, 600, 300, generator=_gen(23))
        ref = man.proj_tangent_tall(X, A)
        got = man.proj_tangent_tall(X, A, products="split_bf16")
        assert float((got - ref).norm() / ref.norm()) <= 1e-5


def test_norm_estimate_takes_bf16_input_on_the_cpu():
    A = torch.randn(600, 200, generator=_gen(24))
    exact = float(torch.linalg.matrix_norm(A.double(), ord=2))
    for dt in (torch.bfloat16, torch.float16):
        assert abs(float(spectral_norm_estimate(A.to(dt))) / exact - 1) < 1e-2


def test_split_choice_is_resolved_when_the_group_is_added(monkeypatch):
    """An invalid WEIGHTGEOM_SPLIT_PRODUCTS fails at construction, not halfway through a step; set later it is not
    read by steps (their choice was made when the group was added)."""
    monkeypatch.setenv(autotune.SPLIT_ENV_VAR, "yes")
    with pytest.raises(ValueError, match="WEIGHTGEOM_SPLIT_PRODUCTS"):
        Muon([torch.nn.Parameter(torch.randn(64, 32))], manifold="stiefel")
    monkeypatch.setenv(autotune.SPLIT_ENV_VAR, "0")
    a, b = torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(64, 32))
    opt = Muon([{"params": [a]}, {"params": [b], "manifold": "stiefel"}])
    monkeypatch.setenv(autotune.SPLIT_ENV_VAR, "yes")
    a.grad, b.grad = torch.randn(64, 32), torch.randn(64, 32)
    opt.step()
    assert "manifold constraint products ieee" in opt.summary()


def test_forced_msign_still_measures_the_products_once(monkeypatch):
    monkeypatch.setenv(autotune.ENV_VAR, "float32")
    monkeypatch.delenv(autotune.SPLIT_ENV_VAR, raising=False)
    calls = []
    monkeypatch.setattr(autotune, "_measure_products", lambda device: calls.append(device) or ("split_bf16", {}))
    autotune.clear_msign_choices()
    try:
        first = autotune.split_products_for("cpu")
        again = autotune.split_products_for("cpu")
        assert first == again == S.split_available() and len(calls) == (1 if S.split_available() else 0)
    finally:
        autotune.clear_msign_choices()


def test_blocked_copy_of_a_tensor_onto_its_own_transpose_is_refused_like_torch():
    X = torch.randn(512, 512)
    with pytest.raises(RuntimeError, match="single memory location"):
        layout.copy_(X, X.mT)


def test_dgram_retraction_keeps_tiny_and_huge_columns_accurate():
    g = _gen(25)
    Q, _ = torch.linalg.qr(torch.randn(40, 10, generator=g, dtype=torch.float64))
    for scale in (1e-20, 1e18):
        Z = ((Q + 1e-4 * torch.randn(40, 10, generator=g, dtype=torch.float64)) * scale).float()
        R = dgram_retract_column_polar(Z)
        assert manifolds.get("dgram").check(R, tol=1e-6), manifolds.get("dgram").check(R, tol=1e-6).reason


@needs_split
def test_a_parameter_stepped_in_place_gets_the_split_products(monkeypatch):
    """A contiguous tall parameter is the working matrix itself (it requires grad; the step runs without grad mode):
    its products split too (they had fallen back to IEEE)."""
    monkeypatch.setenv(autotune.SPLIT_ENV_VAR, "1")
    gemms = []
    real = S.bf16_gemm_
    monkeypatch.setattr(S, "bf16_gemm_", lambda *a, **k: gemms.append(1) or real(*a, **k))
    _two_steps(gemms, "stiefel", 26)
    assert len(gemms) >= 8  # XᵀA (2), the projection (3), the Gram (2), the retraction's update (1), ...


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_column_norms_kernel_matches_torch(dtype, monkeypatch):
    X = torch.randn(2, 700, 300, generator=_gen(28), dtype=dtype) * torch.logspace(-3, 3, 300, dtype=dtype)
    for V in (X, X.mT, X[0], X[0].mT):
        got = column_norms(V)
        ref = V.double().square().sum(-2).sqrt()
        tol = 4 * torch.finfo(dtype).eps if dtype == torch.float32 else 1e-13  # float64: 700 terms summed in order
        assert got.dtype == dtype and float(((got.double() - ref) / ref).abs().max()) <= tol
    monkeypatch.setattr(kernels, "load_kernel", lambda name="md_adam": None)
    torch.testing.assert_close(column_norms(X), X.square().sum(-2).sqrt())


# ---- hostile trial 2 (each failed before its fix) ----------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("env", ["OMP_DYNAMIC=true", "OMP_THREAD_LIMIT=1"])
def test_column_norms_right_when_openmp_starts_fewer_threads(env):
    """The column-sum kernel splits columns over the team OpenMP really started (it may start fewer than asked)."""
    import subprocess
    import sys

    code = ("import torch; from weightgeom.linalg.norms import column_norms; torch.manual_seed(0); "
            "torch.set_num_threads(2); X = torch.randn(512, 256); "
            "from weightgeom import kernels; h, s = kernels.bf16_with_column_sumsq(X); "
            "print(int((~torch.isclose(column_norms(X).double(), X.double().norm(dim=0), rtol=1e-5)).sum()) "
            "+ int((~torch.isclose(s.double(), X.double().square().sum(0), rtol=1e-5)).sum()) "
            "+ int((h != X.bfloat16()).sum()))")
    k, v = env.split("=")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, k: v})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


@needs_kernel
def test_column_norms_kernel_reads_a_parameter_in_an_optimizer_step():
    """A manifold step takes the column norms of the parameter itself (an nn.Parameter, not a plain Tensor): under
    no_grad that is the kernel's work, not torch's square-then-sum (3 of a GPT-2 layer's 4 matrices fell back)."""
    p = torch.nn.Parameter(torch.randn(512, 256, generator=_gen(35)))
    with _counting("column_sumsq") as calls:
        with torch.no_grad():
            got = column_norms(p)
        with_grad = column_norms(p)  # autograd tracks it: torch's differentiable reduction
    assert len(calls) == 1 and with_grad.requires_grad
    torch.testing.assert_close(got, p.detach().norm(dim=0))


def test_column_norms_keeps_forward_ad_vmap_and_small_batches_on_torch():
    import torch.autograd.forward_ad as fwAD

    X, V = torch.randn(512, 256, generator=_gen(30)), torch.randn(512, 256, generator=_gen(31))
    ref_t = (X * V).sum(0) / X.norm(dim=0)  # d‖x_j‖ along V
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(column_norms(fwAD.make_dual(X, V))).tangent
    assert tangent is not None and torch.allclose(tangent, ref_t, rtol=1e-4, atol=1e-6)
    B = torch.randn(3, 512, 256, generator=_gen(32))
    torch.testing.assert_close(torch.func.vmap(column_norms)(B), B.norm(dim=-2))
    _, jt = torch.func.jvp(column_norms, (X,), (V,))
    torch.testing.assert_close(jt, ref_t, rtol=1e-4, atol=1e-6)
    with _counting("column_sumsq") as calls:
        column_norms(torch.randn(5000, 4, 4))  # many small matrices: torch's reduction, no call per matrix
    assert not calls


def test_dgram_projection_stays_finite_when_a_diagonal_entry_overflows():
    from weightgeom.manifolds.dgram import dgram_proj_tangent

    X = torch.linalg.qr(torch.randn(64, 8, generator=_gen(33)))[0]
    X[:, 0] *= 1.5e19  # ‖x_0‖² = 2.25e38, finite; (XᵀY + YᵀX)_00 overflows to inf
    Y = torch.randn(64, 8, generator=_gen(34))
    Y[:, 0] = X[:, 0]
    assert torch.isfinite(dgram_proj_tangent(X, Y)).all()


def test_summary_names_the_products_when_msign_is_set_explicitly():
    W = torch.nn.Parameter(torch.randn(300, 300))
    opt = Muon([W], lr=0.02, manifold="stiefel", msign_dtype=torch.float32, ns_steps=5)
    assert "manifold constraint products on cpu" in opt.summary()


# ---- sym_sum: S + Sᵀ of the constraint arithmetic's n×n matrices ----------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("n", [128, 131, 200, 768])
@pytest.mark.parametrize("alpha", [1.0, 0.5, -0.25, 0.3])
def test_sym_sum_kernel_gives_torchs_bits(n, alpha):
    """The C kernel (8×8 blocks turned in registers, a ragged edge when 8 ∤ n) gives torch's expressions' bits: new
    alpha·(S + Sᵀ), accumulated (out + S) + Sᵀ (alpha ≠ 1: to rounding); on a row-strided S too (a slice of a wider
    matrix); NaN/inf propagate; a new result never reads the garbage of its buffer."""
    from weightgeom.linalg.layout import sym_sum

    big = torch.randn(n, n + 5, generator=_gen(40))
    big[3, 7], big[n - 1, 0] = float("nan"), float("inf")
    tol = 0 if alpha == 1.0 else 1e-6  # accumulating, torch rounds out + alpha·S as one multiply-add
    for Sm in (big[:, :n], big[:, :n].contiguous()):
        want = Sm + Sm.mT if alpha == 1.0 else alpha * (Sm + Sm.mT)
        with _counting("symsum") as calls:
            got = sym_sum(Sm, alpha)
            out = torch.randn(n, n, generator=_gen(41))
            ref = out.clone().add_(Sm, alpha=alpha).add_(Sm.mT, alpha=alpha)
            acc = sym_sum(Sm, alpha, out=out)
        assert len(calls) == 2
        assert torch.allclose(got, want, equal_nan=True, rtol=0, atol=0)
        assert acc is out and torch.allclose(out, ref, equal_nan=True, rtol=tol, atol=tol)


@needs_kernel
def test_sym_sum_batches_broadcasts_and_falls_back_where_the_kernel_does_not_fit():
    from weightgeom.linalg.layout import sym_sum

    B = torch.randn(3, 2, 160, 160, generator=_gen(42))
    torch.testing.assert_close(sym_sum(B), B + B.mT, rtol=0, atol=0)
    out = torch.randn(2, 160, 160, generator=_gen(43))
    ref = out.clone().add_(B[0, 0]).add_(B[0, 0].mT)
    torch.testing.assert_close(sym_sum(B[0, 0], out=out), ref, rtol=0, atol=0)  # one matrix into a batch
    with _counting("symsum") as calls:
        D = torch.randn(200, 200, dtype=torch.float64, generator=_gen(44))
        torch.testing.assert_close(sym_sum(D, 0.5), 0.5 * (D + D.mT), rtol=0, atol=0)  # float64: torch
        small = torch.randn(20, 20, generator=_gen(45))
        torch.testing.assert_close(sym_sum(small), small + small.mT, rtol=0, atol=0)  # below SYM_SUM_MIN
        T = torch.randn(200, 200, generator=_gen(46))
        torch.testing.assert_close(sym_sum(T.mT), T.mT + T, rtol=0, atol=0)  # column-major S: torch
        R = torch.randn(200, 200, generator=_gen(47), requires_grad=True)
        sym_sum(R, 0.5).sum().backward()  # autograd tracks R: torch's differentiable expression
        torch.testing.assert_close(R.grad, torch.ones(200, 200))
        V = torch.randn(4, 200, 200, generator=_gen(48))
        torch.testing.assert_close(torch.func.vmap(sym_sum)(V), V + V.mT, rtol=0, atol=0)
    assert not calls
    with pytest.raises(ValueError, match="sym_sum"):
        sym_sum(torch.randn(3, 4))
    A = torch.randn(200, 200, generator=_gen(49))
    A0 = A.clone()
    with pytest.raises(ValueError, match="sym_sum: out shares memory with S"):
        sym_sum(A[:100, :100], out=A[100:, 100:])
    assert torch.equal(A, A0)


@needs_kernel
@needs_split
def test_manifold_step_sums_its_symmetric_parts_in_the_kernel():
    """The dual ascent's residual P(S + Sᵀ), the cold start, the DGram multiplier and the split Gram's T + Tᵀ go
    through the kernel (torch's S + S.mT reads S.mT a row apart per element: 3× slower at 768²)."""
    with _counting("symsum") as calls:
        _two_steps(calls, "dgram", 50)
    assert len(calls) >= 3


@needs_kernel
@pytest.mark.parametrize("shape", [(3072, 768), (2, 300, 200), (5, 5)], ids=str)
def test_scaled_bf16_kernel_gives_torchs_mixed_multiply_bits(shape):
    """bf16(X·scale) in one C pass: torch.mul(X, scale, out=<bf16>)'s bits — overflow to inf, a value rounding past
    bf16's largest finite one, subnormals — but NaN's payload; per-matrix scales of a batch; a layout it cannot read
    or a mismatched scale gives None (the caller then uses torch)."""
    X = torch.randn(shape, generator=_gen(60)) * 3
    flat = X.view(-1)
    flat[0], flat[1], flat[2], flat[3], flat[4] = float("inf"), 3.3e38, float("nan"), 1e-40, -2.0**-133
    s = torch.rand(*shape[:-2], 1, 1, generator=_gen(61)) + 0.5
    got = kernels.scaled_bf16(X, s)
    want = torch.empty(shape, dtype=torch.bfloat16)
    torch.mul(X, s, out=want)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    one = torch.tensor(0.75)
    torch.testing.assert_close(kernels.scaled_bf16(X, one).float(), (X * 0.75).to(torch.bfloat16).float(),
                               rtol=0, atol=0, equal_nan=True)
    assert kernels.scaled_bf16(X.mT, one) is None  # not row-major
    assert kernels.scaled_bf16(X, torch.ones(7, 1, 1)) is None  # a scale per matrix of another batch
    assert kernels.scaled_bf16(X.double(), one) is None


@needs_kernel
def test_manifold_direction_narrows_the_scaled_gradient_in_the_kernel():
    """The bf16 copy of the normalised gradient that feeds msign is one C pass (torch's mixed-dtype multiply was ~4×
    slower); the direction is the bits of the torch path's."""
    from weightgeom.optim import manifold_direction

    man = manifolds.get("dgram")
    W = man.retract(torch.randn(600, 280, generator=_gen(62)))
    G = torch.randn(600, 280, generator=_gen(63))

    def ms(Z):
        return msign(Z, steps=5, dtype=torch.bfloat16)

    with _counting("scaled_bf16") as calls:
        A1 = manifold_direction(W, G, man, steps=1, msign_fn=ms, project=True, feed_dtype=torch.bfloat16,
                                products="split_bf16")[0]
        kernels.scaled_bf16 = lambda *a: None
        A2 = manifold_direction(W, G, man, steps=1, msign_fn=ms, project=True, feed_dtype=torch.bfloat16,
                                products="split_bf16")[0]
    assert calls and torch.equal(A1, A2)


@needs_kernel
def test_bf16_with_column_sumsq_is_the_copy_and_the_column_norms_in_one_pass():
    """The norm estimate's bf16 Gram factor and its exact diagonal from one read of A: torch's bf16 conversion bits
    (overflow to inf), column_norms' squared values bit for bit (both summed in double, row by row); a row-strided
    view too; anything else None. The estimate is the same with the kernel as without it."""
    from weightgeom.optim.manifold_muon import spectral_norm_estimate

    X = torch.randn(700, 300, generator=_gen(70)) * torch.logspace(-3, 3, 300)
    X[0, 0], X[1, 1] = float("inf"), 3.4e38
    for V in (X, torch.randn(400, 350, generator=_gen(71))[:, :300]):
        hi, sums = kernels.bf16_with_column_sumsq(V)
        assert torch.equal(hi, V.to(torch.bfloat16)) and torch.equal(sums, column_norms(V, squared=True))
    assert kernels.bf16_with_column_sumsq(X.mT) is None and kernels.bf16_with_column_sumsq(X.double()) is None
    A = torch.randn(1536, 512, generator=_gen(72))
    with _counting("bf16_with_column_sumsq") as calls:
        fast = spectral_norm_estimate(A, gram_dtype=torch.bfloat16, products="split_bf16")
        kernels.bf16_with_column_sumsq = lambda x: None
        slow = spectral_norm_estimate(A, gram_dtype=torch.bfloat16, products="split_bf16")
    assert calls and torch.equal(fast, slow)


@needs_kernel
@needs_split
def test_split_pass_sums_the_columns_the_constraint_arithmetic_needs():
    """With a memo a matrix's split also sums its columns' squares (one read pass: the pieces' and
    column_sumsq's bits), and split_column_sumsq hands them out while the matrix is unchanged — the DGram projection's
    d and the split Gram's diagonal — so a manifold step reads no matrix again just for its column norms."""
    X = torch.randn(700, 300, generator=_gen(80))
    hi, lo, sums = kernels.split_with_column_sumsq(X)
    assert torch.equal(hi, kernels.split_bf16_kernel(X)[0]) and torch.equal(sums, column_norms(X, squared=True))
    assert torch.equal(lo.view(torch.int16), kernels.split_bf16_kernel(X)[1].view(torch.int16))
    with _counting("column_sumsq") as calls:
        memo: dict = {}
        S.split_bf16(X, memo=memo)
        calls.clear()
        got = S.split_column_sumsq(X, memo)
        assert not calls and torch.equal(got, sums)  # from the split's pass: no other
        X.mul_(2.0)  # changed in place: summed again
        torch.testing.assert_close(S.split_column_sumsq(X, memo), 4 * sums, rtol=1e-6, atol=0)
        _two_steps(calls, "dgram", 81)
    assert not calls  # the step's column norms all came from its split passes


# ---- hostile trial 3 (each failed before its fix) ----------------------------------------------------------------
def test_a_product_written_into_a_tensor_forgets_its_remembered_pieces():
    """MKL writes an overwritten A (the projection into A) behind torch's back: the write bumps A's version, so a
    later product with A under the same ``Products`` (one memo) splits A again instead of reusing its old pieces."""
    man = manifolds.get("stiefel")
    X = man.retract(torch.randn(768, 256, generator=_gen(90)))
    A = torch.randn(768, 256, generator=_gen(91))
    pr = Products("split_bf16")
    Sm = constraint_mm(X.mT, A, products=pr)  # splits and remembers A
    P = man.proj_tangent_tall(X, A, Sm, overwrite_a=True, products=pr)
    S2 = constraint_mm(X.mT, A, products=pr)
    ref = X.mT @ P
    assert float((S2 - ref).abs().max()) <= 1e-4 * float(ref.abs().max() + 1)


def test_overwrite_is_ignored_where_an_in_place_write_is_not_allowed():
    """A leaf that requires grad (grad mode on) or an inference tensor outside inference mode is not written: the
    projection comes back as a new tensor with the non-overwriting call's values."""
    man = manifolds.get("stiefel")
    X = man.retract(torch.randn(300, 100, generator=_gen(92)))
    A = torch.randn(300, 100, generator=_gen(93), requires_grad=True)
    torch.testing.assert_close(man.proj_tangent_tall(X, A, overwrite_a=True), man.proj_tangent_tall(X, A))
    with torch.inference_mode():
        B = torch.randn(300, 100, generator=_gen(94))
    B0 = B.clone()
    for kind in ("ieee", "split_bf16"):
        got = man.proj_tangent_tall(X, B, overwrite_a=True, products=kind)
        assert torch.equal(B, B0) and torch.equal(got, man.proj_tangent_tall(X, B0, products=kind))


@needs_kernel
def test_split_column_sums_are_column_norms_bits_at_every_size_and_a_fresh_tensor():
    """Below column_norms' kernel size torch sums in float32: there the split does not sum the columns (its double
    sums would differ in the last bits); what split_column_sumsq returns is the caller's own tensor."""
    for shape in ((300, 100), (700, 300)):
        X = torch.randn(*shape, generator=_gen(95))
        memo: dict = {}
        S.split_bf16(X, memo=memo)
        a = S.split_column_sumsq(X, memo)
        assert torch.equal(a, column_norms(X, squared=True))
        a.zero_()
        assert torch.equal(S.split_column_sumsq(X, memo), column_norms(X, squared=True))


@needs_kernel
@pytest.mark.parametrize("name", ["stiefel", "dgram"])
@pytest.mark.parametrize("dist", [1e-3, 0.05, 0.2])
def test_near_retraction_kernels_give_the_torch_expressions_bits(name, dist):
    """polar_near's n×n arithmetic in two C passes (the scaled Gram deviation with its norms and bf16 copy; F with
    its diagonal and bf16 rest) gives the torch expressions' bits: the retraction's result is bitwise the same with
    the kernels as without, at distances that take orders 1, 2 and 3 of the series (and a second iteration). (Not
    where ‖E‖ sits within ~1e-7 of an order threshold: the kernel sums the norms in double, torch in float32.)"""
    man = manifolds.get(name)
    g = _gen(96)
    X0 = man.retract(torch.randn(900, 300, generator=g, dtype=torch.float64)).float()
    if name == "dgram":
        X0 = X0 * torch.linspace(0.5, 2.0, 300)
    W = (X0 + dist * torch.randn(900, 300, generator=g) / 30.0).contiguous()
    with _counting("near_deviation") as calls:
        fast = man.retract(W, "split_bf16")
        kernels.near_deviation = lambda *a, **k: None
        slow = man.retract(W, "split_bf16")
    assert calls and torch.equal(fast, slow)


# ---- hostile trial 4 (each failed before its fix) ----------------------------------------------------------------
@needs_kernel
def test_sym_sum_into_out_bumps_its_version():
    """The C kernel writes out behind torch's back: the write bumps out's version, so a backward that saved out raises
    as for torch's add_ (it returned a wrong gradient) and remembered split pieces of out are not reused."""
    from weightgeom.linalg.layout import sym_sum

    S0 = torch.randn(200, 200, generator=_gen(100))
    out = torch.randn(200, 200, generator=_gen(101))
    w = torch.randn(200, 200, generator=_gen(102), requires_grad=True)
    y = (w * out).sum()  # saves out for backward
    sym_sum(S0, out=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    memo: dict = {}
    X = torch.randn(300, 300, generator=_gen(103))
    hi0 = S.split_bf16(X, memo=memo)[0]
    sym_sum(torch.randn(300, 300, generator=_gen(104)), out=X)
    assert not torch.equal(S.split_bf16(X, memo=memo)[0], hi0)


@needs_kernel
def test_near_deviation_norms_do_not_depend_on_the_thread_count():
    from thread_counts import outputs_per_thread_count

    code = ("import torch, sys; from weightgeom import kernels; torch.set_num_threads(int(sys.argv[1])); "
            "A = torch.randn(1200, 600, generator=torch.Generator().manual_seed(5)); G = A.mT @ A / 1200; "
            "print(kernels.near_deviation(G, None)[2:])")
    one, two = outputs_per_thread_count(code)
    assert one == two


def test_polar_near_refuses_a_scale_of_another_shape():
    """A (n,) or (n, 1) scale went through the C path as s (reshaped) but broke or transposed the scaling on torch's
    path: polar_near now takes only the documented (..., 1, n)."""
    X = torch.linalg.qr(torch.randn(700, 300, generator=_gen(105)))[0]
    for bad in (torch.ones(300), torch.ones(300, 1)):
        with pytest.raises(ValueError, match=r"scale must have shape \(\.\.\., 1, n\)"):
            polar_near(X, scale=bad)
