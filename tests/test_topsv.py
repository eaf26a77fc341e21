"""top_singular: power / randomized agree with full SVD; sign convention; batching; edge cases."""

import pytest
import torch

from weightgeom.linalg.topsv import fix_signs, top_singular

# Tolerances (measured 2026-12, float32, the gapped test matrices below): power and randomized reach
# 1 − |cos(v, v_svd)| < 1e-6 and relative σ error < 1e-6; 1e-4 leaves two orders of margin.
VEC_TOL = 1e-4
SIG_TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gapped(*shape, k=3):
    """Random matrices with a clear top-k spectrum: σ_i = 10, 7, 5, ... over a Gaussian bulk of norm ~1."""
    *b, m, n = shape
    U = torch.linalg.qr(torch.randn(*b, m, k)).Q
    V = torch.linalg.qr(torch.randn(*b, n, k)).Q
    s = torch.tensor([10.0, 7.0, 5.0, 4.0, 3.0][:k])
    bulk = torch.randn(*shape) / (m**0.5 + n**0.5)
    return (U * s) @ V.mT + bulk


@pytest.mark.parametrize("shape", [(3, 60, 40), (2, 40, 90), (50, 50)])
@pytest.mark.parametrize("method", ["power", "randomized"])
@pytest.mark.parametrize("k", [1, 3])
def test_matches_full_svd(shape, method, k):
    W = _gapped(*shape)
    u0, s0, v0 = top_singular(W, k, method="svd")
    u, s, v = top_singular(W, k, method=method)
    m, n = shape[-2:]
    assert u.shape == (*shape[:-2], m, k) and v.shape == (*shape[:-2], n, k) and s.shape == (*shape[:-2], k)
    assert ((s - s0).abs() / s0).max() < SIG_TOL
    assert (1 - (v * v0).sum(-2).abs()).max() < VEC_TOL
    assert (1 - (u * u0).sum(-2).abs()).max() < VEC_TOL
    # same sign convention → the vectors themselves agree, not only up to sign
    assert (v - v0).abs().max() < 1e-2 and (u - u0).abs().max() < 1e-2


@pytest.mark.parametrize("method", ["power", "randomized", "svd"])
def test_sign_convention_and_triplet(method):
    W = _gapped(4, 30, 20)
    u, s, v = top_singular(W, 2, method=method)
    idx = v.abs().argmax(dim=-2, keepdim=True)
    assert (torch.gather(v, -2, idx) > 0).all()
    torch.testing.assert_close(W @ v, u * s[..., None, :], atol=1e-3, rtol=1e-3)
    # flipping W flips u only
    u2, s2, v2 = top_singular(-W, 2, method=method)
    torch.testing.assert_close(v2, v, atol=1e-3, rtol=0)
    torch.testing.assert_close(u2, -u, atol=1e-3, rtol=0)


def test_fix_signs():
    v = torch.tensor([[0.1, -0.9], [-0.8, 0.2]])
    u = torch.ones(3, 2)
    u2, v2 = fix_signs(u, v)
    # largest-|entry| of both columns is negative (-0.8, -0.9): both pairs flip
    assert torch.equal(v2, -v) and torch.equal(u2, -u)
    u3, v3 = fix_signs(u2, v2)
    assert torch.equal(v3, v2) and torch.equal(u3, u2)


def test_zero_and_dtype_and_errors():
    for method in ("power", "randomized", "svd"):
        u, s, v = top_singular(torch.zeros(2, 5, 4), 1, method=method)
        assert torch.all(s == 0) and torch.isfinite(u).all() and torch.isfinite(v).all()
    u, s, v = top_singular(torch.randn(6, 5, dtype=torch.float64), 2, method="power")
    assert s.dtype == torch.float64
    with pytest.raises(ValueError, match="unknown method"):
        top_singular(torch.randn(4, 4), method="lanczos")
    with pytest.raises(ValueError, match="k=5"):
        top_singular(torch.randn(4, 6), k=5)
    with pytest.raises(ValueError, match="need a matrix"):
        top_singular(torch.randn(4))


def test_deterministic():
    W = torch.randn(40, 30)
    a = top_singular(W, 1, method="randomized", seed=3)
    b = top_singular(W, 1, method="randomized", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("shape", [(3, 60, 40), (2, 40, 90)])
@pytest.mark.parametrize("method", ["power", "randomized"])
def test_precomputed_gram(shape, method):
    W = _gapped(*shape)
    G = W.mT @ W if shape[-1] <= shape[-2] else W @ W.mT
    u0, s0, v0 = top_singular(W, 2, method="svd")
    u, s, v = top_singular(W, 2, method=method, gram=G)
    assert ((s - s0).abs() / s0).max() < SIG_TOL
    assert (1 - (v * v0).sum(-2).abs()).max() < VEC_TOL and (1 - (u * u0).sum(-2).abs()).max() < VEC_TOL
    with pytest.raises(ValueError, match="gram has shape"):
        top_singular(W, 1, method=method, gram=G[..., :-1, :-1])
