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

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from weightgeom.train.checkpoint import (
    is_checkpoint_file,
    latest_checkpoint,
    load_checkpoint,
    safe_torch_load,
    weights_only_refusal,
)

__all__ = ["Loaded", "load", "load_gguf", "unpermute_qk", "permute_qk", "GGUF_PERMUTED_ARCHS"]

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
    try:
        with open(path, "rb") as f:
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

    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - SafetensorError (a Rust exception type), OSError, ...
        msg = str(e).replace("Error while deserializing header: ", "").strip().splitlines()
        raise ValueError(f"{path}: not a readable safetensors file ({msg[0] if msg else type(e).__name__}); "
                         "truncated or corrupt?") from None


def _load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(_load_safetensors_file(f))
    return out


_BIN_INDEX = "pytorch_model.bin.index.json"


def _shard_paths(index: Path) -> list[Path]:
    """The shard files an HF ``pytorch_model.bin.index.json`` lists (``weight_map`` values), in order of first use.

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
            raise ValueError(f"{index}: shard {name!r} is not a file name in {index.parent}")
        shard = index.parent / name
        if shard.resolve().parent != base:
            raise ValueError(f"{index}: shard {name!r} resolves to {shard.resolve()}, outside {index.parent}")
        if not shard.is_file():
            raise ValueError(f"{index}: shard {name} is missing from {index.parent}")
        shards.append(shard)
    return shards


def _load_sharded_bin(index: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Tensors of every shard an HF ``pytorch_model.bin.index.json`` lists, each read like a single torch file."""
    out: dict[str, torch.Tensor] = {}
    shards = _shard_paths(index)
    for shard in shards:
        sd, _ = _load_torch(shard)
        out.update(sd)
    return out, [f"loaded {len(shards)} shard{'s' if len(shards) > 1 else ''} listed in {index.name}"]


def _read_config_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None


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
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type).astype(np.float32)
            quantised.add(t.tensor_type.name)
        return torch.from_numpy(np.array(arr.reshape(shape), dtype=np.float32))  # owned copy
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


def load_gguf(path: str | os.PathLike, undo_permute: bool | None = None) -> Loaded:
    """Read a GGUF file into float32 tensors in (out, in) layout with llama.cpp tensor names.

    Args:
        path: the .gguf file.
        undo_permute: undo the Q/K row permutation (default: when the architecture is in ``GGUF_PERMUTED_ARCHS``).

    Raises:
        ValueError: not a GGUF file, truncated or corrupt, or a tensor that cannot be read (one line naming the file).
    """
    reader = _open_gguf(Path(path))
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
    quantised: set[str] = set()
    tensors = {t.name: _gguf_tensor(t, Path(path), quantised) for t in reader.tensors}
    if quantised:
        notes.append(f"dequantised {', '.join(sorted(quantised))} tensors with gguf.quants.dequantize")
    do = arch in GGUF_PERMUTED_ARCHS if undo_permute is None else undo_permute
    if do:
        if not n_head:
            raise ValueError(f"{path}: {arch}.attention.head_count missing; cannot undo the Q/K permutation "
                             "(pass undo_permute=False — adjacent-layer metrics are invariant to it)")
        for name in list(tensors):
            heads = n_head if name.endswith("attn_q.weight") else n_kv if name.endswith("attn_k.weight") else None
            if heads is None:
                continue
            try:
                tensors[name] = unpermute_qk(tensors[name], heads)
            except ValueError as e:
                kv = name.endswith("attn_k.weight") and kv_given
                key = "head_count_kv" if kv else "head_count"
                raise ValueError(f"{path}: tensor {name}: {e} ({arch}.attention.{key}); pass undo_permute=False "
                                 "(--gguf-keep-permutation) to leave the rows as stored") from None
        notes.append(f"undid llama.cpp's Q/K row permutation (arch {arch}, {n_head} heads, {n_kv} KV heads)")
    meta = {"path": str(path), "arch": arch, "n_head": n_head, "n_head_kv": n_kv}
    return Loaded(tensors, "gguf", meta=meta, notes=notes)


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
    if not path.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    if path.is_dir():
        meta = {"path": str(path)}
        cfg = path / "config.json"
        if cfg.exists():
            meta["config"] = _read_config_json(cfg)
        if list(path.glob("*.safetensors")):
            return Loaded(_load_safetensors_dir(path), "safetensors", meta=meta)
        for name in ("pytorch_model.bin", "model.pt", "checkpoint.pt"):
            if (path / name).exists():
                sd, notes = _load_torch(path / name)
                return Loaded(sd, "torch", meta=meta, notes=notes)
        if (path / _BIN_INDEX).exists():  # sharded pytorch_model-0000i-of-0000n.bin
            sd, notes = _load_sharded_bin(path / _BIN_INDEX)
            return Loaded(sd, "torch", meta=meta, notes=notes)
        latest = latest_checkpoint(path / "checkpoints")  # a weightgeom run directory: its newest checkpoint
        if latest is not None:
            sd, notes = _load_torch(latest)
            return Loaded(sd, "torch", meta=meta, notes=notes + [f"run directory: loaded {latest.name}"])
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return load_gguf(ggufs[0], undo_permute)
        pts = sorted(path.glob("*.pt"))
        if pts:
            sd, notes = _load_torch(pts[-1])
            return Loaded(sd, "torch", meta=meta, notes=notes + [f"loaded {pts[-1].name}"])
        if (path / "checkpoints").is_dir():
            raise ValueError(f"{path}: run directory has no checkpoint in checkpoints/ yet (nothing to analyse)")
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
