"""Report section for the magnitude–direction LR sweep (the MD paper): LR transfer (with every optimum at a grid edge
flagged), warmup, the gains' LR, the paper's ablations (one table per axis, with a verdict per claim), loss vs
compute."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from weightgeom.experiments.report.common import (
    LINESTYLES,
    RunData,
    _clip_ylim,
    _colors,
    _plt,
    _savefig,
    final_value,
    fmt,
    fmt_stats,
    image_lines,
    loss_series,
    md_table,
    run_file,
    tagged,
)
from weightgeom.experiments.report.inputs import META, md_code, md_text, plot_text


# -------------------------------------------------------------------------------------------------------- md
def _tag(run: RunData, key: str, default: Any = None) -> Any:
    return run.tags.get(key, default)


WARMUP_MARGIN = 0.01
"""Val-loss difference (nats) within which warmup and no warmup count as no difference."""


def lr_table(lr_runs: Sequence[RunData]) -> dict[tuple[str, int, float], list[float]]:
    """(optimizer, width, lr) -> final val loss of each seed (inf for a diverged run) of the LR-sweep runs."""
    table: dict[tuple[str, int, float], list[float]] = {}
    for r in lr_runs:
        opt, width, lr = _tag(r, "optimizer", r.experiment.get("group", "?")), _tag(r, "width"), _tag(r, "lr")
        if width is None or lr is None:
            continue
        x = float("inf") if r.diverged else final_value(loss_series(r, "val"))
        table.setdefault((str(opt), int(width), float(lr)), []).append(x)
    return table


def optimal_lrs(table: dict[tuple[str, int, float], list[float]]) -> dict[tuple[str, int], tuple[float, float]]:
    """(optimizer, width) -> (optimal LR, mean final val loss there); a point with a diverged seed counts as inf."""
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for (o, w, lr), xs in table.items():
        xs_f = [x for x in xs if math.isfinite(x)]
        m = float(np.mean(xs_f)) if xs_f and len(xs_f) == len(xs) else float("inf")
        if (o, w) not in best or m < best[(o, w)][1]:
            best[(o, w)] = (lr, m)
    return best


def warmup_points(wu_runs: Sequence[RunData], lr_runs: Sequence[RunData]
                  ) -> dict[tuple[str, Any, Any], dict[str, list[RunData]]]:
    """(optimizer, width, lr) of each warmup run -> {"warm": its runs, "cold": the LR-sweep runs at that point}."""
    keyed: dict[tuple[str, Any, Any], dict[str, list[RunData]]] = {}
    for r in wu_runs:
        k = (str(_tag(r, "optimizer", "?")), _tag(r, "width"), _tag(r, "lr"))
        keyed.setdefault(k, {"warm": [], "cold": []})["warm"].append(r)
    for r in lr_runs:
        k = (str(_tag(r, "optimizer", "?")), _tag(r, "width"), _tag(r, "lr"))
        if k in keyed:
            keyed[k]["cold"].append(r)
    return keyed


def warmup_difference(point: dict[str, list[RunData]]) -> float:
    """Mean final val loss with warmup minus without (nats; NaN when either side has no finished run)."""
    cold = [final_value(loss_series(r, "val")) for r in point["cold"] if not r.diverged]
    warm = [final_value(loss_series(r, "val")) for r in point["warm"] if not r.diverged]
    return float(np.mean(warm) - np.mean(cold)) if cold and warm else float("nan")


def md_section(runs: Sequence[RunData], out: Path) -> str:
    """Markdown for the magnitude–direction experiment (the MD paper), writing plots into ``out``."""
    lines = ["## Magnitude–direction decoupling (the MD paper, arXiv:2606.25971)", ""]
    runs = tagged(runs, ("optimizer", "width", "lr"), "the MD tables")
    lr_runs = [r for r in runs if _tag(r, "kind", "lr") == "lr"]
    wu_runs = [r for r in runs if _tag(r, "kind") == "warmup"]
    table = lr_table(lr_runs)
    if table:
        opts = sorted({k[0] for k in table})
        widths = sorted({k[1] for k in table})
        best = optimal_lrs(table)
        rows = []
        for o in opts:
            for w in widths:
                if (o, w) not in best:
                    continue
                lr, m = best[(o, w)]
                grid = sorted(lr_ for (o2, w2, lr_) in table if o2 == o and w2 == w)
                edge = " (grid edge)" if lr in (grid[0], grid[-1]) and len(grid) > 1 else ""
                rows.append([md_text(o), w, f"{lr:g}{edge}", fmt(m, 4), len(grid)])
        lines.append("### LR sweep: optimal LR per width")
        lines.append("")
        lines.append(md_table(["optimizer", "width", "optimal LR", "final val loss at optimum", "LRs tried"], rows))
        lines.append("")
        lines.append(edge_line(grid_edge_optima(best, table)))
        lines.append("")
        lines.append(transfer_verdict(best, table))
        lines.append("")
        lines += image_lines(plot_lr_sweep(table, out / "md_lr_sweep.png"), "loss vs LR")
        lines += image_lines(plot_optimal_lr(best, out / "md_optimal_lr.png"), "optimal LR vs width")
    if wu_runs:
        rows = []
        keyed = warmup_points(wu_runs, lr_runs)

        def cell(rs: list[RunData]) -> str:
            if not rs:
                return "—"
            fin = [final_value(loss_series(r, "val")) for r in rs if not r.diverged]
            nd = sum(r.diverged for r in rs)
            return fmt_stats(fin) + (f" ({nd}/{len(rs)} diverged)" if nd else "")

        for (o, w, lr), d in sorted(keyed.items(), key=lambda kv: str(kv[0])):
            wu = _tag(d["warm"][0], "warmup")
            diff = warmup_difference(d)
            verdict = "—" if not math.isfinite(diff) else ("warmup helps" if diff < -WARMUP_MARGIN else (
                "warmup hurts" if diff > WARMUP_MARGIN else f"no difference (±{WARMUP_MARGIN:g})"))
            rows.append([md_text(o), w, f"{lr:g}", cell(d["cold"]), wu, cell(d["warm"]), fmt(diff, 4), verdict])
        lines.append("### Warmup vs no warmup")
        lines.append("")
        lines.append("Middle width, centre LR of each optimizer's grid; the no-warmup column is the LR-sweep run at "
                     "that point. The paper: MD makes warmup unnecessary.")
        lines.append("")
        lines.append(md_table(["optimizer", "width", "lr", "final val loss, no warmup", "warmup steps",
                               "final val loss, warmup", "Δ (warmup − none)", "verdict"], rows))
        lines.append("")
    lines += gain_lr_lines(runs, lr_runs)
    lines += ablation_lines(runs, lr_runs, out)
    p = plot_loss_vs_compute(runs, out / "md_loss_vs_compute.png")
    if p:
        lines.append("### Loss vs compute")
        lines.append("")
        lines.append("Compute = 6 · N · tokens (N = model parameters; tokens = steps × batch × block), largest width, "
                     "each optimizer at its best LR.")
        lines.append("")
        lines.append(f"![loss vs compute]({p.name})")
        lines.append("")
    return "\n".join(lines)


def grid_edge_optima(best: dict[tuple[str, int], tuple[float, float]],
                     table: dict[tuple[str, int, float], list[float]]) -> list[tuple[str, int, float, str]]:
    """(optimizer, width, optimal LR, "lowest" | "highest") for every optimum at an end of its LR grid (grids of two
    or more LRs; an optimizer whose every LR diverged is left out)."""
    out = []
    for (o, w), (lr, m) in sorted(best.items()):
        grid = sorted(lr_ for (o2, w2, lr_) in table if o2 == o and w2 == w)
        if len(grid) < 2 or not math.isfinite(m):
            continue
        if lr == grid[0]:
            out.append((o, w, lr, "lowest"))
        elif lr == grid[-1]:
            out.append((o, w, lr, "highest"))
    return out


def edge_line(edges: Sequence[tuple[str, int, float, str]]) -> str:
    """One paragraph: no optimum at a grid edge, or which ones are (the grid should then be extended that way)."""
    if not edges:
        return "No optimum sits at an edge of its LR grid."
    items = "; ".join(f"{md_text(o)} width {w}: {lr:g} (the {side} LR tried)" for o, w, lr, side in edges)
    return (f"**{len(edges)} optimum/optima at a grid edge** — the true optimum may lie outside the grid, so the "
            f"transfer verdict for these optimizers is uncertain: {items}.")


def _final_loss(rs: Sequence[RunData]) -> float:
    """Mean final val loss over runs (inf if any diverged, NaN if none)."""
    if not rs:
        return float("nan")
    if any(r.diverged for r in rs):
        return float("inf")
    xs = [final_value(loss_series(r, "val")) for r in rs]
    xs = [x for x in xs if math.isfinite(x)]
    return float(np.mean(xs)) if xs else float("nan")


def _point_runs(lr_runs: Sequence[RunData], opt: str, width: Any, lr: Any) -> list[RunData]:
    return [r for r in lr_runs if (str(_tag(r, "optimizer")), _tag(r, "width"), _tag(r, "lr")) == (opt, width, lr)]


def _base_setting(runs: Sequence[RunData], key: str, default: Any) -> Any:
    """``optim.md.<key>`` of the LR-sweep runs (their resolved config)."""
    for r in runs:
        v = ((r.config.get("optim") or {}).get("md") or {}).get(key)
        if v is not None:
            return v
    return default


def gain_lr_lines(runs: Sequence[RunData], lr_runs: Sequence[RunData]) -> list[str]:
    """Table: final val loss per gain LR for each MD optimizer at its ablation point (best marked, edge flagged)."""
    glr = tagged([r for r in runs if _tag(r, "kind") == "gain_lr"], ("gain_lr",), "the gain-LR table")
    if not glr:
        return []
    rows = []
    points = sorted({(str(_tag(r, "optimizer")), _tag(r, "width"), _tag(r, "lr")) for r in glr}, key=str)
    for o, w, lr in points:
        base = _point_runs(lr_runs, o, w, lr)
        vals: dict[float, float] = {}
        for r in glr:
            if (str(_tag(r, "optimizer")), _tag(r, "width"), _tag(r, "lr")) == (o, w, lr):
                vals.setdefault(float(_tag(r, "gain_lr")), float("nan"))
        for g in list(vals):
            vals[g] = _final_loss([r for r in glr if (str(_tag(r, "optimizer")), _tag(r, "width"), _tag(r, "lr"),
                                                      float(_tag(r, "gain_lr"))) == (o, w, lr, g)])
        if base:
            vals[float(_base_setting(base, "gain_lr", 1e-3))] = _final_loss(base)
        finite = {g: v for g, v in vals.items() if math.isfinite(v)}
        grid = sorted(vals)
        bg = min(finite, key=finite.get) if finite else None
        cells = []
        for g in grid:
            mark = " **best**" if g == bg else ""
            cells.append(f"{g:g}: {fmt(vals[g], 4)}{mark}")
        edge = "—" if bg is None else ("at the grid edge" if bg in (grid[0], grid[-1]) and len(grid) > 1
                                       else "inside the grid")
        spread = (max(finite.values()) - min(finite.values())) if len(finite) > 1 else float("nan")
        rows.append([md_text(o), w, f"{lr:g}", "; ".join(cells), edge, fmt(spread, 4)])
    return ["### Gain learning rate (`optim.md.gain_lr`)", "",
            "Each MD optimizer at the middle width and centre LR of its grid; final val loss per gain LR (the run at "
            "the base config's gain LR is the LR-sweep run).", "",
            md_table(["optimizer", "width", "lr", "final val loss by gain LR", "best gain LR", "max − min"], rows), ""]


# the MD paper's ablation claims: axis -> (paper's preferred value, the claim, kind of test)
ABLATION_CLAIMS = {
    "gains": ("row+col", "row+col gains beat scalar and single-axis gains", "best"),
    "parameterization": ("softplus", "softplus is slightly more consistent than exp or direct gains", "best"),
    "sphere": ("frobenius", "the Frobenius sphere is about as good as row / col spheres (within 0.02)", "tie"),
    "embeddings": ("unit_rows", "unit-L2-norm embeddings are slightly better than unconstrained ones", "best"),
}
ABLATION_DEFAULTS = {"gains": "row+col", "parameterization": "softplus", "sphere": "frobenius",
                     "embeddings": "exclude"}
TIE = 0.02
"""Val-loss difference (nats) within which the sphere claim ("about as good") counts as reproduced."""
MARGIN = 0.005
"""Val-loss difference (nats) below which a "better" claim counts as no difference (not reproduced)."""


def ablation_verdict(axis: str, vals: dict[str, float]) -> str:
    """reproduced / not reproduced / reversed for one axis's claim from {value: final val loss}."""
    pref, _, how = ABLATION_CLAIMS[axis]
    finite = {k: v for k, v in vals.items() if math.isfinite(v)}
    if pref not in finite or len(finite) < 2:
        return "—"
    others = [v for k, v in finite.items() if k != pref]
    if how == "tie":
        gap = max(abs(finite[pref] - v) for v in others)
        return "reproduced" if gap <= TIE else ("reversed" if finite[pref] > max(others) else "not reproduced")
    d = finite[pref] - min(others)
    if d < -MARGIN:
        return "reproduced"
    if abs(d) <= MARGIN:
        return "not reproduced (no difference)"
    return "reversed" if finite[pref] >= max(others) else "not reproduced"


def ablation_data(abl: Sequence[RunData], lr_runs: Sequence[RunData]) -> dict[str, dict[str, dict[str, float]]]:
    """axis -> MD optimizer -> {setting: mean final val loss} of the ablation runs (``kind = ablation``, tagged with
    ``axis`` and ``value``); the default setting's value is the LR-sweep run at the same point."""
    axes = [a for a in ABLATION_CLAIMS if any(_tag(r, "axis") == a for r in abl)]
    opts = sorted({str(_tag(r, "optimizer")) for r in abl})
    data: dict[str, dict[str, dict[str, float]]] = {}
    for axis in axes:
        default = ABLATION_DEFAULTS[axis]
        values = [default] + sorted({str(_tag(r, "value")) for r in abl if _tag(r, "axis") == axis})
        per_opt: dict[str, dict[str, float]] = {}
        for o in opts:
            mine = [r for r in abl if _tag(r, "axis") == axis and str(_tag(r, "optimizer")) == o]
            if not mine:
                continue
            w, lr = _tag(mine[0], "width"), _tag(mine[0], "lr")
            vals = {default: _final_loss(_point_runs(lr_runs, o, w, lr))}
            for v in values[1:]:
                vals[v] = _final_loss([r for r in mine if str(_tag(r, "value")) == v])
            per_opt[o] = vals
        data[axis] = per_opt
    return data


def ablation_lines(runs: Sequence[RunData], lr_runs: Sequence[RunData], out: Path) -> list[str]:
    """One table per ablation axis (rows: settings, columns: MD optimizers; the default is the LR-sweep run at the
    same point), a verdict per claim, and a bar plot."""
    abl = tagged([r for r in runs if _tag(r, "kind") == "ablation"], ("axis", "value"), "the ablation tables")
    if not abl:
        return []
    lines = ["### The MD paper's ablations", "",
             "One setting of `[optim.md]` changed at a time, each MD optimizer at the middle width and centre LR of "
             "its grid (the default row is the LR-sweep run there). Final val loss; Δ = setting − default. A "
             f"'better' claim is reproduced when the paper's choice beats every other setting by more than {MARGIN} "
             f"nats and reversed when it is the worst; the sphere claim is reproduced when all settings lie within "
             f"{TIE} nats.", ""]
    data = ablation_data(abl, lr_runs)
    for axis, per_opt in data.items():
        default = ABLATION_DEFAULTS[axis]
        values = list(dict.fromkeys(v for vals in per_opt.values() for v in vals)) or [default]
        rows = []
        for v in values:
            cells = []
            for o in per_opt:
                x, d = per_opt[o].get(v, float("nan")), per_opt[o].get(default, float("nan"))
                delta = "" if v == default or not (math.isfinite(x) and math.isfinite(d)) else f" (Δ {x - d:+.4f})"
                cells.append(("diverged" if x == float("inf") else fmt(x, 4)) + delta)
            rows.append([md_code(v) + (" (default)" if v == default else "")] + cells)
        pref, claim, _ = ABLATION_CLAIMS[axis]
        verdicts = ", ".join(f"{md_text(o)}: **{ablation_verdict(axis, per_opt[o])}**" for o in per_opt)
        lines += [f"#### `optim.md.{axis}`", "", md_table([axis] + [md_text(o) for o in per_opt], rows), "",
                  f"The paper: {claim} — {verdicts}.", ""]
    lines += image_lines(plot_ablations(data, out / "md_ablations.png"), "MD ablations")
    return lines


def plot_ablations(data: dict[str, dict[str, dict[str, float]]], path: Path) -> Path | None:
    """One panel per ablation axis: final val loss per setting, one bar colour per MD optimizer."""
    if not data:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(data), figsize=(4.5 * len(data), 4.2), squeeze=False)
    finite = [v for per in data.values() for vals in per.values() for v in vals.values() if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    pad = max(0.02, 0.15 * (hi - lo))
    for ax, (axis, per) in zip(axes[0], data.items()):
        opts = list(per)
        values = list(dict.fromkeys(v for vals in per.values() for v in vals))
        x = np.arange(len(values))
        wbar = 0.8 / max(1, len(opts))
        for i, (o, c) in enumerate(zip(opts, _colors(len(opts)))):
            ys = [per[o].get(v, float("nan")) for v in values]
            ys = [y if math.isfinite(y) else np.nan for y in ys]
            ax.bar(x + (i - (len(opts) - 1) / 2) * wbar, ys, wbar, color=c, label=plot_text(o))
        ax.set_xticks(x, [plot_text(v, 30) for v in values], rotation=20)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(f"optim.md.{axis}")
    axes[0][0].set_ylabel("final val loss (missing bar: diverged)")
    axes[0][0].legend()
    fig.suptitle("MD ablations (default = first bar group)")
    return _savefig(fig, path)


def transfer_verdict(best: dict[tuple[str, int], tuple[float, float]], table) -> str:
    """Does the optimal LR stay put across widths? Measured in grid steps per optimizer."""
    out = ["**Does the optimal LR transfer across width?** (spread of the optimal LR over widths, in grid steps)", ""]
    for o in sorted({k[0] for k in best}):
        ws = sorted(w for (o2, w) in best if o2 == o)
        if len(ws) < 2:
            continue
        grid = sorted({lr for (o2, _, lr) in table if o2 == o})
        idx = [grid.index(best[(o, w)][0]) for w in ws if math.isfinite(best[(o, w)][1])]
        if not idx:
            out.append(f"- {md_text(o)}: every LR diverged")
            continue
        spread = max(idx) - min(idx)
        lrs = ", ".join(f"{w}: {best[(o, w)][0]:g}" for w in ws)
        verdict = "transfers" if spread <= 1 else "does **not** transfer"
        out.append(f"- {md_text(o)}: optimal LR by width {lrs} → spread {spread} grid step(s): {verdict}")
    return "\n".join(out)


def plot_lr_sweep(table, path: Path) -> Path | None:
    """Final val loss vs LR, one panel per optimizer, one line per width (diverged: ✕ at the top)."""
    plt = _plt()
    opts = sorted({k[0] for k in table})
    widths = sorted({k[1] for k in table})
    ncols = min(2, len(opts))
    nrows = math.ceil(len(opts) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 4.5 * nrows), squeeze=False, sharey=True)
    for ax in axes.flat[len(opts):]:
        ax.set_visible(False)
    axes = np.array([list(axes.flat[:len(opts)])])
    finite_all = [x for xs in table.values() for x in xs if math.isfinite(x)]
    top = (max(finite_all) if finite_all else 1.0) * 1.02
    for ax, o in zip(axes[0], opts):
        for w, c in zip(widths, _colors(len(widths))):
            pts = sorted((lr, xs) for (o2, w2, lr), xs in table.items() if o2 == o and w2 == w)
            if not pts:
                continue
            lrs = [p[0] for p in pts]
            ys = [np.mean(p[1]) if all(map(math.isfinite, p[1])) else np.nan for p in pts]
            ax.plot(lrs, ys, "o-", color=c, label=f"width {w}")
            for lr, y in zip(lrs, ys):
                if not math.isfinite(y):
                    ax.plot([lr], [top], "x", color=c, ms=10, mew=2)
        ax.set_xscale("log")
        grid = sorted({lr for (o2, _, lr) in table if o2 == o})
        ax.set_xticks(grid, [f"{lr:g}" for lr in grid])
        ax.minorticks_off()
        ax.set_title(plot_text(o))
        ax.set_xlabel("learning rate")
    axes[0][0].set_ylabel("final val loss (✕: diverged)")
    axes[0][0].legend()
    fig.suptitle("LR sweep")
    return _savefig(fig, path)


def plot_optimal_lr(best, path: Path) -> Path | None:
    """Optimal LR vs width per optimizer (log–log)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    opts = sorted({k[0] for k in best})
    for o, c in zip(opts, _colors(len(opts))):
        ws = sorted(w for (o2, w) in best if o2 == o and math.isfinite(best[(o2, w)][1]))
        if ws:
            ax.plot(ws, [best[(o, w)][0] for w in ws], "o-", color=c, label=plot_text(o), lw=2, ms=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("width")
    ax.set_ylabel("optimal LR")
    ax.set_title("Optimal LR vs width (flat line = LR transfers)")
    ax.legend()
    return _savefig(fig, path)


def _num_params(run: RunData) -> float:
    for src in (run.experiment.get("final", {}), run_file(run, "meta.json", META) or {}):
        for k in ("num_params", "n_params", "params"):
            if k in src:
                return float(src[k])
    return float("nan")


def plot_loss_vs_compute(runs: Sequence[RunData], path: Path) -> Path | None:
    """Val loss vs 6·N·tokens for the best-LR run of each optimizer at the largest width."""
    lr_runs = [r for r in runs if _tag(r, "kind", "lr") == "lr" and _tag(r, "width") is not None and not r.diverged]
    if not lr_runs:
        return None
    wmax = max(int(_tag(r, "width")) for r in lr_runs)
    best: dict[str, RunData] = {}
    for r in lr_runs:
        if int(_tag(r, "width")) != wmax:
            continue
        o = str(_tag(r, "optimizer", "?"))
        v = final_value(loss_series(r, "val"))
        if math.isfinite(v) and (o not in best or v < final_value(loss_series(best[o], "val"))):
            best[o] = r
    if not best:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    xlabel = "compute 6·N·tokens (FLOPs)"
    for (o, r), c in zip(sorted(best.items()), _colors(len(best))):
        s = loss_series(r, "val")
        s = s[s.index > 0]
        d = r.config.get("data", {})
        tok = float(d.get("batch_size", 1)) * float(d.get("block_size", 1))
        n = _num_params(r)
        if not math.isfinite(n):
            n = 1.0
            xlabel = "tokens seen (N unknown)"
        ax.plot(s.index.to_numpy() * tok * 6 * n, s.values, marker="o", color=c, lw=2, ms=4,
                label=f"{plot_text(o)} (lr {_tag(r, 'lr'):g})", ls=LINESTYLES[len(ax.get_lines()) % len(LINESTYLES)])
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("val loss")
    ax.set_title(f"Loss vs compute (width {wmax})")
    ax.legend()
    _clip_ylim(ax)
    return _savefig(fig, path)
