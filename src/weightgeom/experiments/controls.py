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
import os
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

    With ``run_dir`` the record is kept on disk as it grows: W_0 goes to ``run_dir/`` :data:`W0_FILE` (tensors only)
    at the first step and rows are appended to ``continuity.jsonl`` as they are logged, so a run killed half-way
    keeps them. A run resumed from a checkpoint at ``start_step`` continues the same record: steps count from there,
    ΔW is measured from the saved W_0 (``w0``), and the rows after ``start_step`` (from steps the resumed run redoes)
    are dropped.

    Args:
        every: recording interval in optimizer steps.
        max_steps: the run's length (always recorded).
        start_step: optimizer steps already done (the step of the checkpoint the trainer resumes from).
        w0: the stacked initial block weights saved by the first session (None: taken at the first step).
        run_dir: where to keep the record while training (None: only in memory until :meth:`write`).
    """

    def __init__(self, every: int, max_steps: int, start_step: int = 0, w0: torch.Tensor | None = None,
                 run_dir: str | Path | None = None) -> None:
        super().__init__()
        self.every = max(1, int(every))
        self.max_steps = int(max_steps)
        self.start_step = int(start_step)
        self.step = self.start_step
        self.rows: list[dict[str, Any]] = []
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._params: list[torch.Tensor] | None = None
        self._w0: torch.Tensor | None = w0
        self._flushed = 0
        self._kept: list[dict[str, Any]] | None = None  # earlier sessions' rows, read when this one starts

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
        if self._params is not None:
            return
        self._params = self._find(opt)
        W = torch.stack([p.detach().float().clone() for p in self._params])
        resumed = self._w0 is not None and self._w0.shape == W.shape
        if not resumed:
            self._w0 = W
            self._log("weight", self._w0)
            g = self._grads()
            if g is not None:
                self._log("grad", g)
        if self.run_dir is not None:  # training has started: the trainer has moved an earlier run's files aside
            self._kept = self._earlier_rows_of(self.run_dir)
            _write_rows(self.run_dir / CONTINUITY_FILE, self._kept)
            self._save_w0(self.run_dir)
            self._flush()

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
        self._flush()

    def _earlier_rows_of(self, run_dir: Path) -> list[dict[str, Any]]:
        """Rows of the earlier sessions this one continues (none for a run started from step 0)."""
        if self.start_step <= 0:
            return []
        return _earlier_rows(run_dir / CONTINUITY_FILE, self.start_step)

    def _flush(self) -> None:
        """Append the rows logged since the last flush to ``run_dir/continuity.jsonl``."""
        if self.run_dir is None or self._flushed == len(self.rows):
            return
        with open(self.run_dir / CONTINUITY_FILE, "a") as f:
            for r in self.rows[self._flushed:]:
                f.write(json.dumps(r) + "\n")
        self._flushed = len(self.rows)

    def _save_w0(self, run_dir: Path) -> None:
        if self._w0 is None or (run_dir / W0_FILE).exists():
            return
        from safetensors.torch import save_file

        tmp = run_dir / (W0_FILE + ".tmp")
        save_file({"w0": self._w0.contiguous()}, str(tmp))
        os.replace(tmp, run_dir / W0_FILE)

    def write(self, run_dir: str | Path) -> Path:
        """Write ``run_dir/continuity.jsonl`` in full (earlier sessions' rows up to ``start_step``, then this one's)
        and W_0 (:data:`W0_FILE`) if it is not there yet."""
        run_dir = Path(run_dir)
        path = run_dir / CONTINUITY_FILE
        streamed = self._kept is not None and self.run_dir is not None and self.run_dir.resolve() == run_dir.resolve()
        earlier = self._kept if streamed else self._earlier_rows_of(run_dir)
        _write_rows(path, list(earlier or []) + self.rows)
        self._save_w0(run_dir)
        return path


CONTINUITY_FILE = "continuity.jsonl"
"""Rows of a continuity record, one JSON object per line."""

W0_FILE = "continuity_w0.safetensors"
"""A continuity run's initial block weights (tensors only), read back when the run is resumed."""


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace ``path`` with ``rows`` (one JSON line each), atomically."""
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    os.replace(tmp, path)


def _earlier_rows(path: Path, upto: int) -> list[dict[str, Any]]:
    """Rows of an existing ``continuity.jsonl`` with ``step <= upto`` (later ones are recomputed after a resume)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a partial last line of a killed writer
        if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= upto:
            out.append(r)
    return out


def _resume_point(run_dir: Path, fresh: bool) -> tuple[int, torch.Tensor | None]:
    """``(start step, saved W_0)`` of a run the trainer will resume (``(0, None)`` for a fresh start)."""
    if fresh:
        return 0, None
    from weightgeom.train.checkpoint import list_checkpoints

    ckpts = list_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        return 0, None
    w0 = None
    if (run_dir / W0_FILE).exists():
        from safetensors.torch import load_file

        try:
            w0 = load_file(str(run_dir / W0_FILE)).get("w0")
        except Exception:  # noqa: BLE001 - an unreadable file: W_0 is taken at the resume point
            w0 = None
    return ckpts[-1][0], w0


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
        start, w0 = _resume_point(Path(run_dir), fresh)
        hooks.append(ContinuityRecorder(int(controls["continuity_every"]), int(get_path(config, "train.max_steps", 0)),
                                        start_step=start, w0=w0, run_dir=run_dir))
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
