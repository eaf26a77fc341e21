"""Sweeps on clusters: ``weightgeom sweep --launcher slurm | ray`` (weightgeom.experiments.launchers).

The SLURM path runs through submitit's local executor (the same jobs, checkpointing hook and requeue, as local
processes); the Ray path through a local Ray instance (marked ``ray``). Both packages are test dependencies
(``setup.sh`` installs the ``slurm`` and ``ray`` extras), so these tests never skip for a missing package.
"""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import weightgeom._signals as wgsig
from weightgeom._fmt import duration
from weightgeom.cli import Terminated, main
from weightgeom.experiments import launchers
from weightgeom.experiments.cli import get_recipe
from weightgeom.experiments.runner import load_parts, plan
from weightgeom.train.checkpoint import checkpoint_name
from weightgeom.train.rundir import LOCK_NAME, read_status

LOCAL_SLURM = ["--launcher", "slurm", "--submitit-cluster", "local", "--cpus-per-run", "1", "--no-report"]


def _manifest(out: Path) -> dict:
    return json.loads((out / "sweep.json").read_text())


def _records(out: Path) -> dict:
    return {r["name"]: r for r in _manifest(out)["runs"]}


def test_slurm_dry_run_prints_commands_and_resources_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "sw"
    rc = main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--dry-run", "--only",
               "all-stiefel,unconstrained", "--gpus-per-run", "4", "--cpus-per-run", "16", "--mem-per-run", "64",
               "--partition", "gpu", "--time-limit", "12:00:00", "--set", "train.grad_accum=4"])
    text = capsys.readouterr().out
    assert rc == 0
    assert not out.exists()  # nothing written, nothing submitted
    lines = [ln for ln in text.splitlines() if ln.startswith(("all-stiefel-s0:", "unconstrained-s0:"))]
    assert len(lines) == 2
    for ln in lines:
        assert "torch.distributed.run --standalone --nproc_per_node=4 -m weightgeom.experiments.launchers" in ln
        assert "gpus=4 cpus=16 mem=64GB time=720min partition=gpu" in ln
        assert str(out.resolve() / ".launch") in ln
    assert "2 of 2 runs would be submitted as one SLURM job array" in text
    # one GPU: no torchrun; a finished run is listed as not submitted
    (out / "all-stiefel-s0").mkdir(parents=True)
    (out / "all-stiefel-s0" / "status.json").write_text(json.dumps({"state": "done", "step": 4}))
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--dry-run", "--only",
                 "all-stiefel,unconstrained", "--gpus-per-run", "1"]) == 0
    text = capsys.readouterr().out
    assert "all-stiefel-s0: already done (not submitted)" in text
    assert [ln for ln in text.splitlines() if ln.startswith("unconstrained-s0:")][0].split("  [")[0].endswith(
        f"-m weightgeom.experiments.launchers {out.resolve() / '.launch' / 'unconstrained-s0.json'}")
    assert "1 of 2 runs would be submitted" in text


def test_dry_run_prints_each_arms_settings_and_an_expected_run_time(tmp_path, capsys):
    """Each run's arm is named with the settings that differ between arms, and the run time is the stated FLOP
    estimate (6 · non-embedding parameters · tokens at the recorded rate), per run and for the whole sweep."""
    from weightgeom.experiments import estimate

    out = tmp_path / "sw"
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--dry-run", "--only",
                 "all-stiefel,unconstrained", "--gpus-per-run", "1", "--steps", "40"]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    assert "settings every run shares: train.max_steps=40," in text
    arms = [ln for ln in text.splitlines() if ln.startswith("  arm ")]
    assert len(arms) == 2 * len([ln for ln in text.splitlines() if ln.startswith("all-stiefel-s")])
    stiefel = next(ln for ln in arms if ln.startswith("  arm all-stiefel:"))
    assert "optim.strategy=all-stiefel" in stiefel and "train.max_steps" not in stiefel
    # the estimate, from the same settings the runs train with
    _, parts, sweep = load_parts("ci", "manifolds")
    spec = plan("manifolds", get_recipe("manifolds").variants(parts, sweep, 40), parts, [0], steps=40,
                only=["all-stiefel"])[0]
    params = estimate.nonembedding_params(spec.config["model"])
    tokens = estimate.run_tokens(spec.resolved())
    assert params > 0 and tokens == 40 * spec.resolved()["data.batch_size"] * spec.resolved()["data.block_size"]
    opt = estimate.optimizer_flops_per_step(spec.resolved(), spec.config["model"])
    assert opt > 0
    secs = (6 * params * tokens + 40 * opt) / estimate.GPU_TRAIN_FLOPS
    assert stiefel.endswith(f"expected ≈ {duration(secs)}")
    assert "expected run time:" in text and "the time limit is 240 min per job" in text
    assert "the order of magnitude" in text
    # MNIST examples are vectors: the block size of the config does not multiply them
    mnist = {"train.max_steps": 500, "data.batch_size": 128, "data.block_size": 128, "data.kind": "mnist"}
    assert estimate.run_tokens(mnist) == 500 * 128


@pytest.mark.parametrize("launcher,module,extra", [("slurm", "submitit", "slurm"), ("ray", "ray", "ray")])
def test_missing_launcher_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch, launcher, module,
                                                               extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    out = tmp_path / "sw"
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", launcher, "--only", "hetero"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pip install 'weightgeom[{extra}]'" in err[0] and f"--launcher {launcher}" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("args,needle", [
    (["--partition", "gpu"], "--partition is an option of --launcher slurm, not local"),
    (["--launcher", "ray", "--time-limit", "60"], "--time-limit is an option of --launcher slurm, not ray"),
    (["--launcher", "slurm", "--jobs", "2"], "--jobs 2 applies to --launcher local"),
    (["--launcher", "slurm", "--time-limit", "1:xx"], "--time-limit '1:xx'"),
    (["--launcher", "slurm", "--slurm-opt", "account"], "--slurm-opt 'account': expected KEY=VALUE"),
])
def test_bad_cluster_options_are_one_line(tmp_path, capsys, args, needle):
    out = tmp_path / "sw"
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--only", "hetero", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not out.exists()


def test_slurm_without_sbatch_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch / srun here
    out = tmp_path / "sw"
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--only", "hetero", "--launcher", "slurm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sbatch and srun are not found" in err[0] and "--submitit-cluster local" in err[0]
    assert not out.exists()


def _wait_for(pred, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_submitit_sweep_failure_kill_and_resume(tmp_path, capsys):
    """The CI preset through submitit's local executor: a run failing by its own error is recorded with its reason
    and the others finish; a sweep process killed with kill -9 takes its jobs with it; re-running the command skips
    the finished runs (never submitted again) and finishes the rest."""
    out = tmp_path / "sw"
    steps = 200  # long enough (seconds) that the kill -9 below lands while all-stiefel trains, on a fast CPU too
    common = ["sweep", "manifolds", "ci", "--out", str(out), "--steps", str(steps), *LOCAL_SLURM]
    # 1. unconstrained trains; all-dgram-capped has a corrupt checkpoint: its own error, recorded, the sweep goes on
    bad = out / "all-dgram-capped-s0" / "checkpoints"
    bad.mkdir(parents=True)
    (bad / checkpoint_name(1)).write_bytes(b"not a checkpoint")
    assert main([*common, "--only", "unconstrained,all-dgram-capped"]) == 1
    recs = _records(out)
    assert recs["unconstrained-s0"]["status"] == "done"
    assert recs["all-dgram-capped-s0"]["status"] == "failed"
    reason = recs["all-dgram-capped-s0"]["reason"]
    assert "\n" not in reason and checkpoint_name(1) in reason, reason
    assert recs["unconstrained-s0"]["job"]["launcher"] == "slurm"
    first_job = recs["unconstrained-s0"]["job"]["id"]
    metrics = (out / "unconstrained-s0" / "metrics.jsonl").read_bytes()
    capsys.readouterr()

    # 2. a sweep process killed with kill -9 while its job trains: the job dies with it
    cmd = [sys.executable, "-m", "weightgeom", *common, "--only", "unconstrained,all-stiefel"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    attempt = out / ".launch" / "all-stiefel-s0.attempt.json"
    try:
        metrics_file = out / "all-stiefel-s0" / "metrics.jsonl"
        _wait_for(lambda: attempt.exists() and metrics_file.exists() and metrics_file.stat().st_size > 0, 120,
                  "the all-stiefel job to train")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    pid = json.loads(attempt.read_text())["pid"]
    _wait_for(lambda: not Path(f"/proc/{pid}").exists() or
              Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z", 30,
              "the job to die with its sweep process")
    assert read_status(out / "all-stiefel-s0").get("state") != "done"

    # 3. re-running the same command: unconstrained is skipped (not submitted), all-stiefel trains to the end
    assert main([*common, "--only", "unconstrained,all-stiefel"]) == 1  # step 1's failed run is still failed
    text = capsys.readouterr().out
    assert f"unconstrained-s0: already done at step {steps} (skipped)" in text
    recs = _records(out)
    assert recs["unconstrained-s0"]["job"]["id"] == first_job  # never submitted again
    assert (out / "unconstrained-s0" / "metrics.jsonl").read_bytes() == metrics
    assert recs["all-stiefel-s0"]["status"] == "done" and recs["all-stiefel-s0"]["step"] == steps
    m = _manifest(out)
    assert [inv["launcher"] for inv in m["invocations"]] == ["slurm"] * 3
    assert not (out / "all-stiefel-s0" / ".weightgeom.lock").exists()


def test_preempted_job_is_requeued_and_resumes_from_its_checkpoint(tmp_path):
    """submitit's checkpointing hook: SIGUSR2 (SLURM's preemption / time-limit signal) stops the training cleanly,
    the same job is requeued and continues from the newest checkpoint; every step is logged once."""
    recipe = get_recipe("manifolds")
    _, parts, sweep = load_parts("ci", "manifolds")
    steps = 24
    spec = plan("manifolds", recipe.variants(parts, sweep, steps), parts, [0], steps=steps, only=["unconstrained"],
                sets={"train.ckpt_every": 2})[0]
    spec.fresh = True  # as under --no-resume: the first attempt starts over, the requeued one must still resume
    out = (tmp_path / "sw").resolve()
    path = launchers.write_job(out, spec, 1)
    ex = launchers.SlurmLauncher(cluster="local").executor(out / ".launch" / "submitit")
    job = ex.submit(launchers.SubmititRun(str(path), 0))
    ckpts = out / spec.name / "checkpoints"
    _wait_for(lambda: ckpts.exists() and any(ckpts.glob("ckpt_*.pt")), 120, "a first checkpoint")
    attempt = json.loads((out / ".launch" / f"{spec.name}.attempt.json").read_text())
    task_pid = int(Path(f"/proc/{attempt['pid']}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(task_pid, signal.SIGUSR2)  # what SLURM sends before preempting or at the time limit
    kind, result, _ = job.result()
    assert kind == "ok" and result["status"] == "done" and result["step"] == steps
    log = (out / ".launch" / f"{spec.name}.log").read_text()
    assert log.count("--- ") == 2 and "stopped by SIGTERM" in log  # two attempts, the first stopped cleanly
    assert "taking over the lock" not in log  # ... and released its run's lock itself (it was not killed unwinding)
    rows = [json.loads(ln) for ln in (out / spec.name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, steps + 1))
    assert not (out / spec.name / "previous").exists()  # resumed, not started over


@pytest.mark.ray
def test_ray_local_instance_sweep_and_rerun(tmp_path, capsys):
    """The CI preset as Ray tasks on a local Ray instance; re-running skips every finished run (no task)."""
    out = tmp_path / "sw"
    cmd = ["sweep", "manifolds", "ci", "--out", str(out), "--steps", "2", "--only", "unconstrained,all-stiefel",
           "--launcher", "ray", "--cpus-per-run", "1"]
    assert main(cmd) == 0
    text = capsys.readouterr().out
    assert "submitted 2 Ray tasks" in text
    recs = _records(out)
    assert {recs[n]["status"] for n in ("unconstrained-s0", "all-stiefel-s0")} == {"done"}
    assert (out / "report.md").exists()
    assert _manifest(out)["invocations"][-1]["launcher"] == "ray"
    assert main(cmd) == 0
    text = capsys.readouterr().out
    assert "Ray tasks" not in text and text.count("(skipped)") == 2


def test_job_wrapper_starts_without_torch():
    """submitit's job process and Ray's worker unpickle this module only to start the training process: importing
    it must not import torch (seconds, tens on a loaded node, per job attempt)."""
    code = "import sys, weightgeom.experiments.launchers as l; print('torch' in sys.modules, l.LOCK_NAME)"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert got == ["False", LOCK_NAME]


def test_cluster_launchers_hold_back_runs_that_wait_for_another():
    """A run declared to come after another (an LR ladder's next rung) is submitted only once that run finished, and
    recorded as skipped when the sweep says so; with nothing in flight, what still waits is released."""
    class Sweep:
        def __init__(self):
            self.state = {0: ("run", ""), 1: ("wait", ""), 2: ("skip", "not trained: a diverged")}
            self.skipped = []

        def blocked(self, i):
            return self.state[i]

        def skip(self, i, why):
            self.skipped.append((i, why))

    sweep, queue = Sweep(), [0, 1, 2]
    ray = launchers.RayLauncher()
    assert ray._ready(sweep, queue, in_flight=False) == [0]
    assert queue == [1] and sweep.skipped == [(2, "not trained: a diverged")]
    assert ray._ready(sweep, queue, in_flight=True) == [] and queue == [1]  # run 0 in flight: 1 waits
    sweep.state[1] = ("run", "")
    assert ray._ready(sweep, queue, in_flight=True) == [1] and queue == []
    sweep.state = {3: ("wait", "")}
    queue = [3]
    assert ray._ready(sweep, queue, in_flight=False) == [3]  # nothing can release it any more


def test_stop_request_waits_until_the_main_thread_leaves_threading_code(monkeypatch):
    """A SIGTERM that lands while the training process is inside threading/queue code (handing TensorBoard's writer
    thread its scalars) is raised a moment later, outside it: raised there, it can leave the writer thread never woken,
    and the unwinding hangs until the job wrapper kills the process with the run's lock left and no reason logged."""
    in_queue = types.SimpleNamespace(f_globals={"__name__": "queue"},
                                     f_back=types.SimpleNamespace(f_globals={"__name__": "weightgeom.train.trainer"},
                                                                  f_back=None))
    outside = types.SimpleNamespace(f_globals={"__name__": "weightgeom.train.trainer"}, f_back=None)
    monkeypatch.setattr(wgsig, "_STOP", {})
    armed = []
    monkeypatch.setattr(signal, "setitimer", lambda which, secs: armed.append((which, secs)))
    launchers._raise_terminated(signal.SIGTERM, in_queue)  # deferred: nothing raised, a retry armed
    assert armed == [(signal.ITIMER_REAL, wgsig._STOP_RETRY_S)]
    launchers._raise_terminated(signal.SIGALRM, in_queue)  # still inside: retried again
    assert len(armed) == 2
    with pytest.raises(Terminated, match="stopped by SIGTERM"):
        launchers._raise_terminated(signal.SIGALRM, outside)  # the retry, once outside: the original request
    launchers._raise_terminated(signal.SIGALRM, outside)  # a late retry of a request already raised: nothing
    with pytest.raises(Terminated, match="stopped by SIGUSR2"):
        launchers._raise_terminated(signal.SIGUSR2, outside)  # outside threading code: raised at once
    wgsig._STOP.update(reason="stopped by SIGTERM (preemption or time limit)",
                           since=time.monotonic() - wgsig.STOP_DEFER_S)
    with pytest.raises(Terminated, match="stopped by SIGTERM"):
        launchers._raise_terminated(signal.SIGALRM, in_queue)  # deferred long enough: raised regardless
    assert len(armed) == 2
    # the plain CLI (weightgeom train under SIGTERM) installs the same deferring handler, SIGALRM included
    with wgsig.sigterm_unwinds():
        assert signal.getsignal(signal.SIGALRM) is signal.getsignal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM).__qualname__.startswith("stop_request_handler")


@pytest.mark.parametrize("flags,needle", [
    (["--mem-per-run", "0"], "--mem-per-run 0: must be a positive number"),
    (["--mem-per-run", "-1"], "--mem-per-run -1"),
    (["--time-limit", "25:99:99"], "minutes and seconds run 0–59"),
    (["--time-limit", "1-25:00:00"], "hours 0–23"),
    (["--time-limit", "99999999"], "longer than 365 days"),
    (["--slurm-opt", "partition=x"], "partition is set by --partition"),
    (["--slurm-opt", "time=10"], "time is set by --time-limit"),
    (["--slurm-opt", "gres=gpu:2"], "gres is set by --gpus-per-run"),
    (["--slurm-opt", "a b=c"], "expected KEY=VALUE with an sbatch option name"),
    (["--slurm-opt", "=x"], "expected KEY=VALUE"),
    (["--gpus-per-run", "-1"], "argument --gpus-per-run: expected an integer >= 0"),
])
def test_bad_cluster_options_are_one_line_and_exit_2(tmp_path, capsys, flags, needle):
    """Hostile trial: each of these used to be accepted (mem 0 means a whole node to SLURM, a --slurm-opt could
    silently override --partition/--time-limit) or printed argparse's usage block before the error."""
    out = tmp_path / "sw"
    with pytest.raises(SystemExit) if flags[0] == "--gpus-per-run" else contextlib.nullcontext():
        rc = main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--dry-run", *flags])
        assert rc == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("case", ["file-in-the-way", "unwritable", "settings", "dangling-link", "link-loop",
                                  "file-as-run-dir", "in-use"])
def test_dry_run_predicts_the_refusals_of_the_real_command(tmp_path, capsys, case):
    """Hostile-trial leftover: a dry run printed a plan for an --out the sweep could not write, or for a sweep
    directory whose recorded --steps the command contradicts; now it refuses as the command would (one line, exit
    2) and still writes nothing."""
    out = tmp_path / "sw"
    extra = []
    if case == "file-in-the-way":
        out.write_text("x")
    elif case == "unwritable":
        out = Path("/proc/no/such/sweep")
    elif case == "dangling-link":
        out.symlink_to(tmp_path / "nowhere" / "dir")
    elif case == "link-loop":
        (tmp_path / "loop").symlink_to(out)
        out.symlink_to(tmp_path / "loop")
    elif case == "file-as-run-dir":
        out.mkdir()
        (out / "unconstrained-s0").write_text("x")
    elif case == "in-use":  # a live sweep (here: this test's parent process) holds the directory
        import platform

        from weightgeom.train import rundir

        out.mkdir()
        (out / rundir.LOCK_NAME).write_text(json.dumps({
            "pid": os.getppid(), "host": platform.node(), "start": rundir._proc_start_time(os.getppid()),
            "time": "2026-12-03T00:00:00Z", "command": ["weightgeom", "sweep"]}))
    else:
        assert main(["sweep", "manifolds", "ci", "--out", str(out), "--only", "unconstrained", "--steps", "2",
                     "--no-report"]) == 0
        extra = ["--steps", "3"]
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
    capsys.readouterr()
    rc = main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--dry-run", "--only",
               "unconstrained", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert {"file-in-the-way": "exists and is not a directory", "unwritable": "cannot create anything",
            "settings": "run unconstrained-s0 was trained with train.max_steps=2",
            "dangling-link": "symbolic link that leads nowhere", "link-loop": "symbolic link that leads nowhere",
            "file-as-run-dir": "unconstrained-s0: exists and is not a directory",
            "in-use": f"is in use by pid {os.getppid()}"}[case] in err[0], err
    if case in ("settings", "file-as-run-dir", "in-use"):
        before = sorted(p.relative_to(out) for p in out.rglob("*")) if case != "settings" else before
        # the same line as the command itself gives, and the command writes nothing either
        assert main(["sweep", "manifolds", "ci", "--out", str(out), "--only", "unconstrained", *extra]) == 2
        assert capsys.readouterr().err.strip().splitlines() == err
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_dry_run_shows_extra_sbatch_options_and_no_resume(tmp_path, capsys):
    out = tmp_path / "sw"
    (out / "unconstrained-s0").mkdir(parents=True)
    (out / "unconstrained-s0" / "status.json").write_text(json.dumps({"state": "done", "step": 4}))
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--dry-run", "--only",
                 "unconstrained", "--slurm-opt", "account=me", "--slurm-opt", "qos=high", "--slurm-setup",
                 "module load cuda", "--no-resume"]) == 0
    text = capsys.readouterr().out
    assert "  sbatch --account=me" in text and "  sbatch --qos=high" in text and "  setup: module load cuda" in text
    assert "--no-resume trains it again" in text and "1 of 1 runs would be submitted" in text


def test_gpus_per_run_that_the_trainer_would_refuse_is_refused_before_submitting(tmp_path, capsys):
    """Hostile trial: --gpus-per-run 2 with train.grad_accum=1 used to be submitted and fail on the cluster."""
    out = tmp_path / "sw"
    common = ["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--dry-run", "--only",
              "unconstrained", "--gpus-per-run", "2"]
    assert main(common) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.grad_accum=1" in err[0] and "--set train.grad_accum=2" in err[0], err
    assert main([*common, "--set", "train.grad_accum=2"]) == 0


def test_a_once_handler_raises_one_stop_and_ignores_the_next_signal(monkeypatch):
    """A sweep worker's SIGINT handler (once=True): Ctrl-C reaches it from the terminal and from the sweep; the second
    must not interrupt the unwinding that writes the run's status (hostile trial: runs left "running")."""
    monkeypatch.setattr(wgsig, "_STOP", {})
    outside = types.SimpleNamespace(f_globals={"__name__": "weightgeom.train.trainer"}, f_back=None)
    h = wgsig.stop_request_handler("interrupted ({signal})", exc_type=KeyboardInterrupt, once=True)
    with pytest.raises(KeyboardInterrupt, match="interrupted"):
        h(signal.SIGINT, outside)
    h(signal.SIGINT, outside)  # ignored
    again = wgsig.stop_request_handler("x", exc_type=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        again(signal.SIGINT, outside)
    with pytest.raises(KeyboardInterrupt):  # without once, every signal raises
        again(signal.SIGINT, outside)


def test_dry_run_lists_the_paths_runs_read_and_the_gpu_hours(tmp_path, capsys):
    """A cluster dry run names every path the runs read — flagged where it does not exist here — and the GPU-hours
    the submission requests at most; --check-paths refuses a missing one (one line, exit 2), before anything is
    written."""
    out = tmp_path / "sw"
    data = tmp_path / "owt"
    common = ["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--only",
              "all-stiefel,unconstrained", "--set", "data.kind=bin", "--gpus-per-run", "2", "--time-limit", "90",
              "--set", "train.grad_accum=2"]
    assert main([*common, "--dry-run", "--set", f"data.path={data}"]) == 0
    text = capsys.readouterr().out
    assert "paths the runs read (they must exist where the runs train):" in text
    assert f"  {data}  (NOT FOUND on this machine; every run)" in text
    assert f"  {sys.executable}  (exists here; every run)" in text
    assert "GPU-hours requested per time-limit window: 2 runs × 2 GPU × 1.5 h = 6 GPU-hours" in text
    # per-run CPUs and memory of a GPU run sized from the config where the command line is silent, and said how
    assert "  cpus per run 16: 8 per GPU (--cpus-per-run to change)" in text
    from weightgeom.experiments.launchers import BYTES_PER_PARAM, RUNTIME_GB_PER_PROCESS
    from weightgeom.experiments.runner import load_parts
    from weightgeom.train.trainer import model_from_config

    parts = load_parts("ci", "manifolds")[1]
    n = sum(p.numel() for p in model_from_config(dict(next(iter(parts.values()))["model"])).parameters())
    mem = math.ceil(2 * (RUNTIME_GB_PER_PROCESS + BYTES_PER_PARAM * n / 1e9))
    assert f"  memory per run {mem:g} GB: 2 process(es) × (4 GB + 32 B × {n / 1e6:.1f}M parameters)" in text
    assert f"gpus=2 cpus=16 mem={mem:g}GB time=90min" in text
    # the array's sbatch script, as submitit writes it
    script = text.split("the sbatch script of the array", 1)[1]
    for line in ("#!/bin/bash", "#SBATCH --array=0-1%2", "#SBATCH --gpus-per-node=2", "#SBATCH --cpus-per-task=16",
                 f"#SBATCH --mem={mem:g}GB", "#SBATCH --time=90", "#SBATCH --job-name=weightgeom",
                 f"-m submitit.core._submit {out.resolve() / '.launch' / 'submitit'}"):
        assert line in script, line
    # --submitit-cluster local submits no sbatch job: no script is shown
    assert main([*common, "--dry-run", "--set", f"data.path={data}", "--submitit-cluster", "local"]) == 0
    assert "sbatch script" not in capsys.readouterr().out
    assert main([*common, "--dry-run", "--set", f"data.path={data}", "--check-paths"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"--check-paths: data.path={data} (run unconstrained-s0 and 1 more) does not exist" in err[0]
    assert not out.exists()
    data.mkdir()
    assert main([*common, "--dry-run", "--set", f"data.path={data}", "--check-paths"]) == 0
    assert f"  {data}  (exists here; every run)" in capsys.readouterr().out
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--check-paths", "--list"]) == 2
    assert "--check-paths is an option of --launcher slurm / ray" in capsys.readouterr().err


def test_ray_dry_run_needs_no_ray_and_prints_the_task_spec(tmp_path, capsys, monkeypatch):
    """A Ray dry run submits nothing, so it works without the ray package, and shows the task each run becomes."""
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    out = tmp_path / "sw"
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "ray", "--only", "all-stiefel",
                 "--gpus-per-run", "1", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "runs would be submitted as Ray tasks" in text
    assert ".options(num_cpus=8, num_gpus=1, max_retries=3, retry_exceptions=False)" in text
    assert not out.exists()


@pytest.mark.parametrize("flags,says", [
    (["--slurm-opt", "comment=x\n#SBATCH --foo\ntouch PWNED"], "line break or control character"),
    (["--slurm-setup", "module load cuda\nrm -rf x"], "line break or control character"),
    (["--partition", "a b;x"], "expected a SLURM partition name"),
    (["--slurm-opt", "comment=a", "--slurm-opt", "comment=b"], "comment was already given"),
])
def test_cluster_options_cannot_add_lines_to_the_job_script(tmp_path, capsys, flags, says):
    """A cluster option's value becomes part of the sbatch script: a line break in it, a partition that is not a
    name, or one option given twice is refused in one line (exit 2) before anything is written."""
    out = tmp_path / "sw"
    assert main(["sweep", "manifolds", "ci", "--out", str(out), "--launcher", "slurm", "--gpus-per-run", "1",
                 "--dry-run", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err
    assert not out.exists()


def test_the_estimate_counts_muon_orthogonalisations_per_step():
    """A 1-layer GPT of width 8 (c_attn 24×8, c_proj 8×8, c_fc 32×8, mlp c_proj 8×32), msign of 3 iterations, 2 dual
    iterations: worked by hand from ≈ 4·m·n² + 2·n³ per iteration (tall m×n), one msign per plain-Muon matrix,
    dual.steps + 1 msigns plus 4·m·n² per dual iteration for a manifold matrix."""
    from weightgeom.experiments import estimate

    model = {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 8, "vocab_size": 50, "block_size": 16}
    base = {"optim.name": "muon", "optim.muon.ns_steps": 3, "optim.muon.dual.steps": 2}
    assert estimate.optimizer_flops_per_step({**base, "optim.strategy": "unconstrained"}, model) == 86016
    assert estimate.optimizer_flops_per_step({**base, "optim.strategy": "all-stiefel"}, model) == 307200
    assert estimate.optimizer_flops_per_step({**base, "optim.name": "adamw"}, model) == 0
    settings = {**base, "optim.strategy": "all-stiefel", "train.max_steps": 10, "data.batch_size": 2,
                "data.block_size": 4}
    assert estimate.expected_seconds(settings, 100, 0, 1, 307200) == pytest.approx(
        (6 * 100 * 80 + 10 * 307200) / estimate.CPU_TRAIN_FLOPS_PER_CORE)
