"""Trainer: end-to-end runs, bit-identical resume, atomic and verified checkpoints, divergence marking, CLI errors."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from weightgeom.train import checkpoint as ck
from weightgeom.train import read_status, train
from weightgeom.train.batches import Batches
from weightgeom.train.logging import read_metrics

TINY = {
    "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
    "data": {"kind": "synthetic", "block_size": 16, "batch_size": 4},
    "optim": {"name": "adamw", "adamw": {"lr": 1e-2}},
    "schedule": {"warmup": 2, "kind": "cosine"},
    "train": {"max_steps": 12, "eval_every": 6, "eval_iters": 2, "log_every": 1, "ckpt_every": 4},
}


def _losses(run_dir, split="train"):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir, split)]


def test_train_writes_run_directory(tmp_path):
    res = train(TINY, run_dir=tmp_path / "r", progress=False)
    rd = tmp_path / "r"
    assert res["status"] == "done" and res["step"] == 12
    assert read_status(rd)["state"] == "done"
    for f in ("config.resolved.toml", "meta.json", "metrics.jsonl", "status.json"):
        assert (rd / f).is_file(), f
    assert any((rd / "tb").iterdir())
    meta = json.loads((rd / "meta.json").read_text())
    assert meta["seed"] == 0 and "torch" in meta["versions"]
    assert [s for s, _ in ck.list_checkpoints(rd / "checkpoints")] == [8, 12]  # keep_checkpoints = 2
    rows = read_metrics(rd)
    assert {r["split"] for r in rows} == {"train", "val"}
    assert [r["step"] for r in rows if r["split"] == "val"] == [0, 6, 12]
    assert res["final"]["val_loss"] == rows[-1]["loss"]
    # the resolved config reproduces the run
    train(rd / "config.resolved.toml", run_dir=tmp_path / "r2", progress=False)
    assert _losses(tmp_path / "r2") == _losses(rd)


def _optim_variants():
    out = [pytest.param({"name": "adamw"}, id="adamw"),
           pytest.param({"name": "adamw-md"}, id="adamw-md")]  # MD's fused CPU path where a C compiler exists
    out.append(pytest.param({"name": "muon", "strategy": "hetero", "muon": {"momentum_form": "sum"}}, id="muon-hetero"))
    out.append(pytest.param({"name": "muon-md"}, id="muon-md"))
    return out


@pytest.mark.parametrize("optim", _optim_variants())
def test_resume_is_bit_identical(tmp_path, monkeypatch, optim):
    cfg = {**TINY, "optim": {**TINY["optim"], **optim}, "model": {**TINY["model"], "dropout": 0.1}}
    full = train(cfg, run_dir=tmp_path / "full", progress=False)

    # interrupted run: dies while computing step 10 (after the checkpoint at step 8)
    orig = Batches.get

    def dying_get(self, split, step, index, device="cpu"):
        if split == "train" and step == 9:
            raise KeyboardInterrupt
        return orig(self, split, step, index, device)

    monkeypatch.setattr(Batches, "get", dying_get)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, run_dir=tmp_path / "cut", progress=False)
    assert read_status(tmp_path / "cut")["state"] == "failed"
    monkeypatch.setattr(Batches, "get", orig)
    res = train(cfg, run_dir=tmp_path / "cut", progress=False, resume=True)
    assert res["status"] == "done"
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "full")  # exactly equal floats, every step
    assert _losses(tmp_path / "cut", "val") == _losses(tmp_path / "full", "val")
    a = ck.load_checkpoint(tmp_path / "full" / "checkpoints" / "ckpt_00000012.pt")
    b = ck.load_checkpoint(tmp_path / "cut" / "checkpoints" / "ckpt_00000012.pt")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert res["final"]["train_loss"] == full["final"]["train_loss"]
    assert len(json.loads((tmp_path / "cut" / "meta.json").read_text())["resumes"]) == 1


def test_checkpoint_roundtrip_and_corruption_refused(tmp_path):
    p = tmp_path / "ckpt_00000001.pt"
    ck.save_checkpoint(p, {"step": 1, "config_hash": "abc", "w": torch.arange(1000.0)})
    assert ck.load_checkpoint(p, expected_hash="abc")["w"].sum() == 499500
    raw = p.read_bytes()
    # truncated
    p.write_bytes(raw[:-100])
    with pytest.raises(ck.CheckpointError, match=r"ckpt_00000001.pt: truncated or corrupt"):
        ck.load_checkpoint(p)
    # one flipped byte in the payload
    bad = bytearray(raw)
    bad[-50] ^= 0xFF
    p.write_bytes(bytes(bad))
    with pytest.raises(ck.CheckpointError, match="corrupt \\(SHA-256 mismatch\\)"):
        ck.load_checkpoint(p)
    # not a checkpoint at all
    p.write_bytes(b"hello")
    with pytest.raises(ck.CheckpointError, match="not a weightgeom checkpoint"):
        ck.load_checkpoint(p)
    # config mismatch
    p.write_bytes(raw)
    with pytest.raises(ck.CheckpointError, match="different config"):
        ck.load_checkpoint(p, expected_hash="xyz")


def test_resume_refuses_corrupt_checkpoint_and_other_config(tmp_path):
    rd = tmp_path / "r"
    train(TINY, run_dir=rd, progress=False)
    latest = ck.latest_checkpoint(rd / "checkpoints")
    with pytest.raises(ValueError, match="different config"):
        train(TINY, run_dir=rd, overrides=["optim.adamw.lr=0.5"], progress=False, resume=True)
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    with pytest.raises(ck.CheckpointError, match="truncated or corrupt"):
        train(TINY, run_dir=rd, progress=False, resume=True)
    with pytest.raises(ValueError, match="no checkpoint"):
        train(TINY, run_dir=tmp_path / "empty", progress=False, resume=True)


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    p = tmp_path / "ckpt_00000004.pt"
    ck.save_checkpoint(p, {"step": 4, "v": torch.ones(3)})

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(ck.os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(p, {"step": 8, "v": torch.zeros(3)})
    monkeypatch.undo()
    assert ck.load_checkpoint(p)["step"] == 4
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ckpt_00000004.pt"]  # the tmp file was removed


def test_killed_write_leaves_previous_checkpoint_loadable(tmp_path):
    """SIGKILL a process in the middle of writing a newer checkpoint (same final name and a new one)."""
    d = tmp_path / "checkpoints"
    ck.save_checkpoint(d / "ckpt_00000004.pt", {"step": 4, "v": torch.ones(3)})
    marker = tmp_path / "writing"
    script = textwrap.dedent(f"""
        import os, time, torch
        from weightgeom.train import checkpoint as ck
        real = os.fsync
        def hang(fd):
            open({str(marker)!r}, "w").close()
            time.sleep(60)
        ck.os.fsync = hang
        big = {{"step": 8, "v": torch.zeros(2_000_000)}}
        ck.save_checkpoint({str(d / "ckpt_00000008.pt")!r}, big)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    t0 = time.time()
    while not marker.exists() and time.time() - t0 < 60 and proc.poll() is None:
        time.sleep(0.05)
    assert marker.exists(), "writer never reached the write"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(x.name.endswith(".tmp") for x in d.iterdir())  # the half-written temporary is all that is left
    assert [s for s, _ in ck.list_checkpoints(d)] == [4]
    assert ck.load_checkpoint(ck.latest_checkpoint(d))["step"] == 4
    ck.prune_checkpoints(d, keep=1)
    assert ck.load_checkpoint(d / "ckpt_00000004.pt")["step"] == 4


def test_divergence_marks_run_and_keeps_logs(tmp_path):
    cfg = {**TINY, "optim": {"name": "adamw", "adamw": {"lr": 50.0}}, "schedule": {"kind": "constant"},
           "train": {**TINY["train"], "max_steps": 200, "grad_clip": 0.0, "diverge_factor": 1.5,
                     "diverge_warmup": 2}}
    res = train(cfg, run_dir=tmp_path / "d", progress=False)
    st = read_status(tmp_path / "d")
    assert res["status"] == "diverged" and st["state"] == "diverged"
    assert st["step"] == res["step"] < 200
    assert "loss explosion" in st["reason"] or "non-finite" in st["reason"]
    rows = read_metrics(tmp_path / "d", "train")
    assert rows and rows[-1]["step"] == st["step"] and rows[-1].get("diverged") == 1


def test_nan_loss_diverges_before_update(tmp_path, monkeypatch):
    import weightgeom.train.trainer as tr

    real_build = tr.model_from_config

    def nan_model(cfg):
        m = real_build(cfg)
        fwd = m.forward
        calls = {"n": 0}

        def forward(x, y=None):
            logits, loss = fwd(x, y)
            if m.training:
                calls["n"] += 1
                if calls["n"] == 5 and loss is not None:
                    loss = loss * float("nan")
            return logits, loss

        m.forward = forward
        return m

    monkeypatch.setattr(tr, "model_from_config", nan_model)
    res = train(TINY, run_dir=tmp_path / "n", progress=False)
    st = read_status(tmp_path / "n")
    assert res["status"] == "diverged" and st["step"] == 5 and "non-finite train loss" in st["reason"]
    assert (tmp_path / "n" / "metrics.jsonl").read_text().count("\n") >= 5  # logs kept


def test_nonfinite_gradient_divergence_names_the_parameter(tmp_path, monkeypatch):
    """A finite loss whose backward gives one parameter a NaN gradient: the reason in status.json names it."""
    import weightgeom.train.trainer as tr

    real_build = tr.model_from_config
    bad_name = "transformer.h.0.mlp.c_proj.weight"

    def poisoned(cfg):
        m = real_build(cfg)
        calls = {"n": 0}

        def hook(g):
            calls["n"] += 1
            return g * float("nan") if calls["n"] == 3 else g

        dict(m.named_parameters())[bad_name].register_hook(hook)
        return m

    monkeypatch.setattr(tr, "model_from_config", poisoned)
    res = train(TINY, run_dir=tmp_path / "g", progress=False)
    st = read_status(tmp_path / "g")
    assert res["status"] == "diverged" and st["step"] == 3
    assert st["reason"].endswith(f"non-finite gradient in {bad_name}"), st["reason"]


def test_one_writer_per_run_directory(tmp_path, monkeypatch):
    """A live process holding the lock refuses train() with its pid; once it is killed the lock is stale and taken
    over; a run releases its lock on success and on failure."""
    from weightgeom.train.rundir import LOCK_NAME, LockError

    rd = tmp_path / "r"
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from weightgeom.train.rundir import DirLock
        DirLock({str(rd)!r}).acquire()
        pathlib.Path({str(ready)!r}).touch()
        time.sleep(120)
    """)])
    try:
        t0 = time.time()
        while not ready.exists() and time.time() - t0 < 60 and holder.poll() is None:
            time.sleep(0.05)
        assert ready.exists(), "lock holder never started"
        with pytest.raises(LockError, match=rf"run directory {rd} is in use by pid {holder.pid} on host"):
            train(TINY, run_dir=rd, progress=False)
        assert sorted(p.name for p in rd.iterdir() if p.name != ".weightgeom.lock.guard") == [LOCK_NAME]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert train(TINY, run_dir=rd, progress=False, overrides=["train.max_steps=2"])["status"] == "done"
    assert not (rd / LOCK_NAME).exists()

    def boom(self, split, step, index, device="cpu"):
        raise KeyboardInterrupt

    monkeypatch.setattr(Batches, "get", boom)
    with pytest.raises(KeyboardInterrupt):
        train(TINY, run_dir=tmp_path / "k", progress=False)
    assert not (tmp_path / "k" / LOCK_NAME).exists()


def test_cli_errors_and_run(tmp_path, capsys):
    from weightgeom.cli import main

    assert main(["train", "tiny-shakespeare", "--set", "train.max_stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key train.max_stepz; did you mean 'max_steps'" in err and err.count("\n") == 1
    assert main(["train", "no-such-config"]) == 2
    assert main(["train", "--list"]) == 0
    assert "tiny-shakespeare" in capsys.readouterr().out
    cfgfile = tmp_path / "tiny.yaml"
    import yaml

    cfgfile.write_text(yaml.safe_dump(TINY))
    rd = tmp_path / "cli"
    assert main(["train", str(cfgfile), "--out", str(rd), "--no-progress", "--set", "train.max_steps=4"]) == 0
    assert read_status(rd)["step"] == 4
    # --resume with more steps continues from step 4
    assert main(["train", "--resume", str(rd), "--no-progress", "--set", "train.max_steps=6"]) == 0
    assert read_status(rd)["step"] == 6
    assert [s for s, _ in _losses(rd)] == [1, 2, 3, 4, 5, 6]


def test_resmlp_mnist_classification(tmp_path):
    res = train("resmlp-mnist", run_dir=tmp_path / "m", progress=False,
                overrides=["model.depth=2", "model.width=32", "train.max_steps=20", "train.eval_every=20",
                           "data.batch_size=64", "schedule.warmup=2"])
    assert res["status"] == "done"
    assert 0.0 <= res["final"]["val_acc"] <= 1.0 and res["final"]["val_acc"] > 0.3


def test_diagnostics_logged_without_changing_the_trajectory(tmp_path):
    plain = train(TINY, run_dir=tmp_path / "p", progress=False)
    diag = train({**TINY, "diagnostics": {"every": 4}}, run_dir=tmp_path / "d", progress=False)
    rows = read_metrics(tmp_path / "d", "diag")
    assert [r["step"] for r in rows] == [4, 8, 12]
    assert any(k.startswith("mat.") for k in rows[0])
    assert _losses(tmp_path / "d") == _losses(tmp_path / "p")
    assert diag["final"]["val_loss"] == plain["final"]["val_loss"]
    # gradient norms are those of the raw gradients, taken before clipping (the train line logs the same total)
    clipped = train({**TINY, "diagnostics": {"every": 4}, "train": {**TINY["train"], "grad_clip": 1e-3}},
                    run_dir=tmp_path / "c", progress=False)
    assert clipped["status"] == "done"
    train_gn = {r["step"]: r["grad_norm"] for r in read_metrics(tmp_path / "c", "train")}
    for r in read_metrics(tmp_path / "c", "diag"):
        assert r["grad_norm.total"] > 1e-2 and r["grad_norm.total"] == pytest.approx(train_gn[r["step"]], rel=1e-4)


def test_nanogpt_bin_data(tmp_path):
    import numpy as np

    d = tmp_path / "owt"
    d.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 50257, 5000, dtype=np.uint16).tofile(d / "train.bin")
    rng.integers(0, 50257, 1000, dtype=np.uint16).tofile(d / "val.bin")
    res = train("gpt2-small-owt", run_dir=tmp_path / "b", progress=False, overrides=[
        f"data.path={d}", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=32",
        "data.block_size=32", "data.batch_size=2", "train.grad_accum=1", "train.max_steps=2", "train.eval_iters=1",
        "diagnostics.every=0", "run.dtype=float32"])
    assert res["status"] == "done" and abs(res["final"]["val_loss"] - 10.83) < 0.5  # ≈ ln(50304) at init
    with pytest.raises(ValueError, match=r"data\.path=.*nope"):
        train("gpt2-small-owt", run_dir=tmp_path / "c", overrides=["data.path=/nope"], progress=False)
    assert not (tmp_path / "c").exists()  # the refused run leaves no directory behind (not even its lock)


def test_explosion_rule_ignores_small_loss_noise_but_catches_blowups():
    from weightgeom.train.trainer import explosion

    sm, ema, n, best = 0.9, 0.0, 0, float("inf")
    for loss in [0.04, 0.03, 0.035, 0.03, 0.032, 0.028, 0.03, 0.031, 0.029, 0.03, 0.03, 0.03]:
        assert explosion(loss, ema, n, best, 5.0, 10, sm) is None
        ema, n = sm * ema + (1 - sm) * loss, n + 1
        best = min(best, ema / (1 - sm**n))
    assert explosion(0.15, ema, n, best, 5.0, 10, sm) is None  # one noisy batch at 5x: not an explosion
    assert "smoothed loss" in explosion(1e3, ema, n, best, 5.0, 10, sm)  # a real blow-up trips at once
    assert explosion(1e3, ema, n, best, 0.0, 10, sm) is None  # disabled
    assert explosion(1e3, ema, 3, best, 5.0, 10, sm) is None  # still in the warmup


# ---------------------------------------------------------------------------------------------------- callbacks
class _Log:
    """Records every hook call as (name, hook, step, extra)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def on_train_start(self, ctx):
        self.log.append((self.name, "start", ctx.step, ctx.resumed))

    def on_before_step(self, ctx):
        assert ctx.grads_available and all(p.grad is not None for p in ctx.model.parameters())
        self.w = next(ctx.model.parameters()).detach().clone()
        self.log.append((self.name, "before", ctx.step, None))

    def on_step_end(self, ctx):
        assert ctx.grads_available and all(p.grad is not None for p in ctx.model.parameters())
        assert not torch.equal(self.w, next(ctx.model.parameters()))  # the update happened in between
        self.log.append((self.name, "end", ctx.step, ctx.loss))

    def on_eval(self, ctx, metrics):
        assert not ctx.grads_available
        self.log.append((self.name, "eval", ctx.step, metrics["loss"]))

    def on_checkpoint(self, ctx, path):
        self.log.append((self.name, "ckpt", ctx.step, path.name))

    def on_train_end(self, ctx, result):
        self.log.append((self.name, "end_train", ctx.step, result["status"]))


def test_callbacks_are_called_in_order(tmp_path):
    log = []
    cfg = {**TINY, "train": {**TINY["train"], "max_steps": 4, "eval_every": 2, "ckpt_every": 2}}
    res = train(cfg, run_dir=tmp_path / "r", progress=False, callbacks=[_Log("a", log), _Log("b", log)])
    assert res["status"] == "done"
    losses, vals = dict(_losses(tmp_path / "r")), dict(_losses(tmp_path / "r", "val"))
    want = [("start", 0, False), ("eval", 0, vals[0])]
    for s in range(1, 5):
        want += [("before", s - 1, None), ("end", s, losses[s])]
        if s % 2 == 0:
            want += [("eval", s, vals[s]), ("ckpt", s, f"ckpt_{s:08d}.pt")]
    want.append(("end_train", 4, "done"))
    assert log == [(n, *w) for w in want for n in ("a", "b")]
    # a callback changes nothing by itself: same losses as a run without callbacks
    train(cfg, run_dir=tmp_path / "plain", progress=False)
    assert _losses(tmp_path / "plain") == _losses(tmp_path / "r")
    assert "callbacks" not in ck.load_checkpoint(tmp_path / "r" / "checkpoints" / "ckpt_00000004.pt")


def test_callback_error_is_named_and_marks_the_run_failed(tmp_path):
    from weightgeom.train.callbacks import Callback, CallbackError
    from weightgeom.train.rundir import LOCK_NAME

    class Boom(Callback):
        def on_step_end(self, ctx):
            if ctx.step == 3:
                raise RuntimeError("nope")

    with pytest.raises(CallbackError, match=r"^callback Boom\.on_step_end failed at step 3: RuntimeError: nope$"):
        train(TINY, run_dir=tmp_path / "r", progress=False, callbacks=[Boom()])
    st = read_status(tmp_path / "r")
    assert st["state"] == "failed" and "callback Boom.on_step_end failed at step 3" in st["reason"]
    assert not (tmp_path / "r" / LOCK_NAME).exists()
    with pytest.raises(TypeError, match="none of the hook methods"):
        train(TINY, run_dir=tmp_path / "x", progress=False, callbacks=[object()])


def test_callback_state_survives_resume(tmp_path, monkeypatch):
    from weightgeom.train.callbacks import Callback

    class Counter(Callback):
        def __init__(self):
            self.n, self.seen = 0, None

        def on_train_start(self, ctx):
            self.seen = (ctx.start_step, ctx.resumed, list(ctx.loaded_state), self.n)

        def on_step_end(self, ctx):
            self.n += 1

        def state_dict(self):
            return {"n": self.n, "t": torch.tensor([float(self.n)])}

        def load_state_dict(self, state):
            self.n = state["n"]
            assert float(state["t"]) == self.n

    class Late(Callback):  # added only on resume: the checkpoint has no state for it
        state_key = "late"

        def on_train_start(self, ctx):
            self.resumed_without_state = ctx.resumed and "late" not in ctx.loaded_state

    orig = Batches.get

    def dying_get(self, split, step, index, device="cpu"):
        if split == "train" and step == 9:
            raise KeyboardInterrupt
        return orig(self, split, step, index, device)

    monkeypatch.setattr(Batches, "get", dying_get)
    first = Counter()
    with pytest.raises(KeyboardInterrupt):
        train(TINY, run_dir=tmp_path / "r", progress=False, callbacks=[first])
    assert first.n == 9 and first.seen == (0, False, [], 0)
    monkeypatch.setattr(Batches, "get", orig)
    second, late = Counter(), Late()
    train(TINY, run_dir=tmp_path / "r", progress=False, callbacks=[second, late])
    assert second.seen == (8, True, ["Counter"], 8)  # restored from the step-8 checkpoint before on_train_start
    assert second.n == 12 and late.resumed_without_state
    payload = ck.load_checkpoint(tmp_path / "r" / "checkpoints" / "ckpt_00000012.pt")
    assert payload["callbacks"]["Counter"]["n"] == 12


def test_truncate_jsonl_moves_later_rows_aside_and_deletes_nothing(tmp_path):
    """On resume a callback's JSON-lines file keeps the rows up to the resumed step; the later ones (and a torn last
    line) move to <name>.dropped.jsonl, so nothing written is lost."""
    from weightgeom.train.logging import truncate_jsonl

    path = tmp_path / "heads.jsonl"
    rows = [json.dumps({"step": s, "x": s}) for s in (2, 4, 6, 8)]
    path.write_text("\n".join(rows) + "\n" + '{"step": 10, "x"')
    assert truncate_jsonl(path, 4) == 3
    assert path.read_text().splitlines() == rows[:2]
    dropped = (tmp_path / "heads.dropped.jsonl").read_text().splitlines()
    assert dropped == rows[2:] + ['{"step": 10, "x"']
    assert truncate_jsonl(tmp_path / "missing.jsonl", 4) == 0
