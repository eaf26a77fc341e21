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
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightgeom._files import write_atomic
from weightgeom.experiments.report.claims import findings as claim_findings
from weightgeom.experiments.report.claims_page import CLAIMS_FILE, report_section, write_claims
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
from weightgeom.experiments.report.inputs import MANIFEST as MANIFEST_SHAPE
from weightgeom.experiments.report.inputs import Problems, html_text, load_json, md_code, md_text
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
        rows.append([md_code(r.name), md_text(r.state), r.status.get("step", "—"), fmt(final_value(t), 4),
                     fmt(final_value(v), 4), fmt(best_value(v), 4), md_text(r.status.get("reason") or "")])
    lines = [f"## {md_text(title)}", "", md_table(["run", "state", "step", "final train loss", "final val loss",
                                                   "best val loss", "reason"], rows), ""]
    png = out / f"{re.sub(r'[^a-z0-9]+', '_', title.lower())[:60]}_loss.png"
    lines += image_lines(plot_loss_curves(group_runs(runs), png, title), "loss curves")
    return "\n".join(lines)


SECTIONS = {"manifolds": manifolds_section, "continuity": continuity_section, "md": md_section}


def max_steps_of(run: RunData) -> int | None:
    """``train.max_steps`` a run was trained with (its ``config.resolved.toml``, else ``experiment.json``)."""
    value = (run.config.get("train") or {}).get("max_steps")
    if value is None:
        value = (run.experiment.get("settings") or {}).get("train.max_steps")
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return int(value) if ok else None


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def max_steps_warning(runs: Sequence[RunData]) -> str | None:
    """One sentence when runs that are compared with each other were trained for different ``train.max_steps``.

    Runs are compared within a recipe's section and config part (e.g. the ``resmlp`` and ``llama`` parts of the
    continuity recipe may train for different step counts by design). None when every group agrees. Run, recipe and
    part names are given as they are (plain text for the terminal); :func:`make_report` escapes them for markdown.
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


def sweep_timing(manifest: dict[str, Any]) -> str:
    """A sweep's size and wall time from its ``sweep.json``: each sitting (invocation of ``weightgeom sweep``) records
    its wall time when it ends, so a sweep resumed across sittings is timed by the sittings that ended, and one
    stopped before it ended says so (never "? s")."""
    count = len(manifest.get("runs") or [])
    n = f"{count} run" + ("" if count == 1 else "s")
    sittings = [i for i in manifest.get("invocations") or [] if isinstance(i, dict)]
    walls = [float(i["wall_s"]) for i in sittings
             if isinstance(i.get("wall_s"), (int, float)) and math.isfinite(i["wall_s"])]
    if len(sittings) <= 1:
        wall = manifest.get("wall_s")
        ended = isinstance(wall, (int, float)) and math.isfinite(wall)
        return f"{n}, " + (f"{fmt(wall, 1)} s" if ended else "stopped before it ended")
    text = f"{n} in {len(sittings)} sittings"
    if walls:
        text += f", {fmt(sum(walls), 1)} s of wall time in the {len(walls)} that ended"
    if len(walls) < len(sittings):
        cut = len(sittings) - len(walls)
        text += f"; {cut} stopped before " + ("it" if cut == 1 else "they") + " ended"
    return text


def _manifest(directory: Path, problems: Problems) -> dict[str, Any] | None:
    """A sweep directory's ``sweep.json`` conformed (:data:`~.inputs.MANIFEST`), or None."""
    return load_json(Path(directory) / MANIFEST, MANIFEST_SHAPE, problems)


MAX_PROBLEM_LINES = 10
"""Warnings printed about unusable files or values (the rest are counted in one more line)."""


def make_report(paths: Sequence[str | Path], out: str | Path | None = None, title: str | None = None,
                note: str | None = None) -> Path:
    """Write ``report.md`` and its PNGs for the run directories under ``paths``; return the markdown path.

    The directories are untrusted input (a sweep received from someone else): every file is read bounded and typed
    (:mod:`.inputs`), and what cannot be used is left out with a warning on stderr (one line per problem, at most
    :data:`MAX_PROBLEM_LINES`) and a note in ``report.md``; every value shown goes through the escaping of
    :mod:`.inputs`, so ``report.md`` is inert as markdown and as HTML; every file is written by
    :func:`weightgeom._files.write_atomic` (a link planted at ``report.md`` or a PNG's name is replaced, its target
    never written). Runs compared in one section that were trained for different ``train.max_steps`` get a warning
    (:func:`max_steps_warning`). The papers' claims these runs test head the report, each with its verdict from the
    claim's stated rule (:mod:`.claims`), and are written to ``claims.json`` beside ``report.md`` for
    ``weightgeom claims``.

    Args:
        paths: run directories or directories containing them (sweep directories).
        out: output directory (default: the single given directory, else ``./report``).
        title: heading of the report.
        note: a paragraph (markdown) printed in bold under the heading, e.g. the quick demo's "smoke test" notice.
    """
    dirs = discover(paths)
    runs = [load_run(d) for d in dirs]
    problems = Problems()
    given = [str(Path(p)) for p in paths]
    manifests: list[tuple[Path, dict[str, Any], bool]] = []  # (sweep.json, its record, a directory given?)
    for p in dict.fromkeys([*given, *sorted({str(d.parent) for d in dirs})]):
        man = _manifest(Path(p), problems)
        if man is not None:
            manifests.append((Path(p) / MANIFEST, man, p in given))
    order: dict[str, int] = {}
    for _, man, _ in manifests:
        for r in man.get("runs") or []:
            if r.get("run_dir"):
                order.setdefault(_resolved(r["run_dir"]), len(order))
    runs.sort(key=lambda r: (order.get(_resolved(r.path), len(order)), str(r.path)))
    if out is None:
        out = Path(paths[0]) if len(paths) == 1 and not is_run_dir(Path(paths[0])) else Path("report")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unfinished = [r for r in runs if r.state not in ("done", "diverged")]
    runs = [r for r in runs if r.state in ("done", "diverged")]
    by_recipe: dict[str, list[RunData]] = {}
    for r in runs:
        by_recipe.setdefault(r.recipe or "", []).append(r)
    parts = [f"# {md_text(title) if title else 'weightgeom experiment report'}", ""]
    if note:
        parts += [f"**{note}**", ""]
    parts.append(f"{len(runs) + len(unfinished)} run directories: "
                 + ", ".join(md_code(d) for d in sorted({str(d.parent) for d in dirs})) + ".")
    if unfinished:
        def why(r: RunData) -> str:
            reason = r.status.get("reason")
            return f"{md_code(r.name)} ({md_text(r.state)}" + (f": {md_text(reason)})" if reason else ")")

        parts.append(f"Left out of the tables and plots ({len(unfinished)} runs not finished): "
                     + ", ".join(why(r) for r in unfinished) + ".")
    warning = max_steps_warning(runs)
    if warning:
        print(f"weightgeom report: warning: {warning}", file=sys.stderr)
        parts.append(f"**Warning:** {md_text(warning)}.")
    for m, man, _ in (x for x in manifests if x[2]):
        parts.append(f"Sweep {md_code(man.get('recipe', '?'))} on config {md_code(man.get('config', '?'))} "
                     f"({sweep_timing(man)}): {md_code(m)}.")
    parts.append("")
    found = claim_findings(runs)
    if found:
        parts.append(report_section(found))
    for recipe in ("manifolds", "continuity", "md"):
        if recipe in by_recipe:
            parts.append(_section(recipe, SECTIONS[recipe], by_recipe.pop(recipe), out, problems))
    for recipe, rs in by_recipe.items():
        parts.append(_section(recipe or "runs", lambda r, o, name=recipe: generic_section(
            r, o, title=f"Runs ({name})" if name else "Runs"), rs, out, problems))
    if not runs:
        parts.append("No finished run yet.")
    parts.append(config_appendix(runs))
    for r in [*runs, *unfinished]:
        for line in r.problems:
            problems.lines.append(line)
    if problems:
        _warn_problems(problems.lines)
        parts += ["", "## Files that could not be used", "",
                  "Left out of the tables above (the rest of each run was used):", ""]
        parts += [f"- {md_text(line)}" for line in problems.lines[:200]]
        if len(problems.lines) > 200:
            parts.append(f"- and {len(problems.lines) - 200} more")
    path = out / "report.md"
    write_claims(found, out / CLAIMS_FILE)
    write_atomic(path, "\n".join(parts).rstrip() + "\n")
    return path


def _resolved(p: str | Path) -> str:
    try:
        return str(Path(p).resolve())
    except (OSError, RuntimeError, ValueError):  # a loop of links, a NUL byte
        return str(p)


def _section(recipe: str, build, runs: list[RunData], out: Path, problems: Problems) -> str:
    """One recipe's section; if it cannot be built from these runs, a note in its place and a problem line (the
    other sections and the report still come out). The typed loading means this does not happen for any run
    directory the hostile-input table builds; it is the last line of defence against one it does not."""
    try:
        return build(runs, out)
    except Exception as e:  # noqa: BLE001 -- untrusted input: report the rest rather than a traceback
        first = (str(e).strip().splitlines() or [""])[0][:200]
        problems.add(f"the {recipe} section", f"could not be built from these runs ({type(e).__name__}: {first})")
        return f"## {md_text(recipe)}\n\nThis section could not be built from these runs; see the end of the report.\n"


def _warn_problems(lines: list[str]) -> None:
    for line in lines[:MAX_PROBLEM_LINES]:
        print(f"weightgeom report: warning: {_visible_line(line)}", file=sys.stderr)
    if len(lines) > MAX_PROBLEM_LINES:
        print(f"weightgeom report: warning: and {len(lines) - MAX_PROBLEM_LINES} more problems (listed at the end of "
              "report.md)", file=sys.stderr)


def _visible_line(text: str) -> str:
    """A problem line for the terminal: control characters (escape sequences included) shown, not sent."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", text)


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
        lines.append(f"<details><summary>shared config ({html_text(part)}, {len(rs)} runs)</summary>\n")
        lines.append("```toml")
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in sorted(common.items())]
        lines.append("```\n</details>\n")
        seen = {}
        for r in rs:
            if r.variant not in seen:
                seen[r.variant] = r.experiment.get("overrides") or {}
        if any(seen.values()):
            lines.append(md_table(["variant", "overrides"], [[md_code(v), ", ".join(
                md_code(f"{k}={json.dumps(x, default=str)}") for k, x in o.items()) or "(base)"]
                for v, o in seen.items()]))
            lines.append("")
    return "\n".join(lines)


def _toml_key(key: str) -> str:
    """A dotted key as written in the appendix's TOML block: bare when it is plain, else a quoted string
    (:func:`_toml_value`)."""
    return key if re.fullmatch(r"[A-Za-z0-9_.\-]+", key) else _toml_value(key)


def _toml_value(value: Any) -> str:
    """A value in the appendix's TOML block: JSON (also TOML for strings, numbers, booleans and arrays), ASCII only,
    with ``<``, ``>``, ``&`` and the backtick written as ``\\u`` escapes — the same string for TOML, and nothing a
    renderer could read as a tag or a closing fence, even one that does not know fenced code blocks."""
    text = json.dumps(value, default=str)
    return re.sub(r"[<>&`]", lambda m: f"\\u{ord(m.group()):04x}", text)
