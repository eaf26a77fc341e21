"""Whole-model compression methods compared at matched savings (``scope = "model"`` presets of
``weightgeom sweep continuity``): does a compression method keep the model usable?

Every point compresses all the preset's roles at once (each role at the same fraction of its parameters, so the
attention + MLP parameters are cut by at least that fraction) with one method, writes the dense reconstructions into
the loaded model, measures the perplexity on the held-out text (the same token ids for every point) and restores the
weights:

===========  ==================================================================================================
method       what
===========  ==================================================================================================
svd          per-layer truncated SVD of the weights (weight-only)
svd-w        per-layer whitened SVD (SVD-LLM: minimises the layer-output error on the calibration text)
shared       weight-only shared bases, each role in its more continuous space (``share="auto"`` without
             calibration)
input-a      activation-aware shared right bases (Basis-Sharing-style, least-squares coefficient refit)
output-a     activation-aware shared left bases (the exact minimiser of the groups' output error)
auto-a       per role, whichever of input-a, output-a and svd-w costs the model least on held-out calibration
             tokens (each fitted on the first 1 − ``calibration_holdout`` of the calibration tokens, that role alone
             replaced, the model's NLL on the rest; the choice then fitted on all of them, as the other methods are)
paper-a      activation-aware, each role in the continuity paper's space (input for Q, K, Gate, Up; output for
             O, Down; V per layer)
paper-rev-a  activation-aware, each role in the other space (output for Q, K, Gate, Up; input for O, Down; V per
             layer): with ``paper-a`` and ``svd-w``, the test of the paper's sharing implication
budget-w     per-layer whitened SVD under a whole-model budget (``--budget model``): the savings fraction of all
             the roles together, allotted per role by the held-out loss curves
             (:mod:`weightgeom.analysis.compress_budget`); compare with ``svd-w`` (every role at that fraction)
===========  ==================================================================================================

The calibration Grams (:func:`~weightgeom.analysis.calibration.collect_grams`) come from the calibration text (the
bundled Shakespeare without its held-out tail), disjoint from the evaluation text (its held-out tail). Each row
records the compression time and the process' peak resident memory after the point (``ru_maxrss``, a running
maximum). Outputs in OUT: ``compress.csv``, ``compress.json``, ``compress.md`` and ``compress.png`` (perplexity against
the fraction of the compressed parameters saved, one line per method).
"""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from weightgeom._files import write_atomic
from weightgeom.analysis.calibration import calibration_text, collect_grams
from weightgeom.analysis.compress import CompressConfig, choose_spaces, compress_roles
from weightgeom.analysis.compress_budget import allocate, role_curves
from weightgeom.analysis.compress_choice import choose_by_loss
from weightgeom.analysis.perplexity import perplexity_of_ids
from weightgeom.analysis.roles import assign_roles
from weightgeom.experiments.report.common import arm_style

__all__ = ["METHODS", "MODEL_ROLES", "method_config", "model_point", "run_model_sweep", "model_table_md",
           "plot_model"]

METHODS = ("svd", "svd-w", "shared", "input-a", "output-a", "auto-a", "paper-a", "paper-rev-a", "budget-w")
PAPER_SPACE = {"Q": "input", "K": "input", "Gate": "input", "Up": "input", "MLP": "input", "O": "output",
               "Down": "output", "V": "none"}
"""The continuity paper's space per role (``paper-a``; V, which it advises not to share, per layer)."""
_OTHER = {"input": "output", "output": "input", "none": "none"}
MODEL_ROLES = ("Q", "K", "V", "O", "Gate", "Up", "Down")
"""Every attention and MLP projection of a Llama block."""
LABELS = {"svd": "per-layer SVD", "svd-w": "per-layer whitened SVD (SVD-LLM)", "shared": "weight-only shared (auto)",
          "input-a": "activation-aware shared, input", "output-a": "activation-aware shared, output",
          "auto-a": "auto (lowest held-out calibration NLL)", "paper-a": "activation-aware, the paper's space",
          "paper-rev-a": "activation-aware, the other space", "budget-w": "whitened SVD, whole-model budget"}


def method_config(method: str, savings: float, layers_per_group: int, roles: tuple[str, ...]) -> tuple[
        CompressConfig, bool]:
    """(:class:`CompressConfig`, whether the method uses the calibration Grams) of a method at ``savings``."""
    share, calibrated = {"svd": ("none", False), "svd-w": ("none", True), "shared": ("auto", False),
                         "input-a": ("input", True), "output-a": ("output", True), "auto-a": ("auto", True),
                         "paper-a": ("auto", True), "paper-rev-a": ("auto", True), "budget-w": ("none", True)}[method]
    return CompressConfig(share=share, savings=savings, layers_per_group=layers_per_group, roles=roles,
                          calibration="shakespeare" if calibrated else None), calibrated


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def model_point(lm, by_role, method: str, savings: float, cfg, grams, continuity: dict, ids,
                progress: bool = False) -> dict:
    """Compress every role of ``cfg.roles`` with ``method`` at ``savings``, evaluate, restore: one row (``progress``:
    auto's per-role loss lines on stderr)."""
    import torch

    roles = tuple(cfg.roles)
    ccfg, calibrated = method_config(method, savings, cfg.layers_per_group, roles)
    sel = {r: by_role[r] for r in roles}
    t0 = time.perf_counter()
    fitted: dict[str, list] = {}
    allot = None
    if method == "budget-w":
        allot = allocate(role_curves(sel, grams), {r: sum(rw.weight.numel() for rw in sel[r]) for r in roles},
                         savings)
    if method in ("paper-a", "paper-rev-a"):
        info = {r: {"space": PAPER_SPACE.get(r, "input") if method == "paper-a" else
                    _OTHER[PAPER_SPACE.get(r, "input")]} for r in roles}
    elif ccfg.share == "auto" and calibrated:
        info = choose_by_loss(sel, ccfg, grams, continuity, progress=progress, keep=fitted, lm=lm)
    elif ccfg.share == "auto":
        info = {r: continuity[r] for r in roles}
    else:
        info = {r: {"space": ccfg.share} for r in roles}
    spaces = {r: v["space"] for r, v in info.items()}
    saved = {(r, rw.layer): rw.weight.clone() for r in roles for rw in sel[r]}
    err = en = 0.0
    try:
        with torch.no_grad():
            # the spaces are fixed above: ``auto`` reads them from ``spaces``
            cut = {r: v for r, v in sel.items() if allot is None or allot[r] > 0}
            whole = sum(rw.weight.numel() for r in roles if r not in cut for rw in sel[r])
            dense, params = whole, whole  # a role the budget keeps whole
            groups = ([g for r in roles for g in fitted[r]] if fitted else
                      compress_roles(None, replace(ccfg, roles=tuple(cut)), spaces=spaces, by_role=cut,
                                     grams=grams if calibrated else None, savings_by_role=allot))
            for g in groups:  # auto-a: the groups its choice already fitted
                for rw in (x for x in sel[g.role] if x.layer in g.coefs):
                    rw.weight.copy_(g.dense(rw.layer))
                dense, params = dense + g.params_dense, params + g.params
                if g.calib_loss is not None:
                    err, en = err + g.calib_loss * g.calib_energy, en + g.calib_energy
        t_c = time.perf_counter() - t0
        res = perplexity_of_ids(lm, ids, tokens=cfg.tokens, context=cfg.context)
    finally:
        with torch.no_grad():
            for r in roles:
                for rw in sel[r]:
                    rw.weight.copy_(saved[(r, rw.layer)])
    row = {"method": method, "savings_target": savings, "params_dense": dense, "params": params,
           "saved_frac": (dense - params) / dense, "spaces": " ".join(f"{r}:{s}" for r, s in spaces.items()),
           "calib_loss": err / en if en > 0 else math.nan, "ppl": res.ppl, "nll": res.nll, "tokens": res.tokens,
           "compress_s": t_c, "eval_s": res.seconds, "peak_rss_mb": _peak_rss_mb()}
    if allot is not None:
        row["allotment"] = " ".join(f"{r}:{v:g}" for r, v in allot.items())
    if method == "auto-a":  # what the choice compared: per role and space, the scored and fitted loss
        row["choice_losses"] = json.dumps({r: {s: [v["loss"][s], v["fit_loss"][s]] for s in v["loss"]}
                                           for r, v in info.items()}, default=str)
    return row


def run_model_sweep(cfg, lm, ids, base, record: dict, rows: list[dict], write, progress: bool = True) -> None:
    """Fill ``rows`` with the (method × savings) grid of a ``scope = "model"`` preset (``write()`` after each point,
    which also records the wall time)."""
    by_role = assign_roles(lm.model.state_dict())
    missing = [r for r in cfg.roles if r not in by_role]
    if missing:
        raise ValueError(f"model {cfg.model}: no role {missing[0]} (it has {', '.join(by_role)})")
    continuity: dict[str, dict] = dict(record.get("spaces") or {})
    done = {(r["method"], r["savings_target"]) for r in rows}
    grid = [(s, m) for s in cfg.savings for m in cfg.methods]
    todo = [m for s, m in grid if (m, s) not in done]
    grams = None
    if any(method_config(m, 0.5, 1, ("Q",))[1] for m in todo):  # calibration only for points still to compute
        holdout = cfg.calibration_holdout if {"auto-a", "budget-w"} & set(cfg.methods) else 0.0
        grams = collect_grams(lm, calibration_text(cfg.calibration), list(cfg.roles), tokens=cfg.calibration_tokens,
                              context=cfg.context, progress=progress, holdout=holdout)
        record["calibration"] = {"text": cfg.calibration or "shakespeare", "tokens": grams.tokens,
                                 "held_tokens": grams.held_tokens, "seconds": grams.seconds}
        if progress:
            print(f"calibration: {grams.tokens} tokens in {grams.seconds:.1f} s", flush=True)
    for i, (s, m) in enumerate(grid):
        if (m, s) in done:
            continue
        if m == "shared" and not continuity:  # the continuity analysis only for the method that follows it
            if progress:
                print("continuity analysis (the spaces of the weight-only shared method) ...", flush=True)
            continuity.update(choose_spaces(lm.model, only=list(cfg.roles)))
            record["spaces"] = continuity
        row = model_point(lm, by_role, m, s, cfg, grams, continuity, ids, progress=progress)
        rows.append(row)
        write()
        if progress:
            print(f"  [{i + 1}/{len(grid)}] saved {row['saved_frac']:.0%} {m:8s}: ppl {row['ppl']:.3f} "
                  f"(×{row['ppl'] / base.ppl:.2f})  compress {row['compress_s']:.1f} s, eval {row['eval_s']:.1f} s, "
                  f"peak RSS {row['peak_rss_mb']:.0f} MiB", flush=True)


def model_table_md(rows: list[dict], baseline: float, methods, title: str, record: dict[str, Any]) -> str:
    """The Markdown page: perplexity (× the uncompressed) per savings level and method."""
    ms = [m for m in METHODS if m in methods]
    cal = record.get("calibration") or {}
    lines = [f"# {title}", "", f"Baseline (uncompressed) perplexity: **{baseline:.2f}**; calibration: "
             f"{cal.get('tokens', '—')} tokens of {cal.get('text', '—')}; device: {record.get('device_kind')}", "",
             "| saved | " + " | ".join(ms) + " |", "|" + "---|" * (len(ms) + 1)]
    for s in sorted({r["savings_target"] for r in rows}):
        pts = {r["method"]: r for r in rows if r["savings_target"] == s}
        frac = min(p["saved_frac"] for p in pts.values())
        cells = [f"{pts[m]['ppl']:.2f} (×{pts[m]['ppl'] / baseline:.2f})" if m in pts else "—" for m in ms]
        lines.append(f"| {frac:.0%} | " + " | ".join(cells) + " |")
    lines += ["", "Methods: " + "; ".join(f"{m} = {LABELS[m]}" for m in ms) + "."]
    return "\n".join(lines) + "\n"


USABLE_RATIO = 20.0
"""A method whose perplexity stays within this factor of the uncompressed model's at every saved fraction is drawn in
the plot's right panel too (linear scale, so that the usable methods can be told apart; the broken ones are
orders of magnitude above and flatten them on the log scale)."""


def plot_model(rows: list[dict], baseline: float, path: Path, title: str) -> Path | None:
    """Perplexity against the fraction of the compressed parameters saved, one line per method: every method on a
    log scale (left), the methods within ``USABLE_RATIO`` of the uncompressed perplexity on a linear one (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return None
    lines = {m: sorted((r["saved_frac"] * 100, r["ppl"]) for r in rows if r["method"] == m) for m in METHODS}
    lines = {m: pts for m, pts in lines.items() if pts}
    usable = {m: pts for m, pts in lines.items() if max(p[1] for p in pts) <= USABLE_RATIO * baseline}
    fig, axes = plt.subplots(1, 2 if usable else 1, figsize=(11.0 if usable else 6.4, 4.2), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
    for ax, shown, log in ((axes[0][0], lines, True), *(((axes[0][1], usable, False),) if usable else ())):
        for m, pts in shown.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[m], label=LABELS[m], fillstyle="none",
                    **arm_style(METHODS.index(m)))  # marker and dash apart too: overlapping lines stay visible
        ax.axhline(baseline, color="k", ls="--", lw=1, label="uncompressed")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("% of the attention + MLP parameters saved")
        ax.set_ylabel("perplexity (held-out text)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title("every method (log scale)" if log and usable else
                     f"within ×{USABLE_RATIO:g} of uncompressed (linear scale)" if not log else "", fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    write_atomic(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return path
