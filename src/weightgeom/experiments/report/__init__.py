"""Reports from run directories: markdown tables + PNG plots for the three paper experiments.

Everything here reads only what a run directory holds — ``metrics.jsonl`` (one JSON object per line with ``step``,
``split`` and numbers), ``status.json``, ``config.resolved.toml``, and, when the sweep runner wrote them,
``experiment.json`` (recipe / variant / seed / tags) and ``continuity.jsonl`` (continuity metrics over training) —
so ``weightgeom report RUN_DIR…`` regenerates every table and plot of a sweep.

Sections by recipe:

* ``manifolds`` — final / best val loss ± spread per strategy, divergences (run, step, reason), loss curves with
  seed bands and divergence markers, and the mechanism curves σ_max(W_Q)·σ_max(W_K), attention-logit max,
  saturation and entropy (from the ``diag`` split), with a plain-words verdict on whether the chain
  DGram attention → σ growth → logit growth → saturation is visible.
* ``continuity`` — per-variant continuity table next to the continuity paper's figures, continuity and dominance
  ratio ‖ΔW‖/‖W₀‖ over training with its crossing of 1, and the Llama per-projection table.
* ``md`` — final loss vs LR per width and optimizer, optimal LR vs width (transfer), warmup vs none, loss vs compute.
* anything else — a generic table (final metrics per run) and loss curves.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from weightgeom.experiments.report.common import (
    RunData,
    best_value,
    discover,
    final_value,
    fmt,
    group_runs,
    image_lines,
    is_run_dir,
    load_run,
    loss_series,
    md_table,
    plot_loss_curves,
)
from weightgeom.experiments.report.continuity import continuity_section
from weightgeom.experiments.report.manifolds import manifolds_section
from weightgeom.experiments.report.md import md_section
from weightgeom.experiments.runner import MANIFEST


# ------------------------------------------------------------------------------------------------------ generic
def generic_section(runs: Sequence[RunData], out: Path, title: str = "Runs") -> str:
    """A table of final metrics per run and loss curves."""
    rows = []
    for r in runs:
        v = loss_series(r, "val")
        t = loss_series(r, "train")
        rows.append([f"`{r.name}`", r.state, r.status.get("step", "—"), fmt(final_value(t), 4),
                     fmt(final_value(v), 4), fmt(best_value(v), 4), r.status.get("reason") or ""])
    lines = [f"## {title}", "", md_table(["run", "state", "step", "final train loss", "final val loss",
                                          "best val loss", "reason"], rows), ""]
    png = out / f"{re.sub(r'[^a-z0-9]+', '_', title.lower())}_loss.png"
    lines += image_lines(plot_loss_curves(group_runs(runs), png, title), "loss curves")
    return "\n".join(lines)


SECTIONS = {"manifolds": manifolds_section, "continuity": continuity_section, "md": md_section}


def max_steps_of(run: RunData) -> int | None:
    """``train.max_steps`` a run was trained with (its ``config.resolved.toml``, else ``experiment.json``)."""
    value = (run.config.get("train") or {}).get("max_steps")
    if value is None:
        value = (run.experiment.get("settings") or {}).get("train.max_steps")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def max_steps_warning(runs: Sequence[RunData]) -> str | None:
    """One sentence when runs that are compared with each other were trained for different ``train.max_steps``.

    Runs are compared within a recipe's section and config part (e.g. the ``resmlp`` and ``llama`` parts of the
    continuity recipe may train for different step counts by design). None when every group agrees.
    """
    groups: dict[tuple[str, str], dict[int, list[str]]] = {}
    for r in runs:
        steps = max_steps_of(r)
        if steps is not None:
            key = (r.recipe or "", str(r.experiment.get("part") or "main"))
            groups.setdefault(key, {}).setdefault(steps, []).append(r.name)
    clauses = []
    for (recipe, part), by_steps in groups.items():
        if len(by_steps) < 2:
            continue
        what = f"{recipe or 'other'} runs" + (f" (part {part})" if part != "main" else "")
        counts = ", ".join(f"{steps} ({len(ns)} run{'s' if len(ns) > 1 else ''}: {_names(sorted(ns))})"
                           for steps, ns in sorted(by_steps.items()))
        clauses.append(f"the {what} compared here were trained for different train.max_steps: {counts}")
    if not clauses:
        return None
    return "; ".join(clauses) + "; their losses and optima are not comparable across step counts"


def make_report(paths: Sequence[str | Path], out: str | Path | None = None, title: str | None = None) -> Path:
    """Write ``report.md`` and its PNGs for the run directories under ``paths``; return the markdown path.

    Runs compared in one section that were trained for different ``train.max_steps`` get a warning: one line on
    stderr and a note at the top of ``report.md`` (:func:`max_steps_warning`).

    Args:
        paths: run directories or directories containing them (sweep directories).
        out: output directory (default: the single given directory, else ``./report``).
        title: heading of the report.
    """
    dirs = discover(paths)
    runs = [load_run(d) for d in dirs]
    order: dict[str, int] = {}
    for p in list(paths) + sorted({str(d.parent) for d in dirs}):
        m = Path(p) / MANIFEST
        if m.exists():
            try:
                for r in json.loads(m.read_text()).get("runs", []):
                    order.setdefault(str(Path(r.get("run_dir", "")).resolve()), len(order))
            except (OSError, json.JSONDecodeError):
                pass
    runs.sort(key=lambda r: (order.get(str(r.path.resolve()), len(order)), str(r.path)))
    if out is None:
        out = Path(paths[0]) if len(paths) == 1 and not is_run_dir(Path(paths[0])) else Path("report")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unfinished = [r for r in runs if r.state not in ("done", "diverged")]
    runs = [r for r in runs if r.state in ("done", "diverged")]
    by_recipe: dict[str, list[RunData]] = {}
    for r in runs:
        by_recipe.setdefault(r.recipe or "", []).append(r)
    parts = [f"# {title or 'weightgeom experiment report'}", ""]
    manifests = []
    for p in paths:
        m = Path(p) / MANIFEST
        if m.exists():
            try:
                manifests.append((m, json.loads(m.read_text())))
            except json.JSONDecodeError:
                pass
    parts.append(f"{len(runs) + len(unfinished)} run directories: "
                 + ", ".join(sorted({str(d.parent) for d in dirs})) + ".")
    if unfinished:
        def why(r: RunData) -> str:
            return f"`{r.name}` ({r.state}" + (f": {r.status['reason']})" if r.status.get("reason") else ")")

        parts.append(f"Left out of the tables and plots ({len(unfinished)} runs not finished): "
                     + ", ".join(why(r) for r in unfinished) + ".")
    warning = max_steps_warning(runs)
    if warning:
        print(f"weightgeom report: warning: {warning}", file=sys.stderr)
        parts.append(f"**Warning:** {warning}.")
    for m, man in manifests:
        cfg = man.get("config", "?")
        parts.append(f"Sweep `{man.get('recipe', '?')}` on config `{cfg}` ({len(man.get('runs', []))} runs, "
                     f"{man.get('wall_s', '?')} s): `{m}`.")
    parts.append("")
    for recipe in ("manifolds", "continuity", "md"):
        if recipe in by_recipe:
            parts.append(SECTIONS[recipe](by_recipe.pop(recipe), out))
    for recipe, rs in by_recipe.items():
        parts.append(generic_section(rs, out, title=f"Runs ({recipe})" if recipe else "Runs"))
    if not runs:
        parts.append("No finished run yet.")
    parts.append(config_appendix(runs))
    path = out / "report.md"
    path.write_text("\n".join(parts).rstrip() + "\n")
    return path


def config_appendix(runs: Sequence[RunData]) -> str:
    """The settings shared by all runs, and what each variant changed — so results come with their configs."""
    def flat(d, prefix=""):
        o = {}
        for k, v in d.items():
            if isinstance(v, dict):
                o.update(flat(v, f"{prefix}{k}."))
            else:
                o[f"{prefix}{k}"] = v
        return o

    lines = ["## Configs", ""]
    by_part: dict[str, list[RunData]] = {}
    for r in runs:
        by_part.setdefault(str(r.experiment.get("part", r.config.get("model", {}).get("kind", "?"))), []).append(r)
    for part, rs in by_part.items():
        flats = [flat({k: v for k, v in r.config.items() if k != "run"}) for r in rs if r.config]
        if not flats:
            continue
        common = {k: v for k, v in flats[0].items() if all(f.get(k) == v for f in flats[1:])}
        lines.append(f"<details><summary>shared config ({part}, {len(rs)} runs)</summary>\n")
        lines.append("```toml")
        lines += [f"{k} = {json.dumps(v, default=str)}" for k, v in sorted(common.items())]
        lines.append("```\n</details>\n")
        seen = {}
        for r in rs:
            if r.variant not in seen:
                seen[r.variant] = r.experiment.get("overrides") or {}
        if any(seen.values()):
            lines.append(md_table(["variant", "overrides"], [[f"`{v}`", ", ".join(
                f"`{k}={json.dumps(x, default=str)}`" for k, x in o.items()) or "(base)"] for v, o in seen.items()]))
            lines.append("")
    return "\n".join(lines)
