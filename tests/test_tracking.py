"""Experiment tracking (``[logging] wandb / mlflow``, weightgeom.train.tracking) in offline mode: W&B offline runs and
an MLflow file store, no network. Both packages are test dependencies (``setup.sh`` installs the ``wandb`` and
``mlflow`` extras), so they run wherever the README's setup ran; only a machine without either (a GPU image running
gpu_check's CUDA tests) skips this module."""

import json
import struct
import sys
from pathlib import Path

import pytest

from weightgeom.cli import main
from weightgeom.train import train
from weightgeom.train.config import config_hash, load_config
from weightgeom.train.logging import read_metrics

# the optional trackers ([mlflow], [wandb] extras; setup.sh installs both, so CI runs these tests): a machine without
# them (a GPU image running gpu_check's CUDA tests) skips this module instead of failing the whole collection
MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient
wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")

CFG = {
    "run": {"device": "cpu"},
    "model": {"kind": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 32, "bias": False},
    "data": {"kind": "shakespeare", "tokenizer": "char", "block_size": 32, "batch_size": 4},
    "optim": {"name": "muon", "strategy": "unconstrained"},
    "train": {"max_steps": 4, "eval_every": 2, "eval_iters": 1, "log_every": 1, "ckpt_every": 2},
    "diagnostics": {"every": 2},
}


def _wandb_records(run_dir: Path) -> list:
    """The records of the W&B offline run under ``run_dir/wandb`` (its .wandb file: a LevelDB-style log of
    protobuf records in 32 KiB blocks, each record with a 7-byte header: crc, length, type)."""
    (path,) = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))[-1:]
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def _wandb_history(run_dir: Path) -> dict[int, dict]:
    hist: dict[int, dict] = {}
    for rec in _wandb_records(run_dir):
        if rec.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            hist.setdefault(int(row["_step"]), {}).update(row)
    return hist


def _expected(run_dir: Path) -> dict[tuple[int, str], float]:
    """``(step, "<split>/<name>") -> value`` for every number of metrics.jsonl."""
    out = {}
    for r in read_metrics(run_dir):
        for k, v in r.items():
            if k not in ("step", "split") and isinstance(v, (int, float)):
                out[(r["step"], f"{r['split']}/{k}")] = float(v)
    return out


def _mlflow_run(store: Path, name: str):
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    exp = client.get_experiment_by_name("weightgeom")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.info.run_name == name]
    return client, run


def test_offline_wandb_and_mlflow_get_every_metrics_line_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "runs" / "a"
    train(CFG, run_dir=run_dir, progress=False,
          overrides=["logging.wandb=true", "logging.mlflow=true", "logging.group=grp"])
    expected = _expected(run_dir)
    splits = {k.split("/")[0] for _, k in expected}
    assert splits == {"train", "val", "diag"}
    # W&B: the offline run holds every number at its step, the resolved config and the group
    hist = _wandb_history(run_dir)
    for (step, key), v in expected.items():
        assert hist[step][key] == pytest.approx(v, rel=1e-6, nan_ok=True), (step, key)
    (run_rec,) = [r.run for r in _wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    assert run_rec.run_group == "grp" and run_rec.display_name == "a"
    config = {i.key: json.loads(i.value_json) for i in run_rec.config.update}
    assert config["optim.strategy"] == "unconstrained" and config["train.max_steps"] == 4
    # MLflow: file store next to the run directory, one run named after it
    client, run = _mlflow_run(tmp_path / "runs" / "mlruns", "a")
    assert run.data.tags["group"] == "grp" and run.data.tags["status"] == "done"
    assert run.data.params["optim.strategy"] == "unconstrained" and run.info.status == "FINISHED"
    for key in {k for _, k in expected}:
        got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        want = {s: v for (s, k), v in expected.items() if k == key}
        assert got == pytest.approx(want, rel=1e-6, nan_ok=True), key


def test_resume_continues_the_tracker_runs_and_sends_each_step_once(tmp_path, monkeypatch):
    """A run resumed from its checkpoint continues the same MLflow run without repeating steps; tracking may be
    turned on at a resume (not a config change that refuses the checkpoint): W&B then gets the whole run."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run_dir = tmp_path / "runs" / "a"
    train(CFG, run_dir=run_dir, progress=False, overrides=["train.max_steps=2", "logging.mlflow=true"])
    first = json.loads((run_dir / "tracking.json").read_text())
    result = train(CFG, run_dir=run_dir, progress=False, overrides=["logging.mlflow=true", "logging.wandb=true"])
    assert result["status"] == "done" and result["step"] == 4
    rec = json.loads((run_dir / "tracking.json").read_text())
    assert rec["mlflow_run_id"] == first["mlflow_run_id"] and rec["mlflow_last_step"]["train"] == 4
    client, run = _mlflow_run(tmp_path / "runs" / "mlruns", "a")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
    assert sorted(_wandb_history(run_dir)) == [0, 1, 2, 3, 4]
    # the [logging] keys are not part of the checkpoint's config identity
    assert config_hash(load_config(CFG)) == config_hash(load_config(CFG, ["logging.wandb=true"]))


@pytest.mark.parametrize("key,module,extra", [("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow")])
def test_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch, key, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\nkind = "shakespeare"\n[train]\nmax_steps = 1\n')
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--set", f"logging.{key}=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"logging.{key}=true" in err[0] and f"pip install 'weightgeom[{extra}]'" in err[0]
    assert not out.exists()


def test_sweep_run_is_grouped_by_its_sweep_and_tracking_is_not_a_sweep_setting(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "my-sweep"
    cmd = ["sweep", "manifolds", "ci", "--out", str(out), "--steps", "2", "--only", "unconstrained", "--no-report",
           "--quiet"]
    assert main([*cmd, "--set", "logging.mlflow=true"]) == 0
    _, run = _mlflow_run(out / "mlruns", "unconstrained-s0")
    assert run.data.tags["group"] == "my-sweep"
    assert run.data.tags["variant"] == "unconstrained" and run.data.tags["recipe"] == "manifolds"
    capsys.readouterr()
    # re-running without tracking is the same sweep (tracking does not change what a run computes)
    assert main(cmd) == 0
    assert "already done at step 2 (skipped)" in capsys.readouterr().out


@pytest.mark.parametrize("sets,needle", [
    (["logging.wandb=true", 'logging.project="a/b"'], "logging.project='a/b': W&B project names"),
    (["logging.mlflow=true", 'logging.mlflow_uri="bogus://x"'], "logging.mlflow_uri='bogus://x': unknown scheme"),
    (["logging.mlflow=true", 'logging.mlflow_uri="/proc/nowhere/m"'], "mlflow cannot start a run"),
])
def test_tracker_settings_that_cannot_work_are_one_line_exit_2(tmp_path, capsys, sets, needle):
    """Hostile trial: these printed a 60-line CallbackError traceback (exit 1); a bad project or scheme is now
    refused with the config, a store MLflow cannot open when the run starts, naming the key."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[data]\nkind = "shakespeare"\n[train]\nmax_steps = 1\n[model]\nn_layer = 1\nn_embd = 16\n'
                   'n_head = 2\n')
    args = [a for s in sets for a in ("--set", s)]
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_plain_mlflow_path_is_a_file_store(tmp_path, monkeypatch):
    """logging.mlflow_uri = a directory path works like file:<path> (it used to fail: MLflow's file store is behind
    MLFLOW_ALLOW_FILE_STORE, set only for file: URIs)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "store"
    cfg = {**CFG, "train": {**CFG["train"], "max_steps": 2}, "logging": {"mlflow": True, "mlflow_uri": str(store)}}
    res = train(cfg, run_dir=tmp_path / "run", progress=False)
    assert res["status"] == "done"
    runs = MlflowClient(tracking_uri=store.as_uri()).search_runs(
        [MlflowClient(tracking_uri=store.as_uri()).get_experiment_by_name("weightgeom").experiment_id])
    assert len(runs) == 1
