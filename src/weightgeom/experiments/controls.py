"""Training-time controls and recorders for the experiment recipes, attached without touching the trainer.

Both work through PyTorch's *global* optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``
/ ``..._post_hook``), installed only for the duration of one ``weightgeom.train.train`` call, so they apply to
whatever optimizer the trainer builds (Muon, AdamW, manifold Muon). Parameters are identified by the ``"names"``
list that ``weightgeom.optim.param_groups`` puts in every group (shape-based fallback for the residual MLP).

* :class:`SigmaCap` — the scale control for DGram attention (not in seed 000): after every step, if
  σ_max(W_Q)·σ_max(W_K) > cap, rescale the attention weight by a scalar so the product equals ``cap``. A scalar
  rescale keeps every Gram-space constraint (DGram: orthogonal columns; Oblique/Stiefel are never above the cap),
  and bounds the logits |Z_ij| ≤ ‖x_i‖‖x_j‖·cap/√d. For a fused ``c_attn`` (Q, K, V stacked by rows) the whole
  fused weight is rescaled (Q, K and V share one constraint); separate ``q_proj``/``k_proj`` are rescaled by
  √(cap/product) each. The models have no QK-norm option, so this is the scale control the recipe uses.
* :class:`ContinuityRecorder` — continuity of the residual-MLP blocks over training: weights W_t, the gradient of
  the step's minibatch, and accumulated updates ΔW = W_t − W_0, with the dominance ratio ‖ΔW‖_F/‖W_0‖_F, written
  to ``continuity.jsonl`` in the run directory.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from weightgeom.experiments.runner import get_path


# ------------------------------------------------------------------------------------------------ metric helpers
def pair_continuity(Ws: torch.Tensor) -> dict[str, torch.Tensor]:
    """Continuity between adjacent matrices of a stack (L, out, in), PyTorch layout (v = input space).

    Returns:
        ``cv``, ``cu`` (|cos| of top right / left singular vectors), ``align_in`` (tr(S_l S_l+1)/‖S_l‖‖S_l+1‖,
        S = WᵀW) and ``align_out`` (same with S = WWᵀ), each of length L−1.
    """
    W = Ws.detach().double()
    S_in, S_out = W.mT @ W, W @ W.mT
    # v1 = top eigenvector of WᵀW; u1 = W v1 / ‖W v1‖ (see top_eigvec: ~10-50× cheaper than SVD/eigh on CPU)
    v1 = top_eigvec(S_in)
    u1 = (W @ v1.unsqueeze(-1)).squeeze(-1)
    u1 = u1 / torch.linalg.vector_norm(u1, dim=-1, keepdim=True).clamp_min(1e-300)
    cv = (v1[:-1] * v1[1:]).sum(-1).abs()
    cu = (u1[:-1] * u1[1:]).sum(-1).abs()

    def align(S: torch.Tensor) -> torch.Tensor:
        n = torch.linalg.matrix_norm(S)
        num = (S[:-1] * S[1:]).sum((-2, -1))
        return num / (n[:-1] * n[1:]).clamp_min(1e-300)

    return {"cv": cv, "cu": cu, "align_in": align(S_in), "align_out": align(S_out)}


def top_eigvec(S: torch.Tensor, squarings: int = 6, iters: int = 4) -> torch.Tensor:
    """Top eigenvector of a batch of symmetric PSD matrices (..., n, n) by repeated squaring + power iteration.

    S^(2^squarings) (Frobenius-normalised after each squaring) separates even close top eigenvalues (a 1 % gap is
    amplified to 0.99^(64·iters)); then ``iters`` power steps from a fixed start vector. Batched matmuls only.
    """
    A = S / torch.linalg.matrix_norm(S, keepdim=True).clamp_min(1e-300)
    for _ in range(squarings):
        A = A @ A
        A = A / torch.linalg.matrix_norm(A, keepdim=True).clamp_min(1e-300)
    n = S.shape[-1]
    g = torch.Generator().manual_seed(1234)
    x = (torch.randn(n, generator=g, dtype=torch.float64).to(S.dtype) + 0.1).expand(*S.shape[:-1]).unsqueeze(-1)
    for _ in range(iters):
        x = A @ x
        x = x / torch.linalg.vector_norm(x, dim=-2, keepdim=True).clamp_min(1e-300)
    return x.squeeze(-1)


def _group_names(opt: torch.optim.Optimizer) -> list[tuple[str | None, torch.Tensor]]:
    out = []
    for g in opt.param_groups:
        names = g.get("names")
        for i, p in enumerate(g["params"]):
            out.append((names[i] if names and i < len(names) else None, p))
    return out


# ---------------------------------------------------------------------------------------------------- hook base
class _GlobalHooks:
    """Install global optimizer pre/post step hooks for the first optimizer that steps (context manager)."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._opt_id: int | None = None

    def _mine(self, opt) -> bool:
        if self._opt_id is None:
            self._opt_id = id(opt)
        return id(opt) == self._opt_id

    def pre(self, opt: torch.optim.Optimizer) -> None:  # pragma: no cover - overridden
        pass

    def post(self, opt: torch.optim.Optimizer) -> None:  # pragma: no cover - overridden
        pass

    def __enter__(self):
        def pre(opt, args, kwargs):
            if self._mine(opt):
                self.pre(opt)

        def post(opt, args, kwargs):
            if self._mine(opt):
                self.post(opt)

        self._handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# ---------------------------------------------------------------------------------------------------- sigma cap
def _sigma_max(W: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(W.detach().float(), ord=2)


class SigmaCap(_GlobalHooks):
    """Cap σ_max(W_Q)·σ_max(W_K) per attention layer by scalar rescaling after each optimizer step.

    Args:
        cap: the bound on the product (Stiefel attention has product ≤ 1 for a fused c_attn).
        every: check every this many steps (1 = every step).
    """

    FUSED = re.compile(r"(.*)\.c_attn\.weight$")
    SEP_Q = re.compile(r"(.*)\.q_proj\.weight$")

    def __init__(self, cap: float, every: int = 1) -> None:
        super().__init__()
        if not cap > 0:
            raise ValueError(f"sigma_cap must be > 0, got {cap}")
        self.cap = float(cap)
        self.every = max(1, int(every))
        self.steps = 0
        self.rescales = 0
        self.max_seen = 0.0
        self._targets: list[tuple[str, Callable[[], None]]] | None = None

    def _find(self, opt) -> list[tuple[str, Callable[[], None]]]:
        named = {n: p for n, p in _group_names(opt) if n}
        if not named:
            raise RuntimeError("sigma_cap needs parameter names in the optimizer groups (weightgeom param_groups)")
        targets = []
        for n, p in named.items():
            m = self.FUSED.match(n)
            if m:
                targets.append((m.group(1), self._fused_fn(p)))
                continue
            m = self.SEP_Q.match(n)
            if m and f"{m.group(1)}.k_proj.weight" in named:
                targets.append((m.group(1), self._sep_fn(p, named[f"{m.group(1)}.k_proj.weight"])))
        if not targets:
            raise RuntimeError("sigma_cap found no attention weights (c_attn or q_proj/k_proj) among the parameters")
        return targets

    def _apply(self, scale_fn, prod: float) -> None:
        self.max_seen = max(self.max_seen, prod)
        if prod > self.cap:
            scale_fn(self.cap / prod)
            self.rescales += 1

    def _fused_fn(self, W: torch.Tensor):
        def fn() -> None:
            d = W.shape[1]
            prod = float(_sigma_max(W[:d]) * _sigma_max(W[d:2 * d]))

            def scale(r: float) -> None:
                with torch.no_grad():
                    W.mul_(math.sqrt(r))  # Q and K each scale by √r → product by r

            self._apply(scale, prod)

        return fn

    def _sep_fn(self, Wq: torch.Tensor, Wk: torch.Tensor):
        def fn() -> None:
            prod = float(_sigma_max(Wq) * _sigma_max(Wk))

            def scale(r: float) -> None:
                with torch.no_grad():
                    Wq.mul_(math.sqrt(r))
                    Wk.mul_(math.sqrt(r))

            self._apply(scale, prod)

        return fn

    def post(self, opt) -> None:
        self.steps += 1
        if self.steps % self.every:
            return
        if self._targets is None:
            self._targets = self._find(opt)
        for _, fn in self._targets:
            fn()

    def summary(self) -> dict[str, Any]:
        """What the control did (written to ``controls.json``)."""
        return {"sigma_cap": self.cap, "steps": self.steps, "rescales": self.rescales,
                "max_product_seen": self.max_seen, "layers": len(self._targets or [])}


# ------------------------------------------------------------------------------------------- continuity recorder
BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.fc\.weight$")


class ContinuityRecorder(_GlobalHooks):
    """Record continuity of the residual-MLP block stack (``blocks.{i}.fc.weight``) during training.

    At the first step (before the update) it stores W_0 and logs weight and gradient continuity at step 0; then every
    ``every`` optimizer steps (and at ``max_steps``) it logs weights (after the update), the gradient used by that
    step, and ΔW = W_t − W_0 with the per-layer dominance ratio ‖ΔW_l‖_F/‖W_0,l‖_F.

    Args:
        every: recording interval in optimizer steps.
        max_steps: the run's length (always recorded).
    """

    def __init__(self, every: int, max_steps: int) -> None:
        super().__init__()
        self.every = max(1, int(every))
        self.max_steps = int(max_steps)
        self.step = 0
        self.rows: list[dict[str, Any]] = []
        self._params: list[torch.Tensor] | None = None
        self._w0: torch.Tensor | None = None

    def _find(self, opt) -> list[torch.Tensor]:
        pairs = _group_names(opt)
        blocks = sorted(((int(m.group(1)), p) for n, p in pairs if n and (m := BLOCK.search(n))), key=lambda t: t[0])
        if blocks:
            return [p for _, p in blocks]
        # no names: the square matrices of the most common shape, in parameter order (ResMLP blocks)
        sq = [p for _, p in pairs if p.ndim == 2 and p.shape[0] == p.shape[1]]
        if len(sq) < 2:
            raise RuntimeError("continuity recorder found fewer than two block weights (blocks.{i}.fc.weight)")
        return sq

    def _log(self, kind: str, stack: torch.Tensor, extra: dict[str, torch.Tensor] | None = None) -> None:
        m = pair_continuity(stack)
        for layer in range(stack.shape[0] - 1):
            row = {"step": self.step, "kind": kind, "role": "fc", "layer": layer}
            row.update({k: float(v[layer]) for k, v in m.items()})
            if extra:
                row.update({k: float(v[layer]) for k, v in extra.items()})
            self.rows.append(row)

    def pre(self, opt) -> None:
        if self._params is None:
            self._params = self._find(opt)
            self._w0 = torch.stack([p.detach().float().clone() for p in self._params])
            self._log("weight", self._w0)
            g = self._grads()
            if g is not None:
                self._log("grad", g)

    def _grads(self) -> torch.Tensor | None:
        if any(p.grad is None for p in self._params):
            return None
        return torch.stack([p.grad.detach().float() for p in self._params])

    def post(self, opt) -> None:
        self.step += 1
        if self.step % self.every and self.step != self.max_steps:
            return
        W = torch.stack([p.detach().float() for p in self._params])
        self._log("weight", W)
        g = self._grads()
        if g is not None and float(g.abs().sum()) > 0:
            self._log("grad", g)
        dW = W - self._w0
        if float(dW.abs().sum()) > 0:
            dom = torch.linalg.matrix_norm(dW) / torch.linalg.matrix_norm(self._w0).clamp_min(1e-30)
            self._log("delta", dW, {"dominance": dom[:-1]})

    def write(self, run_dir: str | Path) -> Path:
        """Write the rows to ``run_dir/continuity.jsonl``."""
        path = Path(run_dir) / "continuity.jsonl"
        with open(path, "w") as f:
            for r in self.rows:
                f.write(json.dumps(r) + "\n")
        return path


# --------------------------------------------------------------------------------------------- entry point
def train_with_controls(config: dict[str, Any], run_dir: str | Path, controls: dict[str, Any],
                        progress: bool = True, fresh: bool = False) -> dict[str, Any]:
    """``weightgeom.train.train(config, run_dir)`` with the given controls attached.

    Args:
        config: the run's full config.
        run_dir: where the trainer writes the run.
        controls: ``{"sigma_cap": float}`` and/or ``{"continuity_every": int}``.
        progress: trainer progress output.
        fresh: start over instead of resuming from the run's newest checkpoint.

    Raises:
        ValueError: an unknown control name.
    """
    from weightgeom.train import train

    unknown = set(controls) - {"sigma_cap", "continuity_every"}
    if unknown:
        raise ValueError(f"unknown experiment control(s): {', '.join(sorted(unknown))} (known: sigma_cap, "
                         "continuity_every)")
    hooks: list[_GlobalHooks] = []
    if "sigma_cap" in controls:
        hooks.append(SigmaCap(float(controls["sigma_cap"])))
    if "continuity_every" in controls:
        hooks.append(ContinuityRecorder(int(controls["continuity_every"]),
                                        int(get_path(config, "train.max_steps", 0))))
    for h in hooks:
        h.__enter__()
    try:
        result = train(config, run_dir=str(run_dir), progress=progress, resume=False if fresh else "auto")
    finally:
        for h in hooks:
            h.__exit__(None, None, None)
    run_dir = Path(result.get("run_dir", run_dir))
    summary: dict[str, Any] = {}
    for h in hooks:
        if isinstance(h, SigmaCap):
            summary.update(h.summary())
        if isinstance(h, ContinuityRecorder) and run_dir.is_dir():
            h.write(run_dir)
            summary["continuity_rows"] = len(h.rows)
    if run_dir.is_dir():
        (run_dir / "controls.json").write_text(json.dumps(summary, indent=1))
    return result
