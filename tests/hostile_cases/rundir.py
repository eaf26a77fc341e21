"""Hostile inputs: rundir (rows of tests/test_hostile.py).

Run directories of ``weightgeom train``: one writer at a time (a lock that a ``kill -9`` leaves stale), ``--fresh``
moves an earlier run aside instead of mixing checkpoints, ``run.name`` stays inside ``run.out_dir``, I/O failures and
checkpoints that do not fit end with one line and exit 2, a resumed run's TensorBoard log has each step once, and a
finished run re-run reports its numbers.

Every row drives the ``weightgeom train`` CLI (in-process, or as a real subprocess where a second process is the
point) with a one-layer GPT on synthetic data: a few steps, about a second each on a CPU.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
import torch
import yaml

from hostile_cases import Hostile, assert_one_line_error, cli

TINY = {
    "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
    "data": {"kind": "synthetic", "block_size": 16, "batch_size": 4},
    "optim": {"name": "adamw", "adamw": {"lr": 1e-2}},
    "train": {"max_steps": 8, "eval_every": 4, "eval_iters": 2, "log_every": 1, "ckpt_every": 2},
}


def _config(tmp: Path) -> str:
    p = tmp / "tiny.yaml"
    p.write_text(yaml.safe_dump(TINY))
    return str(p)


def _train(tmp: Path, run: Path, *extra: str):
    return cli("train", _config(tmp), "--out", str(run), "--no-progress", *extra)


def _result(res) -> dict:
    return json.loads(res.out.strip().splitlines()[-1])


def _steps(run: Path) -> list[int]:
    from weightgeom.train.checkpoint import list_checkpoints

    return [s for s, _ in list_checkpoints(run / "checkpoints")]


def _train_rows(run: Path) -> list[dict]:
    from weightgeom.train.logging import read_metrics

    return read_metrics(run, "train")


# ------------------------------------------------------------------------------------------------ --fresh sequence
def _fresh_sequence(tmp: Path) -> None:
    run = tmp / "r"
    assert _train(tmp, run).rc == 0  # 8 steps: checkpoints 6, 8
    assert _steps(run) == [6, 8]
    (run / "experiment.json").write_text('{"variant": "a"}')  # what a sweep writes just before the run
    res = _train(tmp, run, "--fresh", "--set", "train.max_steps=4")
    assert res.rc == 0, res.err
    # the new run's checkpoints survive pruning; the old ones are in previous/, not mixed in
    assert _steps(run) == [2, 4]
    olds = list((run / "previous").iterdir())
    assert len(olds) == 1 and _steps(olds[0]) == [6, 8]
    assert [r["step"] for r in _train_rows(olds[0])][-1] == 8
    assert (run / "experiment.json").read_text() == '{"variant": "a"}'
    # --resume sees the new run only: done at 4, numbers from its metrics
    res = cli("train", "--resume", str(run), "--no-progress")
    assert res.rc == 0, res.err
    out = _result(res)
    rows = _train_rows(run)
    assert out["step"] == 4 and rows[-1]["step"] == 4 and out["final"]["train_loss"] == rows[-1]["loss"]


# ----------------------------------------------------------------------------------------------- real processes
def _start_writer(tmp: Path, run: Path) -> subprocess.Popen:
    """A real ``weightgeom train`` process training ``run`` for a long time (no checkpoint before its end)."""
    cfg = _config(tmp)
    cmd = [sys.executable, "-m", "weightgeom", "train", cfg, "--out", str(run), "--no-progress",
           "--set", "train.max_steps=100000", "--set", "train.ckpt_every=0", "--set", "train.eval_every=0"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp)


def _wait_training(proc: subprocess.Popen, run: Path, timeout: float = 120.0) -> None:
    """Wait until ``proc`` holds the lock and has logged a train step."""
    from weightgeom.train.rundir import LOCK_NAME

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"writer exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
        m = run / "metrics.jsonl"
        if (run / LOCK_NAME).is_file() and m.is_file() and '"split": "train"' in m.read_text():
            return
        time.sleep(0.1)
    raise AssertionError("writer never started training under the lock")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _two_writers(tmp: Path) -> None:
    from weightgeom.train.rundir import read_lock

    run = tmp / "r"
    proc = _start_writer(tmp, run)
    try:
        _wait_training(proc, run)
        res = _train(tmp, run, "--set", "train.max_steps=2")
        line = assert_one_line_error(res, str(run), f"pid {proc.pid}", "host")
        assert "in use" in line
        assert not (run / "previous").exists()  # the second writer touched nothing
        assert read_lock(run)["pid"] == proc.pid and proc.poll() is None
    finally:
        _kill(proc)


def _stale_lock_after_sigkill(tmp: Path) -> None:
    run = tmp / "r"
    proc = _start_writer(tmp, run)
    try:
        _wait_training(proc, run)
    finally:
        _kill(proc)
    assert proc.returncode == -signal.SIGKILL
    res = _train(tmp, run, "--set", "train.max_steps=4")
    assert res.rc == 0, res.err
    assert f"taking over from pid {proc.pid}" in res.err
    assert json.loads((run / "status.json").read_text())["state"] == "done"
    assert [r["step"] for r in _train_rows(run)] == [1, 2, 3, 4]  # the killed run's lines are not mixed in
    (old,) = (run / "previous").iterdir()
    assert json.loads((old / "status.json").read_text())["state"] == "running"  # what the killed run left, kept


# --------------------------------------------------------------------------------------------------- run.name
def _name_escapes(value: str, fragment: str):
    def check(tmp: Path) -> None:
        target = (tmp / "runs" / value).resolve()  # out_dir is "runs" (the default) under the working directory
        assert not target.exists()
        res = cli("train", _config(tmp), "--no-progress", "--set", f"run.name={value}")
        assert_one_line_error(res, "run.name", fragment)
        assert not target.exists() and not (tmp / "runs").exists()
    return check


def _name_absolute(tmp: Path) -> None:
    target = tmp / "elsewhere" / "x"
    res = cli("train", _config(tmp), "--no-progress", "--set", f"run.name={target}")
    assert_one_line_error(res, "run.name", "absolute")
    assert not target.exists() and not (tmp / "elsewhere").exists()


def _name_through_symlink(tmp: Path) -> None:
    outside = tmp / "outside"
    outside.mkdir()
    (tmp / "runs").mkdir()
    (tmp / "runs" / "link").symlink_to(outside)
    res = cli("train", _config(tmp), "--no-progress", "--set", "run.name=link/x")
    assert_one_line_error(res, "run.name", "outside")
    assert list(outside.iterdir()) == []


# ------------------------------------------------------------------------------------------------ I/O failures
def _unwritable_out(tmp: Path) -> None:
    # tests run as root, which ignores permission bits: a path under a regular file cannot be created by anyone
    (tmp / "afile").write_text("keep me")
    res = _train(tmp, tmp / "afile" / "run")
    assert_one_line_error(res, str(tmp / "afile" / "run"), "Not a directory")
    res = _train(tmp, tmp / "afile")  # the run directory itself is a file
    assert_one_line_error(res, str(tmp / "afile"), "not a directory")
    assert (tmp / "afile").read_text() == "keep me"


def _full_disk(tmp: Path) -> None:
    import weightgeom.train.checkpoint as ck

    run = tmp / "r"
    assert _train(tmp, run, "--set", "train.max_steps=4").rc == 0
    real = ck.save_checkpoint

    def full(path, payload):
        if payload.get("step") == 6:  # the disk fills while the checkpoint at step 6 is written
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, payload)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "save_checkpoint", full)
        res = _train(tmp, run, "--set", "train.max_steps=8")
    assert_one_line_error(res, "ckpt_00000006.pt", "No space left on device")
    assert _steps(run) == [2, 4]  # nothing already written was lost
    assert ck.load_checkpoint(run / "checkpoints" / "ckpt_00000004.pt")["step"] == 4
    assert json.loads((run / "status.json").read_text())["state"] == "failed"
    res = _train(tmp, run, "--set", "train.max_steps=8")  # space again: the run resumes from step 4
    assert res.rc == 0 and _result(res)["step"] == 8, res.err
    assert [r["step"] for r in _train_rows(run)] == list(range(1, 9))


# ------------------------------------------------------------------------------------------ checkpoints that do not fit
def _shape_mismatch_model(tmp: Path) -> None:
    import weightgeom.train.checkpoint as ck

    run = tmp / "r"
    assert _train(tmp, run, "--set", "train.max_steps=4").rc == 0
    p = ck.latest_checkpoint(run / "checkpoints")
    payload = ck.load_checkpoint(p)
    key = "transformer.h.0.mlp.c_fc.weight"
    assert key in payload["model"]
    payload["model"][key] = torch.zeros(3, 3)  # config hash intact, tensor replaced
    ck.save_checkpoint(p, payload)
    res = _train(tmp, run, "--set", "train.max_steps=6")
    assert_one_line_error(res, str(p), key, "(3, 3)")
    assert _steps(run) == [2, 4]


def _shape_mismatch_optimizer(tmp: Path) -> None:
    import weightgeom.train.checkpoint as ck

    run = tmp / "r"
    assert _train(tmp, run, "--set", "train.max_steps=4").rc == 0
    p = ck.latest_checkpoint(run / "checkpoints")
    payload = ck.load_checkpoint(p)
    state = payload["optimizer"]["state"]
    idx = sorted(state)[0]
    state[idx]["exp_avg"] = torch.zeros(5, 7)
    ck.save_checkpoint(p, payload)
    res = _train(tmp, run, "--set", "train.max_steps=6")
    assert_one_line_error(res, str(p), "exp_avg", "(5, 7)")


def _changed_config(tmp: Path) -> None:
    run = tmp / "r"
    assert _train(tmp, run, "--set", "train.max_steps=4").rc == 0
    res = _train(tmp, run, "--set", "optim.adamw.lr=0.5")
    assert_one_line_error(res, "different config", "optim.adamw.lr", "use --fresh to start over",
                          "previous/", "--out to choose another directory")
    assert _steps(run) == [2, 4] and not (run / "previous").exists()


# --------------------------------------------------------------------------------------------- resume bookkeeping
def _tb_scalars(run: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _tb_after_resume(tmp: Path) -> None:
    from weightgeom.train.batches import Batches

    run = tmp / "r"
    orig = Batches.get

    def dying(self, split, step, index, device="cpu"):
        if split == "train" and step == 6:  # dies computing update 7: updates 5, 6 were logged after checkpoint 4
            raise KeyboardInterrupt
        return orig(self, split, step, index, device)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Batches, "get", dying)
        assert _train(tmp, run, "--set", "train.ckpt_every=4").rc == 130
    # TensorBoard reads event files in name order, whose first key is the creation time in whole seconds; a resume
    # is a new process in practice, here it is the same one: let the second tick so the files sort in session order
    time.sleep(1.05)
    assert _train(tmp, run, "--set", "train.ckpt_every=4").rc == 0  # resumes from step 4
    tb = _tb_scalars(run, "train/loss")
    steps = [s for s, _ in tb]
    assert steps == list(range(1, 9)), steps  # each step once: the killed session's 5 and 6 are purged
    jsonl = {r["step"]: r["loss"] for r in _train_rows(run)}
    assert all(v == pytest.approx(jsonl[s], rel=1e-6) for s, v in tb)


def _finished_rerun(tmp: Path) -> None:
    run = tmp / "r"
    first = _train(tmp, run)
    assert first.rc == 0
    ck8 = run / "checkpoints" / "ckpt_00000008.pt"
    mtime, meta = ck8.stat().st_mtime_ns, (run / "meta.json").read_text()
    again = _train(tmp, run)  # the same command again
    assert again.rc == 0 and "already done at step 8" in again.err
    a, b = _result(first), _result(again)
    assert b["already_done"] is True and b["step"] == 8
    for k in ("train_loss", "train_loss_smooth", "val_loss", "tokens"):
        assert b["final"][k] == a["final"][k], k  # not NaN: the finished run's own numbers
    assert ck8.stat().st_mtime_ns == mtime and (run / "meta.json").read_text() == meta  # nothing rewritten


DOCTORED_LINES = (b"[" * 100_000 + b"]" * 100_000, b'{"step": 3, "split": "\xff\xfe"}', b"[1, 2]",
                  b'{"step": ' + b"1" * 5000 + b"}")
"""metrics.jsonl lines that are not usable rows: deeply nested, not UTF-8, not an object, an integer too long."""


def _doctored_metrics(tmp: Path) -> None:
    run = tmp / "r"
    assert _train(tmp, run).rc == 0
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines()
    metrics.write_bytes(b"\n".join(lines[:3] + list(DOCTORED_LINES) + lines[3:]) + b"\n")
    again = _train(tmp, run)  # a finished run re-run reports its numbers from metrics.jsonl
    assert again.rc == 0 and "Traceback" not in again.err, again.err[-2000:]
    assert _result(again)["final"]["val_loss"] == _result(again)["final"]["val_loss"]  # a number, not NaN
    # an interrupted run resumes from step 6: the lines after it, and every unusable one, move to the .dropped file
    (run / "checkpoints" / "ckpt_00000008.pt").unlink()
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "failed", "step": 7}))
    res = _train(tmp, run)
    assert res.rc == 0 and "Traceback" not in res.err, res.err[-2000:]
    dropped = (run / "metrics.dropped.jsonl").read_bytes()
    assert all(line in dropped for line in DOCTORED_LINES), "a doctored line was lost instead of kept aside"
    assert [r["step"] for r in _train_rows(run)] == list(range(1, 9))


def _snapshot_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(root.rglob("*"))}


def _user_folder_untouched(tmp: Path) -> None:
    # a project folder that happens to hold a checkpoints/ folder is not a run directory: refused, nothing moved
    proj = tmp / "project"
    (proj / "checkpoints").mkdir(parents=True)
    (proj / "src").mkdir()
    (proj / "notes.txt").write_text("hi")
    (proj / "checkpoints" / "my_model.pt").write_bytes(b"x")
    (proj / "src" / "main.py").write_text("code")
    before = _snapshot_tree(proj)
    for extra in ((), ("--fresh",)):
        res = _train(tmp, proj, *extra)
        assert_one_line_error(res, str(proj), "holds no weightgeom run", "notes.txt")
        assert _snapshot_tree(proj) == before


def _parent_of_live_run(tmp: Path) -> None:
    # training into the folder that holds other runs (run.name=".", or --out on it) never moves a run aside
    first = _train(tmp, tmp / "runs" / "ra", "--set", "train.max_steps=2")
    assert first.rc == 0, first.err
    before = _snapshot_tree(tmp / "runs")
    res = cli("train", _config(tmp), "--no-progress", "--set", "run.out_dir=runs", "--set", "run.name=.")
    assert_one_line_error(res, "run.name", "itself")
    for extra in ((), ("--fresh",)):
        res = _train(tmp, tmp / "runs", *extra)
        assert_one_line_error(res, "runs", "holds no weightgeom run", "ra")
    assert _snapshot_tree(tmp / "runs") == before


def _run_inside_a_run(tmp: Path) -> None:
    # a run directory that contains another run (a sub-folder with its own run files) is refused on --fresh
    outer = tmp / "outer"
    assert _train(tmp, outer, "--set", "train.max_steps=2").rc == 0
    assert _train(tmp, outer / "inner", "--set", "train.max_steps=2").rc == 0
    before = _snapshot_tree(outer)
    res = _train(tmp, outer, "--fresh")
    assert_one_line_error(res, str(outer), "contains another run", "inner")
    assert _snapshot_tree(outer) == before


def _run_name_control_chars(tmp: Path) -> None:
    res = cli("train", _config(tmp), "--no-progress", "--set", "run.name=a\nb")
    assert res.rc == 2 and "Traceback" not in res.err
    res = cli("train", _config(tmp), "--no-progress", "--set", 'run.name="a\nb"')
    assert_one_line_error(res, "run.name", "control characters")
    assert not (tmp / "runs").exists()


def _sigterm_unwinds(tmp: Path) -> None:
    from weightgeom.train.rundir import read_lock

    run = tmp / "r"
    proc = _start_writer(tmp, run)
    try:
        _wait_training(proc, run)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        _kill(proc)
    assert proc.returncode == 143
    st = json.loads((run / "status.json").read_text())
    assert st["state"] == "failed" and "SIGTERM" in st["reason"]  # not left "running"
    assert read_lock(run) is None  # released, not left for the next writer to break
    res = _train(tmp, run, "--set", "train.max_steps=4")  # and the run continues from its checkpoint or restarts
    assert res.rc == 0, res.err
    assert "taking over" not in res.err


# ------------------------------------------------------------------------------------------------------------ presets
def _preset_keeps_written_keys(tmp: Path) -> None:
    # keys written on the command line or in the file keep their value under a preset, even the library default
    run = tmp / "r"
    res = _train(tmp, run, "--set", "train.max_steps=2", "--set", "optim.name=muon", "--set", "optim.preset=paper",
                 "--set", "optim.muon.dual.steps=1", "--set", "optim.muon.dual.project=true")
    assert res.rc == 0, res.err
    muon = tomllib.loads((run / "config.resolved.toml").read_text())["optim"]["muon"]
    assert muon["dual"]["steps"] == 1 and muon["dual"]["project"] is True and muon["dual"]["keep"] == "last"
    line = next(ln for ln in res.err.splitlines() if "optim.preset=" in ln)  # printed with --no-progress too
    assert "optim.muon.dual.steps=1 (the preset's: 20)" in line and 'optim.muon.dual.keep="last"' in line
    kept = json.loads((run / "meta.json").read_text())["presets"]["optim.preset"]["kept"]
    assert kept == {"optim.muon.dual.steps": [1, 20], "optim.muon.dual.project": [True, False]}
    cfg = {**TINY, "model": dict(TINY["model"])}  # the same key written in the config file
    cfg["optim"] = {"name": "muon", "preset": "paper", "muon": {"dual": {"steps": 1}}}
    cfg["model"]["preset"] = "gpt-nano"  # a model preset: the file's n_layer, n_head, n_embd stay too
    (tmp / "p.yaml").write_text(yaml.safe_dump(cfg))
    res = cli("train", str(tmp / "p.yaml"), "--out", str(tmp / "f"), "--no-progress", "--set", "train.max_steps=2")
    assert res.rc == 0, res.err
    assert tomllib.loads((tmp / "f" / "config.resolved.toml").read_text())["optim"]["muon"]["dual"]["steps"] == 1
    assert "model.n_layer=1 (the preset's: 3)" in res.err and "optim.muon.dual.steps=1 (the preset's: 20)" in res.err
    assert "model.preset" in json.loads((tmp / "f" / "meta.json").read_text())["presets"]


# --------------------------------------------------------------------------------------- the per-device msign choice
def _interrupted(tmp: Path, run: Path, *extra: str):
    """Train ``run`` (checkpoint every 4 steps) and interrupt it while it computes update 7."""
    from weightgeom.train.batches import Batches

    orig = Batches.get

    def dying(self, split, step, index, device="cpu"):
        if split == "train" and step == 6:
            raise KeyboardInterrupt
        return orig(self, split, step, index, device)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Batches, "get", dying)
        return _train(tmp, run, "--set", "train.ckpt_every=4", *extra)


def _resume_keeps_msign_choice(tmp: Path) -> None:
    from weightgeom.linalg.gemm import onednn_available
    from weightgeom.linalg.split import split_available

    muon = ("--set", "optim.name=muon", "--set", "optim.strategy=hetero", "--set", "train.ckpt_every=4")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WEIGHTGEOM_MSIGN", "bfloat16:6")
        mp.setenv("WEIGHTGEOM_PRODUCTS", "ieee")
        whole = _train(tmp, tmp / "u", *muon)  # uninterrupted, for comparison
        assert whole.rc == 0, whole.err
        assert _interrupted(tmp, tmp / "r", *muon).rc == 130
    run = tmp / "r"
    meta = json.loads((run / "meta.json").read_text())
    assert (meta["msign_default"]["dtype"], meta["msign_default"]["steps"]) == ("bfloat16", 6)
    assert meta["constraint_products"] == "ieee"
    other = "ieee_onednn" if onednn_available("cpu") else ("split_bf16" if split_available("cpu") else None)
    forcing = [("WEIGHTGEOM_MSIGN", "float32:5", ("bfloat16, 6 Polar Express steps", "float32, 5 steps"))]
    if other is not None:
        forcing.append(("WEIGHTGEOM_PRODUCTS", other, ("constraint products ieee", f"constraint products {other}")))
    for var, value, expect in forcing:  # another choice forced on resume: refused, nothing written
        before = _snapshot_tree(run)
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("WEIGHTGEOM_MSIGN", raising=False)
            mp.delenv("WEIGHTGEOM_PRODUCTS", raising=False)
            mp.setenv(var, value)
            res = _train(tmp, run, *muon)
        assert_one_line_error(res, f"{var}={value}", *expect, f"unset {var}", "--fresh")
        assert _snapshot_tree(run) == before
    with pytest.MonkeyPatch.context() as mp:  # nothing forced: the recorded choice, the uninterrupted run's loss
        mp.delenv("WEIGHTGEOM_MSIGN", raising=False)
        mp.delenv("WEIGHTGEOM_PRODUCTS", raising=False)
        res = _train(tmp, run, *muon)
    assert res.rc == 0, res.err
    assert _result(res)["final"]["train_loss"] == _result(whole)["final"]["train_loss"]
    session = json.loads((run / "meta.json").read_text())["resumes"][-1]
    assert (session["msign_default"]["dtype"], session["msign_default"]["steps"]) == ("bfloat16", 6)
    assert session["constraint_products"] == "ieee"


# ------------------------------------------------------------------------------------------------ early refusals
def _refused_before_run_dir(tmp: Path) -> None:
    from weightgeom.analysis.recorder import ContinuityRecorder
    from weightgeom.train import train
    from weightgeom.train.auto_assign import AutoAssign

    run = tmp / "r"
    res = _train(tmp, run, "--set", "optim.name=muon-md", "--set", "optim.strategy=auto")
    assert_one_line_error(res, "optim.strategy='auto'", "muon-md")
    assert not run.exists()  # refused before the run directory is created
    resmlp = {"model": {"kind": "resmlp", "depth": 2, "width": 16}, "data": {"kind": "mnist", "batch_size": 8},
              "train": {"max_steps": 1, "eval_iters": 1}}
    (tmp / "m.yaml").write_text(yaml.safe_dump(resmlp))
    res = cli("train", str(tmp / "m.yaml"), "--out", str(run), "--no-progress", "--set", "optim.strategy=auto")
    assert_one_line_error(res, "optim.strategy='auto'", "resmlp")
    assert not run.exists()
    assert _train(tmp, run, "--set", "train.max_steps=2").rc == 0
    before = _snapshot_tree(run)
    for _ in range(2):  # each retry of a refused fresh start: nothing moves to previous/
        res = _train(tmp, run, "--fresh", "--set", "optim.name=muon-md", "--set", "optim.strategy=auto")
        assert_one_line_error(res, "optim.strategy='auto'")
        with pytest.raises(ValueError, match="shares its optimizer group"):  # a callback's refusal (on_setup)
            try:
                train(_config(tmp), run_dir=run, overrides=["optim.name=muon", "optim.strategy=all-dgram"],
                      progress=False, resume=False, callbacks=[AutoAssign()])
            except RuntimeError as e:
                raise e.__cause__ from None
        with pytest.raises(ValueError, match="role"):  # the recorder's refusal (on_setup)
            try:
                train(_config(tmp), run_dir=run, progress=False, resume=False,
                      callbacks=[ContinuityRecorder(1, roles={"mlp": "no_such.{i}.weight"})])
            except RuntimeError as e:
                raise e.__cause__ from None
        assert _snapshot_tree(run) == before and not (run / "previous").exists()


def _compile_warnings_quiet(tmp: Path) -> None:
    # train.compile_optimizer=on on the CPU: while the optimizer step traces, dynamo warns about the graph breaks it
    # makes by design (29 W-lines per run). A stand-in for torch.compile warns the way dynamo does while it traces (its
    # first two calls), so the row takes a second instead of a real compile's minute.
    import logging

    import weightgeom.optim.compiled as compiled

    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    def fake_compile(fn, **kwargs):
        traced = []

        def step(*a, **kw):
            if len(traced) < 2:  # tracing: state created, then present
                traced.append(1)
                logging.getLogger("torch._dynamo.variables.tensor").warning("Graph break from `Tensor.item()`")
                logging.getLogger("torch._dynamo.variables.ctx_manager").warning("Profiler record function ignored")
            return fn(*a, **kw)

        return step

    catch = Catch(logging.WARNING)
    dynamo = logging.getLogger("torch._dynamo")
    dynamo.addHandler(catch)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(compiled.torch, "compile", fake_compile)
            res = _train(tmp, tmp / "r", "--set", "train.max_steps=5", "--set", "train.compile_optimizer=on")
    finally:
        dynamo.removeHandler(catch)
    assert res.rc == 0 and _result(res)["step"] == 5, res.err[-2000:]
    assert not records, f"{len(records)} dynamo warnings printed: {[r.getMessage() for r in records]}"
    assert dynamo.level == logging.NOTSET  # restored: a later warning prints as before
    assert '"split": "compile"' in (tmp / "r" / "metrics.jsonl").read_text()  # the compile cost still logged


CASES: list[Hostile] = [
    Hostile("fresh-sequence", "rundir",
            "`train --fresh` with fewer steps in a used run directory: the old run moves to previous/, the new run's "
            "checkpoints are kept and `--resume` reports the new run", _fresh_sequence),
    Hostile("two-writers", "rundir",
            "a second `weightgeom train` in a directory another live process is training in exits 2 with one line "
            "naming the directory and the owner's pid and host, touching nothing", _two_writers),
    Hostile("stale-lock-sigkill", "rundir",
            "after `kill -9` of a training process its lock is stale: the next run in that directory takes over, "
            "moving the killed run's files to previous/", _stale_lock_after_sigkill),
    Hostile("run-name-dotdot", "rundir",
            "`--set run.name=../../x` is refused with one line, nothing written outside run.out_dir",
            _name_escapes("../../x", "..")),
    Hostile("run-name-absolute", "rundir",
            "an absolute `run.name` is refused with one line, nothing written", _name_absolute),
    Hostile("run-name-symlink", "rundir",
            "a `run.name` that leads out of run.out_dir through a symbolic link is refused with one line",
            _name_through_symlink),
    Hostile("unwritable-out", "rundir",
            "an output directory that cannot be created (a path under a regular file) exits 2 with one line naming "
            "the path and the system's reason", _unwritable_out),
    Hostile("full-disk", "rundir",
            "a full disk while a checkpoint is written exits 2 with one line naming the checkpoint and ENOSPC; "
            "earlier checkpoints stay loadable and the run resumes from them", _full_disk),
    Hostile("shape-mismatch-model", "rundir",
            "a checkpoint whose config hash matches but whose model tensor has another shape is refused with one "
            "line naming the checkpoint and the tensor", _shape_mismatch_model),
    Hostile("shape-mismatch-optimizer", "rundir",
            "a checkpoint whose optimizer state has a tensor of the wrong shape is refused with one line naming the "
            "checkpoint and the state entry (not a traceback at the next step)", _shape_mismatch_optimizer),
    Hostile("changed-config", "rundir",
            "a changed config in an existing run directory is refused with one line naming the changed key, "
            "`--fresh` and `--out`", _changed_config),
    Hostile("tb-purge", "rundir",
            "after an interrupted run resumes, TensorBoard shows each step once (the interrupted session's later "
            "steps are purged)", _tb_after_resume),
    Hostile("finished-rerun", "rundir",
            "re-running a finished run reports its final numbers (not NaN), says it was already done and rewrites "
            "nothing", _finished_rerun),
    Hostile("doctored-metrics", "rundir",
            "a `metrics.jsonl` with lines nested 100000 deep, not UTF-8, not objects or with a 5000-digit step: a "
            "re-run of the finished run reports its numbers and a resume moves those lines byte for byte to "
            "`metrics.dropped.jsonl`, with no traceback", _doctored_metrics),
    Hostile("user-folder-untouched", "rundir",
            "`--out` (with or without `--fresh`) on a folder of the user's own files that holds no weightgeom run "
            "(even one with a `checkpoints/` folder) is refused with one line; nothing in it is moved or written",
            _user_folder_untouched),
    Hostile("parent-of-runs", "rundir",
            "`run.name=.` or `--out` on the folder that holds other runs is refused with one line; no run is moved "
            "aside", _parent_of_live_run),
    Hostile("run-inside-a-run", "rundir",
            "`--fresh` on a run directory that contains another run is refused with one line naming it; nothing "
            "moves", _run_inside_a_run),
    Hostile("run-name-control-chars", "rundir",
            "a `run.name` with a newline or other control character is refused with one line",
            _run_name_control_chars),
    Hostile("sigterm", "rundir",
            "SIGTERM (a scheduler's stop) unwinds a run like Ctrl-C: exit 143, `status.json` says failed with the "
            "reason, the lock is released", _sigterm_unwinds),
    Hostile("preset-keeps-written-keys", "rundir",
            "`optim.preset=paper` (or a `model.preset`) with keys the user wrote in the config file or with `--set`, "
            "even at the library default (`optim.muon.dual.steps=1`, `dual.project=true`): the written values are "
            "kept, and a line on stderr (with or without the progress bar) and `meta.json` say what the preset set "
            "and which written keys it left", _preset_keeps_written_keys),
    Hostile("resume-keeps-msign-choice", "rundir",
            "a run resumed under another `WEIGHTGEOM_MSIGN` or `WEIGHTGEOM_PRODUCTS` is refused with one line naming "
            "the variable, the recorded and the requested choice, unset and `--fresh`, touching nothing; resumed "
            "without them it uses its first session's choice (the final loss equals an uninterrupted run's) and "
            "`meta.json` records what each session ran", _resume_keeps_msign_choice),
    Hostile("refused-before-run-dir", "rundir",
            "a config that cannot train (`optim.strategy=auto` on a ResMLP or with `muon-md`, a callback that "
            "refuses the optimizer's groups, a continuity recorder on a model without two same-shape layers of a role) "
            "is refused with one line before the run directory is created or an "
            "earlier run moved: retries pile nothing into previous/", _refused_before_run_dir),
    Hostile("compile-warnings-quiet", "rundir",
            "`train.compile_optimizer=on` on the CPU trains without printing dynamo's graph-break warnings while the "
            "optimizer step traces (29 lines per run before); the compile's cost is still logged",
            _compile_warnings_quiet),
]
