"""Property tests shared by every manifold (one table drives them), plus per-manifold reasons and the registry.

Adding a manifold: add one line to MANIFOLDS below (and, only if its retraction is deliberately not idempotent,
its id to NOT_IDEMPOTENT).
"""

from __future__ import annotations

import math

import pytest
import torch

from all_pairs import params as all_pairs
from weightgeom import manifolds
from weightgeom.manifolds import DGram, Euclidean, Manifold, Oblique, Stiefel
from weightgeom.manifolds import dgram as dgram_mod
from weightgeom.manifolds import stiefel as stiefel_mod
from weightgeom.manifolds.base import tall

# ---- the table ----------------------------------------------------------------------------------------------------
MANIFOLDS = [
    pytest.param(Stiefel, id="stiefel"),
    pytest.param(lambda: Stiefel(method="svd"), id="stiefel-svd"),
    pytest.param(DGram, id="dgram"),
    pytest.param(lambda: DGram(method="svd"), id="dgram-svd"),
    pytest.param(lambda: DGram(retraction="paper"), id="dgram-paper"),
    pytest.param(Oblique, id="oblique"),
    pytest.param(Euclidean, id="euclidean"),
]
# The manifold-assignment paper's DGram retraction re-assigns
# the sorted singular values to columns by index (docs/manifolds.md).
NOT_IDEMPOTENT = {"dgram-paper"}

# Tall, wide, square, batched 3-D and 4-D, single row/column.
SHAPES = [(7, 4), (4, 7), (5, 5), (3, 6, 4), (2, 2, 4, 6), (1, 5), (5, 1)]
DTYPES = [torch.float64, torch.float32]
# Tolerances on dimensionless quantities (entrywise |‖w‖−1|, |cos|, relative differences). Measured on these shapes:
# float64 results agree to ~1e-15 and float32 ones to ~5e-7; the constants leave ~100× (float64: 1e5×) headroom.
TOL = {torch.float64: 1e-10, torch.float32: 3e-5}


def rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max-entry difference relative to the max entry of b (dimensionless)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Frobenius inner product per matrix (batched)."""
    return (a * b).sum(dim=(-2, -1))


def point(m: Manifold, shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return m.random_point(*shape, generator=g, dtype=dtype)


def sym_pair(n, batch=(), seed=0):
    S, T = rand(*batch, n, n, seed=seed), rand(*batch, n, n, seed=seed + 1)
    return S + S.mT, T + T.mT


params_m = pytest.mark.parametrize("make", MANIFOLDS)
params_shape = pytest.mark.parametrize("shape", SHAPES, ids=str)
params_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=str)
MAKE = {p.id: p.values[0] for p in MANIFOLDS}
# manifold × shape × dtype as an all-pairs table (tests/all_pairs.py): every manifold meets every shape and both
# dtypes, every shape both dtypes — 49 rows instead of the product's 98.
pairs_m_shape_dtype = all_pairs({"manifold": list(MAKE), "shape": SHAPES, "dtype": DTYPES})
# The split-bf16 products run only on float32 matrices whose every dimension is ≥ SPLIT_MIN_DIM (256): the big shapes
# cross it, (7, 4) does not. Each manifold takes them on a big float32 matrix, one matrix or a batch (a named row per
# manifold) beyond the all-pairs rows, where any one of the three factors alone would leave the IEEE path running.
BIG = [(300, 260), (2, 300, 260), (7, 4)]
SPLIT_ROWS = [{"manifold": name, "dtype": torch.float32, "split": True, "shape": BIG[i % 2]}
              for i, name in enumerate(MAKE)]


# ---- P: a self-adjoint projector ----------------------------------------------------------------------------------
@params_m
def test_P_is_selfadjoint_projector(make):
    m = make()
    S, T = sym_pair(6, batch=(3,))
    PS = m.P(S)
    assert torch.allclose(m.P(PS), PS, rtol=0, atol=1e-14)
    assert torch.allclose(inner(PS, T), inner(S, m.P(T)), atol=1e-12)
    assert torch.allclose(m.P(PS).mT, m.P(PS))  # maps symmetric to symmetric
    assert torch.equal(m.target(6, S), m.P(torch.eye(6, dtype=S.dtype)))


# ---- retraction ---------------------------------------------------------------------------------------------------
@pairs_m_shape_dtype
def test_retraction_lands_on_manifold(manifold, shape, dtype):
    m = MAKE[manifold]()
    W0 = point(m, shape, dtype)
    for W in (W0 + 0.1 * rand(*shape, dtype=dtype, seed=1), rand(*shape, dtype=dtype, seed=2)):
        R = m.retract(W)
        assert R.shape == W.shape and R.dtype == dtype
        res = m.check(R, tol=TOL[dtype])
        assert res.ok, res.reason
        assert float(m.constraint_violation(R).max()) < TOL[dtype]


@pairs_m_shape_dtype
def test_retraction_idempotent_on_manifold(manifold, shape, dtype):
    m = MAKE[manifold]()
    W = point(m, shape, dtype)
    R = m.retract(W)
    if manifold in NOT_IDEMPOTENT:
        # Paper DGram: column j receives the j-th largest norm. Moves the point unless norms are already sorted
        # (a single column, or the one-matrix-of-one-column shapes, are trivially sorted).
        X, _ = manifolds.tall(W)
        norms = torch.linalg.vector_norm(X, dim=-2)
        if bool((norms[..., :-1] >= norms[..., 1:]).all()):
            assert rel(R, W) < TOL[dtype]
        else:
            assert rel(R, W) > 0.05
            assert rel(m.retract(R), R) < TOL[dtype]  # once sorted, it is a fixed point
        return
    assert rel(R, W) < TOL[dtype]
    assert rel(m.retract(R), R) < TOL[dtype]


def test_paper_retraction_sorts_column_norms():
    W = torch.linalg.qr(rand(8, 4))[0] * torch.tensor([1.0, 3.0, 2.0, 0.5], dtype=torch.float64)
    R = DGram(retraction="paper").retract(W)
    assert torch.allclose(torch.linalg.vector_norm(R, dim=0), torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64))
    P = DGram().retract(W)
    assert torch.allclose(P, W, atol=1e-12)  # the polar retraction keeps each column's norm


@params_m
@params_dtype
def test_retraction_never_nan_on_zero_columns(make, dtype):
    m = make()
    for W in (rand(6, 4, dtype=dtype), rand(4, 6, dtype=dtype)):
        W = W.clone()
        if W.shape[0] >= W.shape[1]:
            W[:, 1] = 0
        else:
            W[1, :] = 0
        R = m.retract(W)
        assert torch.isfinite(R).all()
        assert torch.isfinite(m.retract(torch.zeros_like(W))).all()


def test_zero_column_policies():
    W = rand(6, 4)
    W[:, 2] = 0
    O = Oblique().retract(W)
    assert torch.equal(O[:, 2], torch.eye(6, dtype=W.dtype)[:, 2])  # documented: zero column → e_j
    assert Oblique().check(O)
    D = DGram().retract(W)
    assert torch.equal(D[:, 2], torch.zeros(6, dtype=W.dtype))  # documented: stays zero (orthogonal to all)
    assert DGram().check(D, tol=1e-10), DGram().check(D).reason
    # A zero column is a valid DGram point; its tangent projection is finite and tangent.
    A = rand(6, 4, seed=5)
    T = DGram().proj_tangent(D, A)
    assert torch.isfinite(T).all() and float(DGram().tangent_residual(D, T)) < 1e-12
    assert torch.equal(Stiefel().retract(torch.zeros(3, 5)), torch.zeros(3, 5))  # polar_express: 0 → 0
    assert Stiefel(method="svd").check(Stiefel(method="svd").retract(torch.zeros(3, 5, dtype=torch.float64)))


# ---- tangent projection -------------------------------------------------------------------------------------------
@pairs_m_shape_dtype
def test_proj_tangent(manifold, shape, dtype):
    m = MAKE[manifold]()
    W = point(m, shape, dtype)
    A, B = rand(*shape, dtype=dtype, seed=3), rand(*shape, dtype=dtype, seed=4)
    T = m.proj_tangent(W, A)
    assert T.shape == A.shape and T.dtype == dtype
    assert float(m.tangent_residual(W, T).max()) < TOL[dtype] * float(A.abs().max())
    assert rel(m.proj_tangent(W, T), T) < TOL[dtype]  # idempotent
    # Orthogonal projection: self-adjoint, and the removed part is orthogonal to every tangent vector.
    TB = m.proj_tangent(W, B)
    scale = float(A.norm() * B.norm())
    assert float((inner(T, B) - inner(A, TB)).abs().max()) < TOL[dtype] * scale
    assert float(inner(A - T, TB).abs().max()) < TOL[dtype] * scale


@params_m
@params_shape
def test_adjoint_identity(make, shape):
    """⟨Λ, P(WᵀA + AᵀW)⟩ = 2⟨W·P(Λ), A⟩ for symmetric Λ (tall view): the normal space is {W·P(Λ)}."""
    m = make()
    W = point(m, shape, torch.float64)
    A = rand(*shape, seed=3)
    X, t = manifolds.tall(W)
    Y = A.mT if t else A
    n = X.shape[-1]
    L = rand(*X.shape[:-2], n, n, seed=6)
    L = L + L.mT
    lhs = inner(L, m.P(X.mT @ Y + Y.mT @ X))
    rhs = 2 * inner(X @ m.P(L), Y)
    assert torch.allclose(lhs, rhs, atol=1e-12 * float(L.norm() * Y.norm() * X.norm()))
    # ... so W·P(Λ) is normal: the tangent projection removes it entirely.
    N = untall_like(X @ m.P(L), t)
    assert float(m.proj_tangent(W, N).abs().max()) < 1e-10 * float(N.abs().max().clamp_min(1))


def untall_like(X, t):
    return X.mT if t else X


@params_m
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (4, 4)], ids=str)
def test_proj_tangent_matches_bruteforce(make, shape):
    """Closed form = Euclidean orthogonal projection onto ker(A ↦ P(WᵀA + AᵀW)), built as an explicit matrix."""
    m = make()
    W = point(m, shape, torch.float64)
    k = W.numel()
    basis = torch.eye(k, dtype=torch.float64).reshape(k, *shape)
    X, t = manifolds.tall(W)
    Ys = basis.mT if t else basis
    J = m.P(X.mT @ Ys + Ys.mT @ X).reshape(k, -1).T  # (n², k): the constraint's linearisation
    proj = torch.eye(k, dtype=torch.float64) - torch.linalg.pinv(J) @ J
    A = rand(*shape, seed=7)
    expected = (proj @ A.reshape(-1)).reshape(shape)
    assert torch.allclose(m.proj_tangent(W, A), expected, atol=1e-10)


def test_tangent_residual_detects_normal_directions():
    W = Stiefel().random_point(6, 3)
    assert float(Stiefel().tangent_residual(W, W)) > 0.1  # W itself is normal for Stiefel
    D = DGram().random_point(6, 3)
    L = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    assert float(DGram().tangent_residual(D, D @ L)) > 0.01
    assert float(DGram().tangent_residual(D, D)) < 1e-12  # scaling columns is tangent to DGram
    assert float(Oblique().tangent_residual(Oblique().random_point(6, 3), rand(6, 3))) > 0.01


def test_proj_tangent_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        Stiefel().proj_tangent(rand(5, 3), rand(3, 5))


# ---- batching, orientation, random points, dtypes -----------------------------------------------------------------
@params_m
@params_dtype
def test_batched_equals_looped(make, dtype):
    m = make()
    W = rand(2, 3, 6, 4, dtype=dtype) + 0.5 * point(m, (2, 3, 6, 4), dtype)
    A = rand(2, 3, 6, 4, dtype=dtype, seed=8)
    Wm = point(m, (2, 3, 6, 4), dtype)
    R, T, cv = m.retract(W), m.proj_tangent(Wm, A), m.constraint_violation(W)
    assert cv.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            assert rel(R[i, j], m.retract(W[i, j])) < TOL[dtype]
            assert rel(T[i, j], m.proj_tangent(Wm[i, j], A[i, j])) < TOL[dtype]
            assert abs(float(cv[i, j] - m.constraint_violation(W[i, j]))) < TOL[dtype] * (1 + float(cv[i, j]))


@all_pairs({"manifold": list(MAKE), "dtype": DTYPES, "split": [False, True], "shape": BIG}, SPLIT_ROWS,
           ids={"split": ["ieee", "split"]})
def test_proj_tangent_tall_overwrite_a_gives_the_same_values(manifold, dtype, split, shape):
    """``overwrite_a=True`` (the dual ascent's projection of its own A) gives the bits of the non-overwriting call,
    writes nothing but A, and whatever it returns — A's memory or a new tensor — holds the projection. S given or
    not; split-bf16 products (``products="split_bf16"``, the CPU's default) or IEEE ones."""
    kind = "split_bf16" if split else "ieee"
    m = MAKE[manifold]()
    X = tall(point(m, shape, dtype))[0]
    A = rand(*X.shape, dtype=dtype, seed=3)
    for S in (None, X.mT @ A):
        ref = m.proj_tangent_tall(X, A, S, products=kind)
        X0, A1 = X.clone(), A.clone()
        got = m.proj_tangent_tall(X, A1, S, overwrite_a=True, products=kind)
        assert torch.equal(got, ref) and torch.equal(X, X0)
        assert got.data_ptr() == A1.data_ptr() or torch.equal(A1, A)  # in A, or A left as it was
    # A that is X, a transposed view, a batch broadcast from one matrix: never written in place, same values
    Ab = rand(*X.shape[-2:], dtype=dtype, seed=4)
    views = [X, A.mT.contiguous().mT] + ([Ab.expand(*X.shape)] if X.ndim > 2 else [])
    for Y in views:
        Y0 = Y.clone()
        got = m.proj_tangent_tall(X, Y, None, overwrite_a=True)
        assert torch.equal(Y, Y0) and torch.equal(got, m.proj_tangent_tall(X, Y0))


@all_pairs({"manifold": list(MAKE), "dtype": DTYPES, "split": [False, True], "shape": BIG, "dist": [1e-3, 3.0],
            "layout": ["row_major", "col_major"]},  # col_major: a wide matrix's tall view
           [{**row, "shape": shape, "dist": dist, "layout": layout} for row in SPLIT_ROWS
            for shape, dist, layout in [(BIG[0], 1e-3, "row_major"), (BIG[1], 3.0, "col_major")]],
           ids={"split": ["ieee", "split"], "dist": ["near", "far"]})
def test_retract_in_place_gives_retracts_bits(manifold, dtype, split, shape, dist, layout):
    """``retract_`` (the optimizer's in-place retraction; Stiefel and DGram write their last near-manifold update
    into a row-major W directly) returns W holding ``retract``'s bits, near the manifold or far from it, tall or wide,
    row- or column-major, batched, with split-bf16 or IEEE products."""
    kind = "split_bf16" if split else "ieee"
    m = MAKE[manifold]()
    W = (point(m, shape, dtype) + dist * rand(*shape, dtype=dtype, seed=5) / max(shape[-2:]) ** 0.5).contiguous()
    if layout == "col_major":
        W = W.mT.contiguous().mT
    ref = m.retract(W.clone(), kind)
    V = W.clone()
    got = m.retract_(V, kind)
    assert got is V and torch.equal(V, ref)


def test_polar_near_in_place_leaves_x_untouched_when_it_gives_up(monkeypatch):
    """polar_near(inplace=True) writes X only in the update it knows to be its last: a call that runs out of
    iterations (returns None) leaves X as it was, and the retraction then falls back on the original point."""
    X = point(Stiefel(), (300, 260), torch.float32) + 0.3 * rand(300, 260, dtype=torch.float32, seed=6) / 300**0.5
    X0 = X.clone()
    monkeypatch.setattr(stiefel_mod, "NEAR_MAX_ITERS", 1)
    assert stiefel_mod.polar_near(X, inplace=True, products="split_bf16") is None
    assert torch.equal(X, X0)
    assert torch.equal(Stiefel().retract_(X, "split_bf16"), Stiefel().retract(X0, "split_bf16"))


@params_m
@params_dtype
def test_wide_is_transposed_tall(make, dtype):
    m = make()
    W = rand(7, 4, dtype=dtype)
    Wm = point(m, (7, 4), dtype)
    A = rand(7, 4, dtype=dtype, seed=9)
    assert rel(m.retract(W.mT), m.retract(W).mT) < TOL[dtype]
    assert rel(m.proj_tangent(Wm.mT, A.mT), m.proj_tangent(Wm, A).mT) < TOL[dtype]
    assert abs(float(m.tangent_residual(Wm.mT, A.mT) - m.tangent_residual(Wm, A))) < TOL[dtype]
    assert m.check(W.mT).ok == m.check(W).ok


@pairs_m_shape_dtype
def test_random_point_on_manifold(manifold, shape, dtype):
    m = MAKE[manifold]()
    W = point(m, shape, dtype)
    assert W.shape == shape and W.dtype == dtype
    res = m.check(W, tol=TOL[dtype])
    assert res.ok and res.reason == "" and res.error <= TOL[dtype], res.reason
    assert not torch.equal(W, point(m, shape, dtype, seed=1))


@params_m
def test_low_precision_input_keeps_dtype(make):
    m = make()
    W = rand(8, 4).to(torch.bfloat16)
    R = m.retract(W)
    assert R.dtype == torch.bfloat16 and torch.isfinite(R).all()
    assert m.check(R, tol=2e-2), m.check(R, tol=2e-2).reason  # bf16 rounding of an fp32-accurate result


@params_m
def test_low_precision_tangent_projection_keeps_dtype(make):
    """proj_tangent of bf16/fp16 point and direction: same dtype out, tangent to that dtype's rounding (DGram's
    column norms once came back float32 and the product mixed dtypes)."""
    m = make()
    for dt in (torch.bfloat16, torch.float16):
        W = point(m, (16, 6), torch.float32).to(dt)
        P = m.proj_tangent(W, rand(16, 6, seed=3).to(dt))
        assert P.dtype == dt and P.shape == (16, 6) and torch.isfinite(P).all()
        assert float(m.tangent_residual(W.float(), P.float()).max()) < 2e-2


@params_m
def test_empty_matrix_retracts_to_itself(make):
    """A matrix with no rows or no columns retracts to an empty matrix of its shape (polar_near once crashed on the
    0×0 Gram); Stiefel keeps refusing it (msign needs a nonempty matrix) by name."""
    m = make()
    for shape in [(0, 4), (4, 0), (2, 0, 3)]:
        try:
            R = m.retract(torch.zeros(shape))
        except ValueError as e:
            assert isinstance(m, Stiefel) and "msign" in str(e), e
            continue
        assert R.shape == shape


@params_m
def test_bad_input_raises(make):
    m = make()
    with pytest.raises(ValueError, match="matrices"):
        m.retract(torch.ones(4))
    with pytest.raises(ValueError, match="matrices"):
        m.check(torch.ones(4))


# ---- check(): reasons name the problem ----------------------------------------------------------------------------
def test_check_reasons_name_the_problem():
    W = Stiefel().random_point(8, 5)
    W[:, 2] *= 1.3
    res = Stiefel().check(W)
    assert not res and "stiefel" in res.reason and "column 2 has norm 1.3" in res.reason
    assert abs(res.error - 0.3) < 1e-9
    assert "row 2 has norm" in Stiefel().check(W.mT.contiguous()).reason

    D = DGram().random_point(10, 8)
    D[:, 7] += 0.5 * D[:, 3] / D[:, 3].norm() * D[:, 7].norm()
    res = DGram().check(D)
    assert not res and "dgram: columns 3 and 7 not orthogonal: |cos| =" in res.reason and "> tol" in res.reason

    B = Oblique().random_point(3, 6, 4)
    B[1, :, 3] *= 2
    res = Oblique().check(B)
    assert not res and "oblique: matrix [1]: column 3 has norm 2" in res.reason

    N = Stiefel().random_point(5, 3)
    N[0, 0] = float("nan")
    assert "NaN" in Stiefel().check(N).reason and not Euclidean().check(N)
    assert Euclidean().check(rand(3, 4)).ok


@params_m
def test_check_rejects_off_manifold_points(make):
    m = make()
    W = rand(3, 6, 4) * 2
    res = m.check(W)
    if isinstance(m, Euclidean):  # every finite matrix is a Euclidean point
        assert res.ok and res.error == 0
        return
    assert not res.ok and res.reason.startswith(m.name + ": matrix [") and res.error > 0.01


# ---- registry -----------------------------------------------------------------------------------------------------
def test_registry_get():
    assert isinstance(manifolds.get("Stiefel"), Stiefel)
    assert isinstance(manifolds.get("DGRAM"), DGram)
    assert manifolds.get("dgram", retraction="paper") == DGram(retraction="paper")
    assert isinstance(manifolds.get("none"), Euclidean) and isinstance(manifolds.get(None), Euclidean)
    m = Oblique()
    assert manifolds.get(m) is m
    with pytest.raises(ValueError, match="available: dgram, euclidean, none, oblique, stiefel"):
        manifolds.get("sphere")
    with pytest.raises(ValueError, match="retraction"):
        manifolds.get("dgram", retraction="qr")
    with pytest.raises(ValueError, match="method"):
        Stiefel(method="muon")
    with pytest.raises(ValueError, match="oblique: unknown retraction 'polar'"):
        manifolds.get("oblique", retraction="polar")
    # "paper" is accepted by every manifold a strategy uses, so one group key selects the published retractions
    for name in ("stiefel", "dgram", "oblique"):
        assert manifolds.get(name, retraction="paper").retraction == "paper"


def test_register_new_manifold(monkeypatch):
    monkeypatch.setattr(manifolds, "_REGISTRY", dict(manifolds._REGISTRY))

    class Sphere(Oblique):
        name = "Sphere"

    assert manifolds.register(Sphere) is Sphere
    assert "sphere" in manifolds.available() and isinstance(manifolds.get("SPHERE"), Sphere)
    with pytest.raises(ValueError, match="already taken"):
        manifolds.register(type("Other", (Oblique,), {"name": "stiefel"}))
    with pytest.raises(ValueError, match="Manifold subclass"):
        manifolds.register(int)


def test_every_registered_manifold_is_in_the_table():
    tested = {type(p.values[0]()) for p in MANIFOLDS}
    assert set(manifolds._REGISTRY.values()) <= tested


# ---- Stiefel shortcut for points near the manifold ----------------------------------------------------------------
@all_pairs({"dist": [1e-6, 1e-3, 0.015, 0.05, 0.2, 0.45], "shape": [(96, 32), (32, 96), (3, 40, 16)],
            "dtype": [torch.float32, torch.float64]})
def test_stiefel_near_retraction_matches_svd_polar(shape, dtype, dist, monkeypatch):
    m = Stiefel()
    W0 = m.random_point(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    D = rand(*shape, seed=4)
    X, _ = manifolds.tall(W0 + D)
    # scale the perturbation so that ‖WᵀW − I‖_F ≈ dist (first order: ‖W0ᵀD + DᵀW0‖_F)
    X0, _ = manifolds.tall(W0)
    Dt, _ = manifolds.tall(D)
    lin = float(torch.linalg.matrix_norm(X0.mT @ Dt + Dt.mT @ X0).max())
    W = (W0 + (dist / lin) * D).to(dtype)
    E = stiefel_mod.gram_deviation(manifolds.tall(W)[0])
    assert float(torch.linalg.matrix_norm(E).max()) <= stiefel_mod.NEAR_TOL
    assert stiefel_mod.polar_near(manifolds.tall(W)[0]) is not None
    ref = Stiefel(method="svd").retract(W.to(torch.float64))
    monkeypatch.setattr(stiefel_mod, "polar", lambda *a, **k: pytest.fail("near point took the Polar Express path"))
    R = m.retract(W)
    assert R.dtype == dtype and rel(R, ref) < TOL[dtype]
    assert m.check(R, tol=TOL[dtype]).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("eta", [1e-5, 0.02, 0.05, 0.3])
def test_stiefel_near_retraction_takes_the_lowest_sufficient_order(eta, dtype, monkeypatch):
    """After a tangent step W − η·A (the optimizer's case: E ≈ η²AᵀA, spectral radius ≪ ‖E‖_F) polar_near cuts its
    series at the lowest order whose remainder bound is below rounding — fewer n×n×n products — and still matches
    the SVD polar factor; the chosen orders are those the bound predicts (float32: order 1 at η = 1e-5, 2 at 0.02,
    3 at 0.05, one iteration each; at 0.3 order 3 and a second iteration; float64 needs more)."""
    m = Stiefel()
    X0 = m.random_point(256, 32, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    A = m.proj_tangent(X0, rand(256, 32, seed=8))
    A = A / torch.linalg.matrix_norm(A, ord=2)
    W = (X0 - eta * A).to(dtype)
    orders: list[int] = []
    real = stiefel_mod._near_correction
    monkeypatch.setattr(stiefel_mod, "_near_correction", lambda E, k, *p: orders.append(k) or real(E, k, *p))
    R = stiefel_mod.polar_near(W)
    ref = Stiefel(method="svd").retract(W.to(torch.float64))
    assert R is not None and rel(R, ref) < TOL[dtype] and m.check(R, tol=TOL[dtype]).ok
    if dtype == torch.float32:
        if eta < 0.3:
            assert orders == [{1e-5: 1, 0.02: 2, 0.05: 3}[eta]]
        else:
            assert len(orders) == 2 and orders[0] == 3
    else:
        assert orders[-1] < 3 or len(orders) > 1 and orders[:-1] == [3] * (len(orders) - 1)


def test_stiefel_far_point_uses_polar_express():
    W = rand(64, 16, seed=6)  # ‖WᵀW − I‖_F ≫ NEAR_TOL
    assert float(torch.linalg.matrix_norm(stiefel_mod.gram_deviation(W))) > stiefel_mod.NEAR_TOL
    assert stiefel_mod.polar_near(W) is None
    R = Stiefel().retract(W)
    assert rel(R, Stiefel(method="svd").retract(W)) < TOL[torch.float64]


@all_pairs({"dist": [1e-5, 1e-3, 2e-2], "shape": [(96, 32), (32, 96), (2, 64, 16)],
            "dtype": [torch.float32, torch.float64]})
def test_dgram_near_retraction_matches_svd(shape, dtype, dist, monkeypatch):
    """m ≥ 2n near the manifold: msign(W) = U₁·msign(U₁ᵀW) with an n×n Polar Express; same result as the SVD."""
    m = DGram(retraction="polar")
    W0 = m.random_point(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    W = (W0 + dist * rand(*shape, seed=6) * torch.linalg.vector_norm(W0) / math.sqrt(W0.numel())).to(dtype)
    ref = DGram(retraction="polar", method="svd").retract(W.to(torch.float64))
    small = min(shape[-2:])
    real_polar = dgram_mod.polar

    def only_small(X, *a, **k):  # the full-size Polar Express must not run: only the n×n one
        assert X.shape[-2:] == (small, small), f"full-size polar on {tuple(X.shape)}"
        return real_polar(X, *a, **k)

    monkeypatch.setattr(dgram_mod, "polar", only_small)
    R = m.retract(W)
    assert R.dtype == dtype and rel(R, ref) < TOL[dtype]


@pytest.mark.parametrize("shape", [(64, 64), (96, 32), (32, 96)], ids=str)
def test_dgram_column_polar_is_a_cheap_first_order_retraction(shape, monkeypatch):
    """The default DGram retraction polar(W·D⁻¹)·D: idempotent, keeps column norms, R(W + tξ) = W + tξ + O(t²) for a
    tangent ξ (the error falls 4× when t halves), and near the manifold no Polar Express runs (square blocks too)."""
    m = DGram()
    assert m.retraction == "column_polar"
    W = m.random_point(*shape, generator=torch.Generator().manual_seed(3))
    xi = m.proj_tangent(W, rand(*shape, seed=4))
    xi = xi / torch.linalg.vector_norm(xi) * torch.linalg.vector_norm(W)
    errs = []
    for t in (1e-2, 5e-3, 2.5e-3):
        V = W + t * xi
        R = m.retract(V)
        assert m.check(R, tol=1e-10).ok
        cols = lambda X: torch.linalg.vector_norm(tall(X)[0], dim=-2)  # noqa: E731
        assert torch.allclose(cols(R), cols(V), rtol=1e-12)
        errs.append(float(torch.linalg.vector_norm(R - V)))
    assert 3.0 < errs[0] / errs[1] < 5.0 and 3.0 < errs[1] / errs[2] < 5.0, errs
    assert rel(m.retract(W), W) < 1e-12  # idempotent

    def no_polar(*a, **k):
        raise AssertionError("Polar Express ran near the manifold")

    monkeypatch.setattr(dgram_mod, "polar", no_polar)
    m.retract((W + 1e-3 * xi).to(torch.float32))


def test_dgram_near_retraction_falls_back():
    m = DGram()
    X = rand(40, 16, seed=8)  # far from the manifold
    assert dgram_mod.polar_near_columns(X, torch.linalg.vector_norm(X, dim=-2, keepdim=True)) is None
    X[:, 3] = 0  # zero column: the shortcut declines, the retraction keeps it at zero
    assert dgram_mod.polar_near_columns(X, torch.linalg.vector_norm(X, dim=-2, keepdim=True)) is None
    assert torch.equal(m.retract(X)[:, 3], torch.zeros(40, dtype=X.dtype))
    Q = rand(24, 16, seed=9)  # m < 2n: declined
    assert dgram_mod.polar_near_columns(Q, torch.linalg.vector_norm(Q, dim=-2, keepdim=True)) is None


@pytest.mark.parametrize("shape", [(64, 32), (96, 96)], ids=str)  # the near-manifold n×n path (m ≥ 2n), the plain one
def test_dgram_retraction_keeps_small_columns(shape):
    """A column at 1e-6·‖W‖_F is below what Polar Express resolves (it came back ×0.022 per call, so small columns
    decayed to zero); it is now completed exactly and keeps its norm over 100 retractions."""
    m, n = shape
    Q = Stiefel().random_point(m, n, generator=torch.Generator().manual_seed(0))
    norms = torch.ones(n, dtype=torch.float64)
    norms[0], norms[3] = 1e-6 * n**0.5, 1e-4 * n**0.5
    W0 = (Q * norms).float()
    W = W0
    for _ in range(100):
        W = DGram().retract(W)
    ratio = torch.linalg.vector_norm(W, dim=0) / torch.linalg.vector_norm(W0, dim=0)
    assert float((ratio - 1).abs().max()) < 1e-3
    assert DGram().check(W, tol=1e-5)


# ---- host-free retractions (what a compiled optimizer step runs) ---------------------------------------------------
@pytest.mark.parametrize("make", MANIFOLDS)
def test_host_free_retraction_lands_where_retract_does(make):
    """Every manifold configuration with a host-free retraction (``host_free_retraction``): from a far batch
    (``far=True``) it lands on the manifold, and from a near one it gives ``retract``'s point to float32 rounding."""
    m = make()
    if not m.host_free_retraction():
        pytest.skip("this configuration retracts eagerly only")
    g = torch.Generator().manual_seed(3)
    far = torch.randn(3, 20, 6, generator=g)
    R = m.retract_host_free(far, far=True)
    assert R.shape == far.shape and R.dtype == far.dtype
    assert float(m.constraint_violation(R).max()) < 1e-5
    near = R + 1e-3 * torch.randn(3, 20, 6, generator=g)
    torch.testing.assert_close(m.retract_host_free(near), m.retract(near), atol=1e-5, rtol=0)


class _UnitColumns(Manifold):
    """A custom manifold written outside the library (unit columns, as Oblique), without a host-free retraction."""

    name = "unit-columns"
    retractions = ("normalize",)
    entrywise_P = True

    def P(self, S: torch.Tensor) -> torch.Tensor:
        return torch.diag_embed(S.diagonal(dim1=-2, dim2=-1))

    def retract(self, W: torch.Tensor) -> torch.Tensor:
        X, t = tall(W)
        return (X / torch.linalg.vector_norm(X, dim=-2, keepdim=True)).mT if t else \
            X / torch.linalg.vector_norm(X, dim=-2, keepdim=True)

    def proj_tangent(self, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        X, t = tall(W)
        Y = A.mT if t else A
        P = Y - X * (X * Y).sum(dim=-2, keepdim=True)
        return P.mT if t else P


class _UnitColumnsHostFree(_UnitColumns):
    """The same manifold with its host-free retraction."""

    def retract_host_free(self, X: torch.Tensor, far: bool = False) -> torch.Tensor:
        return X / torch.linalg.vector_norm(X, dim=-2, keepdim=True)


def test_custom_manifold_steps_host_free_only_with_retract_host_free():
    """A custom manifold that implements ``retract_host_free`` takes the host-free step (what a compiled step traces)
    and lands where its eager step does; one that does not is refused with one line naming the method (it used to
    fall back silently to another path)."""
    from weightgeom.optim import Muon

    g = torch.Generator().manual_seed(0)
    W0 = torch.randn(24, 8, generator=g)
    grads = [torch.randn(24, 8, generator=g) for _ in range(3)]

    def run(manifold: Manifold, host_free: bool) -> torch.Tensor:
        p = torch.nn.Parameter(W0.clone())
        opt = Muon([p], lr=0.05, manifold=manifold)
        opt.host_free = host_free
        for gr in grads:
            p.grad = gr.clone()
            opt.step()
        return p.detach()

    with pytest.raises(TypeError, match=r"_UnitColumns\).*retract_host_free\(X, far\)") as err:
        run(_UnitColumns(), True)
    assert "\n" not in str(err.value)
    eager = run(_UnitColumns(), False)
    torch.testing.assert_close(run(_UnitColumnsHostFree(), True), eager, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.linalg.vector_norm(eager, dim=0), torch.ones(8), atol=1e-5, rtol=0)


def test_custom_manifold_without_retract_host_free_refused_before_any_group_steps():
    """A host-free step over a plain group and then a custom manifold without ``retract_host_free`` raises the one
    TypeError line before any group steps (it used to raise after the plain group had stepped); ``compile_step``
    refuses it when built, and accepts it with ``host_free=False`` (the group then steps eagerly)."""
    import copy

    from weightgeom.optim import Muon, compile_step

    g = torch.Generator().manual_seed(0)
    plain = torch.nn.Parameter(torch.randn(8, 4, generator=g))
    custom = torch.nn.Parameter(torch.randn(24, 8, generator=g))
    opt = Muon([{"params": [plain]}, {"params": [custom], "manifold": _UnitColumns()}], lr=0.05)
    plain.grad, custom.grad = torch.randn(8, 4, generator=g), torch.randn(24, 8, generator=g)
    opt.step()  # eager: both groups step, both have state
    before = (plain.detach().clone(), custom.detach().clone(), copy.deepcopy(opt.state_dict()["state"]))
    opt.host_free = True
    with pytest.raises(TypeError, match=r"_UnitColumns\).*retract_host_free\(X, far\)") as err:
        opt.step()
    assert "\n" not in str(err.value)
    assert torch.equal(plain, before[0]) and torch.equal(custom, before[1])
    for k, st in opt.state_dict()["state"].items():
        assert all(torch.equal(v, before[2][k][n]) for n, v in st.items())
    with pytest.raises(TypeError, match=r"retract_host_free\(X, far\)"):
        compile_step(opt)
    opt.host_free = False
    compile_step(opt)  # builds (nothing compiled until it is called)
