"""2 CPU processes on gloo (torchrun) give the same parameters as 1 process on the same global batch, with DDP and
FSDP2, and each rank holds the optimizer state of (and computes the update for) only its own parameters."""

import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from weightgeom.train import checkpoint as ck
from weightgeom.train import train
from weightgeom.train.logging import read_metrics

pytestmark = pytest.mark.distributed


def _muon_available() -> bool:
    try:
        import weightgeom.optim.muon  # noqa: F401

        return True
    except ImportError:
        return False


def _config() -> dict:
    optim = ({"name": "muon", "strategy": "hetero", "momentum_form": "sum", "adamw_lr": 0.01} if _muon_available()
             else {"name": "adamw", "adamw_lr": 0.01})
    return {
        "model": {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16},
        "data": {"kind": "synthetic", "block_size": 16, "batch_size": 4},
        "optim": optim,
        "schedule": {"warmup": 2},
        "train": {"max_steps": 5, "eval_every": 5, "eval_iters": 2, "log_every": 1, "grad_accum": 2},
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(cfg_path, out, *sets):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "weightgeom", "train", str(cfg_path), "--out", str(out),
           "--no-progress", *[a for s in sets for a in ("--set", s)]]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gloo_processes_match_one(tmp_path, parallel):
    cfg = _config()
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    one = train(cfg, run_dir=tmp_path / "one", progress=False)
    assert one["status"] == "done"
    _torchrun(cfg_path, tmp_path / "two", f"run.parallel={parallel}")

    a = ck.load_checkpoint(tmp_path / "one" / "checkpoints" / "ckpt_00000005.pt")
    b = ck.load_checkpoint(tmp_path / "two" / "checkpoints" / "ckpt_00000005.pt")
    assert b["world_size"] == 2 and b["sharded"]
    for k, v in a["model"].items():
        torch.testing.assert_close(b["model"][k], v, rtol=0, atol=2e-5, msg=k)
    la = [r["loss"] for r in read_metrics(tmp_path / "one", "train")]
    lb = [r["loss"] for r in read_metrics(tmp_path / "two", "train")]
    assert la == pytest.approx(lb, abs=1e-5)

    # each parameter's optimizer state lives on exactly one rank (its update was computed there only)
    r1 = ck.load_checkpoint(tmp_path / "two" / "checkpoints" / "ckpt_00000005.rank1.pt")
    n0, n1, n = len(b["optimizer"]["state"]), len(r1["optimizer"]["state"]), len(a["optimizer"]["state"])
    assert n0 > 0 and n1 > 0 and n0 + n1 == n
