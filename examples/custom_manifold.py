"""Add your own manifold: a fixed-Frobenius-norm sphere, registered and trained with manifold Muon.

What it shows:

1. One ``weightgeom.manifolds.Manifold`` subclass. Every manifold here is a constraint on the Gram matrix of the tall
   view of W (m ≥ n; a wide matrix is transposed): P(WᵀW) = P(I), with P a self-adjoint projector on symmetric n×n
   matrices. Stiefel takes P = Id (all singular values 1), Oblique P = Diag (unit columns), DGram P = Off.

   The new one, ``Sphere``, takes P(S) = (tr S / n)·I: the constraint is tr(WᵀW) = n, i.e. ‖W‖_F = sqrt(n) — the
   root-mean-square singular value is 1 and the spectrum is otherwise free (Stiefel's matrices lie on this sphere;
   it is much larger). Its pieces: the tangent space {A : ⟨W, A⟩ = 0}, the projection A − W·⟨W, A⟩/‖W‖², the
   retraction W·sqrt(n)/‖W‖_F, and ``check`` saying in words why a point is off it.
2. ``register(Sphere)``: from then on ``manifolds.get("sphere")``, ``Muon(..., manifold="sphere")``,
   ``param_groups(model, rules={...: "sphere"})`` and ``optim.rules`` in a training config know it.
3. The properties the library's shared tests check for every manifold, checked here by hand on the new one: P is a
   self-adjoint projector, the retraction lands on the manifold and is idempotent there, the projection is tangent.
4. Training a small model with Muon, its hidden matrices on the sphere (the rest AdamW), and ``check`` before and
   after: every constrained matrix stays on the sphere while the loss goes down; and ``check`` on a point that is
   off the sphere, explaining why.

The same thing inside the library (a pull request) is three small edits:

* one file ``src/weightgeom/manifolds/sphere.py`` holding the class below (with a unique ``name``);
* one line ``register(Sphere)`` in ``src/weightgeom/manifolds/__init__.py`` (plus the import and ``__all__``);
* one row ``pytest.param(Sphere, id="sphere")`` in the ``MANIFOLDS`` table of ``tests/test_manifolds.py`` — the
  shared property tests (projector, retraction on the manifold and idempotent, tangent projection against a brute
  force solve, batching, orientation, dtypes, zero columns) then run on it, and a test fails if a registered class
  is missing from that table. docs/manifolds.md, "Adding a manifold", lists what a subclass must implement.

Run:
    python examples/custom_manifold.py            # width 128, 200 steps
    python examples/custom_manifold.py --tiny     # width 16, 10 steps (what the tests run)

Time on a 2-core CPU: full size about 30 seconds (25 CPU-seconds measured); ``--tiny`` about a second after the
imports. Writes no files.
"""

from __future__ import annotations

import argparse
import math

import torch

from weightgeom import manifolds
from weightgeom.manifolds import CheckResult, Manifold, register, tall, untall
from weightgeom.optim import Muon, describe, param_groups


class Sphere(Manifold):
    """Matrices of Frobenius norm sqrt(n), n = min(m, n): {W : tr(WᵀW) = n} (tall view), P(S) = (tr S / n)·I.

    Args:
        retraction: ``"scale"`` (the only one: W·sqrt(n)/‖W‖_F; a zero matrix becomes the n leading columns of the
            identity, so the result is never NaN).
    """

    name = "sphere"
    retractions = ("scale",)

    def __init__(self, retraction: str = "scale") -> None:
        if retraction not in self.retractions:
            raise ValueError(f"sphere: unknown retraction {retraction!r}; choose one of {list(self.retractions)}")
        self.retraction = retraction

    def P(self, S: torch.Tensor) -> torch.Tensor:
        """The trace part: (tr S / n)·I (batched over leading dims). Self-adjoint and idempotent."""
        n = S.shape[-1]
        mean = torch.diagonal(S, dim1=-2, dim2=-1).sum(-1) / n
        return mean[..., None, None] * torch.eye(n, dtype=S.dtype, device=S.device)

    def retract(self, W: torch.Tensor) -> torch.Tensor:
        """Scale each matrix (of a batch) to Frobenius norm sqrt(n); idempotent on the sphere."""
        X, t = tall(W)
        n = X.shape[-1]
        Z = X.to(torch.float64 if X.dtype == torch.float64 else torch.float32)
        norm = torch.linalg.matrix_norm(Z, keepdim=True)
        eye = torch.eye(Z.shape[-2], n, dtype=Z.dtype, device=Z.device)
        out = torch.where(norm > 0, Z * (math.sqrt(n) / norm.clamp_min(torch.finfo(Z.dtype).tiny)), eye)
        return untall(out.to(W.dtype), t)

    def proj_tangent(self, W: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """A − W·⟨W, A⟩/‖W‖² per matrix: the part of A that does not change ‖W‖_F to first order."""
        inner = (W * A).sum(dim=(-2, -1), keepdim=True)
        sq = (W * W).sum(dim=(-2, -1), keepdim=True)
        return A - W * torch.where(sq > 0, inner / sq.clamp_min(torch.finfo(sq.dtype).tiny), torch.zeros_like(sq))

    def check(self, W: torch.Tensor, tol: float = 1e-5) -> CheckResult:
        """|‖W‖_F / sqrt(n) − 1| ≤ tol for every matrix; the reason names the worst one and its norm."""
        if not torch.isfinite(W).all():
            return CheckResult(False, f"{self.name}: point has {int((~torch.isfinite(W)).sum())} NaN/Inf entries",
                               math.inf)
        X, _ = tall(W)
        n = X.shape[-1]
        norms = torch.linalg.matrix_norm(X.to(torch.float64)).reshape(-1)
        errs = (norms / math.sqrt(n) - 1).abs()
        i = int(errs.argmax())
        err = float(errs[i])
        if err <= tol:
            return CheckResult(True, "", err)
        where = f"matrix [{i}]: " if X.ndim > 2 else ""
        return CheckResult(False, f"{self.name}: {where}‖W‖_F = {float(norms[i]):.6g}, not sqrt({n}) = "
                                  f"{math.sqrt(n):.6g} (|‖W‖_F/sqrt(n) − 1| = {err:.3g} > tol {tol:g})", err)

    def random_point(self, *shape: int, generator: torch.Generator | None = None,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Uniform on the sphere: a Gaussian matrix, scaled."""
        return self.retract(torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)


def property_checks(m: Manifold) -> None:
    """By hand, what tests/test_manifolds.py checks for every registered manifold (a few of its properties)."""
    g = torch.Generator().manual_seed(0)
    S = torch.randn(5, 5, generator=g, dtype=torch.float64)
    S, T = S + S.T, torch.randn(5, 5, generator=g, dtype=torch.float64)
    T = T + T.T
    PS = m.P(S)
    assert torch.allclose(m.P(PS), PS) and torch.allclose((PS * T).sum(), (S * m.P(T)).sum()), "P: not a projector"
    for shape in [(7, 4), (4, 7), (3, 6, 4)]:  # tall, wide (constrained on its rows), a batch of three
        W = m.retract(torch.randn(*shape, generator=g, dtype=torch.float64))
        assert m.check(W, tol=1e-10), m.check(W).reason
        assert torch.allclose(m.retract(W), W), "retraction not idempotent on the manifold"
        A = m.proj_tangent(W, torch.randn(*shape, generator=g, dtype=torch.float64))
        assert float(m.tangent_residual(W, A).max()) < 1e-12, "projection is not tangent"
    print("property checks passed: P is a self-adjoint projector, retraction on the manifold and idempotent, "
          "projection tangent (tall, wide and batched shapes)")


def main(argv: list[str] | None = None) -> int:
    """Register the sphere, check it, train with it, show ``check`` explaining a failing point."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="width 16, 10 steps (about a second)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200; --tiny 10)")
    args = p.parse_args(argv)
    width, steps = (16, 10) if args.tiny else (128, 200)
    steps = args.steps if args.steps is not None else steps
    torch.manual_seed(0)

    register(Sphere)  # one line; the name "sphere" is now known everywhere a manifold name is accepted
    print(f"registered manifolds: {', '.join(manifolds.available())}")
    sphere = manifolds.get("sphere")
    property_checks(sphere)

    # A small regression model; its hidden matrices go on the sphere through a param_groups rule (a regex on the
    # parameter name -> a manifold name). Everything else (input layer, head, biases) is AdamW.
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 1))
    groups = param_groups(model, rules={r"^[24]\.weight$": "sphere"}, lr=0.05, adamw_lr=3e-3)
    opt = Muon(groups)
    print("\n" + describe(opt, model=model))
    hidden = [model[2].weight, model[4].weight]
    # a fresh initialisation is off the sphere; like Stiefel or DGram it is retracted onto it at its first step
    print(f"\nbefore training: {sphere.check(hidden[0].detach()).reason or 'on the sphere'}")

    # (opt.last_stats reports each step's tangent residual. Stiefel, DGram and Oblique declare entrywise_P = True,
    # which lets the optimizer estimate it from a few Gram rows on wide matrices; this P mixes entries (a trace), so
    # Sphere leaves entrywise_P False and the residual is measured in full.)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    y = torch.sin(x.sum(-1, keepdim=True))
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0 or (step + 1) % max(1, steps // 5) == 0:
            print(f"step {step + 1:4d}  loss {float(loss.detach()):.4f}")

    for name, w in zip(("2.weight", "4.weight"), hidden):
        res = sphere.check(w.detach(), tol=1e-5)
        sv = torch.linalg.svdvals(w.detach().double())
        norm = float(w.detach().norm())
        print(f"after training, {name}: check ok={res.ok} (error {res.error:.1e}); ‖W‖_F = {norm:.4f} "
              f"= sqrt({width}); singular values {float(sv.min()):.3f} … {float(sv.max()):.3f} (free, unlike Stiefel)")

    off = hidden[0].detach() * 1.3  # someone edits the weights outside the optimizer
    res = sphere.check(off)
    print(f"\na point off the sphere: ok={res.ok}\n  reason: {res.reason}")
    print(f"  retract() puts it back: {bool(sphere.check(sphere.retract(off)))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
