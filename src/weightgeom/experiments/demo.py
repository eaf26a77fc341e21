"""``weightgeom demo``: the main CPU job — small versions of the manifold-assignment and continuity experiments,
then a report.

1. ``weightgeom sweep manifolds tiny-shakespeare``: the five manifold assignments + ALL-DGRAM with a σ cap +
   HETERO+MD + the automatic assignment (AUTO) on a character-level GPT (Shakespeare, bundled), two seeds, with
   σ/logit/saturation diagnostics; then ``weightgeom sweep manifolds boundary``: the stability boundary (an LR ladder
   per strategy and algorithm, ours and the published one, three seeds) on a smaller GPT.
2. ``weightgeom sweep continuity cpu``: the residual-MLP MNIST ablations at the paper's size (16 × 256) with
   continuity recorded over training, and the Llama activation ablation with per-projection continuity.
3. One combined report (markdown + PNGs) of both sweeps; its path is printed at the end.

Runs train two at a time (one process and one thread each: these models are so small that a 2-thread run spends
its time synchronising threads). About 15 minutes on 2 CPU cores; ``--quick`` runs the same path in a minute or
two (1 seed, 30 steps per run: a smoke test, not a result). Finished runs are skipped, so an interrupted demo
resumes where it stopped. One demo at a time owns its directory (a second one exits 2 naming the first one's pid
and host), and its worker processes exit with it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

SMOKE_NOTE = ("quick demo: its verdicts are a smoke test of the pipeline (1 seed, 30 steps per run), not results; "
              "the recorded verdicts are the README's claims table and docs/results.md")
"""What the quick demo's report and console say before its verdicts."""

QUICK = {"tiny-shakespeare": {"steps": 30, "seeds": [0]}, "cpu": {"steps": 30, "seeds": [0]},
         "boundary": {"seeds": [0], "only": ["all-dgram-ours", "hetero-ours"]}}

RECORDED_SWEEP_S = {"tiny-shakespeare": 95.0, "boundary": 130.0, "cpu": 95.0}
"""Wall seconds of each of the demo's sweeps (by preset) recorded on the 2-core Intel Xeon with AMX, idle, runs two at
a time (docs/experiments.md, "Measured at CPU scale": 86–103, 114–147 and 83–108 s; the middles). The whole demo's
time left is what the sweeps still to run took there, scaled by this machine's pace over the sweeps done so far."""


def demo_time_left(done: list[str], left: list[str], elapsed_s: float) -> float | None:
    """Seconds the demo has left: the recorded times of the presets in ``left`` × (``elapsed_s`` ÷ the recorded
    times of the presets in ``done``); None before a sweep has finished (nothing to scale by yet)."""
    recorded = sum(RECORDED_SWEEP_S[p] for p in done)
    if not done or recorded <= 0 or elapsed_s <= 0:
        return None
    return elapsed_s / recorded * sum(RECORDED_SWEEP_S[p] for p in left)


def _progress(i: int, presets: list[str], elapsed_s: float, quick: bool, jobs: int) -> str:
    """The demo's overall progress before sweep ``i`` (0-based): sweeps done, time so far, time left."""
    if i == 0:
        if quick or jobs != 2:
            return f"sweep 1 of {len(presets)}"
        total = sum(RECORDED_SWEEP_S[p] for p in presets)
        return (f"sweep 1 of {len(presets)}; the whole demo took {total / 60:.0f} min on an idle 2-core AMX Xeon, "
                "longer on a busy machine")
    left = demo_time_left(presets[:i], presets[i:], elapsed_s)
    return (f"sweep {i + 1} of {len(presets)}; demo {elapsed_s / 60:.1f} min so far"
            + (f", ~{left / 60:.1f} min left" if left is not None else ""))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``weightgeom demo``."""
    from weightgeom.experiments.cli import positive_int

    p.add_argument("--quick", action="store_true", help="1-2 minute smoke version (1 seed, 30 steps per run)")
    p.add_argument("--out", default=None, help="demo directory (default: runs/demo or runs/demo-quick)")
    p.add_argument("--only", choices=["manifolds", "continuity"], default=None, help="run one of the two sweeps")
    p.add_argument("--verbose", action="store_true", help="show the trainer's progress bars (with --jobs 1)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key in every run of both sweeps (TOML literal value, as for train and "
                        "sweep), e.g. --set optim.muon.dual.steps=10")
    p.add_argument("--jobs", type=positive_int, default=2,
                   help="runs in parallel, one process and one thread each (default 2: one per core of a 2-core CPU)")


def run(args: argparse.Namespace) -> int:
    """Run both sweeps and write the combined report; exit 2 with one line on bad input or an unusable directory."""
    from weightgeom._cli_args import os_error_line
    from weightgeom.train.rundir import DirLock

    out = Path(args.out or ("runs/demo-quick" if args.quick else "runs/demo"))
    try:
        with DirLock(out, what="demo directory"):
            return _run_locked(args, out)
    except (ValueError, FileNotFoundError) as e:
        print(f"weightgeom demo: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"weightgeom demo: {os_error_line(e)}", file=sys.stderr)
        return 2


def _run_locked(args: argparse.Namespace, out: Path) -> int:
    """The demo's sweeps and report, while this process owns ``out``."""
    from weightgeom.experiments.cli import execute
    from weightgeom.experiments.report import make_report

    plan = [("manifolds", "tiny-shakespeare", "manifolds"), ("manifolds", "boundary", "boundary"),
            ("continuity", "cpu", "continuity")]
    if args.only:
        plan = [p for p in plan if p[0] == args.only]
    t0 = time.perf_counter()
    dirs, failed = [], 0
    presets = [preset for _, preset, _ in plan]
    for i, (recipe, preset, sub) in enumerate(plan):
        kw = QUICK[preset] if args.quick else {}
        where = _progress(i, presets, time.perf_counter() - t0, args.quick, args.jobs)
        print(f"== weightgeom demo: {recipe} sweep on preset {preset!r}"
              f"{' (quick)' if args.quick else ''} ({where}) ==", flush=True)
        manifest, _ = execute(recipe, preset, seeds=kw.get("seeds"), steps=kw.get("steps"), out=out / sub,
                              only=kw.get("only"), sets=args.sets, report=False, progress=True,
                              quiet_trainer=not args.verbose, jobs=args.jobs, threads=1 if args.jobs > 1 else None)
        failed += sum(r.get("status") == "failed" for r in manifest["runs"])
        dirs.append(out / sub)
    path = make_report(dirs, out=out, title="weightgeom demo" + (" (quick)" if args.quick else ""),
                       note=SMOKE_NOTE if args.quick else None)
    print_claims(path.parent, quick=args.quick)
    print(f"demo finished in {(time.perf_counter() - t0) / 60:.1f} min; {failed} failed runs")
    print(f"report: {path}")
    return 1 if failed else 0


def print_claims(report_dir: Path, quick: bool = False) -> None:
    """The papers' claims these runs tested, one line each (verdict, with the reason where inconclusive; claim;
    which sweep), from the report's ``claims.json``; the rules and evidence are in ``report.md``. ``quick``: say
    first that the verdicts are a smoke test and where the recorded ones are."""
    from weightgeom.experiments.report.claims import CLAIM_BY_KEY, inconclusive_reason
    from weightgeom.experiments.report.claims_page import CLAIMS_FILE, read_claims
    from weightgeom.experiments.report.inputs import Problems

    found = read_claims(report_dir / CLAIMS_FILE, Problems())
    if not found:
        return
    if quick:
        print(SMOKE_NOTE)
    print("the papers' claims at this size (rules and evidence: report.md):")
    for f in found:
        text = CLAIM_BY_KEY[f.key].text
        text = text if len(text) <= 66 else text[:65] + "…"
        reason = inconclusive_reason(f)
        verdict = f"{f.verdict} ({reason})" if reason else f.verdict
        print(f"  {verdict:<29}  {text}  [{f.source.split(' (')[0].split()[-1]}]")
