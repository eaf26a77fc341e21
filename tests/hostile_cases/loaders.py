"""Hostile inputs: loaders (rows of tests/test_hostile.py).

``weightgeom analyze`` reads model files as tensors only. A torch file that pickles code is refused with one line naming
it, wherever it comes from (a single file, ``pytorch_model.bin`` or ``*.pt`` in a model directory, ``--reference``, a
crafted checkpoint with a valid header in a run directory); truncated safetensors / GGUF files and random bytes get one
line too; a matrix with NaN/Inf is skipped with a warning naming it while the other matrices are analysed. A refused
input writes no report.

Every row builds its input in a few kilobytes (a 5-layer stack of 16×8 matrices) and runs the CLI in-process.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np
import torch

from hostile_cases import Hostile, assert_one_line_error, cli, marker_path, write_evil_torch
from hostile_cases.checkpoints import write_evil_checkpoint, write_old_format_checkpoint

__all__ = ["CASES"]

_LAYERS = 5
_NAME = "model.layers.{i}.mlp.up_proj.weight"


def _weights(nan_layers: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {_NAME.format(i=i): torch.randn(16, 8, generator=g) for i in range(_LAYERS)}
    for i in nan_layers:
        sd[_NAME.format(i=i)][3, 1] = float("nan")
        sd[_NAME.format(i=i)][0, 0] = float("inf")
    return sd


def _safetensors(path: Path, nan_layers: tuple[int, ...] = ()) -> Path:
    from safetensors.torch import save_file

    save_file(_weights(nan_layers), str(path))
    return path


def _gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.attention.head_count", 2)
    for i, t in enumerate(_weights().values()):
        w.add_tensor(f"blk.{i}.ffn_up.weight", t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _analyze(tmp: Path, *args: str | Path):
    return cli("analyze", *args, "--quiet", "--no-plots", "--out", tmp / "report")


def _refused(tmp: Path, res, *must: str) -> None:
    """No code ran, one line naming the file, exit 2, no report written."""
    assert not marker_path(tmp).exists(), "the file's pickle ran code"
    assert_one_line_error(res, *must)
    assert not (tmp / "report").exists(), "a refused input still wrote a report"


def _evil_file(tmp: Path) -> None:
    write_evil_torch(tmp / "evil.pt", marker_path(tmp))
    _refused(tmp, _analyze(tmp, tmp / "evil.pt"), "evil.pt", "pickled Python objects", "GLOBAL")


def _evil_bin_in_dir(tmp: Path) -> None:
    write_evil_torch(tmp / "model" / "pytorch_model.bin", marker_path(tmp))
    _refused(tmp, _analyze(tmp, tmp / "model"), "pytorch_model.bin", "pickled Python objects")


def _evil_pt_in_dir(tmp: Path) -> None:
    write_evil_torch(tmp / "model" / "weights.pt", marker_path(tmp))
    _refused(tmp, _analyze(tmp, tmp / "model"), "weights.pt", "pickled Python objects")


def _evil_reference(tmp: Path) -> None:
    good = _safetensors(tmp / "good.safetensors")
    write_evil_torch(tmp / "w0.pt", marker_path(tmp))
    _refused(tmp, _analyze(tmp, good, "--reference", tmp / "w0.pt"), "w0.pt", "pickled Python objects")


def _evil_checkpoint_in_run(tmp: Path) -> None:
    ck = tmp / "run" / "checkpoints" / "ckpt_00000004.pt"
    ck.parent.mkdir(parents=True)
    write_evil_checkpoint(ck, marker_path(tmp))
    _refused(tmp, _analyze(tmp, tmp / "run"), "ckpt_00000004.pt", "pickled Python objects")


def _old_checkpoint_in_run(tmp: Path) -> None:
    ck = tmp / "run" / "checkpoints" / "ckpt_00000002.pt"
    ck.parent.mkdir(parents=True)
    write_old_format_checkpoint(ck, marker_path(tmp))
    _refused(tmp, _analyze(tmp, tmp / "run"), "ckpt_00000002.pt", "older weightgeom")


def _truncated_safetensors(tmp: Path) -> None:
    p = _safetensors(tmp / "m.safetensors")
    p.write_bytes(p.read_bytes()[:-100])
    _refused(tmp, _analyze(tmp, p), "m.safetensors", "truncated")


def _truncated_gguf(tmp: Path) -> None:
    p = _gguf(tmp / "m.gguf")
    p.write_bytes(p.read_bytes()[:-100])
    _refused(tmp, _analyze(tmp, p), "m.gguf", "truncated")


def _random_bytes(tmp: Path) -> None:
    p = tmp / "weights.pt"
    p.write_bytes(b"\x80" + os.urandom(4095))  # starts like a pickle, so the unpickler itself must refuse it
    _refused(tmp, _analyze(tmp, p), "weights.pt")
    p.write_bytes(b"junk" + os.urandom(4092))
    _refused(tmp, _analyze(tmp, p), "weights.pt", "not a PyTorch file")


def _nan_layer_skipped(tmp: Path) -> None:
    p = _safetensors(tmp / "m.safetensors", nan_layers=(2,))
    res = _analyze(tmp, p)
    assert res.rc == 0 and "Traceback" not in res.err, res.err
    warn = [ln for ln in res.err.splitlines() if "non-finite" in ln]
    assert len(warn) == 1 and _NAME.format(i=2) in warn[0] and "1 NaN, 1 Inf" in warn[0], res.err
    with open(tmp / "report" / "pairs.csv") as f:
        pairs = [(int(r["layer"]), int(r["layer_next"])) for r in csv.DictReader(f)]
    assert pairs == [(0, 1), (3, 4)], pairs  # the other layers analysed; no pair spans the skipped one


def _all_nan_refused(tmp: Path) -> None:
    p = _safetensors(tmp / "m.safetensors", nan_layers=tuple(range(_LAYERS)))
    _refused(tmp, _analyze(tmp, p), "m.safetensors", "NaN or Inf", _NAME.format(i=0))


def _row(id_: str, what: str, check) -> Hostile:
    return Hostile(id_, "loader", what, check)


CASES: list[Hostile] = [
    _row("evil-pt", "a .pt file whose pickle would run code is refused by `weightgeom analyze`, naming the file and "
         "the pickled object; no code runs", _evil_file),
    _row("evil-pytorch-model-bin", "the same pickle as `pytorch_model.bin` in a model directory is refused",
         _evil_bin_in_dir),
    _row("evil-pt-in-dir", "the same pickle as a `*.pt` file in a model directory is refused", _evil_pt_in_dir),
    _row("evil-reference", "the same pickle given as `--reference` is refused", _evil_reference),
    _row("evil-checkpoint-run-dir", "a run directory whose newest checkpoint has a valid header but pickles code is "
         "refused by `weightgeom analyze RUN`", _evil_checkpoint_in_run),
    _row("old-checkpoint-run-dir", "a run directory whose checkpoint was written by an older weightgeom (fully "
         "pickled) is refused without unpickling it", _old_checkpoint_in_run),
    _row("truncated-safetensors", "a truncated .safetensors file gets one line naming it", _truncated_safetensors),
    _row("truncated-gguf", "a truncated .gguf file gets one line naming it", _truncated_gguf),
    _row("random-bytes-pt", "random bytes named .pt get one line naming the file", _random_bytes),
    _row("nan-layer", "a matrix with NaN/Inf is skipped with one warning naming the tensor; the other layers are "
         "analysed and no pair spans the skipped one", _nan_layer_skipped),
    _row("all-nan", "a checkpoint whose every matrix holds NaN/Inf is refused with one line naming the file",
         _all_nan_refused),
]
