"""Report section for the continuity experiments (the continuity paper): residual-MLP ablations, Llama projections."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from weightgeom.analysis.continuity import random_level_cos
from weightgeom.experiments.report.claims import CLAIM_BY_KEY, continuity_findings, spread_findings
from weightgeom.experiments.report.common import (
    LINESTYLES,
    RunData,
    _colors,
    _legend_below,
    _plt,
    _savefig,
    band,
    divergence_line,
    final_value,
    fmt,
    fmt_stats,
    group_runs,
    image_lines,
    loss_series,
    md_table,
    plot_loss_curves,
    series,
)
from weightgeom.experiments.report.continuity_data import EXPECTED_SPACE, SPREAD_COLUMNS  # noqa: F401
from weightgeom.experiments.report.continuity_data import cont_curve as _cont_curve
from weightgeom.experiments.report.continuity_data import cont_summary as _cont_summary
from weightgeom.experiments.report.continuity_data import spread_mean as _spread_mean  # noqa: F401
from weightgeom.experiments.report.continuity_data import spread_summary as _spread_summary
from weightgeom.experiments.report.inputs import md_code, plot_text

# The continuity paper's figures for the residual-MLP ablations (K. Jeong, W.-G. Paeng, H. Suh, arXiv:2605.04971);
# entries in parentheses: the paper gives no number
SEED_CONTINUITY = {
    "res-relu": "baseline: continuity develops (weight and gradient high)",
    "nores": "gradient continuity ≈ 0.05 (random level); weight continuity does not develop",
    "res-none": "gradient 0.93, weight v1 0.22 (rotation drift)",
    "res-radial": "weight v1 ≈ 0.22 (rotation-equivariant: no symmetry breaking)",
    "init-small": "(paper: init scale changes when ‖ΔW‖ dominates ‖W₀‖)",
    "init-large": "(paper: init scale changes when ‖ΔW‖ dominates ‖W₀‖)",
    "adam-b2-0": "(paper: optimizer setting ablation, ε not given; continuity is not an optimizer artifact)",
    "adam-b1-0-b2-0": "(paper: optimizer setting ablation; continuity is not an optimizer artifact)",
    "res-ln": "LayerNorm spreads continuity over several singular directions",
    "res-relu-ln": "activation + LayerNorm: the activation's v1 mode dominates",
}

def crossing_step(s: pd.Series, level: float = 1.0) -> float:
    """First step at which the series reaches ``level`` (linear interpolation; NaN if never)."""
    if not len(s):
        return float("nan")
    steps, vals = s.index.to_numpy(dtype=float), s.to_numpy(dtype=float)
    for i in range(len(vals)):
        if vals[i] >= level:
            if i == 0:
                return steps[0]
            t = (level - vals[i - 1]) / (vals[i] - vals[i - 1])
            return float(steps[i - 1] + t * (steps[i] - steps[i - 1]))
    return float("nan")


def continuity_section(runs: Sequence[RunData], out: Path) -> str:
    """Markdown for the continuity experiments (the continuity paper), writing plots into ``out``."""
    lines = ["## Geometric continuity (the continuity paper, arXiv:2605.04971)", ""]
    widths = sorted({int(r.config.get("model", {}).get("width", 256)) for r in runs
                     if r.config.get("model", {}).get("kind") == "resmlp"}) or [256]
    rnd = ", ".join(f"{random_level_cos(w):.3f} (d={w})" for w in widths)
    lines.append(f"Continuity of adjacent same-role layers: C_v = |⟨v1(W_l), v1(W_l+1)⟩| (input space), "
                 f"C_u (output space), σ²-weighted Gram alignment tr(S_l S_l+1)/(‖S_l‖‖S_l+1‖) (input space, "
                 f"S = WᵀW); means over layer pairs at the last recorded step. Random level of C_v, C_u: {rnd}. "
                 f"Gradient = the same metrics on the minibatch gradient ∂L/∂W of that step (init = before the first "
                 f"update); ΔW = W_t − W_0; dominance = ‖ΔW‖_F/‖W_0‖_F (crossing = first step where it reaches 1). "
                 f"The σ²-alignment of two independent square Gaussian matrices is ≈ 0.5 (not 0): its random level.")
    lines.append("")
    mlp = [r for r in runs if r.experiment.get("part", r.config.get("model", {}).get("kind")) != "llama"]
    llama = [r for r in runs if r.experiment.get("part", r.config.get("model", {}).get("kind")) == "llama"]
    if mlp:
        groups = group_runs(mlp)
        rows = []
        div_lines = [divergence_line(r) for r in mlp if r.diverged]
        for name, rs in groups.items():
            w = [_cont_summary(r, "weight") for r in rs]
            g = [_cont_summary(r, "grad") for r in rs]
            g0 = [_cont_summary(r, "grad", "first") for r in rs]
            d = [_cont_summary(r, "delta") for r in rs]
            dom = [_cont_curve(r, "delta", "dominance") for r in rs]
            cross = [crossing_step(s) for s in dom]
            acc = [final_value(series(r, "val", ("acc", "accuracy", "val_acc"))) for r in rs]
            loss = [final_value(loss_series(r, "val")) for r in rs]

            def m(ds, k):
                return fmt_stats([x.get(k, float("nan")) for x in ds], 2)

            ndiv = f"{sum(r.diverged for r in rs)}/{len(rs)}"
            rows.append([md_code(name), ndiv, m(w, "cv"), m(w, "cu"), m(w, "align_in"), m(g0, "cv"), m(g, "cv"),
                         m(g, "align_in"), m(d, "cv"), m(d, "dominance"),
                         fmt_stats([c for c in cross if math.isfinite(c)], 0) if any(map(math.isfinite, cross))
                         else "never", fmt_stats(loss, 3), fmt_stats(acc, 3) if any(map(math.isfinite, acc)) else "—",
                         SEED_CONTINUITY.get(name, "—")])
        lines.append("### Residual MLP on MNIST (16 blocks in the paper)")
        lines.append("")
        lines.append(md_table(["variant", "diverged", "weight C_v", "weight C_u", "weight σ²-align", "grad C_v (init)",
                               "grad C_v", "grad σ²-align", "ΔW C_v", "dominance ‖ΔW‖/‖W₀‖", "crossing step",
                               "val loss", "val acc", "paper figure"], rows))
        lines.append("")
        if div_lines:
            lines.append("Diverged runs (their metrics are those of the last finite step before the stop):")
            lines += div_lines
            lines.append("")
        lines.append(continuity_verdict(groups))
        lines.append("")
        lines += spread_lines(groups, out)
        lines += image_lines(plot_continuity_training(groups, out / "continuity_training.png", widths),
                             "continuity over training")
        p = plot_loss_curves(groups, out / "continuity_loss.png", "Loss curves — residual MLP ablations")
        lines += image_lines(p, "loss curves")
    if llama:
        lines.append(llama_section(llama, out))
    return "\n".join(lines)


def continuity_verdict(groups: dict[str, list[RunData]]) -> str:
    """The residual-MLP claims' verdicts in words, from the same findings as the report's claims table
    (:func:`weightgeom.experiments.report.claims.continuity_findings`)."""

    runs = [r for rs in groups.values() for r in rs]
    checks = [f"{CLAIM_BY_KEY[key].text}: {evidence} — " + (verdict if verdict == "inconclusive" else f"**{verdict}**")
              for key, verdict, evidence, _ in continuity_findings(runs)
              if key in ("c-nores", "c-symmetry", "c-dominance", "c-optimizer")]
    rs_b2 = groups.get("adam-b2-0") or []
    if rs_b2 and all(r.diverged for r in rs_b2):
        checks.append("Adam β2 = 0: every run diverged — no data for the optimizer ablation")
    if not checks:
        return ""
    return ("**Against the continuity paper's claims** (rules: the report's claims table):\n\n"
            + "\n".join(f"- {c}" for c in checks))


def spread_verdicts(groups: dict[str, list[RunData]]) -> list[str]:
    """The continuity paper's three claims on activation vs LayerNorm in words, each ending in its verdict
    (reproduced / not reproduced / reversed), from the same findings as the claims table
    (:func:`weightgeom.experiments.report.claims.spread_findings`)."""

    return [f"{CLAIM_BY_KEY[key].text}: {evidence} — "
            + (verdict if verdict in ("reproduced", "inconclusive") else f"**{verdict}**")
            for key, verdict, evidence in spread_findings(groups)]


def spread_lines(groups: dict[str, list[RunData]], out: Path) -> list[str]:
    """Table + plot of how continuity spreads over the top-k input-space singular directions, with the verdicts."""
    rows = []
    k = 0
    for name, rs in groups.items():
        summ = [_spread_summary(r) for r in rs if not r.diverged]
        summ = [x for x in summ if x]
        if not summ:
            continue
        k = max(k, sum(1 for key in summ[0] if key.startswith("cv_dir")))

        def m(key: str, ss=summ) -> str:
            return fmt_stats([x.get(key, float("nan")) for x in ss], 2)

        rows.append([md_code(name), m("cv_dir1"), m("cv_dir2"), m("cv_rest"), m("v1_share"),
                     f"{m('topk_overlap')} ({m('topk_overlap_rand')})"])
    if not rows:
        return []
    lines = [f"### Where continuity lives: the top {k} singular directions", "",
             f"Final weights, means over layer pairs: C_v(v_i) = |⟨v_i(W_l), v_i(W_l+1)⟩| (index-matched); mean "
             f"C_v(v2..v{k}); v1 share = C_v(v1)² / Σ_i C_v(v_i)² (1: only v1 is continuous; 1/{k}: all {k} alike, "
             f"or none); top-{k} subspace overlap ‖V_kᵀV'_k‖_F²/{k} (random level in parentheses).", "",
             md_table(["variant", "C_v(v1)", "C_v(v2)", f"mean C_v(v2..v{k})", "v1 share", f"top-{k} overlap"], rows),
             ""]
    verdicts = spread_verdicts(groups)
    if verdicts:
        lines += ["**Against the continuity paper's activation / LayerNorm claims:**", ""]
        lines += [f"- {v}" for v in verdicts] + [""]
    lines += image_lines(plot_spread(groups, out / "continuity_topk.png"), "continuity per singular direction")
    return lines


def plot_spread(groups: dict[str, list[RunData]], path: Path) -> Path | None:
    """C_v(v_i) against i (final weights, mean over layer pairs and seeds), one line per variant."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    any_data = False
    rand = float("nan")
    for k, ((name, rs), color) in enumerate(zip(groups.items(), _colors(len(groups)))):
        summ = [x for x in (_spread_summary(r) for r in rs if not r.diverged) if x]
        if not summ:
            continue
        idx = sorted(int(key[6:]) for key in summ[0] if key.startswith("cv_dir"))
        ys = [float(np.mean([x.get(f"cv_dir{i}", np.nan) for x in summ])) for i in idx]
        ax.plot(idx, ys, marker="o", color=color, ls=LINESTYLES[k % len(LINESTYLES)], label=plot_text(name))
        any_data = True
        rs_c = [r.continuity for r in rs if r.continuity is not None and "cv_rand" in r.continuity]
        if rs_c:
            rand = float(rs_c[0]["cv_rand"].dropna().iloc[0])
    if not any_data:
        plt.close(fig)
        return None
    if math.isfinite(rand):
        ax.axhline(rand, color="gray", ls=":", lw=1, label="random level")
    ax.set_xlabel("singular direction i (by descending σ)")
    ax.set_ylabel("C_v(v_i) between adjacent layers")
    ax.set_ylim(0, 1.02)
    ax.set_title("Continuity per singular direction (final weights)")
    ax.legend(fontsize=8, ncol=2)
    return _savefig(fig, path)


def plot_continuity_training(groups: dict[str, list[RunData]], path: Path,
                             widths: Sequence[int] = (256,)) -> Path | None:
    """Weight C_v, gradient C_v, ΔW C_v and dominance ratio vs step per variant, with the random level of C_v for
    each block width in ``widths``."""
    specs = [("weight", "cv", "weight continuity C_v (input space)"),
             ("grad", "cv", "gradient continuity C_v"),
             ("delta", "cv", "accumulated-update (ΔW) continuity C_v"),
             ("delta", "dominance", "dominance ratio ‖ΔW‖_F / ‖W₀‖_F")]
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    any_data = False
    for k, ((name, runs), color) in enumerate(zip(groups.items(), _colors(len(groups)))):
        for ax, (kind, metric, _) in zip(axes.flat, specs):
            curves = [_cont_curve(r, kind, metric) for r in runs]
            if any(len(c) for c in curves):
                any_data = True
                band(ax, curves, color, name, ls=LINESTYLES[k % len(LINESTYLES)])
    if not any_data:
        plt.close(fig)
        return None
    for ax, (_, metric, label) in zip(axes.flat, specs):
        ax.set_title(label)
        ax.set_xlabel("step")
        if metric == "dominance":
            ax.axhline(1.0, color="k", ls="--", lw=1)
            if ax.get_lines():
                ax.set_yscale("log")
        else:
            for w in widths:
                ax.axhline(random_level_cos(w), color="gray", ls=":", lw=1, label=f"random level (d={w})")
            ax.set_ylim(0, 1.02)
    fig.suptitle("Continuity over training (mean over adjacent layer pairs; band: min–max over seeds)")
    return _savefig(fig, path, rect=_legend_below(fig, axes[0, 0]))


def llama_section(runs: Sequence[RunData], out: Path) -> str:
    """Per-projection continuity table for the Llama activation ablation."""
    lines = ["### Llama-style transformer: per-projection continuity (activation ablation)", ""]
    groups = group_runs(runs)
    roles = ["q", "k", "v", "o", "gate", "up", "down"]
    header = ["variant"] + [f"{r} C_v / C_u" for r in roles] + ["matches the paper's pattern", "val loss"]
    rows = []
    per_variant = {}
    for name, rs in groups.items():
        cells = []
        match = 0
        total = 0
        vals = {}
        for role in roles:
            cv = [final_value(_cont_curve(r, "weight", "cv", role)) for r in rs]
            cu = [final_value(_cont_curve(r, "weight", "cu", role)) for r in rs]
            cv_m = float(np.nanmean(cv)) if any(map(math.isfinite, cv)) else float("nan")
            cu_m = float(np.nanmean(cu)) if any(map(math.isfinite, cu)) else float("nan")
            vals[role] = (cv_m, cu_m)
            cells.append(f"{fmt(cv_m, 2)} / {fmt(cu_m, 2)}")
            if math.isfinite(cv_m) and math.isfinite(cu_m):
                total += 1
                exp = EXPECTED_SPACE[role]
                got = "v1" if cv_m > cu_m else "u1"
                if exp == "low":  # V: below every other projection's continuity in its expected space
                    ok = None  # decided after all roles are known
                    total -= 1
                else:
                    ok = got == exp
                match += bool(ok)
        if "v" in vals and all(math.isfinite(x) for x in vals["v"]):
            others = [vals[k][0 if EXPECTED_SPACE[k] == "v1" else 1] for k in vals if k != "v"]
            others = [x for x in others if math.isfinite(x)]
            total += 1
            match += bool(others) and max(vals["v"]) < min(others)
        per_variant[name] = vals
        loss = [final_value(loss_series(r, "val")) for r in rs]
        rows.append([md_code(name)] + cells + [f"{match}/{total}" if total else "—", fmt_stats(loss, 3)])
    lines.append("Expected (continuity paper): Q, K, Gate, Up → input space (C_v > C_u); O, Down → output space "
                 "(C_u > C_v); V → low in both (counted as a match when V's larger value is below every other "
                 "projection's continuity in its expected space). Weight continuity of the final checkpoint, mean "
                 "over layer pairs and seeds.")
    lines.append("")
    lines.append(md_table(header, rows))
    lines.append("")
    dims = sorted({int(d) for r in runs if isinstance(d := r.config.get("model", {}).get("dim"), int)})
    p = plot_projection_bars(per_variant, out / "continuity_llama_projections.png", dims)
    lines += image_lines(p, "per-projection continuity")
    return "\n".join(lines)


def plot_projection_bars(per_variant: dict[str, dict[str, tuple[float, float]]], path: Path,
                         dims: Sequence[int] = ()) -> Path | None:
    """Grouped bars: C_v and C_u per projection, one panel per variant; a dotted line at the random level of a unit
    vector in R^d for each model width d in ``dims``."""
    if not per_variant:
        return None
    plt = _plt()
    n = len(per_variant)
    fig, axes = plt.subplots(1, n, figsize=(max(7, 5.5 * n), 4.5), squeeze=False)
    for ax, (name, vals) in zip(axes[0], per_variant.items()):
        roles = list(vals)
        x = np.arange(len(roles))
        ax.bar(x - 0.2, [vals[r][0] for r in roles], 0.4, label="C_v (input)")
        ax.bar(x + 0.2, [vals[r][1] for r in roles], 0.4, label="C_u (output)")
        ax.set_xticks(x, [f"{r}\n({EXPECTED_SPACE[r]})" for r in roles])
        ax.set_ylim(0, 1.02)
        ax.set_title(plot_text(name))
        for d in dims:
            ax.axhline(random_level_cos(d), color="gray", ls=":", lw=1)
    axes[0][0].legend()
    fig.suptitle("Per-projection continuity (expected space in parentheses)")
    return _savefig(fig, path)
