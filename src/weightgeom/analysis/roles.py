"""Tensor name → (projection role, layer index), for GPT-2 (HF and nanoGPT/ours), Llama (HF and llama.cpp GGUF), BERT
and our ResMLP; or a user role map.

Roles: Q, K, V, O (attention), Gate, Up, Down (MLP; GPT-2 / BERT two-layer MLPs map to Up and Down), MLP (ResMLP's
blocks). Weights come out in PyTorch (out, in) layout: HF GPT-2 ``Conv1D`` stores (in, out) and is transposed
(detected from the fused ``c_attn`` shape (d, 3d)); the fused ``c_attn`` is split into Q, K, V along the output rows.

A user role map is ``{role: pattern}`` where the pattern is a tensor name with ``{i}`` for the layer index
(``"model.layers.{i}.attn.wq.weight"``), or ``"re:<regex>"`` with one capturing group for the layer index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["ROLES", "RoleWeight", "assign_roles", "parse_role_map", "ROLE_MAP_HELP"]

ROLES = ("Q", "K", "V", "O", "Gate", "Up", "Down", "MLP")
"""The layer roles continuity analysis recognises, in report order: attention Q, K, V, O and MLP Gate, Up, Down
(``MLP``: a two-matrix MLP's matrices)."""

ROLE_MAP_HELP = (
    "pass a role map, e.g. analyze(src, roles={'Q': 'blocks.{i}.attn.wq.weight', 'Down': 'blocks.{i}.ffn.w2.weight'}) "
    "or `weightgeom analyze PATH --roles '{\"Q\": \"blocks.{i}.attn.wq.weight\"}'` ({i} = layer index; or 're:<regex>' "
    "with one group for the layer)"
)

_P = r"(?:^|\.)"
# (regex, role, family); "QKV" = fused GPT-2 c_attn, split later.
_BUILTIN: list[tuple[str, str, str]] = [
    # HF Llama / Mistral / Qwen naming (also our Llama model)
    (_P + r"layers\.(\d+)\.self_attn\.q_proj\.weight$", "Q", "llama"),
    (_P + r"layers\.(\d+)\.self_attn\.k_proj\.weight$", "K", "llama"),
    (_P + r"layers\.(\d+)\.self_attn\.v_proj\.weight$", "V", "llama"),
    (_P + r"layers\.(\d+)\.self_attn\.o_proj\.weight$", "O", "llama"),
    (_P + r"layers\.(\d+)\.mlp\.gate_proj\.weight$", "Gate", "llama"),
    (_P + r"layers\.(\d+)\.mlp\.up_proj\.weight$", "Up", "llama"),
    (_P + r"layers\.(\d+)\.mlp\.down_proj\.weight$", "Down", "llama"),
    # llama.cpp GGUF naming
    (r"^blk\.(\d+)\.attn_q\.weight$", "Q", "gguf"),
    (r"^blk\.(\d+)\.attn_k\.weight$", "K", "gguf"),
    (r"^blk\.(\d+)\.attn_v\.weight$", "V", "gguf"),
    (r"^blk\.(\d+)\.attn_output\.weight$", "O", "gguf"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", "Gate", "gguf"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", "Up", "gguf"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", "Down", "gguf"),
    # GPT-2 (HF Conv1D or nanoGPT / ours nn.Linear)
    (_P + r"h\.(\d+)\.attn\.c_attn\.weight$", "QKV", "gpt2"),
    (_P + r"h\.(\d+)\.attn\.q_proj\.weight$", "Q", "gpt2"),
    (_P + r"h\.(\d+)\.attn\.k_proj\.weight$", "K", "gpt2"),
    (_P + r"h\.(\d+)\.attn\.v_proj\.weight$", "V", "gpt2"),
    (_P + r"h\.(\d+)\.attn\.c_proj\.weight$", "O", "gpt2"),
    (_P + r"h\.(\d+)\.mlp\.c_fc\.weight$", "Up", "gpt2"),
    (_P + r"h\.(\d+)\.mlp\.c_proj\.weight$", "Down", "gpt2"),
    # BERT
    (_P + r"layer\.(\d+)\.attention\.self\.query\.weight$", "Q", "bert"),
    (_P + r"layer\.(\d+)\.attention\.self\.key\.weight$", "K", "bert"),
    (_P + r"layer\.(\d+)\.attention\.self\.value\.weight$", "V", "bert"),
    (_P + r"layer\.(\d+)\.attention\.output\.dense\.weight$", "O", "bert"),
    (_P + r"layer\.(\d+)\.intermediate\.dense\.weight$", "Up", "bert"),
    (_P + r"layer\.(\d+)\.output\.dense\.weight$", "Down", "bert"),
    # our ResMLP
    (_P + r"blocks\.(\d+)\.fc\.weight$", "MLP", "resmlp"),
]
_BUILTIN_RE = [(re.compile(p), r, f) for p, r, f in _BUILTIN]
_CONV1D_ROLES = {"QKV", "O", "Up", "Down"}


@dataclass
class RoleWeight:
    """One role-assigned matrix: ``weight`` in (out, in) layout; ``name`` the source tensor; ``note`` what was done."""

    role: str
    layer: int
    name: str
    weight: torch.Tensor
    note: str = ""


def parse_role_map(roles: Mapping[str, str] | str) -> list[tuple[re.Pattern, str]]:
    """Compile a user role map ``{role: pattern}`` (or its JSON text) into (regex, role) pairs."""
    if isinstance(roles, str):
        import json

        try:
            roles = json.loads(roles)
        except json.JSONDecodeError as e:
            raise ValueError(f"--roles: not valid JSON ({e.msg}); {ROLE_MAP_HELP}") from None
    if not isinstance(roles, Mapping) or not roles:
        raise ValueError(f"role map must be a non-empty {{role: pattern}} mapping; {ROLE_MAP_HELP}")
    out = []
    for role, pat in roles.items():
        if not isinstance(pat, str):
            raise ValueError(f"role map: pattern for {role!r} must be a string, got {type(pat).__name__}")
        if pat.startswith("re:"):
            rx = re.compile(pat[3:])
        elif "{i}" in pat:
            rx = re.compile("^" + re.escape(pat).replace(r"\{i\}", r"(\d+)") + "$")
        else:
            raise ValueError(f"role map: pattern {pat!r} for {role!r} needs a {{i}} placeholder or a 're:' prefix")
        if rx.groups < 1:
            raise ValueError(f"role map: regex for {role!r} needs one capturing group for the layer index")
        out.append((rx, str(role)))
    return out


def _is_matrix(t) -> bool:
    """A 2-D floating-point tensor, or a not-yet-read :class:`~weightgeom.analysis.loaders.TensorRef` of one."""
    lazy = hasattr(t, "materialize") and hasattr(t, "shape")
    return (isinstance(t, torch.Tensor) or lazy) and t.ndim == 2 and t.is_floating_point()


def _refuse_non_float(tensors: Mapping[str, torch.Tensor], rules, any_float: bool) -> None:
    """When no role was found and the 2-D tensors that carry role names (or, with no floating-point matrix at all,
    any 2-D tensors) are integer, bool or complex, say so, naming them and their dtypes, instead of "no projection
    roles … Seen: (none)": such matrices are not weights (a quantised checkpoint whose scales live elsewhere, or a
    buffer)."""
    others = [k for k, t in tensors.items() if getattr(t, "ndim", 0) == 2 and not t.is_floating_point()]
    named = [k for k in others if any(rx.search(k) for rx, *_ in rules)]
    if not named and (any_float or not others):
        return
    named = named or others
    kinds = sorted({str(getattr(tensors[k], "dtype", "") or "not floating point").removeprefix("torch.")
                    for k in named})
    shown = ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    raise ValueError(f"no floating-point weights to analyse: tensors {shown} are {', '.join(kinds)}, not weights "
                     "(integer, bool and complex tensors are left out; dequantise a quantised checkpoint first)")


def assign_roles(
    tensors: Mapping[str, torch.Tensor], roles: Mapping[str, str] | str | None = None
) -> dict[str, list[RoleWeight]]:
    """Group the 2-D tensors of a state dict by projection role.

    Args:
        tensors: name → tensor (a state dict; non-matrix entries are ignored) or name →
            :class:`~weightgeom.analysis.loaders.TensorRef` (nothing is read: names and shapes suffice; the
            transpose / QKV split are recorded on the reference).
        roles: optional user role map (see module docstring); replaces the built-in naming rules.

    Returns:
        role → list of :class:`RoleWeight` sorted by layer (roles in ``ROLES`` order first).

    Raises:
        ValueError: no tensor matched; the message lists the matrix names seen and how to pass a role map.
    """
    found: dict[str, list[RoleWeight]] = {}
    matrices = [k for k, t in tensors.items() if _is_matrix(t)]
    if roles is not None:
        rules = [(rx, role, "user") for rx, role in parse_role_map(roles)]
    else:
        rules = _BUILTIN_RE
    # Conv1D detection for GPT-2: c_attn stored (d, 3d) means (in, out) layout for all c_* weights.
    conv1d = False
    for k in matrices:
        if re.search(_P + r"h\.\d+\.attn\.c_attn\.weight$", k):
            r, c = tensors[k].shape
            conv1d = c == 3 * r
            break
    for k in matrices:
        for rx, role, fam in rules:
            mt = rx.search(k)
            if not mt:
                continue
            layer = int(mt.group(1))
            W = tensors[k]
            note = ""
            if fam == "gpt2" and conv1d and role in _CONV1D_ROLES:
                W, note = W.T, "Conv1D (in,out) transposed"
            if role == "QKV":
                if W.shape[0] % 3:
                    raise ValueError(f"{k}: fused QKV with {W.shape[0]} output rows is not divisible by 3")
                for part, r in zip(W.chunk(3, dim=0), ("Q", "K", "V")):
                    found.setdefault(r, []).append(
                        RoleWeight(r, layer, k, part, (note + "; " if note else "") + f"split {r} from fused QKV")
                    )
            else:
                found.setdefault(role, []).append(RoleWeight(role, layer, k, W, note))
            break
    if not found:
        _refuse_non_float(tensors, rules, any_float=bool(matrices))
    if not found:
        shown = matrices[:40]
        more = f" … and {len(matrices) - len(shown)} more" if len(matrices) > len(shown) else ""
        raise ValueError(
            f"no projection roles recognised among {len(matrices)} matrix tensors "
            "(known: GPT-2, Llama/HF, llama.cpp GGUF, BERT, ResMLP naming). "
            f"Seen: {', '.join(shown) or '(none)'}{more}. "
            + ROLE_MAP_HELP
        )
    order = {r: i for i, r in enumerate(ROLES)}
    out = {}
    for role in sorted(found, key=lambda r: (order.get(r, len(order)), r)):
        items = sorted(found[role], key=lambda rw: rw.layer)
        layers = [rw.layer for rw in items]
        if len(set(layers)) != len(layers):
            dup = sorted({x for x in layers if layers.count(x) > 1})
            names = [rw.name for rw in items if rw.layer in dup][:4]
            raise ValueError(f"role {role}: several tensors for layer(s) {dup} ({', '.join(names)}); pass a role map")
        out[role] = items
    return out
