"""Where a sweep's runs train: ``--launcher local | slurm | ray``.

``local`` (the default) trains the runs in the sweep process, or ``--jobs N`` worker processes, as
:func:`weightgeom.experiments.runner.run_sweep` always did. ``slurm`` submits each run as a task of one SLURM job
array through ``submitit`` (partition, GPUs and CPUs per run, memory, time limit; ``torchrun`` inside the job when a
run asks for several GPUs). ``ray`` runs each run as a Ray task on an existing cluster (``ray.init(address=...)``) or
on a local Ray instance, with the GPUs and CPUs per run as the task's resources.

Whatever the launcher, the sweep process plans the runs, checks their settings, owns the sweep directory, writes
``sweep.json`` and the report; only the training moves. Each run is described by a JSON file
``<sweep>/.launch/<run>.json`` (the run's config and callbacks) and trained by ``python -m
weightgeom.experiments.launchers <that file>`` (the command ``--dry-run`` prints), which writes the outcome next to it
(``<run>.result.json``) and its output to ``<run>.log``. So the rules of a sweep hold on a cluster too:

* finished runs (``status.json`` ``done`` or ``diverged``) are never submitted again, and re-running the command after
  the sweep process was killed continues the sweep; a SLURM job of an earlier sweep process that is still pending or
  running is waited for, not submitted twice;
* a run the cluster stops (preemption, the time limit) is requeued by submitit's checkpointing hook (SLURM) or retried
  by Ray (``--max-retries``), and resumes from its newest checkpoint (``train.ckpt_every``); the run-directory lock
  left by the stopped attempt on another node is taken over by the next attempt of the same job;
* a run that fails by its own error is recorded ``failed`` with its one-line reason, and the other runs go on.

``submitit`` and ``ray`` are optional (``pip install 'weightgeom[slurm]'`` / ``'weightgeom[ray]'``); choosing a
launcher whose package is missing is one line naming the extra.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightgeom._files import open_append, read_json, write_atomic
from weightgeom._fmt import duration
from weightgeom._optional import import_extra
from weightgeom._signals import Terminated, stop_request_handler

if TYPE_CHECKING:
    from weightgeom.experiments.runner import RunSpec

LOCK_NAME = ".weightgeom.lock"  # weightgeom.train.rundir.LOCK_NAME (a test checks they agree)


def _runner() -> Any:
    """``weightgeom.experiments.runner``, imported on first use. This module is what a job's wrapper process
    (submitit's, a Ray worker) unpickles; it only starts the training process, so it must not spend seconds (tens,
    on a loaded node) importing torch: its top-level imports stay light, and the heavy modules are looked up by name
    (as the callback registry does) where the sweep process or the training process needs them."""
    return importlib.import_module("weightgeom.experiments.runner")


def _rundir() -> Any:
    """``weightgeom.train.rundir`` (locks, status), imported on first use (see :func:`_runner`)."""
    return importlib.import_module("weightgeom.train.rundir")

__all__ = ["LAUNCHERS", "Resources", "SlurmLauncher", "RayLauncher", "make_launcher", "require_package",
           "run_command", "dry_run", "required_paths", "check_paths", "sized_resources", "model_params", "LAUNCH_DIR",
           "main"]

LAUNCHERS = ("local", "slurm", "ray")
EXTRAS = {"slurm": ("submitit", "slurm"), "ray": ("ray", "ray")}
"""Launcher → (module it needs, pip extra of weightgeom that installs it)."""
LAUNCH_DIR = ".launch"
"""Sub-directory of the sweep directory holding each run's job description, outcome and log (and submitit's files)."""
DRIVER_ENV = "WEIGHTGEOM_SWEEP_DRIVER"
"""``pid:host:start`` of the sweep process, given to jobs of the local submitit executor so they end with it."""
RETRY_ENV = "WEIGHTGEOM_JOB_RETRY"
"""``1`` when this attempt of a job follows an earlier attempt of the same job (requeue, retry): it resumes."""
JOB_KEY_ENV = "WEIGHTGEOM_JOB_KEY"
"""The scheduler's identity of a job (SLURM job id, Ray task id), the same for every attempt of that job."""
MAX_TIMEOUT_REQUEUES = 20
"""How often submitit requeues a job that reached its time limit (preemptions do not count): a run may take up to 21
time limits in all, continuing from its checkpoint each time."""
ACTIVE_SLURM_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED",
                       "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "UNKNOWN")


def require_package(launcher: str) -> Any:
    """Import the package ``launcher`` needs.

    Raises:
        ValueError: it is not installed (one line naming the launcher and the pip extra).
    """
    module, extra = EXTRAS[launcher]
    return import_extra(module, extra, f"--launcher {launcher}")


@dataclass(frozen=True)
class Resources:
    """What each run of a sweep asks the cluster for.

    Attributes:
        gpus: GPUs per run (0: CPU only); more than 1 runs the training under ``torchrun`` (DDP, or FSDP with
            ``--set run.parallel=fsdp``), one process per GPU on one node.
        cpus: CPU cores per run (also the run's torch threads when ``--threads`` is not given).
        mem_gb: memory per run in GB (SLURM; None: the partition's default).
        time_min: time limit per job in minutes (SLURM); a run that needs longer is requeued by the
            checkpointing hook and continues from its checkpoint.
        partition: SLURM partition ("" : the cluster's default).
    """

    gpus: int = 0
    cpus: int = 1
    mem_gb: float | None = None
    time_min: int = 240
    partition: str = ""

    def describe(self, launcher: str) -> str:
        """``"gpus=1 cpus=8 mem=32GB time=240min partition=gpu"`` (the fields ``launcher`` uses)."""
        parts = [f"gpus={self.gpus}", f"cpus={self.cpus}"]
        if launcher == "slurm":
            if self.mem_gb is not None:
                parts.append(f"mem={self.mem_gb:g}GB")
            parts.append(f"time={self.time_min}min")
            parts.append(f"partition={self.partition or '(default)'}")
        return " ".join(parts)


MAX_TIME_LIMIT_MIN = 365 * 1440
"""Longest ``--time-limit`` accepted (one year, in minutes)."""

SLURM_OPT_RESERVED = {
    "partition": "--partition", "p": "--partition", "time": "--time-limit", "t": "--time-limit",
    "mem": "--mem-per-run", "mem_per_cpu": "--mem-per-run", "mem_per_gpu": "--mem-per-run",
    "gpus": "--gpus-per-run", "gpus_per_node": "--gpus-per-run", "gres": "--gpus-per-run",
    "gpus_per_task": "--gpus-per-run",
    "cpus_per_task": "--cpus-per-run", "c": "--cpus-per-run", "array": "--array-parallelism",
    "nodes": "(one node per run)", "N": "(one node per run)", "ntasks_per_node": "(one task per GPU)",
    "job_name": "(the run's name)", "output": "(.launch/<run>.log)", "error": "(.launch/<run>.log)",
    "signal": "(the requeue signal)", "open_mode": "(the job log)",
}
"""sbatch options that ``--slurm-opt`` may not set, and the flag (or the launcher's own choice) that sets them."""


def check_slurm_opt(item: str) -> tuple[str, str]:
    """(key, value) of one ``--slurm-opt KEY=VALUE`` (dashes and underscores alike).

    Raises:
        ValueError: not KEY=VALUE, a key that is not an sbatch option name, or one a dedicated flag sets.
    """
    key, sep, value = item.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", key):
        raise ValueError(f"--slurm-opt {item!r}: expected KEY=VALUE with an sbatch option name (e.g. account=myproj)")
    norm = key.replace("-", "_")
    if norm in SLURM_OPT_RESERVED:
        raise ValueError(f"--slurm-opt {item!r}: {key} is set by {SLURM_OPT_RESERVED[norm]}; use that instead")
    return norm, value.strip()


def parse_time_limit(text: str) -> int:
    """Minutes from ``"90"``, ``"1:30:00"`` (H:MM:SS) or ``"2-00:00:00"`` (D-HH:MM:SS).

    Raises:
        ValueError: anything else, or a limit below one minute (naming ``--time-limit`` and the value).
    """
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d{1,2}):(\d{1,2})|(\d+)", text.strip())
    if not m:
        raise ValueError(f"--time-limit {text!r}: expected minutes (90), H:MM:SS (1:30:00) or D-HH:MM:SS")
    if m.group(5):
        minutes = int(m.group(5))
    else:
        d, h, mi, s = (int(g or 0) for g in m.groups()[:4])
        if mi > 59 or s > 59 or (m.group(1) and h > 23):
            raise ValueError(f"--time-limit {text!r}: minutes and seconds run 0–59 (hours 0–23 after a day count)")
        minutes = d * 1440 + h * 60 + mi + (1 if s else 0)
    if minutes > MAX_TIME_LIMIT_MIN:
        raise ValueError(f"--time-limit {text!r}: longer than {MAX_TIME_LIMIT_MIN // 1440} days; a run longer than "
                         "one limit is requeued from its checkpoint anyway")
    if minutes < 1:
        raise ValueError(f"--time-limit {text!r}: must be at least one minute")
    return minutes


# ------------------------------------------------------------------------------------------------------- job files
def job_file(out: Path, name: str, suffix: str = ".json") -> Path:
    """``<sweep>/.launch/<run><suffix>``: the run's job description (``.json``), outcome (``.result.json``), output
    (``.log``) or last attempt (``.attempt.json``)."""
    return Path(out) / LAUNCH_DIR / f"{name}{suffix}"


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, default=str))


def _read_json(path: Path) -> Any:
    """A job file's JSON (``read_json``: bounded, one line for anything bad), or None where missing or unusable."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def write_job(out: Path, spec: RunSpec, threads: int | None) -> Path:
    """Write the job description of ``spec`` (config, callbacks, fresh start or resume, torch threads); an earlier
    outcome of the run is removed so it cannot be mistaken for this submission's."""
    path = job_file(Path(out).resolve(), spec.name)
    job_file(out, spec.name, ".result.json").unlink(missing_ok=True)
    _write_json(path, {"spec": asdict(spec), "run_dir": str(Path(out).resolve() / spec.name), "threads": threads})
    return path


def run_command(path: str | Path, gpus: int) -> list[str]:
    """The command that trains the run described by the job file ``path`` (``torchrun`` for several GPUs)."""
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                "-m", "weightgeom.experiments.launchers", str(path)]
    return [sys.executable, "-m", "weightgeom.experiments.launchers", str(path)]


_CHILD: subprocess.Popen | None = None


def run_job(path: str, gpus: int, job_key: str = "") -> tuple[str, Any, float]:
    """Train the run of job file ``path`` in a child process (this is what a SLURM job or a Ray task executes).

    Returns:
        ``("ok", trainer result, seconds)`` or ``("error", one-line reason, seconds)``.
    """
    global _CHILD
    t0 = time.perf_counter()
    path = Path(path)
    result_path = path.with_name(path.name[:-len(".json")] + ".result.json")
    log_path = path.with_name(path.name[:-len(".json")] + ".log")
    key = job_key or _job_key()
    prev = _read_json(path.with_name(path.name[:-len(".json")] + ".attempt.json"))
    retry = bool(key) and isinstance(prev, dict) and prev.get("job_key") == key
    env = {**os.environ, JOB_KEY_ENV: key, RETRY_ENV: "1" if retry else "0"}
    with open_append(log_path, text=False) as log:
        log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {platform.node()}: "
                  f"{' '.join(run_command(path, gpus))}\n".encode())
        log.flush()
        _CHILD = subprocess.Popen(run_command(path, gpus), env=env, stdout=log, stderr=subprocess.STDOUT,
                                  preexec_fn=_die_with_parent)
        try:
            code = _CHILD.wait()
        finally:
            if _CHILD.returncode is None:  # interrupted here (an exception): do not leave the training behind
                _stop_child()
            _CHILD = None
    res = _read_json(result_path)
    if isinstance(res, dict) and res.get("kind") in ("ok", "error"):
        return res["kind"], res.get("payload"), float(res.get("wall", time.perf_counter() - t0))
    return "error", f"the training process exited with code {code} without a result (log: {log_path})", \
        time.perf_counter() - t0


def _die_with_parent() -> None:
    """``preexec_fn`` of the training process: Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, so it ends with the job's
    wrapper (the sweep's own workers use the same call, ``runner.die_with_parent``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)


def _proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from ``/proc`` (``Z``: exited, not reaped), or None when gone or unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()[0].decode()


def _exited(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie not yet reaped) within ``timeout`` seconds.

    Polls ``/proc`` rather than ``Popen.wait``: this runs inside a signal handler that may have interrupted the
    ``wait`` of the same child, whose lock it cannot take.
    """
    end = time.monotonic() + timeout
    while True:
        if _proc_state(pid) in (None, "Z", "X"):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.2)


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


def _stop_child(grace_s: float = 60.0) -> None:
    """SIGTERM the training child (it unwinds: status failed, lock released); SIGKILL after ``grace_s``."""
    child = _CHILD
    if child is None or child.returncode is not None:
        return
    with contextlib.suppress(OSError):
        child.send_signal(signal.SIGTERM)
    if not _exited(child.pid, grace_s):
        with contextlib.suppress(OSError):
            child.kill()
        _exited(child.pid, 10.0)


def _job_key() -> str:
    """The scheduler's identity of this job, the same across its attempts ("" outside a scheduler)."""
    if os.environ.get("SLURM_ARRAY_JOB_ID"):
        return f"slurm:{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm:{os.environ['SLURM_JOB_ID']}"
    if os.environ.get("SUBMITIT_LOCAL_JOB_ID"):
        return f"local:{os.environ['SUBMITIT_LOCAL_JOB_ID']}"
    return ""


class SubmititRun:
    """The callable a SLURM job runs: :func:`run_job`, with submitit's checkpointing hook.

    On preemption or at the time limit submitit calls :meth:`checkpoint`: the training is stopped cleanly (it keeps
    its newest checkpoint) and the same job is requeued, which resumes from that checkpoint.
    """

    def __init__(self, path: str, gpus: int) -> None:
        self.path, self.gpus = str(path), int(gpus)

    def __call__(self) -> tuple[str, Any, float]:
        return run_job(self.path, self.gpus)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        submitit = require_package("slurm")
        _stop_child()
        return submitit.helpers.DelayedSubmission(SubmititRun(self.path, self.gpus))


def ray_task(path: str, gpus: int) -> tuple[str, Any, float]:
    """The function a Ray task runs: :func:`run_job` keyed by the Ray task id (the same for its retries)."""
    import ray

    return run_job(path, gpus, job_key=f"ray:{ray.get_runtime_context().get_task_id()}")


# ---------------------------------------------------------------------------------------------------- job process
def _take_over_previous_attempt(run_dir: Path, attempt_path: Path, job_key: str) -> None:
    """Remove the run directory's lock if the previous attempt of this same job wrote it (a scheduler runs one
    attempt of a job at a time, so that attempt is gone even when its host cannot be checked from here)."""
    rundir = _rundir()
    rec, prev = rundir.read_lock(run_dir), _read_json(attempt_path)
    if not rec or not isinstance(prev, dict) or not job_key or prev.get("job_key") != job_key:
        return
    if rec.get("host") == prev.get("host") and rec.get("pid") == prev.get("pid") \
            and rundir.lock_is_stale(rec) is not False:
        print(f"weightgeom: {run_dir}: taking over the lock of the previous attempt of job {job_key} (pid "
              f"{rec.get('pid')} on {rec.get('host')})", file=sys.stderr)
        (run_dir / LOCK_NAME).unlink(missing_ok=True)


def _watch_driver(value: str) -> None:
    """Exit this process when the sweep process ``pid:host:start`` on this host is gone (local executor only)."""
    try:
        pid, host, start = value.split(":", 2)
        rec = {"pid": int(pid), "host": host, "start": int(start) if start.isdigit() else None}
    except ValueError:
        return
    if host != platform.node():
        return
    stale = _rundir().lock_is_stale

    def loop() -> None:
        while True:
            time.sleep(1.0)
            if stale(rec):
                os._exit(1)

    threading.Thread(target=loop, daemon=True, name="weightgeom-driver-watch").start()


_raise_terminated = stop_request_handler("stopped by {signal} (preemption or time limit)")
"""Handler of SIGTERM/SIGUSR2 in the training process, and of SIGALRM, its retry (``weightgeom._signals``)."""


def main(argv: list[str] | None = None) -> int:
    """``python -m weightgeom.experiments.launchers JOB_FILE``: train one run of a sweep as a job describes it.

    Rank 0 (the only process without ``torchrun``) writes the outcome to ``<run>.result.json``. Exit code 0 when the
    run finished (done or diverged), 1 when it failed, 143 when it was stopped by SIGTERM/SIGUSR2.
    """
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m weightgeom.experiments.launchers JOB_FILE", file=sys.stderr)
        return 2
    path = Path(args[0])
    job = _read_json(path)
    if not isinstance(job, dict) or not isinstance(job.get("spec"), dict):
        print(f"weightgeom: job file {path} is missing or unreadable", file=sys.stderr)
        return 2
    runner = _runner()
    spec = runner.RunSpec(**job["spec"])
    run_dir = Path(job["run_dir"])
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get(DRIVER_ENV):
        _watch_driver(os.environ[DRIVER_ENV])
    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGALRM):  # SIGALRM: a deferred stop request's retry
        signal.signal(sig, _raise_terminated)
    if job.get("threads"):
        import torch

        torch.set_num_threads(int(job["threads"]))
    attempt = path.with_name(path.name[:-len(".json")] + ".attempt.json")
    key = os.environ.get(JOB_KEY_ENV, "")
    if os.environ.get(RETRY_ENV) == "1":
        spec.fresh = False  # a requeued or retried attempt continues what this job started (also after --no-resume)
    if rank == 0:
        _take_over_previous_attempt(run_dir, attempt, key)
        _write_json(attempt, {"job_key": key, "host": platform.node(), "pid": os.getpid(),
                              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    try:
        kind, payload, wall = runner._worker_call(runner.default_train_fn, spec, run_dir, False)
    except Terminated as e:
        print(f"weightgeom: {e}", file=sys.stderr)
        return 143
    if rank == 0:
        _write_json(path.with_name(path.name[:-len(".json")] + ".result.json"),
                    {"kind": kind, "payload": payload, "wall": wall})
    if kind == "error":
        print(f"weightgeom: run {spec.name} failed: {payload}", file=sys.stderr)
    return 0 if kind == "ok" else 1


# ------------------------------------------------------------------------------------------------------- launchers
@dataclass
class _Launcher:
    """Common part of the cluster launchers: job files, the previous attempt's lock, progress lines."""

    resources: Resources = field(default_factory=Resources)
    poll_s: float = 5.0
    name = "local"

    def check(self) -> None:
        """Refuse, before anything is written, a launcher that cannot submit from this machine (one line)."""

    def record(self) -> dict[str, Any]:
        """What the manifest's invocation records about the launcher."""
        return {"launcher": self.name, "resources": asdict(self.resources)}

    def _prepare(self, sweep: Any, i: int) -> str:
        """Mark run ``i`` started and write its job file; returns the job file's path."""
        sweep.mark_started(i)
        spec = sweep.runs[i]
        threads = sweep.threads or self.resources.cpus
        return str(write_job(sweep.out, spec, threads))

    def _ready(self, sweep: Any, queue: list[int], in_flight: bool) -> list[int]:
        """Take from ``queue`` the runs that may start now; record those the sweep skips (the run they come after
        diverged); leave those that wait for a run still to finish. With nothing in flight, what waits can never be
        released, so it starts too."""
        blocked = getattr(sweep, "blocked", None)
        ready, keep = [], []
        for i in queue:
            state, why = blocked(i) if blocked is not None else ("run", "")
            if state == "skip":
                sweep.skip(i, why)
            elif state == "wait":
                keep.append(i)
            else:
                ready.append(i)
        if not ready and not in_flight:
            ready, keep = keep, []
        queue[:] = keep
        return ready

    def _clear_dead_lock(self, sweep: Any, i: int) -> None:
        """Before submitting run ``i`` again: drop its lock when the attempt that wrote it belonged to an earlier job
        of this sweep that is known to be over (a lock on this host is checked by the trainer itself)."""
        spec = sweep.runs[i]
        run_dir = sweep.out / spec.name
        rundir = _rundir()
        rec, prev = rundir.read_lock(run_dir), _read_json(job_file(sweep.out, spec.name, ".attempt.json"))
        if not rec or not isinstance(prev, dict) or rundir.lock_is_stale(rec) is not None:
            return
        if rec.get("host") == prev.get("host") and rec.get("pid") == prev.get("pid"):
            (run_dir / LOCK_NAME).unlink(missing_ok=True)

    def _outcome(self, sweep: Any, i: int, got: Any, reason: str) -> tuple[str, Any, float]:
        """A job's return value as ``(kind, payload, wall)``; when it returned none (killed, crashed), the outcome
        file if the run wrote one, else ``("error", reason)``."""
        if isinstance(got, (tuple, list)) and len(got) == 3 and got[0] in ("ok", "error"):
            return got[0], got[1], float(got[2])
        res = _read_json(job_file(sweep.out, sweep.runs[i].name, ".result.json"))
        if isinstance(res, dict) and res.get("kind") in ("ok", "error"):
            return res["kind"], res.get("payload"), float(res.get("wall", 0.0))
        return "error", reason, 0.0


@dataclass
class SlurmLauncher(_Launcher):
    """Submit the runs as one SLURM job array through submitit.

    Attributes:
        array_parallelism: most array tasks running at once (0: no limit beyond the cluster's).
        extra: further ``sbatch`` options (``{"account": "x", "qos": "y", "constraint": "a100"}``).
        setup: shell lines run in the job before the training (``["module load cuda", "source venv/bin/activate"]``).
        cluster: ``"slurm"``; ``"local"`` runs the same submitit jobs as local processes (tests, a workstation).
    """

    array_parallelism: int = 0
    extra: dict[str, str] = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)
    cluster: str = "slurm"
    name = "slurm"

    def check(self) -> None:
        if self.cluster == "slurm" and not (shutil.which("sbatch") and shutil.which("srun")):
            raise ValueError("--launcher slurm: sbatch and srun are not found on this machine; run the sweep on a "
                             "login node of the cluster (--submitit-cluster local runs the same jobs here)")

    def executor(self, folder: Path) -> Any:
        submitit = require_package("slurm")
        ex = submitit.AutoExecutor(folder=str(folder / "%j"), cluster=self.cluster,
                                   slurm_max_num_timeout=MAX_TIMEOUT_REQUEUES)
        ex.update_parameters(**self._parameters())
        return ex

    def _parameters(self) -> dict[str, Any]:
        """The job parameters given to submitit's ``AutoExecutor.update_parameters`` (submission and preview)."""
        r = self.resources
        params: dict[str, Any] = {"timeout_min": r.time_min, "cpus_per_task": r.cpus, "tasks_per_node": 1,
                                  "nodes": 1, "name": "weightgeom"}
        if r.gpus:
            params["gpus_per_node"] = r.gpus
        if r.mem_gb is not None:
            params["mem_gb"] = r.mem_gb
        if self.cluster == "slurm":
            if r.partition:
                params["slurm_partition"] = r.partition
            if self.array_parallelism:
                params["slurm_array_parallelism"] = self.array_parallelism
            if self.extra:
                params["slurm_additional_parameters"] = dict(self.extra)
            if self.setup:
                params["slurm_setup"] = list(self.setup)
        return params

    def sbatch_preview(self, out: Path, n: int) -> str:
        """The sbatch script of an array of ``n`` runs, written by submitit's own script writer from the parameters
        :meth:`executor` submits (``_parameters``, named as submitit's SLURM executor converts them; ``%j`` / ``%A`` /
        ``%a`` are filled in by SLURM; each array task then runs its run's command). Needs the ``slurm`` extra;
        touches nothing on disk."""
        from submitit.slurm import slurm as submitit_slurm

        generic = submitit_slurm.SlurmExecutor._equivalence_dict()  # AutoExecutor's generic names → sbatch's
        kw: dict[str, Any] = {"map_count": n}
        for key, value in self._parameters().items():
            kw[key[len("slurm_"):] if key.startswith("slurm_") else generic[key]] = value
        if "mem" in kw:
            kw["mem"] = submitit_slurm._convert_mem(kw["mem"])
        folder = (Path(out) / LAUNCH_DIR / "submitit").resolve() / "%j"
        return submitit_slurm._make_sbatch_string(command=f"{sys.executable} -u -m submitit.core._submit {folder}",
                                                  folder=folder, **kw)

    def _reattach(self, sweep: Any, i: int) -> Any | None:
        """The still pending or running SLURM job an earlier sweep process submitted for run ``i``, or None."""
        job = sweep.records[i].get("job")
        if self.cluster != "slurm" or not isinstance(job, dict) or job.get("launcher") != "slurm":
            return None
        submitit = require_package("slurm")
        try:
            j = submitit.SlurmJob(folder=job["folder"], job_id=str(job["id"]))
            state = j.state
        except Exception:  # noqa: BLE001 - sacct unreachable or the job unknown: submit again
            return None
        return j if state.split()[0] in ACTIVE_SLURM_STATES and state != "UNKNOWN" else None

    def run(self, sweep: Any, todo: list[int]) -> None:
        """Submit ``todo`` (re-attaching jobs still live from an earlier sweep process), wait, record outcomes.

        Runs that must wait for another run (an LR ladder's next rung) are submitted, in a further array, once it
        has finished; runs it makes pointless are recorded as skipped.
        """
        folder = (sweep.out / LAUNCH_DIR / "submitit").resolve()
        ex = self.executor(folder)
        pending: dict[int, Any] = {}
        started: dict[int, float] = {}
        queue = []
        for i in todo:
            j = self._reattach(sweep, i)
            if j is not None:
                pending[i], started[i] = j, time.perf_counter()
                sweep.records[i]["status"] = "running"
                if sweep.progress:
                    print(f"{sweep.tag(i)}: SLURM job {j.job_id} of an earlier sweep process is still live: waiting "
                          "for it", flush=True)
            else:
                queue.append(i)
        old_env = os.environ.get(DRIVER_ENV)
        if self.cluster == "local":  # local jobs are not children of this process: they watch it instead
            os.environ[DRIVER_ENV] = f"{os.getpid()}:{platform.node()}:{_rundir()._proc_start_time(os.getpid())}"
        try:
            while queue or pending:
                wave = self._ready(sweep, queue, bool(pending))
                if wave:
                    for i, j in self._submit(sweep, ex, folder, wave).items():
                        pending[i], started[i] = j, time.perf_counter()
                for i, j in list(pending.items()):
                    if j.done():
                        del pending[i]
                        self._record_job(sweep, i, j, started[i])
                if pending and not any(j.done() for j in pending.values()):
                    time.sleep(self.poll_s)
        except KeyboardInterrupt:
            if self.cluster == "slurm" and pending:
                print(f"weightgeom sweep: {len(pending)} SLURM jobs keep running; re-run the same command to wait "
                      f"for them and record them (scancel to stop them)", file=sys.stderr)
            raise
        finally:
            if self.cluster == "local":
                if old_env is None:
                    os.environ.pop(DRIVER_ENV, None)
                else:
                    os.environ[DRIVER_ENV] = old_env

    def _submit(self, sweep: Any, ex: Any, folder: Path, wave: list[int]) -> dict[int, Any]:
        """Submit the runs ``wave`` as one job array; returns ``{run index: job}``."""
        paths = {}
        for i in wave:
            self._clear_dead_lock(sweep, i)
            paths[i] = self._prepare(sweep, i)
        try:
            with ex.batch():
                jobs = {i: ex.submit(SubmititRun(paths[i], self.resources.gpus)) for i in wave}
        except Exception as e:  # noqa: BLE001 - sbatch missing or refusing the job: one line, nothing runs
            for i in wave:
                sweep.records[i]["status"] = "pending"
            sweep.write_manifest()
            raise ValueError(f"--launcher slurm: submitting the job array failed: {_one_line(e)}") from None
        for i, j in jobs.items():
            sweep.records[i]["job"] = {"launcher": "slurm", "id": str(j.job_id), "folder": str(folder),
                                       "cluster": self.cluster}
        sweep.write_manifest()
        if sweep.progress:
            ids = sorted({str(j.job_id).split("_")[0] for j in jobs.values()})
            print(f"submitted {len(jobs)} runs ({self.resources.describe('slurm')}) as job(s) {', '.join(ids)}; "
                  f"logs: {folder}", flush=True)
        return jobs

    def _record_job(self, sweep: Any, i: int, j: Any, t0: float) -> None:
        got, reason = None, ""
        try:
            got = j.result()
        except Exception as e:  # noqa: BLE001 - killed, timed out too often, node failure
            reason = f"SLURM job {j.job_id} ended without a result ({j.state}): {_one_line(e)}"
        kind, payload, wall = self._outcome(sweep, i, got, reason)
        sweep.finish(i, kind, payload, wall or time.perf_counter() - t0)


@dataclass
class RayLauncher(_Launcher):
    """Run each run as a Ray task.

    Attributes:
        address: the cluster to join (``"auto"``, ``"ray://head:10001"``, ``"head:6379"``); "" starts a local Ray
            instance for this sweep (shut down at the end).
        max_retries: how often Ray runs a task again after its worker or node died (preemption, out of memory); each
            retry resumes from the run's checkpoint.
        local_cpus: CPUs of the local instance (0: all of this machine's).
    """

    address: str = ""
    max_retries: int = 3
    local_cpus: int = 0
    name = "ray"

    def record(self) -> dict[str, Any]:
        return {**super().record(), "address": self.address or "local", "max_retries": self.max_retries}

    def task_options(self) -> dict[str, Any]:
        """The options each run's Ray task is submitted with (``ray.remote(...).options(**task_options())``)."""
        return {"num_cpus": self.resources.cpus, "num_gpus": self.resources.gpus, "max_retries": self.max_retries,
                "retry_exceptions": False}

    def task_spec(self) -> str:
        """The Ray task each run is submitted as, in words and code (what a dry run shows)."""
        opts = ", ".join(f"{k}={v!r}" for k, v in self.task_options().items())
        where = self.address or "a local Ray instance started for the sweep"
        return (f"each run is one Ray task on {where}: ray.remote(weightgeom.experiments.launchers.ray_task)"
                f".options({opts}).remote(JOB_FILE, {self.resources.gpus}); the task runs the command above in a "
                "subprocess and resumes from the run's checkpoint when Ray retries it")

    def run(self, sweep: Any, todo: list[int]) -> None:
        """Start the tasks of ``todo`` (at most as many run at once as the cluster's resources allow), wait, record
        each outcome as it arrives; a run that must wait for another one starts once that one has finished."""
        ray = require_package("ray")
        started_here = not ray.is_initialized()
        if started_here:
            t = time.perf_counter()
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
            try:
                if self.address:
                    ray.init(address=self.address, **kw)
                else:
                    ray.init(num_cpus=self.local_cpus or os.cpu_count() or 1, **kw)
            except Exception as e:  # noqa: BLE001 - no cluster at that address, a broken install: one line
                where = f"--ray-address {self.address}" if self.address else "--launcher ray (local instance)"
                raise ValueError(f"{where}: could not start or join Ray: {_one_line(e)}") from None
            if sweep.progress:
                print(f"ray: {'joined ' + self.address if self.address else 'local instance'} in "
                      f"{time.perf_counter() - t:.1f}s, resources {ray.cluster_resources()}", flush=True)
        refs: dict[Any, int] = {}
        try:
            task = ray.remote(ray_task).options(**self.task_options())
            t0: dict[int, float] = {}
            queue = list(todo)
            while queue or refs:
                wave = self._ready(sweep, queue, bool(refs))
                for i in wave:
                    self._clear_dead_lock(sweep, i)
                    path = self._prepare(sweep, i)
                    refs[task.remote(path, self.resources.gpus)] = i
                    t0[i] = time.perf_counter()
                if wave:
                    sweep.write_manifest()
                    if sweep.progress:
                        print(f"submitted {len(wave)} Ray tasks ({self.resources.describe('ray')}, up to "
                              f"{self.max_retries} retries)", flush=True)
                if not refs:
                    continue
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=self.poll_s)
                for ref in ready:
                    i = refs.pop(ref)
                    got, reason = None, ""
                    try:
                        got = ray.get(ref)
                    except Exception as e:  # noqa: BLE001 - worker or node died more often than max_retries
                        reason = f"Ray task failed: {_one_line(e)}"
                    kind, payload, wall = self._outcome(sweep, i, got, reason)
                    sweep.finish(i, kind, payload, wall or time.perf_counter() - t0[i])
        except BaseException:
            for ref in list(refs):
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            raise
        finally:
            if started_here:
                ray.shutdown()


def make_launcher(name: str, resources: Resources, *, address: str = "", max_retries: int = 3,
                  array_parallelism: int = 0, extra: dict[str, str] | None = None, setup: list[str] | None = None,
                  cluster: str = "slurm", poll_s: float | None = None, check_package: bool = True
                  ) -> _Launcher | None:
    """The launcher called ``name`` (None for ``local``), after checking its package is installed (unless
    ``check_package`` is False: a Ray dry run, which needs nothing from Ray; SLURM's dry run uses submitit's own
    sbatch writer, so it always checks).

    Raises:
        ValueError: unknown name, or its package is missing (one line naming the pip extra).
    """
    if name == "local":
        return None
    if name not in LAUNCHERS:
        raise ValueError(f"--launcher {name!r}: choose one of {', '.join(LAUNCHERS)}")
    if check_package or name == "slurm":
        require_package(name)
    if name == "slurm":
        return SlurmLauncher(resources=resources, poll_s=poll_s or (10.0 if cluster == "slurm" else 1.0),
                             array_parallelism=array_parallelism, extra=dict(extra or {}), setup=list(setup or []),
                             cluster=cluster)
    return RayLauncher(resources=resources, poll_s=poll_s or 2.0, address=address, max_retries=max_retries)


CPUS_PER_GPU = 8
"""CPU cores a GPU run asks for per GPU when ``--cpus-per-run`` is not given (data loading and the host side of the
step; the usual share of a GPU node's cores)."""
RUNTIME_GB_PER_PROCESS = 4
"""Host memory of one training process beyond its tensors (interpreter, torch, the CUDA context), in GB."""
BYTES_PER_PARAM = 32
"""Host bytes per model parameter a process may hold: float32 weights, gradients and two optimizer moments (16),
twice while a checkpoint is serialised."""


def model_params(runs: Sequence[RunSpec]) -> int:
    """The largest parameter count among the runs' models, built on the meta device (no memory, no data); 0 where a
    model cannot be built that way."""
    import torch

    model_from_config = importlib.import_module("weightgeom.train.trainer").model_from_config  # heavy: on first use
    most = 0
    configs = {json.dumps(spec.config["model"], sort_keys=True, default=str): spec.config["model"] for spec in runs}
    for config in configs.values():  # each distinct model once (a sweep's runs mostly share one)
        try:
            with torch.device("meta"):
                model = model_from_config(dict(config))
        except Exception:  # noqa: BLE001 - an estimate: a model that needs its data to be built counts as unknown
            continue
        most = max(most, sum(p.numel() for p in model.parameters()))
    return most


def sized_resources(runs: Sequence[RunSpec], resources: Resources, given: Mapping[str, Any]) -> tuple[Resources,
                                                                                                      list[str]]:
    """``resources`` with the per-run CPUs and memory of a GPU run sized from the config where the command line does
    not give them: ``CPUS_PER_GPU`` cores per GPU; memory per process ``RUNTIME_GB_PER_PROCESS`` +
    ``BYTES_PER_PARAM`` × the largest model's parameters (one process per GPU), rounded up to whole GB. Returns the
    resources and one line per value it sized (for the dry run)."""
    if not resources.gpus:
        return resources, []
    notes = []
    cpus, mem = resources.cpus, resources.mem_gb
    if "cpus_per_run" not in given:
        cpus = CPUS_PER_GPU * resources.gpus
        notes.append(f"cpus per run {cpus}: {CPUS_PER_GPU} per GPU (--cpus-per-run to change)")
    if "mem_per_run" not in given:
        params = model_params(runs)
        per_process = RUNTIME_GB_PER_PROCESS + BYTES_PER_PARAM * params / 1e9
        mem = float(math.ceil(per_process * resources.gpus))
        notes.append(f"memory per run {mem:g} GB: {resources.gpus} process(es) × ({RUNTIME_GB_PER_PROCESS} GB + "
                     f"{BYTES_PER_PARAM} B × {params / 1e6:.1f}M parameters) (--mem-per-run to change)")
    return replace(resources, cpus=cpus, mem_gb=mem), notes


def required_paths(runs: Sequence[RunSpec]) -> dict[str, list[str]]:
    """The files and folders the runs read that must exist where they train: ``data.path`` of each run whose data
    kind reads one (``bin``, ``text``) → the runs that read it, in plan order."""
    out: dict[str, list[str]] = {}
    for spec in runs:
        data = spec.config.get("data") or {}
        path = str(data.get("path") or "")
        if path and data.get("kind") in ("bin", "text"):
            out.setdefault(path, []).append(spec.name)
    return out


def check_paths(runs: Sequence[RunSpec]) -> None:
    """Refuse (one line) a sweep whose runs read a path that does not exist on this machine (``--check-paths``).

    Raises:
        ValueError: naming the first missing path and a run that reads it.
    """
    for path, names in required_paths(runs).items():
        if not Path(path).exists():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise ValueError(f"--check-paths: data.path={path} (run {names[0]}{more}) does not exist on this machine; "
                             "fix the path, or drop --check-paths if it exists only on the cluster")


def dry_run(runs: list[RunSpec], out: Path, launcher: str, resources: Resources, file: Any = None,
            notes: Sequence[str] = (), resume: bool = True, script: Any = None, task_spec: str = "") -> int:
    """Print, per run, the command and resources that would be submitted (nothing is written or submitted); then the
    paths the runs read, flagged where they do not exist on this machine, and the GPU-hours the submitted runs
    request at most (runs × GPUs × time limit).

    Runs already finished in ``out`` are listed as skipped; ``notes`` (e.g. the extra sbatch options and setup lines)
    are printed after the header; ``script(n)``, when given, returns the job script of ``n`` runs (a SLURM launcher's
    :meth:`SlurmLauncher.sbatch_preview`), printed at the end. Returns the number of runs that would be submitted.
    """
    file = file or sys.stdout
    n = 0
    where = (f"job files go to {Path(out) / LAUNCH_DIR}/" if launcher != "local"
             else f"runs train on this machine into {out}/ (the command is what each run's process does)")
    print(f"dry run: --launcher {launcher}, per run {resources.describe(launcher)}; {where}", file=file)
    for line in notes:
        print(f"  {line}", file=file)
    estimate = importlib.import_module("weightgeom.experiments.estimate")  # each arm's settings and expected time
    shared = estimate.shared_settings(runs)
    params = {json.dumps(spec.config["model"], sort_keys=True, default=str): 0 for spec in runs}
    for key in params:
        params[key] = estimate.nonembedding_params(json.loads(key))
    gpus = resources.gpus if launcher != "local" else 0
    seconds: list[float] = []
    print("settings every run shares: " + ", ".join(
        f"{k}={shared[k]}" for k in ("train.max_steps", "data.batch_size", "data.block_size", "train.grad_accum",
                                     "model.kind", "model.n_layer", "model.n_embd") if k in shared), file=file)
    for spec in runs:
        state = _rundir().read_status(Path(out) / spec.name).get("state")
        if state in ("done", "diverged") and resume:
            print(f"{spec.name}: already {state} (not submitted)", file=file)
            continue
        if state is not None and not resume:
            print(f"{spec.name}: {state} earlier; --no-resume trains it again (its files move to previous/)",
                  file=file)
        n += 1
        cmd = run_command(job_file(Path(out).resolve(), spec.name), resources.gpus if launcher != "local" else 0)
        print(f"{spec.name}: {' '.join(cmd)}  [{resources.describe(launcher)}]", file=file)
        model_key = json.dumps(spec.config["model"], sort_keys=True, default=str)
        secs = estimate.expected_seconds(spec.resolved(), params[model_key], gpus, resources.cpus,
                                         estimate.optimizer_flops_per_step(spec.resolved(), json.loads(model_key)))
        if secs is not None:
            seconds.append(secs)
        print(f"  arm {spec.variant}: {estimate.arm_settings(spec, shared)}; expected "
              f"{'≈ ' + duration(secs) if secs is not None else 'unknown (no parameter count)'}",
              file=file)
    how = {"slurm": " as one SLURM job array", "ray": " as Ray tasks"}.get(launcher, "")
    print(f"{n} of {len(runs)} runs would be submitted{how}", file=file)
    if seconds:
        device = f"{gpus} GPU(s) at the H200's recorded rate" if gpus else \
            f"{max(1, resources.cpus)} CPU core(s) at the AMX Xeon's recorded rate"
        limit = (f"; the time limit is {resources.time_min} min per job" if launcher == "slurm" else "")
        lo, hi = duration(min(seconds)), duration(max(seconds))
        print(f"expected run time: {lo if lo == hi else f'{lo}–{hi}'} "
              f"per run, {duration(sum(seconds))} for all {len(seconds)} one after another — a FLOP "
              f"estimate (6 · non-embedding parameters · tokens + Muon's orthogonalisations per step, on {device}; "
              f"weightgeom.experiments.estimate): the order of magnitude — the rate varies with model size{limit}",
              file=file)
    paths = required_paths(runs)
    if launcher != "local":
        paths = {sys.executable: [spec.name for spec in runs], **paths}  # the interpreter each command names
    if paths:
        print("paths the runs read (they must exist where the runs train):", file=file)
        for path, names in paths.items():
            here = "exists here" if Path(path).exists() else "NOT FOUND on this machine"
            who = "every run" if len(names) == len(runs) else ", ".join(names[:3]) + (" …" if len(names) > 3 else "")
            print(f"  {path}  ({here}; {who})", file=file)
    if launcher == "slurm" and resources.gpus and n:
        hours = n * resources.gpus * resources.time_min / 60
        print(f"GPU-hours requested per time-limit window: {n} runs × {resources.gpus} GPU × "
              f"{resources.time_min / 60:g} h = {hours:g} GPU-hours; runs that finish sooner use less, and a run "
              f"still going at its limit is requeued from its checkpoint (up to {MAX_TIMEOUT_REQUEUES} times), each "
              f"requeue another window", file=file)
    if task_spec and n:
        print(task_spec, file=file)
    if script is not None and n:
        print(f"the sbatch script of the array (submitit writes it; array task i runs the command of the i-th run "
              f"above):\n{script(n).rstrip()}", file=file)
    return n


if __name__ == "__main__":
    sys.exit(main())
