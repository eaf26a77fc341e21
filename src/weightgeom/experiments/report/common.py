"""Report building blocks: loading run directories, metric series, formatting, shared plot helpers."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from weightgeom._files import write_atomic
from weightgeom.experiments.report.inputs import (
    CONTINUITY_ROW,
    EXPERIMENT,
    METRICS_ROW,
    STATUS,
    Problems,
    load_json,
    load_jsonl,
    load_toml,
    md_code,
    md_text,
    plot_text,
)
from weightgeom.experiments.runner import EXPERIMENT_FILE
from weightgeom.train.rundir import PREVIOUS_DIR


# ------------------------------------------------------------------------------------------------------ loading
@dataclass
class RunData:
    """Everything the report needs from one run directory."""

    path: Path
    name: str
    variant: str
    seed: int | None
    recipe: str
    config: dict[str, Any]
    status: dict[str, Any]
    experiment: dict[str, Any]
    metrics: pd.DataFrame  # long: step, split, metric, value
    continuity: pd.DataFrame | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # what could not be used, one line each

    @property
    def state(self) -> str:
        return str(self.status.get("state", "unknown"))

    @property
    def diverged(self) -> bool:
        return self.state == "diverged"


def metrics_frame(path: Path, problems: Problems | None = None) -> pd.DataFrame:
    """``metrics.jsonl`` (or ``heads.jsonl``) as a long DataFrame (step, split, metric, value); lines whose step is
    not a non-negative integer and values that are not numbers are left out (counted in ``problems``)."""
    recs = []
    for row in load_jsonl(path, METRICS_ROW, problems if problems is not None else Problems()):
        step, split = row.pop("step"), str(row.pop("split", "train"))
        recs += [(step, split, k, v) for k, v in row.items()]
    return pd.DataFrame(recs, columns=["step", "split", "metric", "value"])


def _strip_seed(name: str) -> tuple[str, int | None]:
    m = re.match(r"^(.*?)[-_]s(?:eed)?(\d+)$", name)
    if m and len(m.group(2)) <= 9:
        return m.group(1), int(m.group(2))
    return name, None


def load_run(path: str | Path) -> RunData:
    """Load one run directory: every file bounded and conformed to its declared shape (:mod:`.inputs`); what could
    not be used is left out and named in ``RunData.problems``."""
    path = Path(path)
    problems = Problems()
    config = load_toml(path / "config.resolved.toml", problems)
    experiment = load_json(path / EXPERIMENT_FILE, EXPERIMENT, problems) or {}
    status = load_json(path / "status.json", STATUS, problems) or {}
    metrics = metrics_frame(path / "metrics.jsonl", problems)
    cont = None
    rows = load_jsonl(path / "continuity.jsonl", CONTINUITY_ROW, problems)
    if rows:
        cont = pd.DataFrame(rows)
    variant, seed = _strip_seed(path.name)
    variant = experiment.get("variant", variant)
    seed = experiment.get("seed", seed if seed is not None else config.get("run", {}).get("seed"))
    return RunData(path=path, name=path.name, variant=variant, seed=seed, recipe=experiment.get("recipe", ""),
                   config=config, status=status, experiment=experiment, metrics=metrics, continuity=cont,
                   tags=dict(experiment.get("tags") or {}), problems=problems.lines)


def run_file(run: RunData, name: str, shape: Any) -> Any:
    """Another JSON file of a run directory (``controls.json``, ``meta.json``), conformed to ``shape``; problems are
    added to the run's."""
    problems = Problems()
    value = load_json(run.path / name, shape, problems)
    run.problems += [p for p in problems.lines if p not in run.problems]
    return value


def run_metrics(run: RunData, name: str) -> pd.DataFrame:
    """Another JSON-lines file of a run (``heads.jsonl``) as :func:`metrics_frame` does; problems added to the run's."""
    problems = Problems()
    df = metrics_frame(run.path / name, problems)
    run.problems += [p for p in problems.lines if p not in run.problems]
    return df


def tagged(runs: Sequence[RunData], keys: Sequence[str], where: str) -> list[RunData]:
    """The runs whose ``experiment.json`` tags hold every one of ``keys`` (with the declared type: the loading drops
    a tag of the wrong type); each other run gets a problem line saying it was left out of ``where``."""
    out = []
    for r in runs:
        missing = [k for k in keys if k not in r.tags]
        if missing:
            r.problems.append(f"{r.path / EXPERIMENT_FILE}: tags {', '.join(missing)} missing or of the wrong type; "
                              f"run left out of {where}")
        else:
            out.append(r)
    return out


def is_run_dir(p: Path) -> bool:
    """A run directory has metrics.jsonl or status.json."""
    return (p / "metrics.jsonl").exists() or (p / "status.json").exists()


def discover(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories given directly or found below the given directories (sorted, unique).

    Raises:
        FileNotFoundError: a path does not exist, or no run directory was found.
    """
    found: list[Path] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"no such run directory: {p}")
        if is_run_dir(p):
            found.append(p)
            continue
        for m in sorted(p.rglob("metrics.jsonl")) + sorted(p.rglob("status.json")):
            d = m.parent
            if "checkpoints" in d.parts or PREVIOUS_DIR in d.relative_to(p).parts:
                continue  # earlier runs moved aside by --fresh / --no-resume are not part of the sweep
            found.append(d)
    out = sorted(set(found))
    if not out:
        raise FileNotFoundError(f"no run directories (metrics.jsonl / status.json) under: {', '.join(map(str, paths))}")
    return out


# ------------------------------------------------------------------------------------------------------ series
LOSS_KEYS = ("loss", "val_loss", "val/loss", "train_loss", "train/loss")


def series(run: RunData, split: str, metric: str | Sequence[str]) -> pd.Series:
    """Values of one metric (first of the candidate names present) in one split, indexed by step."""
    df = run.metrics
    if df.empty:
        return pd.Series(dtype=float)
    names = [metric] if isinstance(metric, str) else list(metric)
    sub = df[df["split"] == split]
    for m in names:
        s = sub[sub["metric"] == m]
        if not s.empty:
            return s.groupby("step")["value"].last().sort_index()
    return pd.Series(dtype=float)


def loss_series(run: RunData, split: str = "val") -> pd.Series:
    """The loss curve of a split (``loss`` or ``val_loss`` …)."""
    return series(run, split, LOSS_KEYS)


def diag_aggregate(run: RunData, suffix: str, how: str = "max") -> pd.Series:
    """Aggregate a per-layer diag metric (``attn.<i>.<suffix>``) over layers at each step."""
    df = run.metrics
    if df.empty:
        return pd.Series(dtype=float)
    sub = df[(df["split"] == "diag") & df["metric"].str.endswith("." + suffix)]
    if sub.empty:
        sub = df[(df["split"] == "diag") & (df["metric"] == suffix)]
    if sub.empty:
        return pd.Series(dtype=float)
    g = sub.groupby("step")["value"]
    return (g.max() if how == "max" else g.mean()).sort_index()


def final_value(s: pd.Series) -> float:
    """Last finite value of a series (NaN if none)."""
    s = s[np.isfinite(s.values)] if len(s) else s
    return float(s.iloc[-1]) if len(s) else float("nan")


def best_value(s: pd.Series) -> float:
    """Minimum finite value of a series (NaN if none)."""
    s = s[np.isfinite(s.values)] if len(s) else s
    return float(s.min()) if len(s) else float("nan")


def fmt_stats(values: Sequence[float], digits: int = 4) -> str:
    """``mean ± std (n)``; ``—`` when empty; ``value`` when one."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return "—"
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    sd = float(np.std(v, ddof=1))
    sd_s = f"{sd:.{digits}f}" if sd >= 10 ** -digits or sd == 0 else f"{sd:.1e}"
    return f"{np.mean(v):.{digits}f} ± {sd_s} (n={len(v)})"


def fmt(x: Any, digits: int = 3) -> str:
    """A number for a table cell."""
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if not math.isfinite(float(x)):
        return "—"
    x = float(x)
    if x != 0 and (abs(x) >= 1e4 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}f}"


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table. Cells are markdown (values from run directories must already have gone through
    :func:`~weightgeom.experiments.report.inputs.md_text` / ``md_code``); as a second line of defence a cell can never
    hold a line break or an unescaped ``|``, so it cannot end the row or add a column."""
    def cell(c: Any) -> str:
        return re.sub(r"(?<!\\)\|", "\\|", re.sub(r"[\r\n\u2028\u2029]+", " ", str(c)))

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(c) for c in r) + " |")
    return "\n".join(lines)


def group_runs(runs: Sequence[RunData]) -> dict[str, list[RunData]]:
    """Runs grouped by variant, in first-seen order."""
    out: dict[str, list[RunData]] = {}
    for r in runs:
        out.setdefault(r.variant, []).append(r)
    return out


# ------------------------------------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # text.parse_math off: names from run directories are shown as typed, never parsed as mathtext ("a$b" raised)
    plt.rcParams.update({"font.size": 11, "axes.grid": True, "grid.alpha": 0.3, "figure.dpi": 110,
                         "legend.fontsize": 9, "text.parse_math": False})
    return plt


def _colors(n: int) -> list:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


LINESTYLES = ("-", "--", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "*", "h")
"""Per-arm markers beside :data:`LINESTYLES` and colour, so arms whose curves overlap stay distinguishable (also in
grey print): arm k gets ``LINESTYLES[k % 3]`` and ``MARKERS[k % 8]``."""
STEP_LABEL = "training step (optimizer updates)"
LOSS_UNIT = "nats, mean cross-entropy"


def arm_style(k: int) -> dict[str, str]:
    """Line style and marker of the k-th arm of a plot (matplotlib keyword arguments)."""
    return {"ls": LINESTYLES[k % len(LINESTYLES)], "marker": MARKERS[k % len(MARKERS)]}


def band(ax, curves: list[pd.Series], color, label: str, marker_steps: Sequence[tuple[int, float]] = (),
         ls: str = "-", marker: str | None = None) -> None:
    """Plot the mean over seeds with a min–max band; mark divergences with ✕. ``marker`` is drawn at about ten
    points along the curve (``ls`` and ``marker`` tell overlapping arms apart)."""
    curves = [c for c in curves if len(c)]
    if curves:
        df = pd.concat(curves, axis=1).sort_index()
        df = df.replace([np.inf, -np.inf], np.nan)
        if len(curves) > 1:
            df = df.interpolate(limit_area="inside")
        mean = df.mean(axis=1)
        ax.plot(mean.index, mean.values, color=color, label=plot_text(label), lw=1.8, ls=ls, marker=marker,
                ms=5, markevery=max(1, len(mean) // 10), fillstyle="none")
        if len(curves) > 1:
            ax.fill_between(df.index, df.min(axis=1).values, df.max(axis=1).values, color=color, alpha=0.2, lw=0)
    for step, y in marker_steps:
        ax.plot([step], [y], marker="x", color=color, ms=11, mew=2.5, ls="none")


def _plain_log_ticks(fig) -> None:
    """Plain tick labels ("0.2", "10", "1e-05") on every log-scaled axis of ``fig``: matplotlib's log formatter writes
    mathtext ("$\\mathdefault{10^{1}}$"), which ``_plt`` turns off (names from run directories must never be parsed),
    so its labels would show as raw markup. Minor ticks are labelled where the axis spans under one decade, at 2 and 5
    (×10ᵏ) under 2.5 decades, else not (as the log formatter does)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")

    def two_and_five(v: float, _) -> str:
        mantissa = round(v / 10 ** math.floor(math.log10(v)), 6) if v > 0 else 0
        return f"{v:g}" if mantissa in (2, 5) else ""

    for ax in fig.get_axes():
        for axis, lim in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            if axis.get_scale() != "log":
                continue
            axis.set_major_formatter(plain)
            lo, hi = sorted(abs(x) for x in lim)
            decades = math.log10(hi / lo) if lo > 0 else math.inf
            axis.set_minor_formatter(plain if decades < 1 else FuncFormatter(two_and_five) if decades < 2.5
                                     else NullFormatter())


def _savefig(fig, path: Path, rect=None) -> Path:
    _plain_log_ticks(fig)
    fig.tight_layout(rect=rect)
    write_atomic(path, lambda p: fig.savefig(p, dpi=110, format="png"), fsync=False)
    _plt().close(fig)
    return path


def _legend_below(fig, ax) -> tuple:
    """One legend for the figure, below the panels (keeps curves visible); returns the tight_layout rect."""
    handles, labels = ax.get_legend_handles_labels()
    if not handles:
        return (0, 0, 1, 1)
    ncol = min(len(labels), 5)
    rows = math.ceil(len(labels) / ncol)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False)
    return (0, 0.035 * rows + 0.01, 1, 1)


def _divergence_marks(runs: Sequence[RunData], split: str) -> list[tuple[int, float]]:
    marks = []
    for r in runs:
        if r.diverged:
            s = loss_series(r, split)
            s = s[np.isfinite(s.values)] if len(s) else s
            step = r.status.get("step", s.index[-1] if len(s) else 0)
            y = float(s.iloc[-1]) if len(s) else float("nan")
            if math.isfinite(y):
                marks.append((int(step), y))
    return marks


def divergence_line(run: RunData) -> str:
    """``- `name` diverged at step N — reason`` for a diverged run (markdown list item)."""
    st = run.status
    return (f"- {md_code(run.name)} diverged at step {st.get('step', '?')} — "
            f"{md_text(st['reason']) if st.get('reason') else 'no reason recorded'}")


def image_lines(path: Path | None, alt: str) -> list[str]:
    """Markdown lines embedding a plot that was written (none when the plot function made no plot)."""
    return [f"![{alt}]({path.name})", ""] if path else []


def plot_loss_curves(groups: dict[str, list[RunData]], path: Path, title: str) -> Path | None:
    """Train and val loss per variant (mean over seeds with min–max band, ✕ = divergence)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    any_data = False
    for k, ((name, runs), color) in enumerate(zip(groups.items(), _colors(len(groups)))):
        for ax, split in zip(axes, ("train", "val")):
            curves = [loss_series(r, split) for r in runs]
            if any(len(c) for c in curves):
                any_data = True
            band(ax, curves, color, f"{name} (n={len(runs)})", _divergence_marks(runs, split), **arm_style(k))
    if not any_data:
        plt.close(fig)
        return None
    for ax, split in zip(axes, ("train", "val")):
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(f"{split} loss ({LOSS_UNIT})")
        ax.set_title(f"{split} loss (band: min–max over seeds, ✕: diverged)")
        _clip_ylim(ax)
    axes[1].legend(loc="upper right")
    fig.suptitle(plot_text(title, 120))
    return _savefig(fig, path)


def _clip_ylim(ax) -> None:
    """Keep exploding curves from flattening the rest: clip y to a robust range of the plotted data."""
    ys = []
    for line in ax.get_lines():
        y = np.asarray(line.get_ydata(), dtype=float)
        ys.append(y[np.isfinite(y)])
    if not ys:
        return
    y = np.concatenate(ys)
    if y.size == 0:
        return
    lo, hi = np.nanmin(y), np.nanpercentile(y, 98)
    if hi > lo:
        pad = 0.05 * (hi - lo)
        ax.set_ylim(lo - pad, hi + 4 * pad)
