"""Report section for the manifold-assignment experiment (the manifold-assignment paper): tables, divergences,
mechanism."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from weightgeom.diagnostics.monitors import attention_modules, qk_scale, qk_sigma_prod
from weightgeom.experiments.manifolds import DEFAULT_AUTO_THRESHOLD, DEFAULT_SIGMA_CAP
from weightgeom.experiments.report.common import (
    LOSS_UNIT,
    MARKERS,
    STEP_LABEL,
    RunData,
    _colors,
    _legend_below,
    _plt,
    _savefig,
    arm_style,
    band,
    best_value,
    diag_aggregate,
    divergence_line,
    final_value,
    fmt,
    fmt_stats,
    group_runs,
    image_lines,
    loss_series,
    md_table,
    plot_loss_curves,
    run_file,
    run_metrics,
    tagged,
)
from weightgeom.experiments.report.inputs import CONTROLS, META, md_code, md_text, plot_text
from weightgeom.optim.param_groups import STRATEGIES
from weightgeom.train.checkpoint import latest_checkpoint, load_checkpoint
from weightgeom.train.trainer import model_from_config

# The manifold-assignment paper's numbers (K. Yoshihara, arXiv:2606.13276; GPT-2 small, OpenWebText, 50k iters)
SEED_MANIFOLDS = {
    "unconstrained": "3.3855",
    "all-stiefel": "3.3679",
    "all-dgram": "unstable",
    "hetero": "3.3544",
    "hetero-inv": "unstable",
}

SIGMA_UNIT = "σ_max(W_Q)·σ_max(W_K) (dimensionless)"
LOGIT_UNIT = "pre-softmax logit (dimensionless)"
SATURATION_UNIT = "fraction of softmax rows with max prob > 0.99"


# --------------------------------------------------------------------------------------------------- manifolds
def _attn_manifold(run: RunData) -> str:
    ctrl = run.experiment.get("controls") or {}
    strat = str(run.config.get("optim", {}).get("strategy", run.experiment.get("overrides", {}).get(
        "optim.strategy", "")))
    if strat == "auto":
        return "auto"
    geo = str(STRATEGIES[strat]["attn"] or "none") if strat in STRATEGIES else "?"
    if ("sigma_cap" in ctrl or "qk_clip" in ctrl or (run.config.get("qk_clip") or {}).get("enabled")
            or run.config.get("model", {}).get("qk_norm")):
        return geo + "+scale-control"
    return geo


def study(run: RunData) -> str:
    """Which part of the recipe a run belongs to: ``boundary``, ``attribution``, ``mechanism``, ``long`` or
    ``main``."""
    return str(run.tags.get("study") or "main")


def manifolds_section(runs: Sequence[RunData], out: Path) -> str:
    """Markdown for the manifold-assignment experiment (the manifold-assignment paper), plots written into ``out``:
    the strategy comparison, then the stability boundary, the attribution, the long mechanism runs and the long runs
    of the published algorithm when the runs include them."""
    by_study: dict[str, list[RunData]] = {}
    for r in runs:
        by_study.setdefault(study(r), []).append(r)
    parts = []
    if by_study.get("main"):
        parts.append(comparison_section(by_study["main"], out))
    else:
        parts.append("## Manifold assignment (the manifold-assignment paper, arXiv:2606.13276)")
    if by_study.get("boundary"):
        parts.append(boundary_section(by_study["boundary"], out))
    if by_study.get("attribution"):
        parts.append(attribution_section(by_study["attribution"], out))
    if by_study.get("mechanism"):
        parts.append(long_mechanism_section(by_study["mechanism"], out))
    if by_study.get("long"):
        parts.append(long_section(by_study["long"], out))
    return "\n\n".join(parts)


def comparison_section(runs: Sequence[RunData], out: Path) -> str:
    """The strategy comparison (part ``main``): final/best val loss, scale control, automatic assignment, divergences,
    mechanism table and verdict, loss and mechanism plots."""
    groups = group_runs(runs)
    rows = []
    mech_rows = []
    div_lines = []
    for name, rs in groups.items():
        finals, bests = [], []
        ndiv = 0
        for r in rs:
            v = loss_series(r, "val")
            if not len(v):
                v = loss_series(r, "train")
            if r.diverged:
                ndiv += 1
                div_lines.append(divergence_line(r))
            else:
                finals.append(final_value(v))
            bests.append(best_value(v))
        strat = str(rs[0].config.get("optim", {}).get("strategy", ""))
        desc = rs[0].experiment.get("description", "")
        rows.append([md_code(name), md_text(desc), _attn_manifold(rs[0]), len(rs), f"{ndiv}/{len(rs)}",
                     fmt_stats(finals), fmt_stats(bests),
                     SEED_MANIFOLDS.get(name, SEED_MANIFOLDS.get(strat, "—") if name == strat
                                        else "— (not in the paper)")])
        sp = [diag_aggregate(r, "qk_sigma_prod") for r in rs]
        lg = [diag_aggregate(r, "logit_max") for r in rs]
        sat = [diag_aggregate(r, "saturation") for r in rs]
        ent = [diag_aggregate(r, "entropy", "mean") for r in rs]

        def first_last(ss: list[pd.Series]) -> tuple[float, float]:
            f = [float(s.iloc[0]) for s in ss if len(s)]
            la = [final_value(s) for s in ss if len(s)]
            return (float(np.nanmean(f)) if f else float("nan"), float(np.nanmax(la)) if la else float("nan"))

        mech_rows.append((name, _attn_manifold(rs[0]), first_last(sp), first_last(lg), first_last(sat),
                          first_last(ent)))
    lines = ["## Manifold assignment (the manifold-assignment paper, arXiv:2606.13276)", ""]
    lines.append("Identical model, data, schedule and hyperparameters; only the manifold assignment (and, for the "
                 "two extra arms, a scale control or the MD wrapper) changes. Final/best = validation loss "
                 "(mean ± sample std over seeds; final excludes diverged runs). Paper column: the "
                 "manifold-assignment paper at GPT-2-small/OpenWebText scale, for reference only.")
    lines.append("")
    lines.append(md_table(["variant", "what", "attention geometry", "seeds", "diverged", "final val loss",
                           "best val loss", "paper (GPT-2 small)"], rows))
    lines.append("")
    ctl_lines = []
    for name, rs in groups.items():
        summ = [c for c in map(_controls, rs) if "sigma_cap" in c]
        if summ:
            resc = sum(int(c.get("rescales", 0)) for c in summ)
            steps = sum(int(c.get("steps", 0)) for c in summ)
            mx = max(float(c.get("max_product_seen", 0)) for c in summ)
            note = (" — the cap never bound, so this arm trained exactly like its uncapped twin" if resc == 0
                    else "")
            ctl_lines.append(f"- {md_code(name)}: cap σ_max(W_Q)·σ_max(W_K) ≤ {summ[0]['sigma_cap']:g}; rescaled at "
                             f"{resc} of {steps} steps (summed over seeds); largest product seen {mx:.3g}{note}.")
    if ctl_lines:
        lines.append("### Scale control")
        lines.append("")
        lines += ctl_lines
        lines.append("")
    auto = auto_lines(runs)
    if auto:
        lines.append("### Automatic assignment (strategy auto)")
        lines.append("")
        lines += auto
        lines.append("")
    lines.append("### Divergences")
    lines.append("\n".join(div_lines) if div_lines else "No run diverged.")
    lines.append("")
    if any(not math.isnan(m[2][1]) for m in mech_rows):
        lines.append("### Mechanism: σ_max(W_Q)·σ_max(W_K) → attention logits → softmax saturation")
        lines.append("")
        lines.append("First = mean over seeds at the first diagnostics step; last = max over seeds and layers at "
                     "the last one (layers: max, entropy: mean).")
        lines.append("")
        mrows = [[md_code(n), g, fmt(s[0]), fmt(s[1]), fmt(lg[0]), fmt(lg[1]), fmt(sa[0]), fmt(sa[1]), fmt(en[0]),
                  fmt(en[1])] for n, g, s, lg, sa, en in mech_rows]
        lines.append(md_table(["variant", "attention", "σQ·σK first", "σQ·σK last", "logit max first",
                               "logit max last", "saturation first", "saturation last", "entropy first",
                               "entropy last"], mrows))
        lines.append("")
        lines.append(mechanism_verdict(mech_rows, groups))
        lines.append("")
    title = "manifold assignment"
    lines += image_lines(plot_loss_curves(groups, out / "manifolds_loss.png", f"Loss curves — {title}"), "loss curves")
    lines += image_lines(plot_mechanism(groups, out / "manifolds_mechanism.png"), "mechanism curves")
    return "\n".join(lines)


def mechanism_verdict(mech_rows, groups: dict[str, list[RunData]]) -> str:
    """Plain-words check of the claim 'DGram attention → σ growth → logit growth → saturation'."""
    dg = [m for m in mech_rows if m[1] == "dgram"]
    st = [m for m in mech_rows if m[1] in ("stiefel",)]
    if not dg or not st:
        return ("**Mechanism check:** needs both a DGram-attention and a Stiefel-attention variant with diagnostics; "
                "not available in these runs.")

    def growth(m, i):
        a, b = m[i]
        return b / a if a and math.isfinite(a) and math.isfinite(b) and a > 0 else float("nan")

    def worst(ms, i, f=growth):
        vals = [f(m, i) for m in ms]
        vals = [v for v in vals if math.isfinite(v)]
        return max(vals) if vals else float("nan")

    sg_d, sg_s = worst(dg, 2), worst(st, 2)
    lg_d, lg_s = worst(dg, 3), worst(st, 3)
    sat_d = worst(dg, 4, lambda m, i: m[i][1])
    sat_s = worst(st, 4, lambda m, i: m[i][1])
    steps = []
    steps.append(("σ_max(W_Q)·σ_max(W_K) grows more under DGram attention", sg_d > 1.5 * sg_s if
                  math.isfinite(sg_d) and math.isfinite(sg_s) else None, f"×{fmt(sg_d)} vs ×{fmt(sg_s)}"))
    steps.append(("attention-logit max grows more", lg_d > 1.5 * lg_s if math.isfinite(lg_d) and math.isfinite(lg_s)
                  else None, f"×{fmt(lg_d)} vs ×{fmt(lg_s)}"))
    steps.append(("softmax saturates more", sat_d > sat_s + 0.05 if math.isfinite(sat_d) and math.isfinite(sat_s)
                  else None, f"{fmt(sat_d)} vs {fmt(sat_s)}"))
    n_div_d = sum(r.diverged for m in dg for r in groups[m[0]])
    n_div_s = sum(r.diverged for m in st for r in groups[m[0]])
    steps.append(("DGram-attention runs diverge (Stiefel-attention runs do not)", n_div_d > 0 and n_div_s == 0,
                  f"{n_div_d} vs {n_div_s} diverged runs"))
    out = ["**Mechanism check** (DGram-attention variants vs Stiefel-attention variants, worst case of each):", ""]
    for text, ok, ev in steps:
        mark = "yes" if ok else ("not measured" if ok is None else "**no**")
        out.append(f"- {text}: {mark} ({ev})")
    un = [m for m in mech_rows if m[1] == "none"]
    if un:
        d_last = max((m[2][1] for m in dg if math.isfinite(m[2][1])), default=float("nan"))
        u_last = max((m[2][1] for m in un if math.isfinite(m[2][1])), default=float("nan"))
        s_last = max((m[2][1] for m in st if math.isfinite(m[2][1])), default=float("nan"))
        out.append(f"- for reference, final σ_max(W_Q)·σ_max(W_K): DGram attention {fmt(d_last)}, unconstrained "
                   f"{fmt(u_last)}, Stiefel attention {fmt(s_last)} (Stiefel pins each σ at ≤ 1; DGram leaves the "
                   "column norms, hence the scale, free like no constraint at all)")
    oks = [ok for _, ok, _ in steps[:3]]
    if all(ok is True for ok in oks):
        out.append("")
        out.append("The chain σ growth → logit growth → saturation is visible in these runs.")
    elif all(ok is None for ok in oks):
        out.append("")
        out.append("The diagnostics needed for the chain were not recorded.")
    else:
        out.append("")
        out.append("The full chain is **not** visible at this scale/length: only the steps marked yes were observed. "
                   "This is a result, not a failure of the report (the paper saw it at 50k steps of GPT-2 small).")
    return "\n".join(out)


def plot_mechanism(groups: dict[str, list[RunData]], path: Path) -> Path | None:
    """2×2 panel: σQ·σK (max over layers), logit max, saturation, entropy vs step per variant."""
    specs = [("qk_sigma_prod", "max", "σ_max(W_Q)·σ_max(W_K)  (max over layers)", True),
             ("logit_max", "max", "attention-logit max |Z|  (max over layers)", True),
             ("saturation", "max", "softmax saturation  (max over layers)", False),
             ("entropy", "mean", "softmax entropy  (mean over layers)", False)]
    units = (SIGMA_UNIT, LOGIT_UNIT, SATURATION_UNIT, "entropy (nats)")
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    any_data = False
    for k, ((name, runs), color) in enumerate(zip(groups.items(), _colors(len(groups)))):
        for ax, (suffix, how, _, _) in zip(axes.flat, specs):
            curves = [diag_aggregate(r, suffix, how) for r in runs]
            if any(len(c) for c in curves):
                any_data = True
                marks = []
                for r, c in zip(runs, curves):
                    if r.diverged and len(c):
                        marks.append((int(c.index[-1]), float(c.iloc[-1])))
                band(ax, curves, color, name, marks, **arm_style(k))
    if not any_data:
        plt.close(fig)
        return None
    for ax, (_, _, label, logy), unit in zip(axes.flat, specs, units):
        ax.set_title(label)
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(unit)
        if logy and ax.get_lines():
            ax.set_yscale("log")
    fig.suptitle("Mechanism curves (diag metrics; band: min–max over seeds; ✕: diverged)")
    return _savefig(fig, path, rect=_legend_below(fig, axes[0, 0]))


# ------------------------------------------------------------------------------------------------ automatic assignment
def _controls(run: RunData) -> dict:
    """A run's ``controls.json`` (what its experiment callbacks did), typed; ``{}`` when it has none or it is bad."""
    return run_file(run, "controls.json", CONTROLS) or {}


def auto_lines(runs: Sequence[RunData]) -> list[str]:
    """One markdown line per run of strategy ``auto``: which attention layers moved, at which step and bound."""
    out = []
    for r in runs:
        c = _controls(r)
        if "auto_threshold" not in c:
            continue
        moves = c.get("auto_moves") or []
        n = int(c.get("auto_layers", 0) or 0)
        peak = max((float(v) for v in (c.get("auto_max_bound") or {}).values()), default=float("nan"))
        if moves:
            what = "; ".join(f"{md_code(m.get('layer'))} → {md_text(m.get('action'))} at step {m.get('step')} (bound "
                             f"{fmt(m.get('bound'))}, σQ·σK {fmt(m.get('qk_sigma_prod'))}"
                             + (f" → {fmt(m.get('qk_sigma_prod_after'))}" if m.get("qk_sigma_prod_after") else "")
                             + ")" for m in moves)
        else:
            what = "no layer crossed the threshold (trained as ALL-DGRAM)"
        out.append(f"- {md_code(r.name)} (threshold {fmt(c.get('auto_threshold'))} logits, {len(moves)}/{n} layers "
                   f"moved; largest bound seen {fmt(peak)}): {what}.")
    return out


# ------------------------------------------------------------------------------------------------ stability boundary
ATTENTION_PAIRS = (("all-dgram", "hetero"), ("hetero-inv", "all-stiefel"))
"""(DGram-attention strategy, Stiefel-attention strategy) with the same MLP geometry (DGram, then Stiefel)."""


def algorithm_label(run: RunData) -> str:
    """The run's algorithm tag, with the msign arithmetic where a published-algorithm run does not use the published
    bfloat16 in its dual ascent (a preset's ``paper_msign_dtype``; the Stiefel retraction keeps the published bf16):
    e.g. ``"paper (dual-ascent msign float32)"``."""
    alg = str(run.tags.get("algorithm", ""))
    dtype = run.config.get("optim", {}).get("muon", {}).get("msign_dtype") if isinstance(run.config, dict) else None
    if alg == "paper" and isinstance(dtype, str) and dtype != "bfloat16":
        return f"{alg} (dual-ascent msign {dtype})"
    return alg


def _val0(run: RunData) -> float:
    v = loss_series(run, "val")
    return float(v.iloc[0]) if len(v) and 0 in v.index else float("nan")


def boundary_record(run: RunData) -> dict:
    """The numbers of one ladder rung: strategy, algorithm, lr, seed, state, step, final and initial val loss."""
    v = loss_series(run, "val")
    return {"strategy": str(run.tags.get("strategy")), "algorithm": str(run.tags.get("algorithm")),
            "label": algorithm_label(run), "lr": float(run.tags.get("lr")), "seed": run.seed, "state": run.state,
            "step": run.status.get("step"), "val_loss": final_value(v) if not run.diverged else float("nan"),
            "val_loss0": _val0(run)}


PROGRESS_FRACTION = 0.5
"""A rung *trains* when its val loss fell by at least this fraction of the largest fall of any rung of the same
ladder (strategy × algorithm × seed). Why not just "below the initial loss": at a huge LR the constrained matrices
blow up (σ_max ~ 4e4 after 8 steps at lr 1e4 on the tiny GPT) while LayerNorm keeps the loss finite and AdamW still
trains the embeddings, so the val loss creeps below its initial value (4.28 vs 4.43; the lr 0.02 rung reached 4.04)
without the Muon-trained matrices doing anything useful."""


def best_gain(recs: Sequence[dict]) -> float:
    """The largest fall of the val loss (initial − final) over the finished rungs of one ladder; NaN if none."""
    gains = [r["val_loss0"] - r["val_loss"] for r in recs
             if r.get("state") == "done" and math.isfinite(r.get("val_loss", math.nan))
             and math.isfinite(r.get("val_loss0", math.nan))]
    return max(gains) if gains else math.nan


def stable(rec: dict, gain: float = math.nan) -> bool:
    """A rung trains without divergence: finished, not diverged, and its val loss fell by at least
    ``PROGRESS_FRACTION`` of ``gain`` (the ladder's :func:`best_gain`; with no gain known, below the initial loss)."""
    v, v0 = rec.get("val_loss", float("nan")), rec.get("val_loss0", float("nan"))
    if rec.get("state") != "done" or not math.isfinite(v):
        return False
    if not math.isfinite(v0):
        return True
    need = PROGRESS_FRACTION * gain if math.isfinite(gain) and gain > 0 else 0.0
    return v0 - v > need


def largest_stable_lr(recs: Sequence[dict], ladder: Sequence[float]) -> tuple[float | None, bool | None]:
    """(largest LR of the ladder below its first unstable rung, whether the whole ladder was stable).

    Rungs are taken in increasing LR. The LR is None when the lowest rung is already unstable. The flag is True when
    every rung trained, False when a rung diverged or made no progress, None when the ladder is unfinished (a rung
    has no record although the one below it trained: not run yet, e.g. a report of a sweep still running).
    """
    by_lr = {float(r["lr"]): r for r in recs}
    gain = best_gain(recs)
    best = None
    for lr in sorted(ladder):
        r = by_lr.get(float(lr))
        if r is None:
            return best, None
        if not stable(r, gain):
            return best, False
        best = float(lr)
    return best, True


def first_divergence(recs: Sequence[dict]) -> tuple[float, int | None] | None:
    """(lr, step) of the lowest diverged rung (step None when not recorded), or None when no rung diverged."""
    div = sorted((float(r["lr"]), r.get("step")) for r in recs if r.get("state") == "diverged")
    if not div:
        return None
    lr, step = div[0]
    return lr, int(step) if step is not None else None


def _fmt_lr(lr: float | None, all_stable: bool | None, ladder: Sequence[float]) -> str:
    if all_stable is None:
        return "unfinished" if lr is None else f"≥ {lr:g} (unfinished)"
    if lr is None:
        return f"< {min(ladder):g}"
    return f"≥ {lr:g} (none diverged)" if all_stable else f"{lr:g}"


def boundary_table(records: Sequence[dict], ladder: Sequence[float] | None = None) -> tuple[list[str], list[list]]:
    """Header and rows of the "stability boundary" table from rung records (:func:`boundary_record`).

    One row per (strategy, algorithm): the largest stable LR per seed, the val loss at each rung (mean over the
    seeds that finished it; ``div@N`` when every seed diverged there, at the first step N; ``—`` not run), and the
    first divergence (lowest diverged LR, step, and in how many seeds).
    """
    ladder = sorted({float(r["lr"]) for r in records} | set(ladder or ()))
    keys = list(dict.fromkeys((r["strategy"], r["algorithm"]) for r in records))
    header = ["strategy", "algorithm", "largest stable LR (per seed)"] + [f"lr {lr:g}" for lr in ladder] + [
        "first divergence (lr, step)", "lowest LR without progress"]
    rows = []
    for s, a in keys:
        recs = [r for r in records if r["strategy"] == s and r["algorithm"] == a]
        seeds = sorted({r["seed"] for r in recs}, key=lambda x: (x is None, x))
        per_seed = [largest_stable_lr([r for r in recs if r["seed"] == sd], ladder) for sd in seeds]
        gains = {sd: best_gain([r for r in recs if r["seed"] == sd]) for sd in seeds}

        def trains(r: dict, gains: dict = gains) -> bool:
            return stable(r, gains[r["seed"]])

        cells = []
        for lr in ladder:
            at = [r for r in recs if float(r["lr"]) == lr]
            vals = [r["val_loss"] for r in at if r["state"] == "done" and math.isfinite(r["val_loss"])]
            div = [r for r in at if r["state"] == "diverged"]
            stuck = [r for r in at if r["state"] == "done" and math.isfinite(r["val_loss"]) and not trains(r)]
            if vals:
                cell = f"{np.mean(vals):.3f}" + (f" ({len(div)} div)" if div else "") + (
                    f" ({len(stuck)} no progress)" if stuck else "")
            elif div:
                steps = [int(r["step"]) for r in div if r.get("step") is not None]
                cell = f"div@{min(steps)}" if steps else "div"
            else:
                cell = "—"
            cells.append(cell)
        fd = [first_divergence([r for r in recs if r["seed"] == sd]) for sd in seeds]
        fd_ok = [f for f in fd if f is not None]
        if fd_ok:
            lo = min(fd_ok, key=lambda f: (f[0], f[1] if f[1] is not None else math.inf))
            first = f"{lo[0]:g}, step {lo[1] if lo[1] is not None else '?'} ({len(fd_ok)}/{len(seeds)} seeds diverged)"
        else:
            first = "none"
        no_prog = sorted(float(r["lr"]) for r in recs if r["state"] == "done" and not trains(r))
        texts = [_fmt_lr(lr, ok, ladder) for lr, ok in per_seed]
        seed_cell = f"{texts[0]} (all {len(texts)} seeds)" if len(texts) > 1 and len(set(texts)) == 1 else ", ".join(
            texts)
        rows.append([md_code(s), md_text(recs[0].get("label", a)), seed_cell] + cells
                    + [first, f"{no_prog[0]:g}" if no_prog else "none"])
    return header, rows


def _rung(lr: float | None, ladder: Sequence[float]) -> float:
    """Position of a boundary on the ladder (rungs are ×2 apart): log2(lr / lowest rung); one rung below the ladder
    for None."""
    lo = min(ladder)
    return math.log2(lr / lo) if lr is not None else -1.0


def attention_comparison(records: Sequence[dict], ladder: Sequence[float] | None = None) -> list[str]:
    """Markdown lines: per algorithm and pair of strategies sharing the MLP geometry, how the DGram-attention
    boundary compares with the Stiefel-attention one (per seed, in rungs of ×2), and the verdict on the paper's claim
    that DGram attention diverges where Stiefel attention does not."""
    ladder = sorted({float(r["lr"]) for r in records} | set(ladder or ()))
    out = []
    for alg in dict.fromkeys(r["algorithm"] for r in records):
        for dg, st in ATTENTION_PAIRS:
            rd = [r for r in records if r["algorithm"] == alg and r["strategy"] == dg]
            rs = [r for r in records if r["algorithm"] == alg and r["strategy"] == st]
            seeds = sorted({r["seed"] for r in rd} & {r["seed"] for r in rs}, key=lambda x: (x is None, x))
            if not seeds:
                continue
            diffs, pairs, above = [], [], []
            for sd in seeds:
                bd, okd = largest_stable_lr([r for r in rd if r["seed"] == sd], ladder)
                bs, oks = largest_stable_lr([r for r in rs if r["seed"] == sd], ladder)
                if okd is None or oks is None:
                    continue  # a ladder still running says nothing yet
                # an all-stable ladder's boundary is above the ladder: count it as one rung above the top
                pd = _rung(bd, ladder) + (1 if okd else 0)
                ps = _rung(bs, ladder) + (1 if oks else 0)
                diffs.append(ps - pd)
                above.append(bool(okd and oks))
                pairs.append(f"{_fmt_lr(bd, okd, ladder)} vs {_fmt_lr(bs, oks, ladder)}")
            if not diffs:
                continue
            if all(d > 0 for d in diffs):
                verdict = "**reproduced**: DGram attention's boundary is lower in every seed"
            elif all(d < 0 for d in diffs):
                verdict = "**reversed**: DGram attention's boundary is higher in every seed"
            elif all(above):
                verdict = ("**not reproduced**: no rung diverged for either, in any seed — both boundaries lie above "
                           "the ladder's top rung")
            elif all(d == 0 for d in diffs):
                verdict = "**not reproduced**: the boundaries are equal in every seed"
            else:
                verdict = "**not reproduced**: the order differs between seeds"
            mean = float(np.mean(diffs))
            per_seed = (f"{pairs[0]} in all {len(pairs)} seeds" if len(pairs) > 1 and len(set(pairs)) == 1
                        else f"per seed {'; '.join(pairs)}")
            gap = "" if all(above) else (f" — Stiefel attention is {mean:+.2g} rungs (×{2 ** mean:.3g} in LR) above "
                                         f"DGram attention on average over {len(diffs)} seeds")
            out.append(f"- {md_text(alg)}, `{dg}` (DGram attention) vs `{st}` (Stiefel attention), same MLP geometry: "
                       f"largest stable LR {per_seed}{gap}; {verdict}.")
    return out


def plot_boundary(records: Sequence[dict], path: Path) -> Path | None:
    """Final val loss against Muon LR per strategy, one panel per algorithm (✕: the lowest diverged rung)."""
    algs = list(dict.fromkeys(r["algorithm"] for r in records))
    strategies = list(dict.fromkeys(r["strategy"] for r in records))
    if not algs:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(algs), figsize=(7 * len(algs), 5), squeeze=False)
    for ax, alg in zip(axes[0], algs):
        for k, (s, color) in enumerate(zip(strategies, _colors(len(strategies)))):
            recs = [r for r in records if r["algorithm"] == alg and r["strategy"] == s]
            lrs = sorted({float(r["lr"]) for r in recs})
            ys = []
            for lr in lrs:
                v = [r["val_loss"] for r in recs if float(r["lr"]) == lr and math.isfinite(r["val_loss"])]
                ys.append(float(np.mean(v)) if v else float("nan"))
            ax.plot(lrs, ys, color=color, label=plot_text(s), fillstyle="none", **arm_style(k))
            fd = first_divergence(recs)
            if fd is not None:
                ok = [y for y in ys if math.isfinite(y)]
                ax.plot([fd[0]], [max(ok) if ok else 0.0], marker="x", color=color, ms=12, mew=2.5, ls="none")
        ax.set_xscale("log", base=2)
        ticks = sorted({float(r["lr"]) for r in records})
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}" for t in ticks], rotation=45)
        ax.set_xlabel("Muon learning rate (peak, per step; log scale)")
        ax.set_ylabel(f"final val loss ({LOSS_UNIT}; mean over seeds that finished)")
        ax.set_title(f"{plot_text(alg)} algorithm (✕: lowest diverged lr)")
    axes[0][0].legend(loc="upper left")
    fig.suptitle("Stability boundary: final val loss against learning rate")
    return _savefig(fig, path)


def boundary_section(runs: Sequence[RunData], out: Path) -> str:
    """The "stability boundary" table, the DGram-vs-Stiefel-attention comparison and the LR plot."""
    records = [boundary_record(r) for r in tagged(runs, ("strategy", "algorithm", "lr"), "the stability boundary")]
    if not records:
        return "### Stability boundary\n\nNo run with usable tags (strategy, algorithm, lr); see the end of the report."
    header, rows = boundary_table(records)
    lines = ["### Stability boundary", "",
             "Each strategy × algorithm trains on a ladder of Muon learning rates (×2 per rung; everything else "
             "fixed); a rung runs only when the rung below it (same seed) did not diverge. A rung *trains without "
             "divergence* when it finished (no NaN/Inf, smoothed train loss never above `train.diverge_factor` × its "
             f"best) and its val loss fell by at least {PROGRESS_FRACTION:g} of the largest fall of any rung of its "
             "ladder (same strategy, algorithm and seed). Cells: final val loss, mean over the seeds that finished the "
             "rung (`div@N`: every seed diverged, first at step N; *no progress*: finished with a smaller fall — at "
             "very large steps the constrained weights blow up while LayerNorm keeps the loss finite and AdamW still "
             "trains the embeddings; `—`: not run).", "",
             "**stability boundary**", "", md_table(header, rows), ""]
    cmp_lines = attention_comparison(records)
    if cmp_lines:
        lines += ["The manifold-assignment paper's claim — DGram attention diverges where Stiefel attention does not, "
                  "at shared hyperparameters:", ""] + cmp_lines + [""]
    lines += image_lines(plot_boundary(records, out / "manifolds_boundary.png"), "stability boundary")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ attribution
def _growth(s: pd.Series) -> float:
    s = s[np.isfinite(s.values)] if len(s) else s
    if len(s) < 2 or not float(s.iloc[0]) > 0:
        return float("nan")
    return float(s.iloc[-1]) / float(s.iloc[0])


def attribution_record(run: RunData) -> dict:
    """One attribution run: strategy, arm, diverged (step), final val loss, σQ·σK growth, logit max, saturation."""
    v = loss_series(run, "val")
    sat = diag_aggregate(run, "saturation")
    return {"strategy": str(run.tags.get("strategy")), "arm": str(run.tags.get("arm")), "seed": run.seed,
            "diverged": run.diverged, "step": run.status.get("step"),
            "val_loss": final_value(v) if not run.diverged else float("nan"),
            "sigma_growth": _growth(diag_aggregate(run, "qk_sigma_prod")),
            "logit_max": final_value(diag_aggregate(run, "logit_max")),
            "saturation": float(sat.max()) if len(sat) else float("nan")}


SATURATION_SEEN = 0.05
"""A run shows saturation when more than this fraction of some layer's softmax rows is saturated."""


def attribution_rows(records: Sequence[dict]) -> list[list]:
    """Rows of the attribution table: per strategy and arm, what it reproduces compared with the ``ours`` arm."""
    rows = []
    for s in dict.fromkeys(r["strategy"] for r in records):
        base = [r for r in records if r["strategy"] == s and r["arm"] == "ours"]
        g0 = np.nanmax([r["sigma_growth"] for r in base]) if base else float("nan")
        s0 = float(np.nanmax([r["saturation"] for r in base])) if base and any(
            math.isfinite(r["saturation"]) for r in base) else 0.0
        d0 = sum(r["diverged"] for r in base)
        for arm in dict.fromkeys(r["arm"] for r in records if r["strategy"] == s):
            rs = [r for r in records if r["strategy"] == s and r["arm"] == arm]
            g = float(np.nanmax([r["sigma_growth"] for r in rs])) if any(
                math.isfinite(r["sigma_growth"]) for r in rs) else float("nan")
            sat = float(np.nanmax([r["saturation"] for r in rs])) if any(
                math.isfinite(r["saturation"]) for r in rs) else float("nan")
            ndiv = sum(r["diverged"] for r in rs)
            steps = [int(r["step"]) for r in rs if r["diverged"] and r["step"] is not None]
            finals = [r["val_loss"] for r in rs if math.isfinite(r["val_loss"])]
            if arm == "ours":
                verdict = "baseline"
            else:
                found = []
                if math.isfinite(g) and math.isfinite(g0) and g > 1.5 * g0:
                    found.append("σ growth")
                if math.isfinite(sat) and sat > SATURATION_SEEN and sat > s0 + SATURATION_SEEN:
                    found.append("saturation")
                if ndiv > d0:
                    found.append("divergence")
                verdict = ", ".join(found) if found else "none"
            diverged = f"{ndiv}/{len(rs)}" + (f" (first step {min(steps)})" if steps else "")
            rows.append([md_code(s), md_text(arm), diverged, fmt_stats(finals), f"×{fmt(g)}",
                         fmt(max((r['logit_max'] for r in rs), default=None)),
                         fmt(sat), verdict])
    return rows


def attribution_section(runs: Sequence[RunData], out: Path) -> str:
    """Which element of the published algorithm reproduces σ growth, saturation or divergence."""
    runs = tagged(runs, ("strategy", "arm"), "the attribution table")
    records = [attribution_record(r) for r in runs]
    lr = runs[0].tags.get("lr") if runs else None
    lines = ["### Attribution: one element of the published algorithm at a time", "",
             f"Our manifold Muon at Muon lr {fmt(lr)} with one element of the manifold-assignment paper's published "
             "code switched on (`paper`: all of them). *Reproduces* compares each arm with `ours` on the same "
             "strategy: σ growth = σ_max(W_Q)·σ_max(W_K) (max over layers) grows more than 1.5× as much; "
             f"saturation = the largest saturated fraction of some layer's softmax rows is above {SATURATION_SEEN:g} "
             f"and more than {SATURATION_SEEN:g} above ours; divergence = more seeds diverged. σ growth is last / "
             "first diagnostics step (max over seeds).", "",
             md_table(["strategy", "arm", "diverged", "final val loss", "σQ·σK growth", "logit max (last)",
                       "saturation (max)", "reproduces"], attribution_rows(records)), ""]
    lines += bf16_lines(records)
    lines += image_lines(plot_mechanism(group_runs(runs), out / "manifolds_attribution_mechanism.png"),
                         "attribution mechanism curves")
    return "\n".join(lines)


def bf16_lines(records: Sequence[dict]) -> list[str]:
    """What the published msign's bfloat16 arithmetic changes: the ``paper`` arm (bf16, as published) against
    ``paper-fp32-msign`` (the same in float32, as the boundary and mechanism presets run it), per strategy."""
    out = []
    for s in dict.fromkeys(r["strategy"] for r in records):
        arms = {a: [r for r in records if r["strategy"] == s and r["arm"] == a] for a in ("paper", "paper-fp32-msign")}
        if not all(arms.values()):
            continue

        def summary(rs: list[dict]) -> str:
            finals = [r["val_loss"] for r in rs if math.isfinite(r["val_loss"])]
            g = max((r["sigma_growth"] for r in rs if math.isfinite(r["sigma_growth"])), default=float("nan"))
            sat = max((r["saturation"] for r in rs if math.isfinite(r["saturation"])), default=float("nan"))
            div = sum(r["diverged"] for r in rs)
            return f"val loss {fmt_stats(finals)}, σQ·σK ×{fmt(g)}, saturation {fmt(sat)}, {div}/{len(rs)} diverged"

        out.append(f"- `{md_text(s)}`: bf16 msign (as published) {summary(arms['paper'])}; float32 msign "
                   f"{summary(arms['paper-fp32-msign'])}.")
    if out:
        out = ["What the published msign's bfloat16 arithmetic changes (`paper` against `paper-fp32-msign`, the "
               "arithmetic the boundary and mechanism presets use):", "", *out, ""]
    return out


# --------------------------------------------------------------------------------------------- long mechanism runs
def head_frame(run: RunData) -> pd.DataFrame:
    """``heads.jsonl`` of a run as a long DataFrame (step, metric, value); empty when the run has none."""
    df = run_metrics(run, "heads.jsonl")
    return df[df["split"] == "heads"] if not df.empty else df


def head_summary(df: pd.DataFrame) -> dict:
    """From per-head rows: the last step's max saturation and min entropy over heads, the first step at which some
    head's saturation exceeds :data:`SATURATION_SEEN`, and the number of heads."""
    if df.empty:
        return {}
    sat = df[df["metric"].str.contains(r"\.saturation_h\d+$")]
    ent = df[df["metric"].str.contains(r"\.entropy_h\d+$")]
    last = int(df["step"].max())
    over = sat[sat["value"] > SATURATION_SEEN]
    return {"heads": int(sat["metric"].nunique()), "last_step": last,
            "sat_max_last": float(sat[sat["step"] == last]["value"].max()) if not sat.empty else float("nan"),
            "sat_max_any": float(sat["value"].max()) if not sat.empty else float("nan"),
            "ent_min_last": float(ent[ent["step"] == last]["value"].min()) if not ent.empty else float("nan"),
            "first_sat_step": int(over["step"].min()) if not over.empty else None}


def plot_heads(runs: Sequence[RunData], path: Path) -> Path | None:
    """Per-head softmax entropy and saturation against step, one colour per run, one line per head."""
    frames = [(r, head_frame(r)) for r in runs]
    frames = [(r, f) for r, f in frames if not f.empty]
    if not frames:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for j, ((r, df), color) in enumerate(zip(frames, _colors(len(frames)))):
        for ax, kind in zip(axes, ("entropy", "saturation")):
            sub = df[df["metric"].str.contains(rf"\.{kind}_h\d+$")]
            for k, (_, g) in enumerate(sub.groupby("metric")):
                g = g.sort_values("step")
                ax.plot(g["step"], g["value"], color=color, lw=1.0, alpha=0.7, ms=3, fillstyle="none",
                        label=plot_text(r.variant) if k == 0 else None, **arm_style(j))
            if r.diverged:
                ax.axvline(int(r.status.get("step", 0)), color=color, ls=":", lw=1.2)
    axes[0].set_title("softmax entropy per head (nats)")
    axes[1].set_title("saturated fraction of softmax rows per head")
    axes[0].set_ylabel("entropy (nats)")
    axes[1].set_ylabel(SATURATION_UNIT)
    for ax in axes:
        ax.set_xlabel(STEP_LABEL)
    fig.suptitle("Per-head attention statistics (one line per head; dotted: divergence)")
    return _savefig(fig, path, rect=_legend_below(fig, axes[0]))


def long_mechanism_section(runs: Sequence[RunData], out: Path) -> str:
    """The chain σ → logits → saturation → divergence on long runs, with per-head statistics."""
    rows = []
    for r in runs:
        hs = head_summary(head_frame(r))
        sp = diag_aggregate(r, "qk_sigma_prod")
        lg = diag_aggregate(r, "logit_max")
        chain = []
        g = _growth(sp)
        if math.isfinite(g) and g > 1.5:
            chain.append(f"σ ×{fmt(g)}")
        gl = _growth(lg)
        if math.isfinite(gl) and gl > 1.5:
            chain.append(f"logits ×{fmt(gl)}")
        if hs and math.isfinite(hs.get("sat_max_any", float("nan"))) and hs["sat_max_any"] > SATURATION_SEEN:
            chain.append(f"saturation (first at step {hs['first_sat_step']})")
        if r.diverged:
            chain.append(f"divergence at step {r.status.get('step')}")
        v = loss_series(r, "val")
        rows.append([md_code(r.name), md_text(algorithm_label(r)), r.state, r.status.get("step", "—"),
                     fmt(final_value(v) if not r.diverged else None, 4), f"{fmt(sp.iloc[0]) if len(sp) else '—'} → "
                     f"{fmt(final_value(sp))}", f"{fmt(lg.iloc[0]) if len(lg) else '—'} → {fmt(final_value(lg))}",
                     fmt(hs.get("sat_max_any")), fmt(hs.get("ent_min_last")), hs.get("heads", "—"),
                     " → ".join(chain) if chain else "nothing grew"])
    lines = ["### Mechanism at length: σ → logits → saturation → divergence", "",
             "Long runs with the softmax entropy and saturation of every attention head recorded (`heads.jsonl`). "
             f"Chain: σ / logits = σ_max(W_Q)·σ_max(W_K) / attention-logit max grew more than 1.5× (max over "
             f"layers, first → last diagnostics step); saturation = some head has more than {SATURATION_SEEN:g} of "
             "its softmax rows saturated; divergence = the run diverged.", "",
             md_table(["run", "algorithm", "state", "step", "final val loss", "σQ·σK first → last",
                       "logit max first → last", "head saturation (max)", "head entropy (min, last)", "heads",
                       "chain seen"], rows), ""]
    lines += image_lines(plot_heads(runs, out / "manifolds_heads.png"), "per-head statistics")
    lines += image_lines(plot_mechanism(group_runs(runs), out / "manifolds_long_mechanism.png"),
                         "long-run mechanism curves")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the instability at length
SIGMA_PRODUCT_CROSSED = DEFAULT_SIGMA_CAP
"""σ_max(W_Q)·σ_max(W_K) above this (max over layers) counts as grown: the σ cap of the main preset, twice Stiefel
attention's value of 1."""
LOGIT_CROSSED = DEFAULT_AUTO_THRESHOLD
"""Attention-logit max above this counts as large: the ``auto`` arm's threshold (a softmax over 64 keys is ~99 %
one-hot at a logit range of ~9)."""


def _first_above(s: pd.Series, threshold: float) -> int | None:
    """The first step of a step-indexed series whose value exceeds ``threshold`` (None if it never does)."""
    s = s[np.isfinite(s.values)] if len(s) else s
    over = s[s > threshold]
    return int(over.index[0]) if len(over) else None


def head_saturation_series(run: RunData) -> pd.Series:
    """Largest saturated fraction over all heads at each recorded step (``heads.jsonl``; empty without it)."""
    df = head_frame(run)
    if df.empty:
        return pd.Series(dtype=float)
    sat = df[df["metric"].str.contains(r"\.saturation_h\d+$")]
    return sat.groupby("step")["value"].max().sort_index() if not sat.empty else pd.Series(dtype=float)


def _times(mult: Any) -> str:
    """A learning-rate multiplier as "×8" ("×?" when unknown)."""
    return f"×{float(mult):g}" if isinstance(mult, (int, float)) else "×?"


def _divergence_step(run: RunData, train: pd.Series) -> int | str:
    """A diverged run's step: its ``status.json`` step, else (a status without a usable step) its last logged train
    step, else ``"?"``."""
    step = run.status.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    return int(train.index[-1]) if len(train) else "?"


def long_record(run: RunData) -> dict:
    """One long run: its tags, how far it went, the first step each link of the chain crossed its threshold, and the
    time courses plotted (``curves``: σQ·σK, logit max, head saturation, train loss)."""
    sp, lg, sat = diag_aggregate(run, "qk_sigma_prod"), diag_aggregate(run, "logit_max"), head_saturation_series(run)
    train = loss_series(run, "train")
    div = _divergence_step(run, train) if run.diverged else None
    first_sat = _first_above(sat, SATURATION_SEEN)
    if div is None:
        follows = "no divergence"
    elif first_sat is not None and isinstance(div, int) and first_sat <= div:
        follows = f"yes (saturated at {first_sat}, diverged at {div})"
    else:
        follows = f"no: diverged at {div} without saturation"
    finite = [float(x) for x in (sp.max() if len(sp) else math.nan, lg.max() if len(lg) else math.nan)]
    control = run.tags.get("control")
    sched = run.config.get("schedule") or {}
    train_time = (run.experiment.get("final") or {}).get("train_time_s")
    return {"run": run, "strategy": str(run.tags.get("strategy", "?")) + (f"+{control}" if control else ""),
            "schedule": str(sched.get("kind", "?")), "warmup": int(sched.get("warmup") or 0),
            "train_time": float(train_time) if isinstance(train_time, (int, float)) else math.nan,
            "lr": run.tags.get("lr"),
            "mult": run.tags.get("lr_multiplier"), "msign": str(run.tags.get("msign_dtype", "?")),
            "attn": _attn_manifold(run), "steps": run.status.get("step"), "diverged": div,
            "val": final_value(loss_series(run, "val")) if div is None else None,
            "train": final_value(train), "curves": (sp, lg, sat, train),
            "sigma": (float(sp.iloc[0]) if len(sp) else math.nan, finite[0]),
            "sigma_at": _first_above(sp, SIGMA_PRODUCT_CROSSED),
            "logit": (float(lg.iloc[0]) if len(lg) else math.nan, finite[1]),
            "logit_at": _first_above(lg, LOGIT_CROSSED),
            "sat": float(sat.max()) if len(sat) else math.nan, "sat_at": first_sat, "follows": follows}


def long_verdict(records: Sequence[dict]) -> list[str]:
    """In words: which runs diverged, whether divergence followed saturation, how far the others got."""
    dg = [r for r in records if r["attn"].startswith("dgram") and "scale-control" not in r["attn"]]
    st = [r for r in records if r["attn"].startswith("stiefel") and "scale-control" not in r["attn"]]

    def count(rs: Sequence[dict]) -> str:
        d = [r for r in rs if r["diverged"] is not None]
        where = ", ".join(f"{r['strategy']} {_times(r['mult'])} at step {r['diverged']}" for r in d)
        return f"{len(d)} of {len(rs)}" + (f" ({where})" if d else "")

    lines = [f"- Diverged: DGram attention {count(dg)}; Stiefel attention {count(st)}."]
    div = [r for r in records if r["diverged"] is not None]
    if div:
        after = sum(r["follows"].startswith("yes") for r in div)
        lines.append(f"- Divergence followed saturation in {after} of {len(div)} diverged runs.")
    for name, rs in (("DGram attention", dg), ("Stiefel attention", st)):
        if not rs:
            continue
        sat = max((r["sat"] for r in rs if math.isfinite(r["sat"])), default=math.nan)
        lg = max((r["logit"][1] for r in rs if math.isfinite(r["logit"][1])), default=math.nan)
        sp = max((r["sigma"][1] for r in rs if math.isfinite(r["sigma"][1])), default=math.nan)
        crossed = [r for r in rs if r["sat_at"] is not None]
        lines.append(f"- {name}: largest σQ·σK {fmt(sp)}, logit max {fmt(lg)}, head saturation {fmt(sat)}; "
                     f"saturation above {SATURATION_SEEN:g} in {len(crossed)} of {len(rs)} runs"
                     + (" (first: " + ", ".join(f"{r['strategy']} {_times(r['mult'])} at {r['sat_at']}"
                                                 for r in crossed) + ")" if crossed else "") + ".")
    if dg and st:
        dg_div = sum(r["diverged"] is not None for r in dg)
        st_div = sum(r["diverged"] is not None for r in st)
        if dg_div > st_div:
            lines.append("- **Reproduced at this size**: DGram attention diverges where Stiefel attention does not.")
        elif dg_div == st_div == 0:
            lines.append("- **Not reproduced at this size**: no run diverged. " + _next_larger(records))
        else:
            lines.append(f"- **Not reproduced at this size**: Stiefel attention diverged as often or more "
                         f"({st_div} vs {dg_div}).")
    return lines


PAPER_BLOWUP_STEPS = (15_000, 20_000)
"""Where the manifold-assignment paper's published val-loss curves blow up (ALL-DGRAM near step 15k, HETERO-INV near
20k, of a 50k cosine schedule): the steps a constant-learning-rate run's growth is extrapolated to."""


def _next_larger(records: Sequence[dict]) -> str:
    """The next larger setting to try after long runs in which nothing diverged: the peak learning rate held (the
    ``long-const`` preset) when the runs decayed it; a run to the paper's blow-up steps when they held it for fewer
    steps; else only the paper's own model and data."""
    paper = ("the paper's own model and data (preset `gpt2-small-owt` with `optim.preset=paper` on GPUs; see "
             "docs/experiments.md for the command and its cost).")
    if not all(r["schedule"] == "constant" for r in records):
        return ("The next larger setting is a run at the peak learning rate (`weightgeom sweep manifolds long-const`) "
                "or " + paper)
    steps = max((r["steps"] for r in records if isinstance(r["steps"], int)), default=0)
    held = f"These runs held the peak learning rate for {steps:,} steps; the next larger setting is "
    if steps < PAPER_BLOWUP_STEPS[-1]:
        return held + f"a run to the paper's blow-up steps (`--steps {PAPER_BLOWUP_STEPS[-1]}`) or " + paper
    return held + paper


TREND_WINDOW = 0.5
"""Fraction of a constant-learning-rate run's steps after warm-up, counted back from its last step, through which
the growth line is fitted (the later half: the early transient left out)."""

TREND_MIN_SPAN = 1000
"""Fewest steps a fit window must span for its line to be reported and extrapolated: a line through a few hundred
steps, extrapolated to 20,000, reads noise as a trend."""


def trend(s: pd.Series, start: int, log: bool, at: Sequence[int] = PAPER_BLOWUP_STEPS) -> tuple[float, list[float]]:
    """A least-squares line through a step-indexed series over steps ≥ ``start``.

    Args:
        s: values indexed by training step.
        start: first step of the fit.
        log: fit log(value) (positive quantities that grow by factors: σQ·σK, logit max) instead of the value (a
            fraction: head saturation).
        at: steps to extrapolate the line to.

    Returns:
        The change per 1,000 steps (a factor when ``log``, else a difference) and the line's value at each step of
        ``at`` (a fraction, clipped to [0, 1], when not ``log``; ``inf`` past the float range); NaNs when fewer than 3
        finite points are in the window or they span fewer than :data:`TREND_MIN_SPAN` steps.
    """
    s = s[(s.index >= start) & np.isfinite(s.values)] if len(s) else s
    if log:
        s = s[s > 0]
    if len(s) < 3 or s.index.max() - s.index.min() < TREND_MIN_SPAN:
        return math.nan, [math.nan] * len(at)
    x = s.index.to_numpy(dtype=float)
    y = np.log(s.to_numpy(dtype=float)) if log else s.to_numpy(dtype=float)
    slope, intercept = (float(v) for v in np.polyfit(x, y, 1))
    line = [intercept + slope * a for a in at]
    if log:
        def exp(v: float) -> float:
            return math.exp(v) if v < 700.0 else math.inf  # e^700 ≈ 1e304, near float64's limit

        return exp(1000.0 * slope), [exp(v) for v in line]
    return 1000.0 * slope, [min(1.0, max(0.0, v)) for v in line]


def trend_record(r: dict) -> dict:
    """A constant-learning-rate long run (:func:`long_record`'s record): the fit window, and per link of the chain
    (``sigma``, ``logit``, ``sat``) the last value, the change per 1,000 steps and the values extrapolated to
    :data:`PAPER_BLOWUP_STEPS` (:func:`trend`)."""
    last = int(r["steps"] or 0)
    start = int(last - TREND_WINDOW * max(0, last - r["warmup"]))
    out = {"from": start, "to": last}
    for key, series, log in zip(("sigma", "logit", "sat"), r["curves"][:3], (True, True, False)):
        out[key] = (final_value(series), *trend(series, start, log))
    return out


def _per_1k(x: float, log: bool) -> str:
    return "—" if not math.isfinite(x) else (f"×{x:.3g}" if log else f"{x:+.3g}")


def constant_lr_lines(records: Sequence[dict]) -> list[str]:
    """At a constant learning rate (preset ``long-const``): per run how it ended, and for the runs that did not
    diverge the growth per 1,000 steps of σQ·σK, logit max and head saturation and where each line leads at the
    paper's blow-up steps; then in words for the DGram-attention runs, and the training time."""
    recs = [r for r in records if r["schedule"] == "constant"]
    if not recs:
        return []
    a, b = PAPER_BLOWUP_STEPS
    rows, words = [], []
    for r in recs:
        t = trend_record(r)
        end = f"diverged at {r['diverged']}" if r["diverged"] is not None else f"ran to {t['to']:,}"
        cells = []
        for key, log in (("sigma", True), ("logit", True), ("sat", False)):
            last, per, (at_a, at_b) = t[key]
            cells += [fmt(last), _per_1k(per, log), f"{fmt(at_a)} / {fmt(at_b)}" if r["diverged"] is None else "—"]
        hours = r["train_time"] / 3600 if math.isfinite(r["train_time"]) else math.nan
        rows.append([md_code(r["run"].name), md_text(r["strategy"]), f"{float(r['lr']):g} ({_times(r['mult'])})", end,
                     *cells, fmt(hours, 2)])
        if r["attn"] == "dgram":
            if r["diverged"] is not None:
                words.append(f"- {md_text(r['strategy'])} {_times(r['mult'])}: diverged at step {r['diverged']}.")
            else:
                (s_last, s_per, s_at), (l_last, l_per, l_at), (q_last, q_per, q_at) = t["sigma"], t["logit"], t["sat"]
                words.append(
                    f"- {md_text(r['strategy'])} {_times(r['mult'])}: no divergence in {t['to']:,} steps. Over steps "
                    f"{t['from']:,}–{t['to']:,}, σQ·σK changes {_per_1k(s_per, True)} per 1,000 steps (now "
                    f"{fmt(s_last)}, line at {a // 1000}k/{b // 1000}k: {fmt(s_at[0])}/{fmt(s_at[1])}), logit max "
                    f"{_per_1k(l_per, True)} ({fmt(l_last)} → {fmt(l_at[0])}/{fmt(l_at[1])}), head saturation "
                    f"{_per_1k(q_per, False)} ({fmt(q_last)} → {fmt(q_at[0])}/{fmt(q_at[1])}).")
    times = [r["train_time"] for r in recs if math.isfinite(r["train_time"])]
    kinds = sorted({str((run_file(r["run"], "meta.json", META) or {}).get("device_kind", "?")) for r in recs})
    total = (f"Training time (steps and diagnostics, evaluation left out, summed over resumed sittings): "
             f"{sum(times) / 3600:.1f} h over {len(times)} of {len(recs)} runs, on {md_text(', '.join(kinds))}."
             if times else "")
    return ["#### At a constant learning rate: growth per 1,000 steps and where it leads", "",
            f"Runs whose learning rate stays at its peak after warm-up. For each run that did not diverge, a "
            f"least-squares line through the later {TREND_WINDOW:.0%} of its post-warm-up steps: σQ·σK and logit max "
            f"as a factor per 1,000 steps (a line in log scale), head saturation as a change of the fraction per "
            f"1,000 steps; then the line's value at steps {a:,} and {b:,}, where the paper's ALL-DGRAM and "
            f"HETERO-INV blew up. An extrapolation, not a measurement: it assumes the trend of the fitted window "
            f"continues.", "",
            md_table(["run", "strategy", "Muon lr", "end", "σQ·σK (last)", "σQ·σK per 1k steps",
                      f"σQ·σK at {a // 1000}k / {b // 1000}k", "logit max (last)", "logit max per 1k steps",
                      f"logit max at {a // 1000}k / {b // 1000}k", "saturation (last)", "saturation per 1k steps",
                      f"saturation at {a // 1000}k / {b // 1000}k", "train time (h)"], rows), "",
            *(words or ["- No DGram-attention run without a scale control at a constant learning rate."]),
            *([total] if total else []), ""]


SCALE_CHECKPOINT_MAX_BYTES = 4 << 30
"""Largest checkpoint file the report reads for :func:`scale_at_last_checkpoint` (4 GiB; it is read whole to check
its hash, so a GPT-2-small checkpoint with its optimizer state fits)."""
SCALE_MAX_TENSORS = 10_000
"""Most tensors a checkpoint's model state may hold for :func:`scale_at_last_checkpoint` (Llama 70B has 723)."""
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _checked_model_state(state: Any, file_bytes: int) -> dict[str, Any]:
    """The checkpoint's ``model`` state after the checks that bound what rebuilding it costs: a dict of at most
    :data:`SCALE_MAX_TENSORS` real, finite-sized tensors whose bytes (numel × element size, views counted whole)
    fit in the file, so a stride-0 or shared-storage view cannot stand for more memory than the file holds."""
    import torch

    sd = state.get("model") if isinstance(state, dict) else None
    if not isinstance(sd, dict) or not sd:
        raise ValueError("no model state in it")
    if len(sd) > SCALE_MAX_TENSORS:
        raise ValueError(f"{len(sd):,} tensors in its model state, more than {SCALE_MAX_TENSORS:,}")
    total = 0
    for k, t in sd.items():
        if not isinstance(t, torch.Tensor) or t.is_meta or t.is_complex():
            raise ValueError(f"model state {str(k)[:60]!r} is not a real tensor")
        total += t.numel() * t.element_size()
    if total > file_bytes:
        raise ValueError(f"its model tensors claim {total:,} bytes, more than the file's {file_bytes:,}")
    return sd


def _layer_count_fits(model_cfg: dict[str, Any], sd: dict[str, Any]) -> None:
    """Refuse a config with more layers than the checkpoint's keys number (before any module is built)."""
    have = len({int(m.group(1)) for k in sd for m in [_LAYER_INDEX.search(str(k))] if m})
    for key in ("n_layer", "n_layers"):
        n = model_cfg.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > have:
            raise ValueError(f"the config's model.{key} = {n} but the checkpoint has {have} layers")


def scale_at_last_checkpoint(run: RunData) -> dict[str, Any] | None:
    """Where the attention's logit scale sits at the run's newest checkpoint (:func:`weightgeom.diagnostics.qk_scale`
    on the model rebuilt from the run's config): the largest over attention layers of σ_max(W_Q)·σ_max(W_K), of the
    attention-input norm's mean |gain| and of σQ·σK with that gain folded in, and the checkpoint's step. None
    without a checkpoint; one that cannot be used (over :data:`SCALE_CHECKPOINT_MAX_BYTES`, corrupt, tensors that
    claim more memory than the file holds, a config of another model or with more layers than it has) is named in
    the run's problems. The model is built on the meta device and takes the checkpoint's tensors, so what the report
    allocates is bounded by the file."""
    import torch

    path = latest_checkpoint(run.path / "checkpoints")
    if path is None:
        return None
    try:
        size = path.stat().st_size
        if size > SCALE_CHECKPOINT_MAX_BYTES:
            raise ValueError(f"over {SCALE_CHECKPOINT_MAX_BYTES >> 20} MiB, not read")
        state = load_checkpoint(path)
        sd = _checked_model_state(state, size)
        model_cfg = run.config.get("model")
        if not isinstance(model_cfg, dict):
            raise ValueError("the run's config has no [model] section")
        _layer_count_fits(model_cfg, sd)
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 10**12:
            raise ValueError(f"its step is {str(step)[:40]!r}, not a step count")
        with torch.device("meta"):
            model = model_from_config(dict(model_cfg))
        model.load_state_dict(sd, assign=True)
        sp = [qk_sigma_prod(*m.qk_weights())["qk_sigma_prod"] for _, m in attention_modules(model)]
        d = qk_scale(model)
    except Exception as e:  # noqa: BLE001 -- an untrusted run directory: say what was wrong, report the rest
        why = " ".join(str(e).replace(str(path), path.name).split())
        run.problems.append(f"{run.name}: attention scale not computed from {path.name} "
                            f"({type(e).__name__}: {why[:300]})")
        return None

    def top(key: str) -> float:
        vals = [v for k, v in d.items() if k.endswith("." + key) and math.isfinite(v)]
        return max(vals) if vals else math.nan
    return {"step": step, "sigma": max(sp, default=math.nan),
            "gain": top("norm_gain_mean"), "sigma_gain": top("qk_sigma_prod_gain")}


def scale_lines(records: Sequence[dict]) -> list[str]:
    """The long runs' "where the attention scale sits" table (:func:`scale_at_last_checkpoint`)."""
    rows = []
    for r in records:
        sc = scale_at_last_checkpoint(r["run"])
        if sc is None:
            continue
        lg = r["curves"][1]
        rows.append([md_code(r["run"].name), md_text(r["strategy"]), _times(r["mult"]), f"{sc['step']:,}",
                     fmt(sc["sigma"]), fmt(sc["gain"]), fmt(sc["sigma_gain"]),
                     fmt(float(lg.iloc[-1])) if len(lg) else "—"])
    if not rows:
        return []
    return ["#### Where the attention scale sits (newest checkpoint)", "",
            "σQ·σK is measured on the weights alone. Before a pre-norm attention its input passes a norm with a gain "
            "g, so the logits are bounded by the product with g folded in, σ_max(W_Q·diag g)·σ_max(W_K·diag g). A "
            "run that shrinks W_Q and W_K (QK-clip, the σ cap) can move the scale into g, and one that grows them "
            "can shrink g. Largest over layers, from each run's newest checkpoint "
            "(`weightgeom.diagnostics.qk_scale`; the trainer's diagnostics also log it as "
            "`attn.<i>.qk_sigma_prod_gain` and `attn.<i>.norm_gain_mean`, in runs of a weightgeom that has it).", "",
            md_table(["run", "strategy", "Muon lr", "checkpoint step", "σQ·σK (weights)", "input-norm gain (mean abs.)",
                      "σQ·σK with g folded in", "logit max (last diagnostics)"], rows), ""]


def plot_long(records: Sequence[dict], path: Path) -> Path | None:
    """Time courses per run: σQ·σK, logit max, largest head saturation and train loss; colour = strategy, line
    style = lr multiplier, ✕ = divergence."""
    if not records:
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    strategies = sorted({r["strategy"] for r in records})
    colors = dict(zip(strategies, _colors(len(strategies))))
    mults = sorted({float(r["mult"]) for r in records if r["mult"] is not None})
    styles = {m: ("-", "--", "-.", ":")[k % 4] for k, m in enumerate(mults)}
    markers = {s: MARKERS[k % len(MARKERS)] for k, s in enumerate(strategies)}
    any_data = False
    for r in records:
        label = plot_text(f"{r['strategy']} {_times(r['mult'])}")
        for ax, c in zip(axes.flat, r["curves"]):  # the series long_record read: each run's files read once
            if not len(c):
                continue
            any_data = True
            ax.plot(c.index, c.values, color=colors[r["strategy"]], ls=styles.get(float(r["mult"] or 0), "-"),
                    marker=markers[r["strategy"]], markevery=max(1, len(c) // 10), ms=4, fillstyle="none",
                    lw=1.2, label=label if ax is axes[0, 0] else None)
            if r["diverged"] is not None:
                ax.plot([c.index[-1]], [c.values[-1]], marker="x", color=colors[r["strategy"]], ms=9, mew=2)
    if not any_data:
        plt.close(fig)
        return None
    titles = (f"σ_max(W_Q)·σ_max(W_K), max over layers (threshold {SIGMA_PRODUCT_CROSSED:g})",
              f"attention-logit max (threshold {LOGIT_CROSSED:g})",
              f"largest saturated fraction of any head (threshold {SATURATION_SEEN:g})", "train loss")
    units = (SIGMA_UNIT, LOGIT_UNIT, SATURATION_UNIT, f"train loss ({LOSS_UNIT})")
    for ax, title, thr, unit in zip(axes.flat, titles, (SIGMA_PRODUCT_CROSSED, LOGIT_CROSSED, SATURATION_SEEN, None),
                                    units):
        ax.set_title(title)
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(unit)
        if thr is not None:
            ax.axhline(thr, color="grey", lw=0.8, ls=":")
    for ax in axes[0]:
        if ax.get_lines():
            ax.set_yscale("log")
    fig.suptitle("The published algorithm over a long run (colour and marker: strategy; line style: Muon lr "
                 "multiplier; ✕: diverged)")
    return _savefig(fig, path, rect=_legend_below(fig, axes[0, 0]))


def long_section(runs: Sequence[RunData], out: Path) -> str:
    """The instability at length: per run the step each link of σ → logits → saturation → divergence first crossed
    its threshold, whether divergence followed saturation, the verdict and the time courses."""
    records = [long_record(r) for r in tagged(runs, ("strategy", "lr"), "the long runs")]
    if not records:
        return "### The instability at length\n\nNo run with usable tags (strategy, lr); see the end of the report."
    records.sort(key=lambda r: (r["strategy"], float(r["mult"] or 0)))
    rows = []
    for r in records:
        rows.append([md_code(r["run"].name), md_text(r["strategy"]), f"{float(r['lr']):g} ({_times(r['mult'])})",
                     md_text(r["msign"]), r["steps"] if r["steps"] is not None else "—", fmt(r["val"], 4),
                     f"{fmt(r['sigma'][0])} → {fmt(r['sigma'][1])}", r["sigma_at"] or "never",
                     f"{fmt(r['logit'][0])} → {fmt(r['logit'][1])}", r["logit_at"] or "never",
                     fmt(r["sat"]), r["sat_at"] or "never",
                     r["diverged"] if r["diverged"] is not None else "no", md_text(r["follows"])])
    msigns = sorted({r["msign"] for r in records})
    arith = ("the dual ascent's msign in " + ", ".join(msigns) +
             (" — not the published bfloat16, which `paper_msign_dtype` selects; the Stiefel retraction keeps the "
              "published bfloat16 msign" if msigns != ["bfloat16"] else ", as published"))
    lines = ["### The instability at length (the published algorithm)", "",
             f"The published algorithm (`optim.preset = \"paper\"`; {arith}) on each strategy at the Muon learning "
             "rates shown, every other setting shared. Per run: σQ·σK = σ_max(W_Q)·σ_max(W_K) (max over layers, "
             "first → largest) and the step it first exceeded "
             f"{SIGMA_PRODUCT_CROSSED:g}; logit max (first → largest) and the step it first exceeded "
             f"{LOGIT_CROSSED:g}; the largest saturated fraction of any head's softmax rows and the step it first "
             f"exceeded {SATURATION_SEEN:g}; the divergence step (the trainer's rule: NaN/Inf, or the smoothed "
             "train loss above `train.diverge_factor` × its best) and whether it came after saturation.", "",
             md_table(["run", "strategy", "Muon lr", "dual-ascent msign", "steps", "final val loss", "σQ·σK",
                       f"σQ·σK > {SIGMA_PRODUCT_CROSSED:g} at", "logit max", f"logit > {LOGIT_CROSSED:g} at",
                       "head saturation (max)", f"saturation > {SATURATION_SEEN:g} at", "diverged at",
                       "divergence after saturation?"], rows), "", *long_verdict(records), "",
             *constant_lr_lines(records)]
    lines += image_lines(plot_long(records, out / "manifolds_long.png"), "long-run time courses")
    lines += image_lines(plot_heads(runs, out / "manifolds_long_heads.png"), "per-head statistics")
    lines += ["", *scale_lines(records)]
    return "\n".join(lines)
