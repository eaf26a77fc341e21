"""Cross-layer shared bases: ``compress(source, out)`` applies ``--suggest``'s advice to a checkpoint.

For a role (Q, K, V, O, Gate, Up, Down, MLP) the layers are cut into groups of ``layers_per_group`` consecutive layers
of one shape (m×n, PyTorch's (out, in) layout). Per group:

* **input space** (``share="input"``): one shared right basis V (n×r), the top-r right singular vectors of the stacked
  rows [W_1; …; W_k] (the top-r eigenvectors of Σ_l W_lᵀW_l); per layer the coefficients C_l = W_l V (m×r);
  W_l ≈ C_l Vᵀ. Parameters n·r + k·m·r.
* **output space** (``share="output"``): one shared left basis U (m×r) of [W_1, …, W_k] (eigenvectors of
  Σ_l W_lW_lᵀ); coefficients C_l = Uᵀ W_l (r×n); W_l ≈ U C_l. Parameters m·r + k·n·r.
* **per layer** (``share="none"``, the no-sharing baseline): truncated SVD of each W_l, W_l ≈ (U_rΣ_r) V_rᵀ.
  Parameters (m + n)·r per layer.
* ``share="auto"``: each role in the space whose top singular vectors are more continuous across adjacent layers
  (C_v or C_u over its random level, :func:`choose_spaces`).

With calibration (``calibration``: a text; or precomputed ``grams``) every mode is fitted to the layers' outputs
instead of their weights: per-layer whitened SVD (SVD-LLM), shared bases with least-squares coefficients refitted
with each layer's input Gram (:mod:`weightgeom.analysis.compress_fit`, Grams from
:mod:`weightgeom.analysis.calibration`), stored in the same format (bases + coefficients); ``share="auto"`` then picks
per role the lowest calibration loss among input, output and per layer (:mod:`weightgeom.analysis.compress_choice`).

``basis="random"`` replaces the shared basis by a random orthonormal one (QR of a seeded Gaussian matrix), with the
same least-squares coefficients: the baseline that tells how much of a shared basis' worth is the data's.

Counts are exact: a group's basis is counted once, each layer's coefficients once. A rank may be given (``rank``) or
derived per group from a target fraction of the role's parameters saved (``savings``; the largest rank whose
parameter count is at most (1 − savings) × the dense count, so the saving reached is at least the target).

Output (``compress(source, out)``): ``out/compressed.json`` (the index: source, roles, groups, shapes, the tensors of
the source each layer came from) and one safetensors file per group (``tensors/<role>-g<j>.safetensors``: ``basis``
and ``coef.<layer>``), each written whole (temporary name, then renamed) before the index names it; the index is
rewritten after every role with ``"complete": false`` until the end, so Ctrl-C leaves the finished roles usable.
``savings.csv`` is the parameters table. Reading back (:func:`apply_compressed`, :func:`decompress`) checks every
shape against the index, loads tensors only (safetensors) and writes the dense products Ŵ_l into the matching
(role, layer) matrices of a model or state dict (GPT-2's transposed Conv1D and fused QKV rows included, through the
same role assignment as the analysis).

The source is streamed like ``analyze``: only one group's matrices (k of them, float32) are in memory at a time.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch

from weightgeom._files import is_regular, read_json, write_atomic
from weightgeom.analysis.api import SHARE_SPACE, _as_loaded, analyze_full, as_computable
from weightgeom.analysis.compress_fit import CALIBRATION_HOLDOUT, CALIBRATION_TOKENS, fit_group
from weightgeom.analysis.loaders import Loaded, check_source, load, materialize
from weightgeom.analysis.report import space_ratios, summary_table
from weightgeom.analysis.roles import ROLES, RoleWeight, assign_roles
from weightgeom.train.rundir import LOCK_NAME, DirLock

__all__ = ["CompressConfig", "CompressResult", "GroupResult", "SHARE_MODES", "BUDGETS", "BASES", "SPACES", "INDEX_FILE",
           "compress", "compress_roles", "choose_spaces", "group_params", "max_rank", "rank_for_savings",
           "shared_basis", "random_basis", "coefficients", "reconstruct", "apply_compressed", "decompress",
           "read_index", "compressed_source", "check_out", "source_fingerprint", "FORMAT_VERSION"]

SHARE_MODES = ("input", "output", "auto", "none")
BUDGETS = ("role", "model")
"""``savings`` per role (each role saves that fraction of its own parameters) or of the whole model (all the compressed
roles' parameters together, allotted per role by measured calibration loss:
:mod:`weightgeom.analysis.compress_budget`)."""
SPACES = ("input", "output", "none")
BASES = ("svd", "random")
INDEX_FILE = "compressed.json"
SAVINGS_FILE = "savings.csv"
FORMAT_VERSION = 1
DEFAULT_ROLES_EXCLUDED = ("V",)
"""Roles compressed only when named: the continuity paper advises no shared basis for V."""


@dataclass(frozen=True)
class CompressConfig:
    """What :func:`compress` does.

    Attributes:
        share: ``input`` | ``output`` | ``auto`` (each role's more continuous space) | ``none`` (per-layer SVD).
        rank: basis rank r per group (exclusive with ``savings``).
        savings: target fraction of each role's parameters saved, in (0, 1) (exclusive with ``rank``).
        layers_per_group: k, consecutive layers sharing one basis (the last group of a run may be shorter).
        roles: roles to compress (None: every recognised role except V).
        basis: ``svd`` (top-r singular vectors of the group) or ``random`` (seeded random orthonormal basis).
        seed: seed of the random bases.
        calibration: None (weight-only fits: the bases minimise the weight error) or the calibration text (a file
            path, or ``shakespeare`` for the bundled text without its held-out tail): every mode then minimises the
            layer-output error on it (:mod:`weightgeom.analysis.compress_fit`), and ``auto`` picks per role the
            space with the lowest calibration loss (input, output or per layer).
        calibration_tokens: calibration budget in tokens.
        calibration_holdout: for ``auto`` with calibration, the fraction of the calibration tokens (the last ones)
            each space's fit is scored on, fitted on the rest (0: scored on the tokens it was fitted on); the chosen
            space is then fitted on all of them.
        budget: ``role`` (``savings`` of each role's parameters) or ``model`` (``savings`` of all the compressed
            roles' parameters together, allotted per role by calibration loss; needs calibration).
    """

    share: str = "auto"
    rank: int | None = None
    savings: float | None = None
    layers_per_group: int = 4
    roles: tuple[str, ...] | None = None
    basis: str = "svd"
    seed: int = 0
    calibration: str | None = None
    calibration_tokens: int = CALIBRATION_TOKENS
    calibration_holdout: float = CALIBRATION_HOLDOUT
    budget: str = "role"

    def check(self) -> None:
        """Raise ``ValueError`` (one line) for an impossible setting."""
        if self.share not in SHARE_MODES:
            raise ValueError(f"unknown share mode {self.share!r}; choose from {', '.join(SHARE_MODES)}")
        if self.basis not in BASES:
            raise ValueError(f"unknown basis {self.basis!r}; choose from {', '.join(BASES)}")
        if (self.rank is None) == (self.savings is None):
            raise ValueError("give exactly one of rank (--rank) and savings (--savings)")
        if self.rank is not None and (isinstance(self.rank, bool) or int(self.rank) != self.rank or self.rank < 1):
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        if self.savings is not None and not (isinstance(self.savings, (int, float)) and 0 < self.savings < 1):
            raise ValueError(f"savings must be a fraction strictly between 0 and 1, got {self.savings!r}")
        if self.layers_per_group < 1:
            raise ValueError(f"layers_per_group must be >= 1, got {self.layers_per_group}")
        if self.roles is not None:
            bad = [r for r in self.roles if r not in ROLES]
            if bad:
                raise ValueError(f"unknown role {bad[0]!r}; choose from {', '.join(ROLES)}")
            if not self.roles:
                raise ValueError("roles: name at least one role")
        if self.basis == "random" and self.share == "none":
            raise ValueError("basis 'random' needs a shared space (share input, output or auto), not 'none'")
        if type(self.calibration_tokens) is not int or self.calibration_tokens < 2:
            raise ValueError(f"calibration_tokens must be an integer >= 2, got {self.calibration_tokens!r}")
        if self.budget not in BUDGETS:
            raise ValueError(f"unknown budget {self.budget!r}; choose from {', '.join(BUDGETS)}")
        if self.budget == "model" and self.savings is None:
            raise ValueError("budget model allots a whole-model --savings across roles; give --savings, not --rank")
        h = self.calibration_holdout
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
            raise ValueError(f"calibration_holdout must be a fraction in [0, 1), got {h!r}")


# --------------------------------------------------------------------------------------------------- pure counting
def group_params(space: str, k: int, m: int, n: int, r: int) -> int:
    """Parameters of one group of k (m×n) layers at rank r: the shared basis once plus each layer's coefficients.

    Args:
        space: ``input`` (n·r + k·m·r), ``output`` (m·r + k·n·r) or ``none`` (k·(m + n)·r, per-layer SVD).
    """
    if space == "input":
        return n * r + k * m * r
    if space == "output":
        return m * r + k * n * r
    if space == "none":
        return k * (m + n) * r
    raise ValueError(f"unknown space {space!r}; choose from {', '.join(SPACES)}")


def max_rank(space: str, k: int, m: int, n: int) -> int:
    """Largest meaningful rank: the basis' dimension, at most the rank of the stacked group (min(n, k·m) in the input
    space, min(m, k·n) in the output space, min(m, n) per layer)."""
    if space == "input":
        return min(n, k * m)
    if space == "output":
        return min(m, k * n)
    return min(m, n)


def rank_for_savings(space: str, k: int, m: int, n: int, savings: float) -> int:
    """The largest rank whose :func:`group_params` is at most (1 − savings)·k·m·n (0 when even rank 1 costs more),
    capped at :func:`max_rank`."""
    per_rank = group_params(space, k, m, n, 1)
    budget = (1.0 - savings) * k * m * n
    return min(int(math.floor(budget / per_rank + 1e-9)), max_rank(space, k, m, n))


# ---------------------------------------------------------------------------------------------------- linear algebra
def random_basis(d: int, r: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random orthonormal d×r basis (float32): QR of a d×r standard Gaussian matrix (float64) drawn from
    ``generator``."""
    return torch.linalg.qr(torch.randn(d, r, generator=generator, dtype=torch.float64)).Q.float()


def shared_basis(Ws: Sequence[torch.Tensor], space: str, r: int, basis: str = "svd",
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """The group's orthonormal basis (d×r, d = n for ``input``, m for ``output``), float32.

    ``svd``: the top-r eigenvectors of Σ_l W_lᵀW_l (input) or Σ_l W_lW_lᵀ (output), i.e. the top-r right (left)
    singular vectors of the stacked [W_1; …; W_k] ([W_1, …, W_k]); the d×d Gram is accumulated and diagonalised in
    float64. ``random``: QR of a d×r standard Gaussian matrix drawn from ``generator``.
    """
    m, n = Ws[0].shape
    d = n if space == "input" else m
    if basis == "random":
        return random_basis(d, r, generator)
    G = torch.zeros(d, d, dtype=torch.float64)
    for W in Ws:
        W64 = W.double()
        G += W64.mT @ W64 if space == "input" else W64 @ W64.mT
    _, vecs = torch.linalg.eigh(G)
    return vecs[:, -r:].flip(-1).contiguous().float()


def coefficients(W: torch.Tensor, B: torch.Tensor, space: str) -> torch.Tensor:
    """Least-squares coefficients of W in the orthonormal basis B: W B (m×r, input space) or Bᵀ W (r×n, output)."""
    return W @ B if space == "input" else B.mT @ W


def reconstruct(C: torch.Tensor, B: torch.Tensor, space: str) -> torch.Tensor:
    """The dense m×n matrix from coefficients and basis: C Bᵀ (input space, and per-layer SVD) or B C (output)."""
    return B @ C if space == "output" else C @ B.mT


def _per_layer_svd(W: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated SVD of W at rank r: (U_rΣ_r (m×r), V_r (n×r)), so that W ≈ C Vᵀ as in the input space."""
    U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    return (U[:, :r] * S[:r]).float(), Vh[:r].mT.contiguous().float()


# ---------------------------------------------------------------------------------------------------------- spaces
def choose_spaces(source, roles: Mapping[str, str] | str | None = None,
                  only: Sequence[str] | None = None) -> dict[str, dict]:
    """Per role, the space whose top singular vectors are more continuous across adjacent layers.

    Runs the streamed continuity analysis (C_v, C_u with their random levels) and picks, per role, the space with the
    larger ratio to its random level (:func:`space_ratios`); a role with fewer than two layers of one shape falls back
    to the continuity paper's space (``SHARE_SPACE``).

    Returns:
        role → ``{"space": "input"|"output", "input": ratio, "output": ratio}``.
    """

    res = analyze_full(source, roles, metrics=("cv", "cu"), method="randomized")
    s = summary_table(res.pairs) if not res.pairs.empty else pd.DataFrame()
    out: dict[str, dict] = {}
    names = list(only) if only is not None else sorted({str(r) for r in res.layers["role"]}) if not res.layers.empty \
        else []
    for role in names:
        if role in s.index:
            r = s.loc[role]
            ratios = space_ratios(float(r["cv"]), float(r["cv_rand"]), float(r["cu"]), float(r["cu_rand"]))
            best = "input" if not ratios["output"] > ratios["input"] else "output"
            out[role] = {"space": best, **ratios}
        else:
            out[role] = {"space": SHARE_SPACE.get(role, "input"), "input": math.nan, "output": math.nan}
    return out


# --------------------------------------------------------------------------------------------------- the streaming
@dataclass
class GroupResult:
    """One compressed group.

    Attributes:
        role, space, basis: what was done (``space`` ``none`` = per-layer SVD).
        layers: the layer indices; ``names``: the source tensor each came from (with its role-assignment note).
        shape: (m, n) of each layer's matrix; ``rank``: r.
        basis_t: the shared basis (d×r), or per layer for ``none`` (dict layer → n×r).
        coefs: layer → coefficients.
        params_dense, params: parameter counts before / after; ``energy_lost``: Σ‖W − Ŵ‖_F² / Σ‖W‖_F².
        calib_loss: with calibration Grams, the relative layer-output error Σ_l tr(D_l G_l D_lᵀ) / ``calib_energy``
            (D_l = W_l − Ŵ_l); ``calib_energy`` = Σ_l tr(W_l G_l W_lᵀ). None without calibration.
    """

    role: str
    space: str
    basis: str
    layers: list[int]
    names: list[str]
    notes: list[str]
    shape: tuple[int, int]
    rank: int
    basis_t: torch.Tensor | dict[int, torch.Tensor]
    coefs: dict[int, torch.Tensor]
    params_dense: int
    params: int
    energy_lost: float
    calib_loss: float | None = None
    calib_energy: float = 0.0

    def dense(self, layer: int) -> torch.Tensor:
        """Ŵ of ``layer`` (m×n float32)."""
        B = self.basis_t[layer] if isinstance(self.basis_t, dict) else self.basis_t
        return reconstruct(self.coefs[layer], B, "input" if self.space == "none" else self.space)


def _runs(items: list[RoleWeight]) -> list[list[RoleWeight]]:
    """Consecutive layers of one shape (a shape change starts a new run)."""
    runs: list[list[RoleWeight]] = []
    for rw in items:
        if runs and tuple(runs[-1][-1].weight.shape) == tuple(rw.weight.shape) and rw.layer == runs[-1][-1].layer + 1:
            runs[-1].append(rw)
        else:
            runs.append([rw])
    return runs


def _groups(items: list[RoleWeight], k: int) -> list[list[RoleWeight]]:
    return [run[i:i + k] for run in _runs(items) for i in range(0, len(run), k)]


def _plural(n: int, word: str) -> str:
    """``"1 layer"``, ``"2 layers"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _percent(x: float) -> str:
    """A fraction as a percentage with three significant digits (0.001 → ``"0.1%"``, 0.75 → ``"75%"``)."""
    return f"{x * 100:.3g}%"


def _plan(by_role: dict[str, list[RoleWeight]], cfg: CompressConfig, spaces: Mapping[str, str],
          allow_growth: bool = False, savings_by_role: Mapping[str, float] | None = None
          ) -> list[tuple[str, str, list[RoleWeight], int]]:
    """(role, space, group, rank) for every group, checked before anything is read.

    Args:
        allow_growth: accept a rank at which a group takes at least as many parameters as its dense matrices (a
            full-rank round trip); refused by default.
        savings_by_role: role → its own savings fraction instead of ``cfg.savings`` (a whole-model budget's
            allotment).

    Raises:
        ValueError: a rank larger than a group's matrices allow, a rank that saves no parameters (naming the largest
            that does), or a savings target no rank ≥ 1 reaches.
    """
    plan = []
    for role, items in by_role.items():
        space = spaces[role]
        for g in _groups(items, cfg.layers_per_group):
            m, n = (int(d) for d in g[0].weight.shape)
            k = len(g)
            top = max_rank(space, k, m, n)
            if cfg.rank is not None:
                if cfg.rank > top:
                    what = {"input": f"the input space of {m}×{n} matrices has {n} dimensions",
                            "output": f"the output space of {m}×{n} matrices has {m} dimensions",
                            "none": f"a {m}×{n} matrix has rank at most {min(m, n)}"}[space]
                    raise ValueError(f"--rank {cfg.rank} is larger than role {role} allows: {what} (layers "
                                     f"{g[0].layer}-{g[-1].layer}, {space} space); at most {top}")
                r = int(cfg.rank)
                if not allow_growth and group_params(space, k, m, n, r) >= k * m * n:
                    best = min((k * m * n - 1) // group_params(space, k, m, n, 1), top)
                    hint = (f"the largest rank that saves parameters is {best}" if best >= 1 else
                            "no rank saves parameters there (choose another --share or --layers-per-group)")
                    raise ValueError(f"--rank {r} saves nothing for role {role}: {_plural(k, 'layer')} of {m}×{n} "
                                     f"(layers {g[0].layer}-{g[-1].layer}, {space} space) take "
                                     f"{group_params(space, k, m, n, r)} parameters at rank {r}, not fewer than "
                                     f"their {k * m * n} dense ones; {hint}")
            else:
                sv = float((savings_by_role or {}).get(role, cfg.savings))
                r = rank_for_savings(space, k, m, n, sv)
                if r < 1:
                    raise ValueError(f"savings {sv:g}: even rank 1 keeps more than "
                                     f"{_percent(1 - sv)} of role {role}'s {m}×{n} parameters in the {space} "
                                     f"space (k={k}); lower it")
            plan.append((role, space, g, r))
    return plan


def compress_roles(source, cfg: CompressConfig, *, role_map: Mapping[str, str] | str | None = None,
                   spaces: Mapping[str, str] | None = None, progress: bool = False,
                   by_role: dict[str, list[RoleWeight]] | None = None, allow_growth: bool = False,
                   skip: Collection[str] = (), grams=None,
                   savings_by_role: Mapping[str, float] | None = None) -> Iterator[GroupResult]:
    """Compress group by group (a generator: each :class:`GroupResult` is yielded, then dropped by the caller).

    Args:
        source: path, nn.Module, state dict or :class:`~weightgeom.analysis.loaders.Loaded` (paths are streamed).
        cfg: :class:`CompressConfig`.
        role_map: user role map (as ``analyze --roles``).
        spaces: role → ``input``/``output`` (required for ``share="auto"`` unless computed here by
            :func:`choose_spaces`).
        progress: one stderr line per group with the elapsed time and an ETA (by matrix size).
        by_role: already assigned roles (skips opening ``source``).
        allow_growth: accept a rank that saves no parameters (see :func:`_plan`).
        skip: roles planned but neither read nor yielded (already written by an interrupted :func:`compress`); their
            random bases are drawn and dropped, so the other roles get those of an uninterrupted run.
        grams: calibration Grams (:class:`weightgeom.analysis.calibration.Grams`): every group is fitted to minimise
            its layers' output error on them (:func:`weightgeom.analysis.compress_fit.fit_group`; a random basis
            keeps its least-squares refitted coefficients); None: weight-only fits.
        savings_by_role: role → its own savings fraction (a whole-model budget's allotment, see :func:`_plan`).

    Raises:
        ValueError: bad config, unknown naming, no matrix of the requested roles, a rank a group cannot have or that
            saves nothing, a non-finite matrix (named).
    """

    cfg.check()
    if by_role is None:
        by_role = assign_roles(_as_loaded(source).tensors, role_map)
    by_role = _select(by_role, cfg.roles)
    if cfg.share == "auto":
        if not spaces:
            spaces = {r: v["space"] for r, v in choose_spaces(source, role_map, list(by_role)).items()}
        spaces = dict(spaces)
    else:
        spaces = dict.fromkeys(by_role, cfg.share)
    plan = _plan(by_role, cfg, spaces, allow_growth, savings_by_role)
    gen = torch.Generator().manual_seed(int(cfg.seed))
    total = sum(rw.weight.numel() for role, _, g, _ in plan if role not in skip for rw in g) or 1
    done, t0 = 0, time.perf_counter()
    for j, (role, space, g, r) in enumerate(plan):
        if role in skip:
            if cfg.basis == "random" and space != "none":
                m, n = g[0].weight.shape
                random_basis(int(n if space == "input" else m), r, gen)
            continue
        Ws = []
        for rw in g:
            W = as_computable(materialize(rw.weight), rw.name).float()
            if not bool(torch.isfinite(W).all()):
                raise ValueError(f"{rw.name} (role {role} layer {rw.layer}) holds NaN or Inf: cannot compress it")
            Ws.append(W)
        m, n = Ws[0].shape
        fit = None
        if grams is not None:
            rb = random_basis(int(n if space == "input" else m), r, gen) if cfg.basis == "random" else None
            fit = fit_group(space, Ws, [grams.get(role, rw.layer) for rw in g], r, basis=rb)
            coefs = {rw.layer: c for rw, c in zip(g, fit.coefs)}
            basis_t = {rw.layer: b for rw, b in zip(g, fit.basis)} if space == "none" else fit.basis
        elif space == "none":
            pairs = [_per_layer_svd(W, r) for W in Ws]
            coefs = {rw.layer: c for rw, (c, _) in zip(g, pairs)}
            basis_t: torch.Tensor | dict = {rw.layer: b for rw, (_, b) in zip(g, pairs)}
        else:
            basis_t = shared_basis(Ws, space, r, cfg.basis, gen)
            coefs = {rw.layer: coefficients(W, basis_t, space) for rw, W in zip(g, Ws)}
        res = GroupResult(role, space, cfg.basis if space != "none" else "svd", [rw.layer for rw in g],
                          [rw.name for rw in g], [rw.note for rw in g], (m, n), r, basis_t, coefs,
                          len(g) * m * n, group_params(space, len(g), m, n, r), 0.0)
        tot = sum(float((W.double() ** 2).sum()) for W in Ws)
        lost = sum(float(((W - res.dense(rw.layer)).double() ** 2).sum()) for rw, W in zip(g, Ws))
        res.energy_lost = lost / tot if tot > 0 else 0.0
        if fit is not None:
            res.calib_loss, res.calib_energy = fit.loss, float(sum(fit.energies))
        del Ws
        done += sum(rw.weight.numel() for rw in g)
        if progress:
            el = time.perf_counter() - t0
            print(f"  [{j + 1}/{len(plan)}] {role:5s} layers {g[0].layer}-{g[-1].layer} {m}×{n} {space} rank {r}  "
                  f"{el:.1f} s elapsed, ETA {el / done * (total - done):.1f} s", file=sys.stderr, flush=True)
        yield res


def _select(by_role: dict[str, list[RoleWeight]], roles: Sequence[str] | None) -> dict[str, list[RoleWeight]]:
    """The requested roles (default: all recognised but V); refuses a requested role the source lacks, and a role
    (from a user role map) that is not one of :data:`ROLES`."""
    unknown = [r for r in by_role if r not in ROLES]
    if unknown:
        raise ValueError(f"role map: unknown role {unknown[0]!r}; choose from {', '.join(ROLES)}")
    if roles is None:
        sel = {r: v for r, v in by_role.items() if r not in DEFAULT_ROLES_EXCLUDED}
        if not sel:
            raise ValueError(f"only role(s) {', '.join(by_role)} found, which are compressed only when named "
                             "(--roles V)")
        return sel
    missing = [r for r in roles if r not in by_role]
    if missing:
        raise ValueError(f"role {missing[0]} not found in the source (it has {', '.join(by_role) or 'none'})")
    return {r: by_role[r] for r in roles}


# ------------------------------------------------------------------------------------------------------ the writer
@dataclass
class CompressResult:
    """What :func:`compress` wrote.

    Attributes:
        table: one row per role (and ``total``): layers, shape, space, ranks, params before/after, saved, saved_frac,
            energy_lost.
        index: the ``compressed.json`` contents.
        out: the output directory (None when nothing was written).
        spaces: role → the space used (with the continuity ratios for ``auto``).
    """

    table: pd.DataFrame
    index: dict
    out: Path | None
    spaces: dict = field(default_factory=dict)


def savings_table(groups: Sequence[dict]) -> pd.DataFrame:
    """Per role: layers, shape(s), space, ranks, params before / after, saved, saved fraction, energy lost; plus a
    ``total`` row. ``groups`` are index entries (``role, space, layers, shape, rank, params_dense, params,
    energy_lost``)."""
    rows = []
    by_role: dict[str, list[dict]] = {}
    for g in groups:
        by_role.setdefault(g["role"], []).append(g)
    for role, gs in by_role.items():
        dense, after = sum(g["params_dense"] for g in gs), sum(g["params"] for g in gs)
        e_tot = sum(g["energy_lost"] * g["params_dense"] for g in gs) / dense if dense else 0.0
        ranks = sorted({g["rank"] for g in gs})
        rows.append({"role": role, "layers": sum(len(g["layers"]) for g in gs), "groups": len(gs),
                     "shape": ", ".join(sorted({f"{g['shape'][0]}x{g['shape'][1]}" for g in gs})),
                     "space": "/".join(sorted({g["space"] for g in gs})), "basis": "/".join(sorted({g["basis"]
                                                                                                 for g in gs})),
                     "rank": ranks[0] if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}",
                     "params_dense": dense, "params": after, "saved": dense - after,
                     "saved_frac": (dense - after) / dense if dense else 0.0, "energy_lost": e_tot,
                     **_calib_cols(gs)})
    if rows:
        dense, after = sum(r["params_dense"] for r in rows), sum(r["params"] for r in rows)
        rows.append({"role": "total", "layers": sum(r["layers"] for r in rows),
                     "groups": sum(r["groups"] for r in rows), "shape": "", "space": "", "basis": "", "rank": "",
                     "params_dense": dense, "params": after,
                     "saved": dense - after, "saved_frac": (dense - after) / dense if dense else 0.0,
                     "energy_lost": sum(r["energy_lost"] * r["params_dense"] for r in rows) / dense if dense else 0.0,
                     **_calib_cols(groups)})
    return pd.DataFrame(rows)


def _calib_cols(groups: Sequence[dict]) -> dict:
    """``{"calib_loss": Σ loss·energy / Σ energy}`` over groups fitted with calibration ({} when none was)."""
    gs = [g for g in groups if isinstance(g.get("calib_loss"), (int, float))]
    if not gs:
        return {}
    en = sum(float(g.get("calib_energy") or 0.0) for g in gs)
    err = sum(float(g["calib_loss"]) * float(g.get("calib_energy") or 0.0) for g in gs)
    return {"calib_loss": err / en if en > 0 else 0.0}


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")
_WEIGHT_INDEXES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def source_fingerprint(path: str | Path) -> dict[str, list[int]]:
    """A cheap fingerprint of a model source, nothing read: ``{file: [size in bytes, modification time in ns]}`` of the
    file itself, or of a folder's weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``,
    ``*.gguf``, ``config.json`` and the shard indexes) and those of its ``checkpoints/`` (a run directory)."""
    p = Path(path)
    if not p.is_dir():
        st = p.stat()
        return {p.name: [st.st_size, st.st_mtime_ns]}
    out: dict[str, list[int]] = {}
    for sub in (p, p / "checkpoints"):
        if not sub.is_dir():
            continue
        for f in sorted(sub.iterdir()):
            if (f.suffix.lower() in _WEIGHT_SUFFIXES or f.name in _WEIGHT_INDEXES) and f.is_file():
                st = f.stat()
                out[f.relative_to(p).as_posix()] = [st.st_size, st.st_mtime_ns]
    return out


def _fingerprint_change(old: Mapping, new: Mapping) -> str:
    """What differs between two :func:`source_fingerprint` results, in words ("" when nothing)."""
    for name in sorted(set(old) | set(new)):
        if name not in new:
            return f"{name} is gone"
        if name not in old:
            return f"{name} was added"
        if list(old[name]) != list(new[name]):
            return f"{name} has another size or modification time"
    return ""


def _source_info(source) -> dict:
    """Where the compressed weights came from: the resolved path and :func:`source_fingerprint` (path None for an
    in-memory model)."""

    if isinstance(source, Loaded):
        source = source.meta.get("path")
    if isinstance(source, (str, Path)):
        p = Path(source).resolve()
        return {"path": str(p), "fingerprint": source_fingerprint(p)}
    return {"path": None}


def _jsonable(x):
    """``x`` as it reads back from JSON (tuples become lists), for comparing settings with a written index."""
    return json.loads(json.dumps(x, default=_json_default))


def _names(entries: Sequence[str], shown: int = 3) -> str:
    """``"a, b, c and 4 more"``."""
    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(entries[:shown]) + more


def _recorded_source(d: Path) -> str:
    """`` (<path>)`` of the source a compress output's index records; "" when it cannot be read or names ``d``."""
    try:
        src = read_json(d / INDEX_FILE, what="compressed index")["source"]["path"]
        return f" ({src})" if Path(src).resolve() != d.resolve() else ""
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def check_out(out: str | Path, source, cfg: CompressConfig, role_map: Mapping[str, str] | str | None = None, *,
              locked: bool = False) -> dict | None:
    """Whether ``out`` may take :func:`compress`'s output for ``source`` and ``cfg``; nothing is written.

    ``out`` in use by another live compress (its lock, :class:`~weightgeom.train.rundir.DirLock`) is refused, unless
    ``locked``: the caller holds that lock itself (the check :func:`compress` repeats under it).

    Returns:
        None for a new or empty directory; the index to resume for an interrupted compress (``"complete": false``)
        of the same source (path and :func:`source_fingerprint`), settings and role map.

    Raises:
        FileNotFoundError: no such source.
        ValueError: a dangling link or special file as the source; the source is itself a compress output; ``out``
            is the source or inside it; ``out`` is not empty and is not an interrupted compress of the same source
            and settings (one line naming what differs).
        FileExistsError: ``out`` holds a finished compressed checkpoint.
    """
    path = source.meta.get("path") if isinstance(source, Loaded) else source
    out_p = Path(out)
    info: dict = {"path": None}
    if isinstance(path, (str, Path)):
        sp = Path(path)
        check_source(sp)  # nothing there, a dangling link or a special file: one line
        if sp.is_dir() and (sp / INDEX_FILE).is_file():
            raise ValueError(f"{sp}: is a compress output ({INDEX_FILE}), not a model; compress its source"
                             f"{_recorded_source(sp)} instead")
        info = _source_info(sp)
        o, s = out_p.resolve(), Path(info["path"])
        if o == s or s in o.parents:
            where = "is the source model" if o == s else "is inside the source model"
            raise ValueError(f"--out {out}: {where} {sp}; compress writes into a directory of its own — choose "
                             "another --out")
    if not out_p.is_dir():
        return None
    busy = "" if locked else DirLock(out_p, what="--out").in_use_reason()  # another compress writing there now
    if busy:
        raise ValueError(busy)
    entries = sorted(e.name for e in out_p.iterdir() if not e.name.startswith(LOCK_NAME))
    if not entries:
        return None
    if INDEX_FILE not in entries:
        raise ValueError(f"--out {out}: is not empty ({_names(entries)}) and not a compress output; compress writes "
                         "only into a new or empty directory — choose another --out")
    idx = read_json(out_p / INDEX_FILE, what="compressed index")
    if not isinstance(idx, dict) or idx.get("format") != "weightgeom-compressed":
        raise ValueError(f"--out {out}: {INDEX_FILE} is not a weightgeom compressed index; choose another --out")
    if _complete(out_p, idx):
        raise FileExistsError(f"--out {out}: already holds a compressed checkpoint ({INDEX_FILE}); choose another "
                              "--out or remove it")
    if info["path"] is None:
        raise ValueError(f"--out {out}: holds an interrupted compress, which an in-memory model cannot be matched to; "
                         "choose another --out or remove it")
    old_src = idx.get("source") if isinstance(idx.get("source"), dict) else {}
    old_cfg = idx.get("config") if isinstance(idx.get("config"), dict) else {}
    new_cfg = _jsonable(asdict(cfg))
    diff = [k for k in new_cfg if old_cfg.get(k) != new_cfg[k]]
    if old_src.get("path") != info["path"]:
        diff.insert(0, f"source {old_src.get('path')}")
    elif old_src.get("fingerprint") != info["fingerprint"]:
        diff.insert(0, f"source files ({_fingerprint_change(old_src.get('fingerprint') or {}, info['fingerprint'])})")
    if idx.get("role_map") != _jsonable(role_map):
        diff.append("role map")
    if idx.get("version") != FORMAT_VERSION:
        diff.append(f"format version {idx.get('version')!r}")
    if diff:
        raise ValueError(f"--out {out}: holds an interrupted compress with another {', '.join(diff)}; rerun that "
                         "command to finish it, or choose another --out")
    groups = idx.get("groups")
    if not isinstance(groups, list):
        raise ValueError(f"{out_p / INDEX_FILE}: groups is not a list")
    _check_groups(out_p, groups)
    return idx


def _group_file(role: str, j: int) -> str:
    return f"tensors/{role}-g{j:03d}.safetensors"


def compress(source, out: str | Path | None = None, cfg: CompressConfig | None = None, *,
             role_map: Mapping[str, str] | str | None = None, progress: bool = False,
             on_role_done: Callable[[CompressResult], None] | None = None, allow_growth: bool = False,
             grams=None, spaces_info: Mapping[str, dict] | None = None,
             savings_by_role: Mapping[str, float] | None = None, **kwargs) -> CompressResult:
    """Compress ``source``'s roles with shared (or per-layer) low-rank bases; write them to ``out``.

    Args:
        source: HF directory, .safetensors, torch checkpoint (weights only), .gguf, run directory, nn.Module or state
            dict (paths are streamed: one group of matrices in memory at a time).
        out: output directory (None: compute the table only, write nothing): new, empty, or an interrupted compress
            of the same source and settings, which is finished (its finished roles kept, see :func:`check_out`).
        cfg: :class:`CompressConfig` (or its fields as keyword arguments).
        role_map: user role map, as for ``analyze``.
        progress: one stderr line per group.
        on_role_done: called after each finished role with the result so far (a snapshot).
        allow_growth: accept a rank that saves no parameters (a full-rank round trip); refused by default.
        grams: calibration Grams (:class:`weightgeom.analysis.calibration.Grams`), required when
            ``cfg.calibration`` is set (:func:`weightgeom.analysis.compress_choice.compress_calibrated` collects
            them and picks ``auto``'s spaces).
        spaces_info: for ``share="auto"``, role → ``{"space": ...}`` chosen by the caller (an interrupted compress
            being finished keeps the spaces its index records).
        savings_by_role: role → its savings fraction for ``budget="model"`` (the allotment
            :func:`weightgeom.analysis.compress_choice.compress_calibrated` measures); a role allotted 0 is left
            whole.

    Returns:
        :class:`CompressResult`.

    Raises:
        ValueError: bad settings, source or ``out`` (one line); ``FileExistsError``: ``out`` already holds a
            compressed checkpoint.
    """
    from safetensors.torch import save


    cfg = cfg or CompressConfig(**kwargs)
    cfg.check()
    out_p = Path(out) if out is not None else None
    old = check_out(out_p, source, cfg, role_map) if out_p is not None else None
    src = _as_loaded(source)
    by_role = _select(assign_roles(src.tensors, role_map), cfg.roles)
    if cfg.budget == "model":
        if savings_by_role is None:
            raise ValueError("budget model: pass the allotment (savings_by_role=...) or call "
                             "weightgeom.analysis.compress_choice.compress_calibrated, which measures it")
        by_role = {r: v for r, v in by_role.items() if savings_by_role.get(r, 0) > 0}
    if cfg.share != "auto":
        _plan(by_role, cfg, dict.fromkeys(by_role, cfg.share), allow_growth,
              savings_by_role)  # a bad rank: refused before calibrating
    if grams is None and cfg.calibration is not None:
        raise ValueError("calibration: pass the Grams (grams=...) or call "
                         "weightgeom.analysis.compress_choice.compress_calibrated, which collects them")
    old_spaces = old.get("spaces") if old is not None else None
    if cfg.share == "auto" and isinstance(old_spaces, dict) and all(
            isinstance(old_spaces.get(r), dict) and old_spaces[r].get("space") in SPACES
            for r in by_role):
        spaces_info = {r: old_spaces[r] for r in by_role}  # resuming: the spaces the finished roles were cut in
    elif cfg.share == "auto" and spaces_info is not None:
        missing = [r for r in by_role if r not in spaces_info]
        if missing:
            raise ValueError(f"spaces_info: no space for role {missing[0]}")
        spaces_info = {r: spaces_info[r] for r in by_role}
    elif cfg.share == "auto" and grams is not None:
        raise ValueError("share auto with calibration: call weightgeom.analysis.compress_choice.compress_calibrated "
                         "(it picks each role's space by calibration loss) or pass spaces_info")
    elif cfg.share == "auto":
        spaces_info = choose_spaces(src, role_map, list(by_role))
    else:
        spaces_info = {r: {"space": cfg.share, **({"savings": savings_by_role[r]} if savings_by_role else {})}
                       for r in by_role}
    spaces = {r: v["space"] for r, v in spaces_info.items()}
    finished = {g["role"] for g in old["groups"]} if old is not None else set()
    _plan(by_role, cfg, spaces, allow_growth, savings_by_role)  # refuse a bad rank before anything is written
    index = {"format": "weightgeom-compressed", "version": FORMAT_VERSION, "complete": False,
             "source": {**_source_info(source), "format": src.format}, "role_map": _jsonable(role_map),
             "config": asdict(cfg), "spaces": spaces_info, "groups": list(old["groups"]) if old is not None else []}
    if savings_by_role is not None:
        index["budget"] = {"savings": cfg.savings, "roles": {r: float(v) for r, v in savings_by_role.items()}}
    if grams is not None:
        index["calibration"] = {"text": grams.text, "tokens": grams.tokens,
                                "held_tokens": int(getattr(grams, "held_tokens", 0) or 0)}
    counters: dict[str, int] = {}

    def flush() -> None:
        if out_p is not None:
            write_atomic(out_p / INDEX_FILE, json.dumps(index, indent=1, default=_json_default))
            write_atomic(out_p / SAVINGS_FILE, lambda p: savings_table(index["groups"]).to_csv(p, index=False))

    def role_done() -> None:
        flush()
        if on_role_done is not None:
            snap = {**index, "groups": list(index["groups"])}
            on_role_done(CompressResult(savings_table(snap["groups"]), snap, out_p, spaces_info))

    with _one_writer(out_p):  # one compress writes into out_p at a time; a second is refused
        if out_p is not None:  # again under the lock: what another compress finished meanwhile
            check_out(out_p, source, cfg, role_map, locked=True)
        flush()  # the index first (no roles yet): a rerun recognises the directory as this compress, interrupted
        current = None
        for g in compress_roles(src, cfg, role_map=role_map, spaces=spaces, progress=progress, by_role=by_role,
                                allow_growth=allow_growth, skip=finished, grams=grams,
                                savings_by_role=savings_by_role):
            if current is not None and g.role != current:
                role_done()
            current = g.role
            j = counters[g.role] = counters.get(g.role, -1) + 1
            entry = {"role": g.role, "group": j, "space": g.space, "basis": g.basis, "layers": g.layers,
                     "tensors": g.names, "notes": g.notes, "shape": list(g.shape), "rank": g.rank,
                     "params_dense": g.params_dense, "params": g.params, "energy_lost": g.energy_lost}
            if g.calib_loss is not None:
                entry.update(calib_loss=g.calib_loss, calib_energy=g.calib_energy)
            if out_p is not None:
                tensors = {f"coef.{lay}": c.contiguous() for lay, c in g.coefs.items()}
                if isinstance(g.basis_t, dict):
                    tensors.update({f"basis.{lay}": b.contiguous() for lay, b in g.basis_t.items()})
                else:
                    tensors["basis"] = g.basis_t.contiguous()
                entry["file"] = _group_file(g.role, j)
                write_atomic(out_p / entry["file"], save(tensors, metadata=_group_metadata(entry)))
            index["groups"].append(entry)
        index["complete"] = True
        flush()
    return CompressResult(savings_table(index["groups"]), index, out_p, spaces_info)


@contextlib.contextmanager
def _one_writer(out: Path | None) -> Iterator[None]:
    """Hold ``out``'s :class:`~weightgeom.train.rundir.DirLock` (the lock runs and sweeps use) while a compress
    writes into it: a second compress into the same directory is refused with one line naming it and its owner.

    Raises:
        ValueError: (``LockError``) another live process is writing into ``out``.
    """
    if out is None:
        yield
        return
    with DirLock(out, what="--out"):
        yield


def _group_metadata(entry: dict) -> dict[str, str]:
    """What a group file records about itself (safetensors metadata, strings): its role, space, group number and
    layers, checked against the index when it is read, so files swapped between groups are refused."""
    return {"role": str(entry.get("role")), "space": str(entry.get("space")), "group": str(entry.get("group")),
            "layers": ",".join(str(x) for x in entry.get("layers") or ())}


def _json_default(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


# ------------------------------------------------------------------------------------------------------ the reader
_FILE_RE = re.compile(r"^tensors/[A-Za-z]+-g\d{3}\.safetensors$")


def _short(v) -> str:
    """``repr(v)``, cut to 60 characters."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_count(x, least: int = 0) -> bool:
    return type(x) is int and x >= least


def _group_problem(g) -> str:
    """What is wrong with one group entry of an index, naming the field and the reason ("" when nothing)."""
    if not isinstance(g, dict):
        return f"is {type(g).__name__}, not an object"
    if g.get("role") not in ROLES:
        return f"role {_short(g.get('role'))} is not one of {', '.join(ROLES)}"
    if g.get("space") not in SPACES:
        return f"space {_short(g.get('space'))} is not one of {', '.join(SPACES)}"
    if g.get("basis", "svd") not in BASES:
        return f"basis {_short(g.get('basis'))} is not one of {', '.join(BASES)}"
    f = g.get("file")
    if not isinstance(f, str):
        return "file is missing or not a string"
    if not _FILE_RE.match(f):
        if f.startswith("/") or ".." in f.replace("\\", "/").split("/"):
            return f"file {_short(f)} escapes the directory"
        return f"file {_short(f)} is not named tensors/<role>-g<NNN>.safetensors"
    shape = g.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(_is_count(x, 1) for x in shape)):
        return f"shape {_short(shape)} is not two positive integers"
    if not _is_count(g.get("rank"), 1):
        return f"rank {_short(g.get('rank'))} is not a positive integer"
    layers = g.get("layers")
    if not (isinstance(layers, list) and layers and all(_is_count(x) for x in layers)):
        return f"layers {_short(layers)} is not a non-empty list of layer indices"
    if len(set(layers)) != len(layers):
        return f"layers {_short(layers)} names a layer twice"
    for key in ("params_dense", "params"):
        if not _is_count(g.get(key, 0)):
            return f"{key} {_short(g.get(key))} is not a non-negative integer"
    if not (g.get("energy_lost") is None or type(g.get("energy_lost")) in (int, float)):
        return f"energy_lost {_short(g.get('energy_lost'))} is not a number"
    return ""


def _complete(d: Path, idx: dict) -> bool:
    """The index's ``complete`` flag, which must be a JSON boolean (``"no"`` is no more complete than ``"yes"``).

    Raises:
        ValueError: one line naming the index and the value.
    """
    flag = idx.get("complete")
    if type(flag) is not bool:
        raise ValueError(f"{d}/{INDEX_FILE}: complete is {_short(flag)}, not true or false (weightgeom compress "
                         "writes a boolean); compress the model again into a new --out")
    return flag


def _check_groups(d: Path, groups: list) -> None:
    """Refuse the first malformed group entry of ``d``'s index (one line: the group, the field and the reason), and
    a layer of a role or a file that two groups both claim (a duplicated group would be applied twice)."""
    layers: dict[tuple[str, int], int] = {}
    files: dict[str, int] = {}
    for i, g in enumerate(groups):
        problem = _group_problem(g)
        if problem:
            raise ValueError(f"{d}/{INDEX_FILE}: group {i}: {problem}")
        if g["file"] in files:
            raise ValueError(f"{d}/{INDEX_FILE}: group {i}: file {g['file']} is also group {files[g['file']]}'s; "
                             "each group has a file of its own — compress the model again into a new --out")
        files[g["file"]] = i
        for lay in g["layers"]:
            other = layers.setdefault((g["role"], lay), i)
            if other != i:
                raise ValueError(f"{d}/{INDEX_FILE}: group {i}: role {g['role']} layer {lay} is also in group "
                                 f"{other} (a duplicated group); compress the model again into a new --out")


def read_index(path: str | Path) -> dict:
    """The index of a compressed checkpoint directory (``compressed.json``), checked.

    Raises:
        ValueError: not a compressed checkpoint, an unknown version, an incomplete (interrupted) one, or an entry
            with a bad file name, role, space, shape or rank (one line naming the directory, the group, the field
            and the reason).
        FileNotFoundError: no such directory / index.
    """

    d = Path(path)
    if not (d / INDEX_FILE).exists():
        raise FileNotFoundError(f"{d}: no {INDEX_FILE} (not a directory written by weightgeom compress)")
    idx = read_json(d / INDEX_FILE, what="compressed index")
    if not isinstance(idx, dict) or idx.get("format") != "weightgeom-compressed":
        raise ValueError(f"{d}/{INDEX_FILE}: not a weightgeom compressed index")
    if idx.get("version") != FORMAT_VERSION:
        raise ValueError(f"{d}/{INDEX_FILE}: format version {idx.get('version')!r}, expected {FORMAT_VERSION}")
    groups = idx.get("groups")
    if not isinstance(groups, list):
        raise ValueError(f"{d}/{INDEX_FILE}: groups is not a list")
    if not _complete(d, idx):
        done = dict.fromkeys(str(g.get("role")) for g in groups if isinstance(g, dict))
        raise ValueError(f"{d}: incomplete compressed checkpoint (interrupted; finished roles: "
                         f"{', '.join(done) or 'none'}); run the same weightgeom compress command again to finish it")
    if not groups:
        raise ValueError(f"{d}/{INDEX_FILE}: no groups")
    _check_groups(d, groups)
    return idx


def _check_group_file(d: Path, p: Path) -> None:
    """Refuse a group file that is not a regular file (a FIFO would block the reader) or that resolves outside the
    output directory ``d`` (a link leading out), as ``analyze`` refuses shards that lead out of a model folder.

    Raises:
        ValueError: one line naming the file and what is wrong; FileNotFoundError: nothing there.
    """
    if not os.path.lexists(p):
        raise FileNotFoundError(str(p))
    real, root = Path(os.path.realpath(p)), Path(os.path.realpath(d))
    if root not in real.parents:
        raise ValueError(f"{p}: a link that leads outside {d} (to {real}); a compress output's files live in it — "
                         "compress the model again into a new --out")
    try:
        is_regular(p)
    except ValueError as e:
        raise ValueError(f"{e}; a compress output's group files are safetensors files") from None


def _check_group_metadata(d: Path, p: Path, g: dict, meta: dict) -> None:
    """Refuse a group file whose recorded role (and, where recorded, space, group number and layers) is not the
    index's for it: two same-shape files swapped (Q ↔ K) would otherwise load as the wrong matrices.

    Raises:
        ValueError: one line naming the file, what it records and what the index says.
    """
    want = _group_metadata(g)
    for key in ("role", "space", "group", "layers"):
        if key not in meta and key != "role":
            continue  # older outputs record role and space only
        if meta.get(key) != want[key]:
            raise ValueError(f"{p}: records {key} {_short(meta.get(key))} but {d / INDEX_FILE} lists it as "
                             f"{want[key]!r} (files swapped or copied between groups); compress the model again "
                             "into a new --out")


def _read_group(d: Path, g: dict) -> GroupResult:
    """Read one group's safetensors file and check every tensor's shape against the index."""
    from safetensors import safe_open

    p = d / g["file"]
    m, n = g["shape"]
    r, space = g["rank"], g["space"]
    want: dict[str, tuple[int, ...]] = {}
    for lay in g["layers"]:
        want[f"coef.{lay}"] = (r, n) if space == "output" else (m, r)
        if space == "none":
            want[f"basis.{lay}"] = (n, r)
    if space != "none":
        want["basis"] = (n, r) if space == "input" else (m, r)
    try:
        _check_group_file(d, p)  # a FIFO never blocks; a link never leads out of the output
        with safe_open(str(p), framework="pt") as f:
            keys = set(f.keys())
            missing = sorted(set(want) - keys)
            if missing:
                raise ValueError(f"{p}: missing tensor {missing[0]}")
            _check_group_metadata(d, p, g, f.metadata() or {})
            ts = {k: f.get_tensor(k) for k in want}
    except FileNotFoundError:
        raise FileNotFoundError(f"{p}: missing (named in {d / INDEX_FILE})") from None
    except Exception as e:  # safetensors raises its own SafetensorError (not an OSError) for corrupt files
        if isinstance(e, ValueError) and str(e).startswith(str(p)):
            raise
        raise ValueError(f"{p}: not a readable safetensors file ({str(e).splitlines()[0][:160]})") from None
    for k, shape in want.items():
        t = ts[k]
        if tuple(t.shape) != shape or not t.is_floating_point():
            raise ValueError(f"{p}: tensor {k} is {tuple(t.shape)} {t.dtype}, expected {shape} floating point")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{p}: tensor {k} holds NaN or Inf")
    coefs = {lay: ts[f"coef.{lay}"].float() for lay in g["layers"]}
    basis_t = ({lay: ts[f"basis.{lay}"].float() for lay in g["layers"]} if space == "none" else ts["basis"].float())
    return GroupResult(g["role"], space, g.get("basis", "svd"), list(g["layers"]), list(g.get("tensors", [])),
                       list(g.get("notes", [])), (m, n), r, basis_t, coefs, int(g.get("params_dense", 0)),
                       int(g.get("params", 0)), float(g.get("energy_lost") or 0.0))


@torch.no_grad()
def apply_compressed(target, path: str | Path, *, role_map: Mapping[str, str] | str | None = None) -> int:
    """Write the reconstructed dense matrices Ŵ_l of a compressed checkpoint into ``target``, in place.

    Args:
        target: nn.Module or a state dict (name → tensor) of the same architecture as the compressed source; its
            matrices are found by role and layer (``assign_roles``: Llama/HF, GGUF names, GPT-2 Conv1D and fused
            QKV are written through views into the stored layout).
        path: the directory :func:`compress` wrote.
        role_map: the user role map (default: the one recorded in the index).

    Returns:
        The number of matrices replaced.

    Raises:
        ValueError: a role / layer of the checkpoint missing in ``target``, a shape mismatch, a malformed file.
    """
    d = Path(path)
    idx = read_index(d)
    sd = target.state_dict() if isinstance(target, torch.nn.Module) else target
    by_role = assign_roles(sd, role_map if role_map is not None else idx.get("role_map"))
    lookup = {(r, rw.layer): rw for r, items in by_role.items() for rw in items}
    # check every target before writing any (nothing half-applied on a mismatch)
    for g in idx["groups"]:
        for lay in g["layers"]:
            rw = lookup.get((g["role"], lay))
            if rw is None:
                raise ValueError(f"{d}: role {g['role']} layer {lay} has no matrix in the model")
            if tuple(rw.weight.shape) != tuple(g["shape"]):
                raise ValueError(f"{d}: role {g['role']} layer {lay} is {tuple(g['shape'])} in the checkpoint but "
                                 f"{tuple(rw.weight.shape)} in the model ({rw.name})")
    n = 0
    for g in idx["groups"]:
        grp = _read_group(d, g)
        for lay in grp.layers:
            w = lookup[(g["role"], lay)].weight
            w.copy_(grp.dense(lay).to(w.dtype))
            n += 1
    return n


def compressed_source(path: str | Path, base: str | Path | None = None) -> str:
    """The base model of a compressed checkpoint, checked: ``base`` when given, else the source path its index
    records, which must still be what was compressed (:func:`source_fingerprint`).

    Raises:
        ValueError: the index records no path (compressed from an in-memory model) and no ``base`` is given; the base
            does not exist; it is itself a compress output (an index that loops back to its own directory, or to
            another compress output); the recorded base changed since it was compressed.
    """
    d = Path(path)
    idx = read_index(d)
    info = idx.get("source") if isinstance(idx.get("source"), dict) else {}
    src = base if base is not None else info.get("path")
    named = f"--base {base}" if base is not None else f"its base model {src}"
    if not src or not isinstance(src, (str, Path)):
        raise ValueError(f"{d}: compressed from an in-memory model; name the base model (--base)")
    b = Path(src)
    if not b.exists():
        if base is not None:
            raise ValueError(f"--base {base}: no such file or directory")
        raise ValueError(f"{d}: its base model {src} does not exist any more; name it with --base")
    if b.is_dir() and (b / INDEX_FILE).is_file():
        if b.resolve() == d.resolve():
            raise ValueError(f"{d}: {named} is this directory itself (the index loops back); name the uncompressed "
                             "model with --base")
        raise ValueError(f"{d}: {named} is itself a compress output, not a model; name the uncompressed model with "
                         "--base")
    old = info.get("fingerprint")
    if base is None and isinstance(old, dict):
        change = _fingerprint_change(old, source_fingerprint(b))
        if change:
            raise ValueError(f"{d}: its base model {src} changed since it was compressed ({change}); compress it "
                             f"again, or pass --base {src} to use it as it is now")
    return str(b)


def decompress(path: str | Path, base=None) -> dict[str, torch.Tensor]:
    """The base model's state dict with the compressed roles replaced by their reconstructions, in the base's own
    layout and names (for a GGUF base: GGUF names, Q/K un-permuted as :func:`~weightgeom.analysis.loaders.load`
    returns them).

    Args:
        path: the compressed checkpoint directory.
        base: the uncompressed source: a path, nn.Module or state dict (default: the path recorded in the index,
            checked by :func:`compressed_source`).
    """

    if base is None or isinstance(base, (str, Path)):
        base = compressed_source(path, base)
    src = load(base)
    tensors = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in src.tensors.items()}
    apply_compressed(tensors, path)
    return tensors
