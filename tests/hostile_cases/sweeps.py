"""Hostile inputs: sweeps (rows of tests/test_hostile.py).

``weightgeom sweep``: one sweep at a time per sweep directory (the second exits 2 naming the owner's pid and host),
worker processes die with a killed sweep process (and a re-run then finishes the sweep), a finished sweep re-run with
other ``--set`` / ``--steps`` is refused with one line naming the difference instead of reporting the old runs under
the new settings (so is a command adding new runs with other sweep-level settings), a report of runs trained for
different step counts warns, ``--no-resume`` keeps the earlier run under ``<run>/previous/``, and bad sweep input is
one line.

Runs use a one-layer GPT on synthetic data, three steps each (about a second on a CPU). Where a second process is the
point, a real subprocess runs a sweep whose training (the real trainer) is held before each optimizer step while a
hold file exists (:func:`held_train`), so the rows do not depend on timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hostile_cases import Hostile, assert_one_line_error, cli
from weightgeom.train.rundir import proc_state

HOLD_ENV = "WG_TEST_SWEEP_HOLD"
"""Environment variable naming the hold file of :func:`held_train`."""

TESTS_DIR = Path(__file__).resolve().parents[1]

SWEEP_TOML = """
[sweep]
seeds = [0]
widths = [16]
optimizers = ["adamw"]
warmup = 1
[sweep.lrs]
adamw = [0.01, 0.03]

[run]
device = "cpu"
[model]
kind = "gpt"
n_layer = 1
n_head = 2
n_embd = 16
[data]
kind = "synthetic"
block_size = 16
batch_size = 4
[optim]
name = "adamw"
[optim.adamw]
lr = 0.01
[train]
max_steps = 3
eval_every = 3
eval_iters = 2
log_every = 1
"""
"""A sweep file for the ``md`` recipe: runs ``adamw-w16-lr0.01-s0``, ``adamw-w16-lr0.03-s0`` and a warmup arm."""

RUNS = ("adamw-w16-lr0.01", "adamw-w16-lr0.03")
ONLY = ",".join(RUNS)


# --------------------------------------------------------------------------------------------------------- helpers
def held_train(spec: Any, run_dir: Path, progress: bool) -> dict[str, Any]:
    """The sweep's default train function, held before every optimizer step while the hold file exists.

    The first hold writes ``held-<run>.pid`` (this process's pid) next to the hold file. Module-level, so a sweep's
    worker processes can run it.
    """
    import torch.optim.optimizer as topt

    from weightgeom.experiments.runner import default_train_fn

    hold = Path(os.environ[HOLD_ENV])
    marker = hold.parent / f"held-{spec.name}.pid"

    def pre_step(*_args: Any) -> None:
        if hold.exists() and not marker.exists():
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, marker)
        while hold.exists():
            time.sleep(0.05)

    handle = topt.register_optimizer_step_pre_hook(pre_step)
    try:
        return default_train_fn(spec, run_dir, progress)
    finally:
        handle.remove()


DRIVER = """
import signal
import sys
# a sweep started from a shell: Ctrl-C's default disposition and mask, whatever the test process passed down (an
# inherited ignored or blocked SIGINT made the interrupted-parent row hang in the full suite)
was = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
print("inherited SIGINT:", signal.getsignal(signal.SIGINT), "blocked" if signal.SIGINT in was else "unblocked",
      flush=True)
signal.signal(signal.SIGINT, signal.default_int_handler)
from hostile_cases.sweeps import held_train
from weightgeom.experiments.cli import execute
config, out, only, jobs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
execute("md", config, out=out, only=only, jobs=jobs, threads=1, report=False, progress=False, train_fn=held_train)
"""


def _sweep_file(tmp: Path) -> str:
    p = tmp / "sweep-tiny.toml"
    p.write_text(SWEEP_TOML)
    return str(p)


def _held_sweep(tmp: Path, out: Path, jobs: int) -> tuple[subprocess.Popen, Path]:
    """Start a sweep of :data:`RUNS` in a subprocess whose training is held; returns it and the hold file."""
    hold = tmp / "HOLD"
    hold.touch()
    env = {**os.environ, HOLD_ENV: str(hold),
           "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with open(tmp / "driver.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, _sweep_file(tmp), str(out), ONLY, str(jobs)],
                                cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, hold


def _wait_for(cond: Callable[[], bool], timeout: float, what: str, log: Path | None = None) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
        time.sleep(0.1)





def _running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a killed process not yet reaped no longer runs)."""
    return proc_state(pid) not in (None, "Z", "X")


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (Linux /proc), leaving out multiprocessing's resource tracker."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_bytes()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid and b"resource_tracker" not in cmd:
            out.append(int(d))
    return out


def _stop(proc: subprocess.Popen, pids: list[int], hold: Path) -> None:
    """Clean up after a row: let held training go, end the driver and any survivors (by pid)."""
    hold.unlink(missing_ok=True)
    for pid in pids:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _snapshot(root: Path) -> dict[str, str]:
    """Path → sha256 of every file under ``root`` (to show nothing was written or changed)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _sweep(tmp: Path, out: Path, *extra: str):
    return cli("sweep", "md", _sweep_file(tmp), "--out", str(out), "--only", ONLY, "--no-report", "--quiet", *extra)


def _sweep_only(tmp: Path, out: Path, only: str, *extra: str):
    return cli("sweep", "md", _sweep_file(tmp), "--out", str(out), "--only", only, "--no-report", "--quiet", *extra)


def _states(out: Path) -> dict[str, Any]:
    return {f"{r}-s0": json.loads((out / f"{r}-s0" / "status.json").read_text()).get("state") for r in RUNS}


# ------------------------------------------------------------------------------------------------------------ rows
def _held_workers(tmp: Path, out: Path) -> tuple[subprocess.Popen, Path, list[int]]:
    """A held ``--jobs 2`` sweep of :data:`RUNS` whose two workers are both training; returns (sweep, hold, pids)."""
    proc, hold = _held_sweep(tmp, out, jobs=2)
    markers = [tmp / f"held-{r}-s0.pid" for r in RUNS]
    try:
        _wait_for(lambda: all(m.exists() for m in markers), 120, "both workers to train", tmp / "driver.log")
    except BaseException:
        _stop(proc, [], hold)
        raise
    return proc, hold, sorted({int(m.read_text()) for m in markers} | set(_children(proc.pid)))


def _two_sweeps_one_dir(tmp: Path) -> None:
    out = tmp / "sw"
    proc, hold = _held_sweep(tmp, out, jobs=1)
    try:
        _wait_for(lambda: (tmp / f"held-{RUNS[0]}-s0.pid").exists(), 90, "the first sweep to train", tmp / "driver.log")
        before = _snapshot(out)
        res = _sweep(tmp, out)
        assert_one_line_error(res, "sweep directory", f"pid {proc.pid}", platform.node())
        assert _snapshot(out) == before  # the second sweep wrote nothing
        hold.unlink()
        assert proc.wait(timeout=120) == 0, (tmp / "driver.log").read_text()[-2000:]
        assert _states(out) == {f"{r}-s0": "done" for r in RUNS}
    finally:
        _stop(proc, [], hold)
    res = _sweep(tmp, out)  # the directory is free again: everything is already done
    assert res.rc == 0 and res.out.count("(skipped)") == 2, res.err


def _killed_parent(tmp: Path) -> None:
    out = tmp / "sw"
    proc, hold, workers = _held_workers(tmp, out)
    try:
        assert len(workers) >= 2 and all(_running(p) for p in workers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        # the hold file still exists: a worker that outlived its parent would go on "training" forever
        end = time.monotonic() + 5
        while any(_running(p) for p in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [p for p in workers if _running(p)], "sweep workers outlived the killed sweep process"
        # wait until init has reaped them (a zombie's pid still looks alive to the run locks)
        _wait_for(lambda: all(proc_state(p) is None for p in workers), 30, "the killed workers to be reaped")
    finally:
        _stop(proc, workers, hold)
    res = _sweep(tmp, out)  # a re-run takes over the stale locks and finishes the sweep
    assert res.rc == 0, res.err
    assert _states(out) == {f"{r}-s0": "done" for r in RUNS}
    man = json.loads((out / "sweep.json").read_text())
    assert {r["name"]: r["status"] for r in man["runs"]} == {f"{r}-s0": "done" for r in RUNS}


def _interrupted_parent(tmp: Path) -> None:
    # Ctrl-C / SIGTERM of the sweep process alone (not its process group): it must not wait for its workers' runs
    # (held here forever), but stop them so they unwind: runs marked failed, run locks released
    from weightgeom.experiments.runner import WORKER_GRACE_S
    from weightgeom.train.rundir import read_lock

    out = tmp / "sw"
    proc, hold, workers = _held_workers(tmp, out)
    try:
        os.kill(proc.pid, signal.SIGINT)
        # the hold file still exists: waiting for the runs would never end. The bound leaves room for the workers'
        # grace (WORKER_GRACE_S), a kill and the interpreter's exit on a loaded 2-core machine (60 s timed out once
        # in CI beside two other jobs; alone it takes 10-32 s)
        proc.wait(timeout=WORKER_GRACE_S + 100)
        assert not [p for p in workers if _running(p)], "workers outlived the interrupted sweep"
        for r in RUNS:
            st = json.loads((out / f"{r}-s0" / "status.json").read_text())
            assert st["state"] == "failed" and "KeyboardInterrupt" in st["reason"], st
            assert read_lock(out / f"{r}-s0") is None
        assert read_lock(out) is None
    finally:
        _stop(proc, workers, hold)


def _changed_settings_refused(tmp: Path) -> None:
    out = tmp / "sw"
    assert _sweep(tmp, out).rc == 0
    before = _snapshot(out)
    res = _sweep(tmp, out, "--set", "optim.adamw.weight_decay=0.5")
    line = assert_one_line_error(res, f"run {RUNS[0]}-s0 was trained with optim.adamw.weight_decay=", "asks 0.5",
                                 "--no-resume")
    assert str(out) in line
    res = _sweep(tmp, out, "--steps", "5")
    assert_one_line_error(res, f"run {RUNS[0]}-s0 was trained with train.max_steps=3, the command asks 5")
    assert _snapshot(out) == before  # nothing written: the manifest still describes the runs as they were trained
    res = _sweep(tmp, out)  # the unchanged command still resumes (skips the finished runs)
    assert res.rc == 0 and res.out.count("(skipped)") == 2, res.err


def _no_resume_keeps_previous(tmp: Path) -> None:
    out = tmp / "sw"
    assert _sweep(tmp, out).rc == 0
    run = out / f"{RUNS[0]}-s0"
    old_ckpt = (run / "checkpoints" / "ckpt_00000003.pt").read_bytes()
    old_metrics = (run / "metrics.jsonl").read_text()
    old_exp = json.loads((run / "experiment.json").read_text())
    res = _sweep(tmp, out, "--no-resume", "--set", "optim.adamw.weight_decay=0.5")
    assert res.rc == 0, res.err
    prev = list((run / "previous").iterdir())
    assert len(prev) == 1, prev
    assert (prev[0] / "checkpoints" / "ckpt_00000003.pt").read_bytes() == old_ckpt
    assert (prev[0] / "metrics.jsonl").read_text() == old_metrics
    assert json.loads((prev[0] / "experiment.previous.json").read_text()) == old_exp
    new_exp = json.loads((run / "experiment.json").read_text())
    assert new_exp["settings"]["optim.adamw.weight_decay"] == 0.5 != old_exp["settings"]["optim.adamw.weight_decay"]
    assert json.loads((run / "status.json").read_text())["state"] == "done"
    # the re-trained runs are recorded with their new settings: the same command now resumes
    res = _sweep(tmp, out, "--set", "optim.adamw.weight_decay=0.5")
    assert res.rc == 0 and res.out.count("(skipped)") == 2, res.err


def _sweep_level_settings(tmp: Path) -> None:
    out = tmp / "sw"
    first, other = RUNS
    assert _sweep_only(tmp, out, first).rc == 0
    before = _snapshot(out)
    refusals = [
        (("--steps", "5"), ("was run with no --steps, the command gives --steps 5", "use --out")),
        (("--set", "optim.adamw.weight_decay=0.5"), ("without --set optim.adamw.weight_decay", "use --out")),
        (("--steps", "5", "--no-resume"), ("--no-resume would leave 1 of its runs", f"{first}-s0")),
    ]
    for extra, expect in refusals:  # the command plans only a run the directory does not hold yet
        line = assert_one_line_error(_sweep_only(tmp, out, other, *extra), *expect)
        assert str(out) in line
        assert _snapshot(out) == before  # nothing written: no run of other settings joins the sweep
    res = _sweep_only(tmp, out, other, "--seeds", "1")  # another subset and seed: the same sweep, added to
    assert res.rc == 0, res.err
    man = json.loads((out / "sweep.json").read_text())
    assert sorted(r["name"] for r in man["runs"]) == [f"{first}-s0", f"{other}-s1"]
    assert man["seeds"] == [0, 1]
    assert [(i["only"], i["seeds"]) for i in man["invocations"]] == [([first], [0]), ([other], [1])]


def _report_mixed_steps(tmp: Path) -> None:
    a, b = tmp / "a", tmp / "b"
    assert _sweep_only(tmp, a, RUNS[0]).rc == 0
    assert _sweep_only(tmp, b, RUNS[1], "--steps", "2").rc == 0
    res = cli("report", str(a), str(b), "--out", str(tmp / "rep"))
    assert res.rc == 0, res.err
    warn = [ln for ln in res.err.splitlines() if ln.strip()]
    assert len(warn) == 1 and "warning" in warn[0] and "train.max_steps: 2 (1 run" in warn[0] \
        and "3 (1 run" in warn[0], res.err
    assert "**Warning:**" in (tmp / "rep" / "report.md").read_text()


def _bad_input(tmp: Path) -> None:
    cfg = _sweep_file(tmp)
    out = tmp / "sw"
    cases = [
        (("sweep", "md", "no-such-preset"), "unknown preset 'no-such-preset'"),
        (("sweep", "md", cfg, "--only", "nope"), "--only nope matches no variant"),
        (("sweep", "md", cfg, "--set", "train.nope=1"), "train.nope"),
        (("sweep", "md", cfg, "--set", "optim.adamw.lr=-1"), "optim.adamw.lr"),
        (("sweep", "md", cfg, "--set", "optim.name=muon"), "--set optim.name: recipe 'md' sets this key itself"),
        (("sweep", "md", cfg, "--set", "run.seed=3"), "--set run.seed: the sweep sets run.seed"),
        (("sweep", "md", cfg, "--steps", "0"), "--steps"),
    ]
    for args, expect in cases:
        assert_one_line_error(cli(*args, "--out", str(out), "--no-report"), expect)
        assert not out.exists(), f"{args} wrote {out}"
    (tmp / "afile").write_text("keep me")
    assert_one_line_error(cli("sweep", "md", cfg, "--out", str(tmp / "afile")), "afile", "not a directory")
    assert (tmp / "afile").read_text() == "keep me"


def _deeply_nested_files(tmp: Path) -> None:
    # sweep.json of 100000 nested lists, and run files as deep: one line naming the file, the sweep still runs
    out = tmp / "sw"
    assert _sweep_only(tmp, out, RUNS[0]).rc == 0
    deep = "[" * 100_000 + "]" * 100_000
    (out / "sweep.json").write_text(deep)
    run = out / f"{RUNS[0]}-s0"
    for name in ("experiment.json", "status.json"):
        (run / name).write_text(deep)
    res = _sweep(tmp, out)
    assert "Traceback" not in res.err and res.rc == 0, res.err[-2000:]
    warn = [ln for ln in res.err.splitlines() if "sweep.json" in ln]
    assert len(warn) == 1 and "nested too deeply" in warn[0], res.err
    (kept,) = out.glob("sweep.unreadable-*.json")  # nothing lost: the file is kept as it was
    assert kept.read_text() == deep
    assert {r["name"] for r in json.loads((out / "sweep.json").read_text())["runs"]} == {f"{r}-s0" for r in RUNS}
    (tmp / "deep.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000)  # the sweep's config file
    assert_one_line_error(cli("sweep", "md", str(tmp / "deep.toml"), "--out", str(tmp / "sw2")), "deep.toml")
    assert not (tmp / "sw2").exists()


CASES: list[Hostile] = [
    Hostile("two-sweeps-one-dir", "sweep",
            "a second `weightgeom sweep` in a directory a running sweep owns exits 2 with one line naming the owner's "
            "pid and host, and writes nothing", _two_sweeps_one_dir),
    Hostile("interrupted-parent", "sweep",
            "Ctrl-C or SIGTERM of a sweep process with `--jobs 2` stops its workers instead of waiting for their runs: "
            "each run is marked failed and its lock released", _interrupted_parent),
    Hostile("killed-parent", "sweep",
            "`kill -9` of a sweep process with `--jobs 2` takes its worker processes with it within seconds; a re-run "
            "then takes over the stale locks and finishes the sweep", _killed_parent),
    Hostile("changed-settings", "sweep",
            "re-running a finished sweep with a changed `--set` or `--steps` is refused with one line naming the run "
            "and the first differing setting (never reported as done under the new settings); nothing is written",
            _changed_settings_refused),
    Hostile("no-resume-keeps-previous", "sweep",
            "`--no-resume` trains the runs again and moves each earlier run (checkpoints, metrics, experiment record) "
            "to `<run>/previous/<time>/`; nothing is deleted", _no_resume_keeps_previous),
    Hostile("sweep-level-settings", "sweep",
            "a sweep directory keeps one recipe, config, `--steps` and `--set`: a command with other ones exits 2 "
            "with one line naming the first difference, even when it adds only new runs (another `--only`), and "
            "writes nothing; other `--only` / `--seeds` join the sweep, and `sweep.json` keeps every invocation",
            _sweep_level_settings),
    Hostile("report-mixed-steps", "sweep",
            "`weightgeom report` on runs trained for different `train.max_steps` warns with one line on stderr and "
            "a note in `report.md`", _report_mixed_steps),
    Hostile("bad-input", "sweep",
            "an unknown preset, an `--only` that matches nothing, a bad `--set` key or value, `--steps 0`, or an "
            "`--out` that is a file: one line, exit 2, nothing written", _bad_input),
    Hostile("deeply-nested-files", "sweep",
            "a `sweep.json` of 100000 nested lists (and a run's `experiment.json` and `status.json` as deep) gets one "
            "line naming it and is kept aside byte for byte while the sweep runs; a config file as deep is one line, "
            "exit 2, nothing written", _deeply_nested_files),
]
