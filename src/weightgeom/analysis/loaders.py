"""Load weights for analysis from an nn.Module, a state dict, an HF model directory (safetensors, pytorch_model.bin or
the shards listed in pytorch_model.bin.index.json), a torch checkpoint (ours or any ``{"model": state_dict, ...}``),
or a llama.cpp GGUF file.

Files are read as tensors only: safetensors, ``torch.load(weights_only=True)`` (PyTorch's restricted unpickler,
memory-mapped for zip-format files), our checkpoints (verified, also ``weights_only=True``) and GGUF. Nothing in a file
is executed: a torch file that pickles Python objects (a class, a function — what a malicious pickle needs) is refused
with one line naming the file and the object, as are truncated, corrupt and unrecognised files and stride-0 or
overlapping views whose shape needs more elements than their storage holds (``ValueError``).

GGUF: tensors are read with ``gguf.GGUFReader`` and quantised types dequantised with ``gguf.quants.dequantize``.
llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of Q and K per head (interleaving the two RoPE halves) for
the Llama family; :func:`load_gguf` undoes it using the ``{arch}.attention.head_count(_kv)`` metadata so the tensors
equal the HF ones. (All adjacent-layer metrics of a role are invariant to that permutation anyway: every layer gets the
same row permutation P and ⟨Pu, Pu'⟩ = ⟨u, u'⟩, tr(PSPᵀ PS'Pᵀ) = tr(SS'); only cross-role comparisons would differ.)
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from weightgeom._files import is_regular, open_regular, read_json
from weightgeom.analysis._gguf_header import check_gguf_header
from weightgeom.train.checkpoint import (
    is_checkpoint_file,
    latest_checkpoint,
    load_checkpoint,
    safe_torch_load,
    weights_only_refusal,
)

__all__ = ["Loaded", "TensorRef", "load", "open_lazy", "open_gguf", "load_gguf", "materialize", "unpermute_qk",
           "permute_qk", "GGUF_PERMUTED_ARCHS"]

# Architectures whose Q/K rows convert_hf_to_gguf.py permutes (LlamaModel.modify_tensors and subclasses).
GGUF_PERMUTED_ARCHS = ("llama", "mistral", "granite", "granitemoe", "deci", "llama4")

_WRAPPER_KEYS = ("model", "state_dict", "model_state_dict", "module", "model_state")


@dataclass
class Loaded:
    """Weights ready for role assignment.

    Attributes:
        tensors: name → tensor (CPU).
        format: ``"module"``, ``"state_dict"``, ``"safetensors"``, ``"torch"`` or ``"gguf"``.
        grads: name → gradient when the source carried them (an nn.Module with ``.grad`` set), else empty.
        meta: extra facts (GGUF architecture and head counts, config.json contents, source path).
        notes: human-readable remarks (what was unpermuted, dequantised, unwrapped).
    """

    tensors: dict[str, torch.Tensor]
    format: str
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class TensorRef:
    """A tensor of a file that is not read yet: its name, shape and kind, and how to read it.

    :func:`open_lazy` returns these instead of tensors, so that role assignment (which needs names and shapes only)
    reads nothing, and the analysis reads each matrix when it gets to it and drops it afterwards. ``.T`` and
    ``.chunk(n)`` record a transpose / a split along the rows (GPT-2's Conv1D layout and fused QKV) that
    :meth:`materialize` applies after reading.

    Attributes:
        name: tensor name in the file.
        shape: shape after the recorded transforms.
        floating: True for a floating-point tensor.
        nbytes: bytes the stored tensor occupies in the file (before dequantisation).
        dtype: the stored dtype's name as the file states it (``"int64"``, ``"F8_E4M3"``, ``"Q4_K"``; ``""`` when
            unknown), for messages.
    """

    def __init__(self, name: str, shape: tuple[int, ...], floating: bool, read, nbytes: int = 0, ops: tuple = (),
                 dtype: str = ""):
        self.name = name
        self.dtype = dtype
        self.shape = torch.Size(shape)
        self.floating = floating
        self.nbytes = nbytes
        self._read = read
        self._ops = ops

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def numel(self) -> int:
        """Number of elements (after the recorded transforms)."""
        n = 1
        for d in self.shape:
            n *= int(d)
        return n

    def is_floating_point(self) -> bool:
        """True for a floating-point tensor (like ``torch.Tensor.is_floating_point``)."""
        return self.floating

    @property
    def T(self) -> TensorRef:  # noqa: N802 - mirrors torch.Tensor.T
        """The transposed 2-D tensor (read lazily)."""
        return TensorRef(self.name, tuple(reversed(self.shape)), self.floating, self._read, self.nbytes,
                         self._ops + (("T",),), self.dtype)

    def chunk(self, n: int, dim: int = 0) -> list[TensorRef]:
        """``n`` equal row blocks (``dim`` must be 0; the row count divisible by ``n``), read lazily."""
        if dim != 0 or self.shape[0] % n:
            raise ValueError(f"{self.name}: cannot split {tuple(self.shape)} into {n} row blocks")
        r = self.shape[0] // n
        return [TensorRef(self.name, (r, *self.shape[1:]), self.floating, self._read, self.nbytes // n,
                          self._ops + (("rows", i * r, (i + 1) * r),), self.dtype) for i in range(n)]

    def materialize(self) -> torch.Tensor:
        """Read the tensor (an owned CPU tensor in its stored dtype, or float32 for GGUF) and apply the transforms."""
        t = self._read()
        for op in self._ops:
            t = t.T if op[0] == "T" else t[op[1]:op[2]]
        return t

    def __repr__(self) -> str:
        return f"TensorRef({self.name!r}, shape={tuple(self.shape)})"


def materialize(t) -> torch.Tensor:
    """``t`` itself for a tensor, the read tensor for a :class:`TensorRef`."""
    return t.materialize() if isinstance(t, TensorRef) else t


def _strip(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        k = k.replace("_orig_mod.", "")  # torch.compile wrappers
        while k.startswith("module."):  # DDP
            k = k[len("module."):]
        out[k] = v
    return out


def _unwrap(obj) -> dict[str, torch.Tensor]:
    """Find the state dict inside a checkpoint object."""
    if isinstance(obj, Mapping):
        if any(isinstance(v, torch.Tensor) for v in obj.values()):
            return _strip({k: v for k, v in obj.items() if isinstance(v, torch.Tensor)})
        for key in _WRAPPER_KEYS:
            if key in obj and isinstance(obj[key], Mapping):
                return _unwrap(obj[key])
        for v in obj.values():  # last resort: first nested mapping holding tensors
            if isinstance(v, Mapping) and any(isinstance(x, torch.Tensor) for x in v.values()):
                return _unwrap(v)
    if isinstance(obj, torch.nn.Module):
        return _strip(obj.state_dict())
    raise ValueError(f"checkpoint holds no state dict (top-level type {type(obj).__name__}); "
                     f"expected tensors or one of the keys {', '.join(_WRAPPER_KEYS)}")


_RESAVE = "weightgeom loads tensors only — re-save it with torch.save(model.state_dict())"


def _load_torch(path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors of a torch file: our verified checkpoint, or any ``torch.save`` file read with ``weights_only=True``.

    Zip-format files (``torch.save``'s default since PyTorch 1.6) are memory-mapped; legacy files are read whole.

    Raises:
        ValueError: the file needs the full unpickler (pickled Python objects), is truncated, corrupt, not a torch
            file, or holds no state dict — one line naming the file and the reason. Nothing in it is executed.
    """
    notes = []
    _model_file(path, "PyTorch")
    try:
        with open_regular(path) as f:
            head = f.read(8)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    if is_checkpoint_file(head):  # our trainer's verified checkpoint (weightgeom.train.checkpoint)
        payload = load_checkpoint(path)
        notes.append(f"weightgeom checkpoint, step {payload.get('step')}")
        return _check_storage(_unwrap_named(payload, path), path), notes
    if not head:
        raise ValueError(f"{path}: empty file")
    if not head.startswith((b"PK\x03\x04", b"\x80")):  # torch.save zip archive, or a (legacy torch) pickle
        raise ValueError(f"{path}: not a PyTorch file (neither a torch.save zip archive nor a pickle)")
    try:
        obj = safe_torch_load(path, map_location="cpu", mmap=head.startswith(b"PK\x03\x04"))
    except Exception as e:  # noqa: BLE001 - any failure of the restricted unpickler or the zip reader: one line
        why = weights_only_refusal(e)
        hint = f"; {_RESAVE}" if why.startswith("holds pickled") else ""
        raise ValueError(f"{path}: {why}{hint}") from None
    return _check_storage(_unwrap_named(obj, path), path), notes


def _check_storage(sd: dict[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """Refuse views whose shape needs more elements than their storage holds (stride-0 or overlapping views).

    A few bytes of ``torch.zeros(1).expand(300000, 300000)`` would otherwise become a 360 GB matrix once analysed.

    Raises:
        ValueError: one line naming the file and the tensor, with its shape and its storage's size.
    """
    for name, t in sd.items():
        held = t.untyped_storage().nbytes() // max(t.element_size(), 1)
        if t.numel() > held:
            shape = "×".join(str(d) for d in t.shape)
            raise ValueError(f"{path}: tensor {name} is a stride-0 or overlapping view ({shape} = {t.numel()} "
                             f"elements over a storage of {held}, strides {tuple(t.stride())}); weightgeom reads "
                             "plain tensors only — re-save it with .contiguous()")
    return sd


def _unwrap_named(obj, path: Path) -> dict[str, torch.Tensor]:
    try:
        return _unwrap(obj)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _load_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of one ``.safetensors`` file.

    Raises:
        ValueError: truncated, corrupt or not a safetensors file (one line naming it).
    """
    from safetensors.torch import load_file

    _model_file(path, "safetensors")
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - SafetensorError (a Rust exception type), OSError, ...
        msg = str(e).replace("Error while deserializing header: ", "").strip().splitlines()
        raise ValueError(f"{path}: not a readable safetensors file ({msg[0] if msg else type(e).__name__}); "
                         "truncated or corrupt?") from None


def _load_safetensors_dir(path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every tensor of an HF safetensors folder in memory: the shards its ``model.safetensors.index.json`` lists, or
    else every ``*.safetensors`` file."""
    refs, notes = _lazy_safetensors_dir(path)
    return {k: materialize(v) for k, v in refs.items()}, notes


_BIN_INDEX = "pytorch_model.bin.index.json"
_FILE_KINDS = {".safetensors": "safetensors", ".gguf": "GGUF", ".pt": "PyTorch", ".pth": "PyTorch", ".bin": "PyTorch",
               ".ckpt": "PyTorch"}
_ST_DTYPE_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
                   "I32": "int32", "U64": "uint64", "I64": "int64", "C64": "complex64"}
"""safetensors' names of the dtypes that are not floating point → torch's (for messages)."""


def _shard_paths(index: Path) -> list[Path]:
    """The shard files an HF ``pytorch_model.bin.index.json`` or ``model.safetensors.index.json`` lists
    (``weight_map`` values), in order of first use.

    Raises:
        ValueError: unreadable index, no ``weight_map``, a shard name that is not a plain file name in the index's
            directory (absolute, ``..``, a sub-directory, a symlink leading out) or a missing shard — one line naming
            the index and the shard.
    """
    doc = _read_config_json(index)
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise ValueError(f"{index}: no \"weight_map\" (tensor name → shard file) in the index")
    base = index.parent.resolve()
    shards = []
    for name in dict.fromkeys(wmap.values()):
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"{index}: lists shard {name!r}, outside {index.parent} (a shard must be a file name in "
                             "the index's folder)")
        shard = index.parent / name
        if shard.resolve().parent != base:
            raise ValueError(f"{index}: lists shard {name!r}, a link that leads outside {index.parent} (to "
                             f"{shard.resolve()})")
        if not os.path.lexists(shard):
            raise ValueError(f"{index}: shard {name} is missing from {index.parent}")
        _model_file(shard, f"shard ({index.name} lists it)")
        shards.append(shard)
    return shards


def _safetensors_refs(path: Path) -> dict[str, TensorRef]:
    """:class:`TensorRef` for every tensor of one ``.safetensors`` file (header only; each read opens the file with
    ``safe_open``, copies that one tensor and closes it, so no page of the file stays mapped between reads).

    Raises:
        ValueError: truncated, corrupt or not a safetensors file (one line naming it).
    """
    from safetensors import safe_open

    _model_file(path, "safetensors")

    def read(name: str, f: str = str(path)) -> torch.Tensor:
        with safe_open(f, framework="pt") as h:
            return h.get_tensor(name)

    out: dict[str, TensorRef] = {}
    try:
        with safe_open(str(path), framework="pt") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                shape, dt = tuple(int(d) for d in sl.get_shape()), str(sl.get_dtype())
                n = 1
                for d in shape:
                    n *= d
                bits = int("".join(c for c in dt.split("_")[0] if c.isdigit()) or 8)
                out[k] = TensorRef(k, shape, dt.startswith(("F", "BF")), lambda k=k: read(k), n * bits // 8,
                                   dtype=_ST_DTYPE_NAMES.get(dt, dt))
    except Exception as e:  # noqa: BLE001 - SafetensorError (a Rust exception type), OSError, ...
        msg = str(e).replace("Error while deserializing header: ", "").strip().splitlines()
        raise ValueError(f"{path}: not a readable safetensors file ({msg[0] if msg else type(e).__name__}); "
                         "truncated or corrupt?") from None
    return out


_ST_INDEX = "model.safetensors.index.json"


def _lazy_safetensors_dir(path: Path) -> tuple[dict[str, TensorRef], list[str]]:
    """References to the tensors of an HF safetensors directory: the shards ``model.safetensors.index.json`` lists
    (only the tensors its ``weight_map`` assigns to each shard), or else every ``*.safetensors`` file."""
    index = path / _ST_INDEX
    if not _present(index):
        out: dict[str, TensorRef] = {}
        for f in _files(path, "*.safetensors", "safetensors"):
            out.update(_safetensors_refs(f))
        return out, []
    shards = _shard_paths(index)
    wmap = _read_config_json(index)["weight_map"]
    out = {}
    for shard in shards:
        refs = _safetensors_refs(shard)
        for name, sh in wmap.items():
            if sh == shard.name:
                if name not in refs:
                    raise ValueError(f"{index}: tensor {name} is listed in shard {sh}, which does not hold it")
                out[name] = refs[name]
    return out, [f"streamed {len(shards)} shard{'s' if len(shards) > 1 else ''} listed in {_ST_INDEX}"]


def _read_torch_one(path: Path, name: str) -> torch.Tensor:
    """One tensor of a zip-format torch file: memory-mapped load, an owned copy of ``name``, the mapping dropped."""
    obj = safe_torch_load(path, map_location="cpu", mmap=True)
    t = _unwrap(obj)[name].clone()
    del obj
    return t


def _lazy_torch(path: Path) -> tuple[dict[str, torch.Tensor | TensorRef], list[str]]:
    """References to the tensors of a zip-format torch file (checked like :func:`_load_torch`, memory-mapped, nothing
    copied); our verified checkpoints and legacy pickles are read whole (the same as :func:`_load_torch`)."""
    sd, notes = _load_torch(path)
    try:
        with open_regular(path) as f:
            zipped = f.read(4) == b"PK\x03\x04"
    except OSError:
        zipped = False
    if not zipped or notes:  # legacy pickle, or our checkpoint (already verified and in memory)
        return sd, notes
    refs = {k: TensorRef(k, tuple(t.shape), t.is_floating_point(), lambda k=k: _read_torch_one(path, k),
                         t.numel() * t.element_size(), dtype=str(t.dtype).removeprefix("torch."))
            for k, t in sd.items()}
    del sd
    return refs, notes


def _load_sharded_bin(index: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors of every shard an HF ``pytorch_model.bin.index.json`` lists, each read like a single torch file."""
    out: dict[str, torch.Tensor] = {}
    shards = _shard_paths(index)
    for shard in shards:
        sd, _ = _load_torch(shard)
        out.update(sd)
    return out, [f"loaded {len(shards)} shard{'s' if len(shards) > 1 else ''} listed in {index.name}"]


def _read_config_json(path: Path) -> dict:
    """A model folder's ``config.json`` or shard index: bounded (``SMALL_FILE_LIMIT``), a regular file only."""
    try:
        return read_json(path)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None


def _folder_meta(path: Path) -> dict:
    """``{"path": …, "config": config.json's contents (bounded) when the folder has one}``."""
    meta: dict = {"path": str(path)}
    if _present(path / "config.json"):
        meta["config"] = _read_config_json(path / "config.json")
    return meta


def check_source(path: Path) -> None:
    """Refuse, with one line that names the real problem, a path that cannot be a model source: nothing there (or a
    dangling link, or a loop of links — ``Path.exists()`` calls both "missing"), or a FIFO, device or socket
    (checked with ``stat``: nothing is opened, so nothing blocks). Directories pass (a model folder).

    Raises:
        FileNotFoundError: nothing is there.
        ValueError: a dangling link, a loop of links, or a special file.
    """
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no such file or directory: {path}")
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{path}: a loop of symbolic links (it never reaches a file)") from None
        if isinstance(e, FileNotFoundError):
            raise ValueError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist") from None
        raise
    if not path.is_dir():
        is_regular(path)


def _model_file(path: Path, kind: str) -> Path:
    """``path`` checked as a ``kind`` file (``safetensors``, ``GGUF`` …) before any reader opens it: a directory of
    that name, a FIFO, a device, an unreadable or an empty file is one line saying what it is, where the reader would
    say "No such device", "truncated or corrupt?" or block. The file is opened with :func:`open_regular` (non-blocking,
    checked with ``fstat``) and closed again."""
    check_source(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory, not a {kind} file")
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    if size == 0:
        raise ValueError(f"{path}: empty file (0 bytes), not a {kind} file")
    return path


def _present(path: Path) -> bool:
    """Whether a file a model folder may hold is there (a regular file); a FIFO, device, directory, dangling link or
    loop of links of that name is one line saying so, not "absent"."""
    if not os.path.lexists(path):
        return False
    _model_file(path, path.suffix.lstrip(".") or "model")
    return True


def _files(folder: Path, pattern: str, kind: str) -> list[Path]:
    """The ``pattern`` entries of a model folder, each checked as a ``kind`` file (:func:`_model_file`)."""
    return [_model_file(p, kind) for p in sorted(folder.glob(pattern))]


def permute_qk(W: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """llama.cpp's permutation of Q/K rows (per head, halves interleaved), as in convert_hf_to_gguf.py."""
    r = W.shape[0]
    return W.reshape(n_head, 2, r // n_head // 2, *W.shape[1:]).swapaxes(1, 2).reshape(W.shape)


def unpermute_qk(W: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """Inverse of :func:`permute_qk`: GGUF row order → HF row order."""
    r = W.shape[0]
    if r % (2 * n_head):
        raise ValueError(f"cannot undo the GGUF Q/K permutation: {r} rows not divisible by 2·{n_head} heads")
    return W.reshape(n_head, r // n_head // 2, 2, *W.shape[1:]).swapaxes(1, 2).reshape(W.shape)


def _field_value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except AttributeError:  # older gguf
        v = f.parts[f.data[0]]
        return bytes(v).decode() if v.dtype == np.uint8 else v.tolist()[0]


def _open_gguf(path: Path):
    """A ``GGUFReader`` on ``path`` whose tensors all lie inside the file.

    Raises:
        ValueError: not a GGUF file, truncated or corrupt (one line naming the file).
    """
    from gguf import GGUFReader

    _model_file(path, "GGUF")
    check_gguf_header(path)  # counts the reader would trust (a 2**62-item array): refused before it loops on them
    try:
        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size or t.data.nbytes != int(t.n_bytes):
                raise ValueError(f"truncated: tensor {t.name} needs bytes up to {end}, the file has {size}")
    except Exception as e:  # noqa: BLE001 - the reader fails with ValueError, IndexError, struct/numpy errors, ...
        text = str(e).strip().splitlines()
        raise ValueError(f"{path}: not a readable GGUF file ({text[0] if text else type(e).__name__}); "
                         "truncated or corrupt?") from None
    return reader


def _gguf_tensor(t, path: Path, quantised: set[str]) -> torch.Tensor:
    """One GGUF tensor as float32 in (out, in) layout; adds the names of dequantised types to ``quantised``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(x) for x in reversed(list(t.shape)))  # GGUF stores ne (innermost first)
    try:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.F64):
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type).astype(np.float32)
            quantised.add(t.tensor_type.name)
        return torch.from_numpy(np.array(arr.reshape(shape), dtype=np.float32))  # owned copy
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {t.name} is of type {t.tensor_type.name}, {_UNREADABLE}") from None
    except Exception as e:  # noqa: BLE001 - unsupported type, wrong size: name the tensor
        raise ValueError(f"{path}: cannot read GGUF tensor {t.name} ({type(e).__name__}: {e})") from None


def _head_count(reader, key: str, path: str | os.PathLike) -> int | None:
    """The GGUF metadata value ``key`` as a positive head count, or None when absent.

    Raises:
        ValueError: the value is not a positive integer (one line naming the file and the key).
    """
    v = _field_value(reader, key)
    if v is None:
        return None
    if isinstance(v, list) and len(v) == 1:  # some writers store a one-element array
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) <= 0:
        raise ValueError(f"{path}: GGUF metadata {key} = {v!r} is not a positive integer (a head count)")
    return int(v)


_GGUF_INT_TYPES = ("I8", "I16", "I32", "I64")
_UNREADABLE = ("which the installed gguf package cannot dequantize (convert the file to F16, BF16 or a common quant "
               "type)")


@functools.cache
def _gguf_dequantizable(qtype) -> bool:
    """Whether :func:`_gguf_tensor` can read a tensor of GGML type ``qtype`` (tried on one zero block with
    ``gguf.quants.dequantize``, which raises ``NotImplementedError`` for the types it lacks, e.g. Q8_K)."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    if qtype.name in ("F32", "F16", "F64", *_GGUF_INT_TYPES):
        return True
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - any other failure is the real read's to report, naming the tensor
        return True
    return True


def _refuse_all_undequantizable(path: Path, refs: dict[str, TensorRef], unreadable: dict[str, str]) -> None:
    """One line when every matrix of a GGUF file is of a type the gguf package cannot dequantize (instead of the
    first read failing mid-analysis, or "no projection roles"); files with some readable matrices are analysed, and a
    read of one that is not names it (:func:`_gguf_tensor`)."""
    if not unreadable or any(r.ndim == 2 and r.floating and k not in unreadable for k, r in refs.items()):
        return
    types = ", ".join(sorted(set(unreadable.values())))
    names = ", ".join(list(unreadable)[:3]) + (f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else "")
    raise ValueError(f"{path}: every matrix is of type {types}, {_UNREADABLE}: {names}")


def _release_pages(reader, t) -> None:
    """Drop the resident pages of tensor ``t``'s bytes from the reader's read-only memory map (they are read again
    from the file if touched), so reading a GGUF tensor by tensor keeps the process's RSS bounded."""
    import mmap

    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = int(t.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, int(t.data_offset) + int(t.n_bytes) - start)
    except (OSError, ValueError):
        pass


def open_gguf(path: str | os.PathLike, undo_permute: bool | None = None) -> Loaded:
    """References to the tensors of a GGUF file (see :class:`TensorRef`): each is read from the reader's memory map,
    dequantised to float32 in (out, in) layout and, for Q/K, un-permuted only when the analysis reads it.

    Args:
        path: the .gguf file.
        undo_permute: undo the Q/K row permutation (default: when the architecture is in ``GGUF_PERMUTED_ARCHS``).

    Raises:
        ValueError: not a GGUF file, truncated or corrupt, head counts missing or not dividing the Q/K rows (one line
            naming the file).
    """
    path = Path(path)
    reader = _open_gguf(path)
    try:
        arch = _field_value(reader, "general.architecture") or "unknown"
        n_head = _head_count(reader, f"{arch}.attention.head_count", path)
        n_kv = _head_count(reader, f"{arch}.attention.head_count_kv", path)
        kv_given, n_kv = n_kv is not None, n_kv or n_head
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - malformed metadata fields
        raise ValueError(f"{path}: corrupt GGUF metadata ({type(e).__name__}: {e})") from None
    notes = []
    do = arch in GGUF_PERMUTED_ARCHS if undo_permute is None else undo_permute
    if do and not n_head:
        raise ValueError(f"{path}: {arch}.attention.head_count missing; cannot undo the Q/K permutation "
                         "(pass undo_permute=False — adjacent-layer metrics are invariant to it)")
    quantised: set[str] = set()
    refs: dict[str, TensorRef] = {}
    unreadable: dict[str, str] = {}
    for t in reader.tensors:
        name = t.name
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        heads = None
        if do:
            heads = n_head if name.endswith("attn_q.weight") else n_kv if name.endswith("attn_k.weight") else None
        if heads is not None and (len(shape) < 1 or shape[0] % (2 * heads)):
            kv = name.endswith("attn_k.weight") and kv_given
            key = "head_count_kv" if kv else "head_count"
            raise ValueError(f"{path}: tensor {name}: cannot undo the GGUF Q/K permutation: {shape[0]} rows not "
                             f"divisible by 2·{heads} heads ({arch}.attention.{key}); pass undo_permute=False "
                             "(--gguf-keep-permutation) to leave the rows as stored")
        tname = t.tensor_type.name
        if not _gguf_dequantizable(t.tensor_type):
            unreadable[name] = tname
        elif tname not in ("F32", "F16", "F64") and tname not in _GGUF_INT_TYPES:
            quantised.add(tname)

        def read(t=t, heads=heads) -> torch.Tensor:
            w = _gguf_tensor(t, path, set())
            _release_pages(reader, t)
            return unpermute_qk(w, heads).contiguous() if heads is not None else w

        refs[name] = TensorRef(name, shape, tname not in _GGUF_INT_TYPES, read, int(t.n_bytes), dtype=tname)
    _refuse_all_undequantizable(path, refs, unreadable)
    if quantised:
        notes.append(f"dequantised {', '.join(sorted(quantised))} tensors with gguf.quants.dequantize")
    if do:
        notes.append(f"undid llama.cpp's Q/K row permutation (arch {arch}, {n_head} heads, {n_kv} KV heads)")
    meta = {"path": str(path), "arch": arch, "n_head": n_head, "n_head_kv": n_kv}
    return Loaded(refs, "gguf", meta=meta, notes=notes)


def load_gguf(path: str | os.PathLike, undo_permute: bool | None = None) -> Loaded:
    """Read a GGUF file into float32 tensors in (out, in) layout with llama.cpp tensor names (every tensor in memory;
    :func:`open_gguf` reads them one at a time instead).

    Args:
        path: the .gguf file.
        undo_permute: undo the Q/K row permutation (default: when the architecture is in ``GGUF_PERMUTED_ARCHS``).

    Raises:
        ValueError: not a GGUF file, truncated or corrupt, or a tensor that cannot be read (one line naming the file).
    """
    lazy = open_gguf(path, undo_permute)
    lazy.tensors = {k: materialize(v) for k, v in lazy.tensors.items()}
    return lazy


def load(source, undo_permute: bool | None = None) -> Loaded:
    """Load weights from any supported source (see module docstring).

    Args:
        source: nn.Module, state dict (or a checkpoint dict wrapping one), or a path (HF directory, .safetensors,
            .pt/.pth/.bin/.ckpt torch file, .gguf).
        undo_permute: GGUF only, see :func:`load_gguf`.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: unsupported file type, no weights found, or a file that is truncated, corrupt or needs the full
            unpickler (one line naming the file and the reason; nothing in the file is executed).
    """
    if isinstance(source, torch.nn.Module):
        tensors, grads = {}, {}
        for k, v in source.state_dict(keep_vars=True).items():
            tensors[k] = v.detach().cpu()
            if isinstance(v, torch.nn.Parameter) and v.grad is not None:
                grads[k] = v.grad.detach().cpu()
        return Loaded(_strip(tensors), "module", grads=_strip(grads))
    if isinstance(source, Mapping):
        return Loaded(_unwrap(source), "state_dict")
    path = Path(source)
    check_source(path)
    if path.is_dir():
        meta = _folder_meta(path)
        if _files(path, "*.safetensors", "safetensors") or _present(path / _ST_INDEX):
            sd, notes = _load_safetensors_dir(path)
            return Loaded(sd, "safetensors", meta=meta, notes=notes)
        for name in ("pytorch_model.bin", "model.pt", "checkpoint.pt"):
            if _present(path / name):
                sd, notes = _load_torch(path / name)
                return Loaded(sd, "torch", meta=meta, notes=notes)
        if _present(path / _BIN_INDEX):  # sharded pytorch_model-0000i-of-0000n.bin
            sd, notes = _load_sharded_bin(path / _BIN_INDEX)
            return Loaded(sd, "torch", meta=meta, notes=notes)
        latest = latest_checkpoint(path / "checkpoints")  # a weightgeom run directory: its newest checkpoint
        if latest is not None:
            sd, notes = _load_torch(latest)
            return Loaded(sd, "torch", meta=meta, notes=notes + [f"run directory: loaded {latest.name}"])
        ggufs = _files(path, "*.gguf", "GGUF")
        if ggufs:
            return load_gguf(ggufs[0], undo_permute)
        pts = _files(path, "*.pt", "PyTorch")
        if pts:
            sd, notes = _load_torch(pts[-1])
            return Loaded(sd, "torch", meta=meta, notes=notes + [f"loaded {pts[-1].name}"])
        if (path / "checkpoints").is_dir():
            raise ValueError(f"{path}: run directory has no checkpoint in checkpoints/ yet (nothing to analyse)")
        if path.suffix.lower() in _FILE_KINDS:  # a folder named like a model file
            raise ValueError(f"{path}: is a directory, not a {_FILE_KINDS[path.suffix.lower()]} file, and holds no "
                             "model file")
        raise ValueError(f"{path}: directory has no *.safetensors, pytorch_model.bin (or {_BIN_INDEX}), *.pt or "
                         "*.gguf file")
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return load_gguf(path, undo_permute)
    if suffix == ".safetensors":
        return Loaded(_load_safetensors_file(path), "safetensors", meta={"path": str(path)})
    if suffix in (".pt", ".pth", ".bin", ".ckpt"):
        sd, notes = _load_torch(path)
        return Loaded(sd, "torch", meta={"path": str(path)}, notes=notes)
    raise ValueError(f"{path}: unsupported file type {suffix!r}; expected an HF directory, .safetensors, .pt/.pth/"
                     ".bin/.ckpt or .gguf")


def open_lazy(source, undo_permute: bool | None = None) -> Loaded:
    """Like :func:`load`, but a file's tensors come as :class:`TensorRef` (read one at a time when analysed).

    Streamed: safetensors files and directories (with or without ``model.safetensors.index.json``; each tensor read
    with ``safe_open``), zip-format torch files and the shards of ``pytorch_model.bin.index.json`` (each tensor from a
    memory-mapped ``torch.load(weights_only=True)``), GGUF (per-tensor dequantisation from the reader's memory map).
    Read whole, as :func:`load` does: nn.Modules and state dicts (already in memory), our verified checkpoints (a run
    directory's too) and legacy (non-zip) torch pickles.

    Raises:
        FileNotFoundError, ValueError: as :func:`load`.
    """
    if isinstance(source, (torch.nn.Module, Mapping)):
        return load(source, undo_permute)
    path = Path(source)
    check_source(path)
    if path.is_dir():
        meta = _folder_meta(path)
        if _files(path, "*.safetensors", "safetensors") or _present(path / _ST_INDEX):
            refs, notes = _lazy_safetensors_dir(path)
            return Loaded(refs, "safetensors", meta=meta, notes=notes)
        for name in ("pytorch_model.bin", "model.pt", "checkpoint.pt"):
            if _present(path / name):
                sd, notes = _lazy_torch(path / name)
                return Loaded(sd, "torch", meta=meta, notes=notes)
        if _present(path / _BIN_INDEX):
            out: dict = {}
            shards = _shard_paths(path / _BIN_INDEX)
            for shard in shards:
                out.update(_lazy_torch(shard)[0])
            note = f"streamed {len(shards)} shard{'s' if len(shards) > 1 else ''} listed in {_BIN_INDEX}"
            return Loaded(out, "torch", meta=meta, notes=[note])
        if latest_checkpoint(path / "checkpoints") is None:
            ggufs = _files(path, "*.gguf", "GGUF")
            if ggufs:
                return open_gguf(ggufs[0], undo_permute)
        return load(path, undo_permute)
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return open_gguf(path, undo_permute)
    if suffix == ".safetensors":
        return Loaded(_safetensors_refs(path), "safetensors", meta={"path": str(path)})
    if suffix in (".pt", ".pth", ".bin", ".ckpt"):
        sd, notes = _lazy_torch(path)
        return Loaded(sd, "torch", meta={"path": str(path)}, notes=notes)
    return load(path, undo_permute)
