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
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from hostile_cases import Hostile, assert_one_line_error, cli, marker_path, write_evil_torch
from hostile_cases.checkpoints import OsSystemPayload, write_evil_checkpoint, write_old_format_checkpoint

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


def _gguf(path: Path, head_count: int | str = 2, tensor: str = "ffn_up") -> Path:
    """A llama GGUF file of the 5-layer stack as ``blk.{i}.<tensor>.weight``, with the given head count metadata."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    if isinstance(head_count, str):
        w.add_string("llama.attention.head_count", head_count)
    else:
        w.add_int32("llama.attention.head_count", head_count)
    for i, t in enumerate(_weights().values()):
        w.add_tensor(f"blk.{i}.{tensor}.weight", t.numpy().astype(np.float32))
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


def _os_system_pickle(tmp: Path, name: str, zip_format: bool) -> None:
    p = tmp / name
    torch.save({_NAME.format(i=0): torch.randn(16, 8), "evil": OsSystemPayload(marker_path(tmp))}, p,
               _use_new_zipfile_serialization=zip_format)
    res = _analyze(tmp, p)
    _refused(tmp, res, name, "pickled Python objects", "posix.system", "os.system")
    assert "weights_only" not in res.err, f"PyTorch's advice to turn weights_only off was repeated: {res.err!r}"


def _os_system_pth(tmp: Path) -> None:
    _os_system_pickle(tmp, "evil.pth", zip_format=True)


def _os_system_legacy_pt(tmp: Path) -> None:
    _os_system_pickle(tmp, "evil_legacy.pt", zip_format=False)


def _expanded_view(tmp: Path) -> None:
    p = tmp / "expanded.pt"
    sd = _weights()
    sd[_NAME.format(i=1)] = torch.zeros(1).expand(300000, 300000)  # 4 bytes of storage, a 360 GB matrix by shape
    torch.save(sd, p)
    assert p.stat().st_size < 16384
    _refused(tmp, _analyze(tmp, p), "expanded.pt", _NAME.format(i=1), "stride-0")


def _gguf_bad_head_count(tmp: Path) -> None:
    for i, bad in enumerate((-2, 0, "two")):
        p = _gguf(tmp / f"heads{i}.gguf", head_count=bad, tensor="attn_q")
        _refused(tmp, _analyze(tmp, p), p.name, "llama.attention.head_count", "positive integer")
    p = _gguf(tmp / "heads3.gguf", head_count=3, tensor="attn_q")  # 16 rows are not 3 heads of an even size
    _refused(tmp, _analyze(tmp, p), "heads3.gguf", "blk.0.attn_q.weight", "llama.attention.head_count")


def _empty_matrix_skipped(tmp: Path) -> None:
    from safetensors.torch import save_file

    sd = _weights()
    sd[_NAME.format(i=2)] = torch.zeros(0, 8)
    save_file(sd, str(tmp / "m.safetensors"))
    res = _analyze(tmp, tmp / "m.safetensors")
    assert res.rc == 0 and "Traceback" not in res.err, res.err
    warn = [ln for ln in res.err.splitlines() if "warning" in ln]
    assert len(warn) == 1 and _NAME.format(i=2) in warn[0] and "empty" in warn[0], res.err
    with open(tmp / "report" / "pairs.csv") as f:
        pairs = [(int(r["layer"]), int(r["layer_next"])) for r in csv.DictReader(f)]
    assert pairs == [(0, 1), (3, 4)], pairs


def _sharded_index(model: Path, shards: dict[str, str]) -> None:
    (model / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))


def _sharded_bin(tmp: Path) -> None:
    model = tmp / "model"
    model.mkdir()
    sd = _weights()
    names = [f"pytorch_model-0000{k}-of-00002.bin" for k in (1, 2)]
    shards: dict[str, str] = {}
    for k, name in enumerate(names):
        part = {n: t for i, (n, t) in enumerate(sd.items()) if i % 2 == k}
        torch.save(part, model / name)
        shards.update(dict.fromkeys(part, name))
    _sharded_index(model, shards)
    res = _analyze(tmp, model)
    assert res.rc == 0 and "Traceback" not in res.err, res.err
    with open(tmp / "report" / "pairs.csv") as f:
        assert len(list(csv.DictReader(f))) == _LAYERS - 1  # every layer, from both shards
    shutil.rmtree(tmp / "report")
    # a shard the index places outside the model directory is refused, naming the index; an evil shard too
    (tmp / "outside.bin").write_bytes((model / names[0]).read_bytes())
    _sharded_index(model, {_NAME.format(i=0): "../outside.bin"})
    _refused(tmp, _analyze(tmp, model), "pytorch_model.bin.index.json", "../outside.bin")
    write_evil_torch(model / names[1], marker_path(tmp))
    _sharded_index(model, shards)
    _refused(tmp, _analyze(tmp, model), names[1], "pickled Python objects")


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
    _row("os-system-pth", "a .pth file whose pickle calls `os.system` (a module PyTorch blocks) is refused with one "
         "line naming the file and `posix.system`/`os.system`, never PyTorch's advice to switch its "
         "weights-only safety off; no code runs", _os_system_pth),
    _row("os-system-legacy-pt", "the same `os.system` pickle in a legacy (non-zip) torch file is refused the same "
         "way", _os_system_legacy_pt),
    _row("expanded-view", "a few-KB .pt file holding a stride-0 view (`torch.zeros(1).expand(300000, 300000)`) is "
         "refused with one line naming the file and the tensor, before anything is allocated", _expanded_view),
    _row("gguf-bad-head-count", "a GGUF file whose `head_count` is negative, zero or a string, or does not divide "
         "the Q rows, is refused with one line naming the file and the key", _gguf_bad_head_count),
    _row("empty-matrix", "an empty (0×8) matrix is skipped with one warning naming the tensor; the other layers are "
         "analysed", _empty_matrix_skipped),
    _row("sharded-bin", "a model directory of sharded `pytorch_model-*.bin` files is loaded through "
         "`pytorch_model.bin.index.json`, each shard tensors-only; a shard outside the directory or one that pickles "
         "code is refused with one line naming it", _sharded_bin),
]
