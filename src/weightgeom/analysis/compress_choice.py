"""``share="auto"`` with calibration: per role, the space (input-shared, output-shared or per layer) whose
activation-aware fit has the lowest held-out calibration loss at the requested savings (or rank).

Each role is fitted in all three spaces (:func:`~weightgeom.analysis.compress.compress_roles` with the calibration
Grams, one group in memory at a time) and its relative layer-output error Σ_l tr(D_l G_l D_lᵀ) / Σ_l tr(W_l G_l W_lᵀ)
(D_l = W_l − Ŵ_l) compared; a space no rank ≥ 1 reaches the savings in is skipped.

The loss compared is measured on calibration tokens the fit did not see: with Grams that hold a part apart
(:attr:`~weightgeom.analysis.calibration.Grams.held`, the last ``calibration_holdout`` of the tokens) every space is
fitted on the rest (:meth:`~weightgeom.analysis.calibration.Grams.fit_part`) and scored with the held-out Grams G_l^h;
the chosen space is then fitted again on all the tokens. Scored on its own fitting data instead, the loss favours the
fit with more free parameters: at matched savings a shared basis buys a higher rank (more coefficients per layer),
whose in-sample loss is lower by what it overfits. Without a held-out part the in-sample loss is compared. The
continuity ratios (:func:`~weightgeom.analysis.compress.choose_spaces`) are reported beside the choice, not obeyed.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from weightgeom.analysis.api import _as_loaded, as_computable
from weightgeom.analysis.calibration import runnable_lm, source_grams
from weightgeom.analysis.compress import (
    SPACES,
    CompressConfig,
    CompressResult,
    _plan,
    _select,
    check_out,
    choose_spaces,
    compress,
    compress_roles,
)
from weightgeom.analysis.compress_budget import allocate, role_curves
from weightgeom.analysis.compress_fit import output_energy, output_error
from weightgeom.analysis.loaders import Loaded, materialize
from weightgeom.analysis.perplexity import perplexity_of_ids
from weightgeom.analysis.roles import RoleWeight, assign_roles

__all__ = ["role_losses", "choose_by_loss", "format_choice_table", "compress_calibrated"]


def role_losses(items: list[RoleWeight], role: str, cfg: CompressConfig, grams, space: str,
                keep: list | None = None, held=None) -> float:
    """The role's relative calibration loss when fitted in ``space`` at ``cfg``'s savings or rank (NaN when no rank
    reaches it there).

    Args:
        grams: the Grams the fits minimise the output error on.
        keep: a list the fitted :class:`~weightgeom.analysis.compress.GroupResult` s are appended to (None: dropped).
        held: Grams to score the fits with instead (the held-out part, :attr:`Grams.held` as a ``{(role, layer):
            G}`` dict); None: the fit's own loss on ``grams``.
    """
    ccfg = replace(cfg, share=space, basis="svd", roles=(role,))
    try:
        _plan({role: items}, ccfg, {role: space})
    except ValueError:
        return math.nan
    err = en = 0.0
    by_layer = {rw.layer: rw for rw in items}
    for g in compress_roles(None, ccfg, by_role={role: items}, spaces={role: space}, grams=grams):
        if held is None:
            err += (g.calib_loss or 0.0) * g.calib_energy
            en += g.calib_energy
        else:
            for lay in g.layers:
                W = as_computable(materialize(by_layer[lay].weight), by_layer[lay].name).float()
                H = held[(role, lay)]
                err += output_error(W, g.dense(lay), H)
                en += output_energy(W, H)
        if keep is not None:
            keep.append(g)
    return err / en if en > 0 else 0.0


def choose_by_loss(by_role: Mapping[str, list[RoleWeight]], cfg: CompressConfig, grams,
                   ratios: Mapping[str, dict] | None = None, progress: bool = False,
                   keep: dict | None = None, savings_by_role: Mapping[str, float] | None = None,
                   lm=None) -> dict[str, dict]:
    """Per role, the space with the lowest calibration loss: held-out when ``grams`` holds a part apart (each space
    fitted on :meth:`~weightgeom.analysis.calibration.Grams.fit_part`, scored on
    :attr:`~weightgeom.analysis.calibration.Grams.held`), else in-sample.

    Args:
        by_role: role → its matrices (lazy or dense).
        cfg: the settings (its savings or rank is used for every space).
        grams: :class:`~weightgeom.analysis.calibration.Grams`.
        ratios: role → continuity ratios ``{"input": C_v/random, "output": C_u/random}`` to report beside it.
        keep: a dict that gets role → the chosen space's fitted groups (so they need not be fitted again); only
            without a held-out part (the groups fitted on the fit part are not the final ones, so none are kept).
        savings_by_role: role → its own savings (a whole-model budget's allotment) instead of ``cfg.savings``.
        lm: the runnable model (:class:`~weightgeom.analysis.perplexity.CausalLM`) the Grams came from: with a
            held-out part, each space is then judged by the model's own loss on the held-out tokens with that role's
            matrices replaced by the fits (the other roles whole): the increase of the NLL per token over the
            uncompressed model's (``"nll"``), which the choice follows instead of the layer-output loss.

    Returns:
        role → ``{"space": ..., "loss": {space: relative loss}, "fit_loss": {space: in-sample loss on the fitted
        part}, "input": ratio, "output": ratio, "by": "held-out loss" | "loss"}``.
    """
    out: dict[str, dict] = {}
    t0 = time.perf_counter()
    held = grams.held if getattr(grams, "held", None) and grams.held_tokens > 0 else None
    fit_grams = grams.fit_part() if held is not None else grams
    keep_here = keep is not None and held is None
    judge = _NllJudge(lm, grams) if lm is not None and held is not None and grams.held_ids is not None else None
    for j, (role, items) in enumerate(by_role.items()):
        fitted: dict[str, list] = {s: [] for s in SPACES}
        losses, fit_losses, nll = {}, {}, {}
        for s in SPACES:
            groups = fitted[s] if keep_here or held is not None else None
            rcfg = replace(cfg, savings=savings_by_role[role]) if savings_by_role else cfg
            losses[s] = role_losses(items, role, rcfg, fit_grams, s, groups, held)
            fit_losses[s] = _in_sample(groups) if held is not None else losses[s]
            if judge is not None:
                nll[s] = judge.delta(role, groups) if not math.isnan(losses[s]) else math.nan
            if not keep_here:
                fitted[s] = []
        score = nll if judge is not None and not all(math.isnan(v) for v in nll.values()) else losses
        ok = {s: v for s, v in score.items() if not math.isnan(v)}
        best = min(ok, key=lambda s: ok[s]) if ok else "none"
        if keep_here:
            keep[role] = fitted[best]
        del fitted
        r = dict((ratios or {}).get(role) or {})
        out[role] = {"space": best, "loss": losses, "fit_loss": fit_losses, "input": r.get("input", math.nan),
                     "output": r.get("output", math.nan),
                     "by": "held-out NLL" if score is nll else "held-out loss" if held is not None else "loss"}
        if score is nll:
            out[role]["nll"] = nll
        if savings_by_role:
            out[role]["savings"] = savings_by_role[role]
        if progress:
            print(f"  [{j + 1}/{len(by_role)} roles] auto: {role} " + ", ".join(
                f"{s} {v:.4g}" + (f" (ΔNLL {nll[s]:+.4f})" if s in nll else "") for s, v in losses.items())
                + f" → {best}  {time.perf_counter() - t0:.1f} s elapsed", file=sys.stderr, flush=True)
    return out


class _NllJudge:
    """The model's NLL per token on the held-out calibration tokens with one role's matrices replaced by fitted
    groups (every other weight as loaded), minus the uncompressed model's: what a role's compression costs the model
    itself on text the fits did not see."""

    def __init__(self, lm, grams):
        self.lm, self.ids, self.ctx = lm, grams.held_ids, grams.context or None
        self._ppl = perplexity_of_ids
        self.model_roles = assign_roles(lm.model.state_dict())
        self.base = self._nll()

    def _nll(self) -> float:
        return self._ppl(self.lm, self.ids, tokens=int(self.ids.numel()), context=self.ctx).nll

    def delta(self, role: str, groups: list) -> float:
        """ΔNLL with ``role``'s layers replaced by ``groups``' reconstructions (NaN when the model lacks them)."""
        import torch

        mats = {rw.layer: rw.weight for rw in self.model_roles.get(role, [])}
        layers = [lay for g in groups for lay in g.layers]
        if not layers or any(lay not in mats or tuple(mats[lay].shape) != tuple(g.shape)
                             for g in groups for lay in g.layers):
            return math.nan
        saved = {lay: mats[lay].clone() for lay in layers}
        try:
            with torch.no_grad():
                for g in groups:
                    for lay in g.layers:
                        mats[lay].copy_(g.dense(lay).to(mats[lay].dtype))
            return self._nll() - self.base
        finally:
            with torch.no_grad():
                for lay, w in saved.items():
                    mats[lay].copy_(w)


def _in_sample(groups: list | None) -> float:
    """The energy-weighted in-sample calibration loss of fitted groups (NaN for none)."""
    en = sum(g.calib_energy for g in groups or ())
    return sum((g.calib_loss or 0.0) * g.calib_energy for g in groups or ()) / en if en > 0 else math.nan


def _num(x) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4g}"


def format_choice_table(spaces: Mapping[str, dict]) -> str:
    """The per-role table ``compress`` ends with: the choice, the calibration loss of each option (relative
    layer-output error on the calibration text) and the continuity ratios (C_v, C_u over their random levels)."""
    budget = any("savings" in v for v in spaces.values())
    by_nll = any("nll" in v for v in spaces.values())
    head = ("role",) + (("savings",) if budget else ()) + ("choice", "loss input", "loss output", "loss per-layer") + (
        ("ΔNLL input", "ΔNLL output", "ΔNLL per-layer") if by_nll else ()) + ("C_v/rand", "C_u/rand")
    rows = [head]
    for role, v in spaces.items():
        loss = v.get("loss") or {}
        sv = (f"{v['savings']:.1%}" if "savings" in v else "—",) if budget else ()
        choice = "whole" if v.get("space") == "kept" else "per-layer" if v.get("space") == "none" else str(
            v.get("space"))
        nll = v.get("nll") or {}
        rows.append((role,) + sv + (choice, _num(loss.get("input")), _num(loss.get("output")), _num(loss.get("none")))
                    + ((_num(nll.get("input")), _num(nll.get("output")), _num(nll.get("none"))) if by_nll else ())
                    + (_num(v.get("input")), _num(v.get("output"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    left = 1 + budget  # role (and savings) and choice left-aligned
    return "\n".join("  ".join(c.rjust(w) if i > left else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def compress_calibrated(source, out: str | Path | None = None, cfg: CompressConfig | None = None, *,
                        role_map: Mapping[str, str] | str | None = None, progress: bool = False,
                        allow_growth: bool = False, grams=None, **kwargs) -> CompressResult:
    """:func:`~weightgeom.analysis.compress.compress` with activation-aware fits: collects the calibration Grams of
    ``source`` (:func:`~weightgeom.analysis.calibration.source_grams` on ``cfg.calibration``, unless ``grams`` is
    given; for ``auto`` the last ``cfg.calibration_holdout`` of the tokens held apart), picks ``auto``'s spaces by
    the model's held-out calibration NLL (:func:`choose_by_loss` with the loaded model; with given ``grams``, which
    come without it, by the held-out layer-output loss; continuity ratios beside), then compresses with the Grams of
    all the calibration tokens.

    Raises:
        ValueError: as :func:`~weightgeom.analysis.compress.compress`, and a source that cannot be run for
            calibration (one line saying to use weight-only fits).
    """
    cfg = cfg or CompressConfig(**kwargs)
    if cfg.calibration is None and grams is None:
        cfg = replace(cfg, calibration="shakespeare")
    cfg.check()
    if out is not None:
        check_out(out, source, cfg, role_map)  # refused before the calibration pass
    src = _as_loaded(source)
    by_role = _select(assign_roles(src.tensors, role_map), cfg.roles)
    if cfg.share != "auto":
        _plan(by_role, cfg, dict.fromkeys(by_role, cfg.share), allow_growth)
    lm = None
    if grams is None:
        runnable = source.meta.get("path") if isinstance(source, Loaded) else source
        choose = cfg.share == "auto" or cfg.budget == "model"
        lm = runnable_lm(runnable, progress)
        grams = source_grams(lm, list(by_role), text=cfg.calibration, role_map=role_map,
                             tokens=cfg.calibration_tokens, progress=progress,
                             holdout=cfg.calibration_holdout if choose else 0.0)
    spaces_info = savings_by_role = None
    if cfg.budget == "model":
        if progress:
            print(f"allotting {cfg.savings:.0%} of the roles' parameters by each role's calibration loss curve ...",
                  file=sys.stderr, flush=True)
        curves = role_curves(by_role, grams, progress=progress)
        dense = {r: sum(rw.weight.numel() for rw in items) for r, items in by_role.items()}
        allotted = allocate(curves, dense, float(cfg.savings))
        savings_by_role = {r: v for r, v in allotted.items() if v > 0}
        kept = [r for r, v in allotted.items() if v <= 0]
        by_role = {r: by_role[r] for r in savings_by_role}
        if cfg.share != "auto":
            spaces_info = {r: {"space": cfg.share, "savings": v} for r, v in savings_by_role.items()}
    if cfg.share == "auto":
        if progress:
            print("continuity analysis (its ratios are reported beside auto's choice) ...", file=sys.stderr, flush=True)
        ratios = choose_spaces(src, role_map, list(by_role))
        if progress:
            print("measuring each role's calibration loss in the input, output and per-layer spaces ...",
                  file=sys.stderr, flush=True)
        spaces_info = choose_by_loss(by_role, cfg, grams, ratios, progress, savings_by_role=savings_by_role, lm=lm)
    del lm  # the runnable copy is not needed for the compress itself
    res = compress(source, out, cfg, role_map=role_map, progress=progress, allow_growth=allow_growth, grams=grams,
                   spaces_info=spaces_info, savings_by_role=savings_by_role)
    if cfg.budget == "model":
        res.spaces = {**(res.spaces or {}), **{r: {"space": "kept", "savings": 0.0} for r in kept}}
    return res
