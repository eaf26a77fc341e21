"""Load weights for analysis from an nn.Module, a state dict, an HF model directory (safetensors or pytorch_model.bin),
a torch checkpoint (ours or any ``{"model": state_dict, ...}``), or a llama.cpp GGUF file.

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


def _load_torch(path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    notes = []
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"WGCKPT1"):  # our trainer's verified checkpoint (weightgeom.train.checkpoint)
        from weightgeom.train.checkpoint import load_checkpoint

        payload = load_checkpoint(path)
        notes.append(f"weightgeom checkpoint, step {payload.get('step')}")
        return _unwrap(payload), notes
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickled non-tensor objects (e.g. a config dataclass) need the full unpickler
        if "weights_only" not in str(e) and "Unpickl" not in type(e).__name__:
            raise
        obj = torch.load(path, map_location="cpu", weights_only=False)
        notes.append("checkpoint needed weights_only=False (it pickles Python objects); only load files you trust")
    return _unwrap(obj), notes


def _load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


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


def load_gguf(path: str | os.PathLike, undo_permute: bool | None = None) -> Loaded:
    """Read a GGUF file into float32 tensors in (out, in) layout with llama.cpp tensor names.

    Args:
        path: the .gguf file.
        undo_permute: undo the Q/K row permutation (default: when the architecture is in ``GGUF_PERMUTED_ARCHS``).
    """
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _field_value(reader, "general.architecture") or "unknown"
    n_head = _field_value(reader, f"{arch}.attention.head_count")
    n_kv = _field_value(reader, f"{arch}.attention.head_count_kv") or n_head
    notes = []
    plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16}
    quantised = set()
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(list(t.shape)))  # GGUF stores ne (innermost first)
        if t.tensor_type in plain:
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, t.tensor_type).astype(np.float32)
            quantised.add(t.tensor_type.name)
        tensors[t.name] = torch.from_numpy(np.array(arr.reshape(shape), dtype=np.float32))  # owned copy
    if quantised:
        notes.append(f"dequantised {', '.join(sorted(quantised))} tensors with gguf.quants.dequantize")
    do = arch in GGUF_PERMUTED_ARCHS if undo_permute is None else undo_permute
    if do:
        if not n_head:
            raise ValueError(f"{path}: {arch}.attention.head_count missing; cannot undo the Q/K permutation "
                             "(pass undo_permute=False — adjacent-layer metrics are invariant to it)")
        for name in list(tensors):
            if name.endswith("attn_q.weight"):
                tensors[name] = unpermute_qk(tensors[name], int(n_head))
            elif name.endswith("attn_k.weight"):
                tensors[name] = unpermute_qk(tensors[name], int(n_kv))
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
        ValueError: unsupported file type or no weights found.
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
            meta["config"] = json.loads(cfg.read_text())
        if list(path.glob("*.safetensors")):
            return Loaded(_load_safetensors_dir(path), "safetensors", meta=meta)
        for name in ("pytorch_model.bin", "model.pt", "checkpoint.pt"):
            if (path / name).exists():
                sd, notes = _load_torch(path / name)
                return Loaded(sd, "torch", meta=meta, notes=notes)
        if (path / "checkpoints").is_dir():  # a weightgeom run directory: its newest checkpoint
            cks = sorted((path / "checkpoints").glob("ckpt_*.pt"))
            cks = [c for c in cks if ".rank" not in c.name]
            if cks:
                sd, notes = _load_torch(cks[-1])
                return Loaded(sd, "torch", meta=meta, notes=notes + [f"run directory: loaded {cks[-1].name}"])
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return load_gguf(ggufs[0], undo_permute)
        pts = sorted(path.glob("*.pt"))
        if pts:
            sd, notes = _load_torch(pts[-1])
            return Loaded(sd, "torch", meta=meta, notes=notes + [f"loaded {pts[-1].name}"])
        raise ValueError(f"{path}: directory has no *.safetensors, pytorch_model.bin, *.pt or *.gguf file")
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        return load_gguf(path, undo_permute)
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        return Loaded(load_file(str(path)), "safetensors", meta={"path": str(path)})
    if suffix in (".pt", ".pth", ".bin", ".ckpt"):
        sd, notes = _load_torch(path)
        return Loaded(sd, "torch", meta={"path": str(path)}, notes=notes)
    raise ValueError(f"{path}: unsupported file type {suffix!r}; expected an HF directory, .safetensors, .pt/.pth/"
                     ".bin/.ckpt or .gguf")
