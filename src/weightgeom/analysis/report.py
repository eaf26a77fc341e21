"""Analysis outputs: a summary table for the screen, CSV/JSON files and PNG plots.

Files written by :func:`write_report` into ``out_dir``:
    ``pairs.csv`` (one row per (role, layer pair)), ``layers.csv`` (one row per (role, layer)), ``summary.csv``
    (per-role means with random levels), ``analysis.json`` (all of it plus metadata), ``continuity.png`` (each metric
    across depth, one line per role, dashed = random level), ``v1_heatmap.png`` / ``u1_heatmap.png``
    (|cos(x1_i, x1_j)| for all layer pairs, one panel per role).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from weightgeom._files import write_atomic
from weightgeom.analysis.api import SHARE_SPACE, AnalysisResult
from weightgeom.analysis.continuity import random_level_cos

__all__ = ["summary_table", "format_summary", "format_reading", "CONTINUOUS_RATIO", "WEAK_RATIO", "ALPHA_RANGES",
           "write_report", "plot_continuity", "plot_heatmaps", "shared_basis_runs",
           "format_suggestions", "format_legend"]

_LABELS = {
    "cv": "C_v = |cos(v1_l, v1_l+1)| (input space)",
    "cu": "C_u = |cos(u1_l, u1_l+1)| (output space)",
    "gram_in": "Gram alignment, input space (σ²-weighted)",
    "gram_out": "Gram alignment, output space (σ²-weighted)",
    "idx_in": "index-matched alignment, input space",
    "idx_out": "index-matched alignment, output space",
    "share_k1": "energy of W_l+1 in layer l's top-1 basis (role's space)",
    "share_k8": "energy of W_l+1 in layer l's top-8 basis (role's space)",
    "share_k64": "energy of W_l+1 in layer l's top-64 basis (role's space)",
}


def _metric_cols(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if f"{c}_rand" in df.columns]


def summary_table(pairs: pd.DataFrame) -> pd.DataFrame:
    """Per-role mean of every metric over its layer pairs, with the mean random level beside it (``*_rand``)."""
    if pairs.empty:
        return pd.DataFrame()
    cols = []
    for c in _metric_cols(pairs):
        cols += [c, f"{c}_rand"]
    extra = [c for c in ("dominance",) if c in pairs.columns]
    g = pairs.groupby("role", sort=False)
    out = g[cols + extra].mean()
    out.insert(0, "pairs", g.size())
    return out


def format_summary(result: AnalysisResult, digits: int = 3) -> str:
    """The screen table: per role, metric (random level) means over adjacent pairs, plus notes."""
    s = summary_table(result.pairs)
    lines = []
    if s.empty:
        lines.append("(no role had two or more layers of one shape: no adjacent pairs)")
    else:
        mets = [c for c in s.columns if c != "pairs" and not c.endswith("_rand") and c != "dominance"]
        head = ["role", "pairs"] + mets + (["dominance"] if "dominance" in s.columns else [])
        rows = []
        for role, r in s.iterrows():
            row = [str(role), str(int(r["pairs"]))]
            for c in mets:
                row.append(f"{r[c]:.{digits}f} ({r[c + '_rand']:.{digits}f})")
            if "dominance" in s.columns:
                row.append(f"{r['dominance']:.{digits}f}")
            rows.append(row)
        w = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(head)]
        lines.append("  ".join(h.ljust(w[i]) for i, h in enumerate(head)))
        lines.append("  ".join("-" * x for x in w))
        lines += ["  ".join(x[i].ljust(w[i]) for i in range(len(head))) for x in rows]
        lines.append("mean over adjacent layer pairs; (random level) beside each metric")
    for n in result.meta.get("notes", []):
        lines.append(f"note: {n}")
    return "\n".join(lines)


CONTINUOUS_RATIO = 2.0
"""A role's space reads as *continuous* when its mean top-vector alignment (C_v input space, C_u output space) is at
least this many times its random level; below ``WEAK_RATIO`` it reads as at the random level."""
WEAK_RATIO = 1.25
ALPHA_RANGES = ((0.0, 2.0, "very heavy-tailed (below 2: strongly correlated, possibly over-fit)"),
                (2.0, 6.0, "in the 2–6 range of well-trained layers"),
                (6.0, math.inf, "light-tailed (above 6: close to random, little learned)"))
"""The usual reading of the power-law exponent α of a layer's eigenvalue spectrum, as WeightWatcher users know it
(Martin & Mahoney: 2 ≤ α ≤ 6 for well-trained layers)."""


def _alpha_reading(alpha: float) -> str:
    return next(text for lo, hi, text in ALPHA_RANGES if lo <= alpha < hi)


def space_ratios(cv: float, cv_rand: float, cu: float, cu_rand: float) -> dict[str, float]:
    """C_v and C_u as multiples of their random levels: ``{"input": C_v/rand, "output": C_u/rand}`` — the rule by
    which the plain-words reading (:func:`format_reading`) and ``compress --share auto`` pick a role's space."""
    return {"input": cv / cv_rand if cv_rand > 0 else math.nan, "output": cu / cu_rand if cu_rand > 0 else math.nan}


def format_reading(result: AnalysisResult) -> str:
    """The analysis in plain words, per role: which space (input: C_v, output: C_u) is continuous and how far above
    its random level (``CONTINUOUS_RATIO``), and, when the spectra were computed (``--spectra``), the range of α over
    the role's layers with its usual reading (``ALPHA_RANGES``)."""
    s = summary_table(result.pairs)
    lines = ["In plain words:"]
    if not s.empty and {"cv", "cu"} <= set(s.columns):
        for role, r in s.iterrows():
            ratios = space_ratios(float(r["cv"]), float(r["cv_rand"]), float(r["cu"]), float(r["cu_rand"]))
            best = max(ratios, key=lambda k: ratios[k] if math.isfinite(ratios[k]) else -1.0)
            value = r["cv"] if best == "input" else r["cu"]
            name = "C_v" if best == "input" else "C_u"
            if ratios[best] >= CONTINUOUS_RATIO:
                what = (f"continuous in its {best} space ({name} {value:.3f}, {ratios[best]:.1f}× the random level"
                        f" {r['cv_rand' if best == 'input' else 'cu_rand']:.3f})")
            elif ratios[best] >= WEAK_RATIO:
                what = f"weakly continuous in its {best} space ({name} {value:.3f}, {ratios[best]:.1f}× random)"
            else:
                what = (f"not continuous: both spaces at the random level (C_v {ratios['input']:.1f}×, C_u "
                        f"{ratios['output']:.1f}× random)")
            expected = SHARE_SPACE.get(str(role))
            if expected and ratios[best] >= WEAK_RATIO and expected != best and str(role) != "V":
                what += f"; the continuity paper expects the {expected} space for {role}"
            lines.append(f"  {role}: {what}.")
    else:
        lines.append("  no role had two adjacent layers of one shape: nothing to say about continuity.")
    layers = result.layers
    if not layers.empty and "alpha" in layers.columns and layers["alpha"].notna().any():
        lines.append("  α (power-law exponent of each layer's eigenvalue spectrum):")
        for role, g in layers.groupby("role", sort=False):
            a = g["alpha"].dropna()
            if a.empty:
                continue
            lo, hi = float(a.min()), float(a.max())
            counts = [(sum(_alpha_reading(x) == text for x in a), text) for _, _, text in ALPHA_RANGES]
            reading = ", ".join(f"{c} {text}" for c, text in counts if c) if len([c for c, _ in counts if c]) > 1 \
                else ("all " if len(a) > 1 else "") + next(text for c, text in counts if c)
            span = f"{lo:.2f}" if hi - lo < 5e-3 else f"{lo:.2f}–{hi:.2f}"
            lines.append(f"    {role}: {span} over {len(a)} layer{'s' if len(a) != 1 else ''} — {reading}.")
    elif not layers.empty:
        lines.append("  α per layer (heavy-tailed spectra, as WeightWatcher reads them): run with --spectra.")
    return "\n".join(lines)


def format_legend(result: AnalysisResult, suggest: bool = False) -> str:
    """"How to read this": what C_v, C_u, the random levels and the Gram columns mean, with this model's dimensions.

    One text for ``weightgeom analyze`` (printed last) and ``examples/analyze_checkpoint.py``.

    Args:
        result: the analysis; the random levels are given for the dimensions of its analysed matrices
            (``layers``' ``in_dim`` / ``out_dim``; at most four, smallest first).
        suggest: also explain the ``--suggest`` table.

    Returns:
        The lines, joined with newlines (no trailing newline).
    """
    layers = result.layers
    dims: list[int] = []
    if not layers.empty and {"in_dim", "out_dim"} <= set(layers.columns):
        # an empty matrix (a dimension of 0) has no random level: it is left out, never divided by
        dims = sorted({int(d) for d in pd.concat([layers["in_dim"], layers["out_dim"]]).dropna() if int(d) > 0})
    levels = ", ".join(f"{random_level_cos(d):.3f} for d = {d}" for d in dims[:4]) or "sqrt(2/(π d))"
    more = f" (and {len(dims) - 4} more dimensions)" if len(dims) > 4 else ""
    lines = [
        "How to read this:",
        "  C_v = |cos(v1_l, v1_l+1)|: do adjacent layers amplify the same input direction? C_u: the same output one.",
        "  (x.xxx) beside a value is its random level sqrt(2/(π d)), d the dimension of that space:",
        f"  {levels}{more}.",
        f"  Near it: no more alike than chance; {CONTINUOUS_RATIO:g}x it or more: continuous "
        f"({WEAK_RATIO:g}x-{CONTINUOUS_RATIO:g}x: weakly).",
        "  gram_in / gram_out compare the whole σ²-weighted spectra (Gram matrices), not only the top vector.",
    ]
    if suggest:
        lines += [
            "  --suggest: layer runs where layer l's top-8 singular basis keeps >= 50% of W_l+1's energy, i.e. where",
            "  one shared low-rank basis would lose least; 'none' means sharing a basis is not advised for this model.",
        ]
    return "\n".join(lines)


def shared_basis_runs(pairs: pd.DataFrame, k: int = 8, min_share: float = 0.5) -> pd.DataFrame:
    """Layer runs where a shared rank-k basis would lose least (from ``analyze_full(..., suggest=True)``).

    A pair (l, l+1) qualifies when layer l's top-k basis in the role's space captures at least ``min_share`` of
    W_{l+1}'s energy (``share_k{k}``); a run is a maximal chain of qualifying adjacent pairs. Rows: role, space,
    first and last layer, pairs, mean / min captured energy and its random level k/d, and ``advised`` (False for V,
    which shares neither space in the continuity paper). Sorted by role, then mean captured energy (best first).
    """
    col = f"share_k{k}"
    columns = ["role", "space", "first_layer", "last_layer", "pairs", f"mean_{col}", f"min_{col}", f"{col}_rand",
               "advised"]
    if pairs.empty or col not in pairs.columns:
        return pd.DataFrame(columns=columns)
    rows = []
    for role, d in pairs.groupby("role", sort=False):
        run: list = []
        for r in list(d.itertuples()) + [None]:
            ok = r is not None and getattr(r, col) >= min_share
            if ok and run and run[-1].layer_next == r.layer:
                run.append(r)
                continue
            if run:
                vals = [getattr(x, col) for x in run]
                rows.append({"role": role, "space": SHARE_SPACE.get(role, "input"), "first_layer": run[0].layer,
                             "last_layer": run[-1].layer_next, "pairs": len(run), f"mean_{col}": float(np.mean(vals)),
                             f"min_{col}": float(np.min(vals)), f"{col}_rand": float(getattr(run[0], col + "_rand")),
                             "advised": role != "V"})
            run = [r] if ok else []
    out = pd.DataFrame(rows, columns=columns)  # the header even with no row (suggest.csv stays a readable CSV)
    if out.empty:
        return out
    order = {r: i for i, r in enumerate(dict.fromkeys(pairs["role"]))}
    out["_o"] = out["role"].map(order)
    return out.sort_values(["_o", f"mean_{col}"], ascending=[True, False]).drop(columns="_o").reset_index(drop=True)


def format_suggestions(runs: pd.DataFrame, k: int = 8, min_share: float = 0.5, pairs: pd.DataFrame | None = None
                       ) -> str:
    """The screen text of :func:`shared_basis_runs`: one line per run, or why none qualified (with ``pairs``, the
    best pair's share)."""
    head = (f"shared-basis runs (layer l's top-{k} basis keeps ≥ {min_share:.0%} of W_l+1's energy in the role's "
            "space):")
    if runs.empty:
        return head + "\n  none: " + _why_no_run(pairs, k, min_share)
    col = f"share_k{k}"
    lines = [head]
    for r in runs.itertuples():
        adv = "" if r.advised else "  (V: sharing not advised)"
        lines.append(f"  {r.role:5s} {r.space:6s} layers {r.first_layer}-{r.last_layer} ({r.pairs} pairs): keeps "
                     f"{getattr(r, 'mean_' + col):.3f} mean, {getattr(r, 'min_' + col):.3f} min (random "
                     f"{getattr(r, col + '_rand'):.3f}){adv}")
    return "\n".join(lines)


def _why_no_run(pairs: pd.DataFrame | None, k: int, min_share: float) -> str:
    """Why :func:`shared_basis_runs` found no run: no comparable pair, or the best pair's share below the bound."""
    col = f"share_k{k}"
    if pairs is not None and (pairs.empty or col not in pairs.columns or pairs[col].isna().all()):
        return ("no two adjacent layers of one role and one shape were analysed (a single layer per role, or the "
                "others skipped), so there is no pair to compare")
    why = (f"no adjacent pair of same-role layers keeps {min_share:.0%} of the next layer's energy in layer l's "
           f"top-{k} basis")
    if pairs is not None:
        best = pairs.loc[pairs[col].idxmax()]
        why += (f"; the best, {best['role']} layers {best['layer']}-{best['layer_next']}, keeps {best[col]:.3f} "
                f"(random {best[col + '_rand']:.3f})")
    return why + f"; no shared basis is advised (pairs.csv has each pair's {col})"


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (np.floating, np.integer)):
        return _json_safe(x.item())
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def plot_continuity(pairs: pd.DataFrame, path: str | Path, title: str = "") -> Path | None:
    """One panel per metric: value vs layer for each role (solid) and its random level (dashed, same colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    mets = [c for c in _metric_cols(pairs) if not c.startswith(("grad_", "delta_"))]
    mets += [c for c in _metric_cols(pairs) if c.startswith(("grad_", "delta_"))]
    if pairs.empty or not mets:
        return None
    ncol = 2
    nrow = math.ceil(len(mets) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.4 * ncol, 3.6 * nrow), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    roles = list(dict.fromkeys(pairs["role"]))
    for ax, m in zip(axes.flat, mets):
        for i, role in enumerate(roles):
            d = pairs[pairs["role"] == role]
            c = colors[i % len(colors)]
            ax.plot(d["layer"], d[m], marker="o", ms=3, color=c, label=role)
            ax.plot(d["layer"], d[f"{m}_rand"], ls="--", lw=1, color=c, alpha=0.7)
        base = m.split("_", 1)[1] if m.startswith(("grad_", "delta_")) else m
        kind = "gradient " if m.startswith("grad_") else "update ΔW " if m.startswith("delta_") else ""
        ax.set_title(kind + _LABELS.get(base, base), fontsize=10)
        ax.set_xlabel("layer l (pair l, l+1)")
        ax.set_ylabel(m)
        ax.set_ylim(-0.02, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(mets):]:
        ax.axis("off")
    h, lab = axes.flat[0].get_legend_handles_labels()
    from matplotlib.lines import Line2D

    h.append(Line2D([], [], color="gray", ls="--"))
    lab.append("random level")
    fig.legend(h, lab, loc="upper right", ncol=min(len(lab), 9), fontsize=9)
    fig.suptitle(title or "Adjacent-layer continuity per projection role", x=0.01, y=0.995, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    write_atomic(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return Path(path)


def plot_heatmaps(mats: dict[str, np.ndarray], path: str | Path, which: str = "v1", title: str = "") -> Path | None:
    """Grid of |cos(x1_i, x1_j)| matrices (one panel per role), colour scale 0..1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mats = {k: v for k, v in mats.items() if v.shape[0] >= 2}
    if not mats:
        return None
    n = len(mats)
    ncol = min(4, n)
    nrow = math.ceil(n / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.6 * ncol + 0.8, 3.4 * nrow), squeeze=False)
    im = None
    for ax, (role, M) in zip(axes.flat, mats.items()):
        im = ax.imshow(M, vmin=0, vmax=1, cmap="viridis", origin="upper")
        ax.set_title(role)
        ax.set_xlabel("layer j")
        ax.set_ylabel("layer i")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    space = "input space" if which == "v1" else "output space"
    fig.suptitle(title or f"|cos({which}_i, {which}_j)| of top singular vectors, all layer pairs ({space})")
    fig.tight_layout(rect=(0, 0, 0.92, 0.94))
    cax = fig.add_axes((0.93, 0.15, 0.015, 0.7))
    fig.colorbar(im, cax=cax, label=f"|cos({which}_i, {which}_j)|")
    write_atomic(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return Path(path)


def write_report(result: AnalysisResult, out_dir: str | Path, plots: bool = True, title: str = "") -> list[Path]:
    """Write CSV, JSON and (optionally) PNG files for ``result`` into ``out_dir`` (created). Returns the paths.

    Each CSV/JSON file is written to a temporary name and renamed into place, so the files are always complete (the
    CLI rewrites them after every role; after an interrupt they hold the finished roles, and ``analysis.json``'s
    ``meta.roles_missing`` names the others).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    write_atomic(out / "pairs.csv", lambda p: result.pairs.to_csv(p, index=False))
    write_atomic(out / "layers.csv", lambda p: result.layers.to_csv(p, index=False))
    s = summary_table(result.pairs)
    write_atomic(out / "summary.csv", s.to_csv)
    paths += [out / "pairs.csv", out / "layers.csv", out / "summary.csv"]
    doc = {
        "meta": result.meta,
        "summary": s.reset_index().to_dict(orient="records") if not s.empty else [],
        "pairs": result.pairs.to_dict(orient="records"),
        "layers": result.layers.to_dict(orient="records"),
        "v1_cos": {k: v.tolist() for k, v in result.v1_cos.items()},
        "u1_cos": {k: v.tolist() for k, v in result.u1_cos.items()},
    }
    text = json.dumps(_json_safe(doc), indent=1)
    write_atomic(out / "analysis.json", text)
    paths.append(out / "analysis.json")
    share = [c for c in result.pairs.columns if c.startswith("share_k")]
    if share or result.meta.get("suggest"):  # asked for: the header row even when no pair could be compared
        runs = shared_basis_runs(result.pairs)
        write_atomic(out / "suggest.csv", lambda p: runs.to_csv(p, index=False))
        paths.append(out / "suggest.csv")
        if plots and share:
            sp = plot_continuity(result.pairs[["role", "layer", "layer_next", *share]], out / "suggest.png",
                                 "Energy of W_l+1 kept by layer l's top-k basis (role's space); dashed = random k/d")
            if sp is not None:
                paths.append(sp)
    if plots:
        for p in (plot_continuity(result.pairs, out / "continuity.png", title),
                  plot_heatmaps(result.v1_cos, out / "v1_heatmap.png", "v1"),
                  plot_heatmaps(result.u1_cos, out / "u1_heatmap.png", "u1")):
            if p is not None:
                paths.append(p)
    return paths
