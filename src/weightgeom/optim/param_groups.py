"""``param_groups(model, strategy)``: assign every trainable parameter to a Muon / manifold-Muon / AdamW group.

Roles are recognised from parameter names (and module types for embeddings / norms), so the same strategies work on
this package's GPT / Llama / ResMLP models and on Hugging Face GPT-2, Llama and BERT modules:

=========  =====================================================================================================
role       names (regex on the full parameter name; first match wins)
=========  =====================================================================================================
attn       ``attn.{c_attn,c_proj,q_proj,k_proj,v_proj,o_proj}.weight`` (nanoGPT / HF GPT-2 / ours),
           ``self_attn.{q,k,v,o}_proj.weight`` (HF Llama / ours), ``attention.self.{query,key,value}.weight`` and
           ``attention.output.dense.weight`` (HF BERT)
mlp        ``mlp.{c_fc,c_proj,gate_proj,up_proj,down_proj,fc1,fc2}.weight``, BERT ``intermediate.dense.weight`` and
           ``layer.{i}.output.dense.weight``, ResMLP ``blocks.{i}.fc.weight``
embed      parameters of ``nn.Embedding`` modules (``wte``, ``wpe``, ``embed_tokens``, BERT embeddings)
head       ``lm_head.*``, ``head.*``
norm/bias  parameters of ``*Norm*`` modules, 1-D parameters, ``*.bias``
other      any other parameter (e.g. BERT's pooler, ResMLP's ``inp``): AdamW
=========  =====================================================================================================

Strategies map roles to (algorithm, manifold): ``unconstrained`` (Muon on attn + mlp), ``all-stiefel``,
``all-dgram``, ``hetero`` (attn Stiefel, mlp DGram), ``hetero-inv`` (attn DGram, mlp Stiefel), ``adamw``
(everything AdamW), ``auto`` (ALL-DGRAM with each attention matrix in its own group, for the trainer callback
:class:`weightgeom.train.auto_assign.AutoAssign` that moves a layer to Stiefel when its logit bound grows).
Embeddings, head, norms, biases and other → AdamW, weight decay only on ≥2-D tensors.

Hyperparameters go to the groups whose algorithm reads them (one rule, checked: a key nobody reads is an error
with a "did you mean"):

- AdamW groups: ``adamw_lr``, ``adamw_weight_decay``, ``adamw_betas``, ``adamw_eps`` (the ``adamw_`` prefix
  dropped), the AdamW-only ``betas`` and ``eps``, and the entries of ``adamw_hparams={"lr": ...}`` (keys ``lr``,
  ``weight_decay``, ``betas``, ``eps``). The same setting given two ways is an error.
- Muon groups: every other keyword, which must be a Muon group key (a keyword of ``weightgeom.optim.Muon``:
  ``lr``, ``weight_decay``, ``momentum``, ``dual``, ``init``, ...). ``lr`` and ``weight_decay`` are Muon's.
- An AdamW group given no ``lr`` takes the optimizer's (``Muon(..., adamw_lr=)``, else ``Muon(..., lr=)``).

HF GPT-2 uses ``Conv1D`` whose weight is stored (in, out): such parameters get the group key ``layout="in_out"`` so
Muon's shape scale and the QKV split use the (out, in) view; manifold constraints are orientation-free (wide matrices
are transposed to tall). With ``split_qkv=True`` the fused ``c_attn`` weight (out = 3·d) gets ``split=3``: Muon treats
it as three d×in matrices [Q; K; V] split along the *output* dimension whichever the storage layout, each with its
own momentum direction, Gram constraint and multiplier.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch.nn as nn

from weightgeom import manifolds
from weightgeom.optim.dual import GROUP_KEYS as DUAL_GROUP_KEYS
from weightgeom.optim.muon import Muon
from weightgeom.optim.muon_checks import MUON_DEFAULTS
from weightgeom.schema import suggest

__all__ = ["param_groups", "describe", "STRATEGIES", "ROLE_PATTERNS", "ADAMW_GROUP_KEYS", "format_table", "classify",
           "muon_group_keys"]

# strategy -> {role: manifold name or None (plain Muon) or "adamw"}
STRATEGIES: dict[str, dict[str, str | None]] = {
    "unconstrained": {"attn": None, "mlp": None},
    "all-stiefel": {"attn": "stiefel", "mlp": "stiefel"},
    "all-dgram": {"attn": "dgram", "mlp": "dgram"},
    "hetero": {"attn": "stiefel", "mlp": "dgram"},
    "hetero-inv": {"attn": "dgram", "mlp": "stiefel"},
    "adamw": {"attn": "adamw", "mlp": "adamw"},
    # starts as ALL-DGRAM with each attention matrix in its own group, so that the trainer callback
    # weightgeom.train.auto_assign.AutoAssign can move one layer's Q/K weights to Stiefel during training
    "auto": {"attn": "dgram", "mlp": "dgram"},
}
"""Parameter-group strategies by name: strategy -> {role (``attn``, ``mlp``): manifold name, ``None`` (plain Muon) or
``"adamw"``}."""

ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"(^|\.)attn\.(c_attn|c_proj|q_proj|k_proj|v_proj|o_proj)\.weight$", "attn"),
    (r"(^|\.)self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$", "attn"),
    (r"(^|\.)attention\.self\.(query|key|value)\.weight$", "attn"),
    (r"(^|\.)attention\.output\.dense\.weight$", "attn"),
    (r"(^|\.)mlp\.(c_fc|c_proj|gate_proj|up_proj|down_proj|fc1|fc2)\.weight$", "mlp"),
    (r"(^|\.)intermediate\.dense\.weight$", "mlp"),
    (r"(^|\.)layer\.\d+\.output\.dense\.weight$", "mlp"),
    (r"(^|\.)blocks\.\d+\.fc\.weight$", "mlp"),
    (r"(^|\.)(lm_head|head)\.", "head"),
)
_FUSED_QKV = re.compile(r"(^|\.)attn\.c_attn\.weight$")
_ADAMW_ROLES = ("embed", "head", "norm", "bias", "other")

# The keys Muon's AdamW step reads from a group; ``betas`` and ``eps`` are read by nothing else.
ADAMW_GROUP_KEYS = ("lr", "weight_decay", "betas", "eps")
_ADAMW_ONLY = ("betas", "eps")
# Group keys param_groups sets itself (from the strategy, rules and split_qkv), not keywords.
_PLACEMENT_KEYS = ("algorithm", "manifold", "layout", "split")
# param_groups' own keywords (for "did you mean").
_OWN_KEYWORDS = ("strategy", "rules", "split_qkv", "verbose", "adamw_hparams")


def muon_group_keys() -> tuple[str, ...]:
    """The hyperparameter keys a Muon group accepts: ``weightgeom.optim.Muon``'s keywords (``MUON_DEFAULTS``) except
    the placement keys param_groups sets and the AdamW-path keys (``betas``, ``eps``, ``adamw_lr``, ``adamw_eps``)."""
    skip = {*_PLACEMENT_KEYS, *_ADAMW_ONLY, "adamw_lr", "adamw_eps"}
    # plus the older dual_<field> spelling of ``dual``, passed on to Muon, which warns and takes it
    return (*(k for k in MUON_DEFAULTS if k not in skip), *DUAL_GROUP_KEYS)


def _route(hparams: Mapping[str, Any], adamw_hparams: Mapping[str, Any] | None) -> tuple[dict, dict]:
    """Split param_groups' keywords into (Muon group keys, AdamW group keys) by the rule in the module docstring.

    Raises:
        ValueError: one line naming a key no group reads (with a "did you mean"), a placement key given as a keyword,
            or a setting given twice.
    """
    muon_keys = muon_group_keys()
    adamw_kw = tuple(f"adamw_{k}" for k in ADAMW_GROUP_KEYS)
    muon_hp: dict[str, Any] = {}
    adamw_hp: dict[str, Any] = {}
    source: dict[str, str] = {}
    for k, v in dict(adamw_hparams or {}).items():
        if k not in ADAMW_GROUP_KEYS:
            raise ValueError(f"param_groups: adamw_hparams key {k!r} is not read by AdamW groups (they read "
                             f"{', '.join(ADAMW_GROUP_KEYS)}){suggest(k, ADAMW_GROUP_KEYS)}")
        adamw_hp[k], source[k] = v, f"adamw_hparams[{k!r}]"
    for k, v in hparams.items():
        if k in adamw_kw or k in _ADAMW_ONLY:
            key = k.removeprefix("adamw_")
            if key in source:
                raise ValueError(f"param_groups: the AdamW {key!r} is given twice: as {k!r} and as {source[key]}")
            adamw_hp[key], source[key] = v, repr(k)
        elif k in muon_keys:
            muon_hp[k] = v
        elif k in _PLACEMENT_KEYS:
            raise ValueError(f"param_groups: {k!r} is not a keyword: the strategy, rules and split_qkv set it "
                             f"(e.g. rules={{regex: {{'manifold': 'stiefel'}}}})")
        else:
            options = (*muon_keys, *adamw_kw, *_ADAMW_ONLY, *_OWN_KEYWORDS)
            raise ValueError(f"param_groups: unknown keyword {k!r} (not a Muon group key, not an AdamW one)"
                             f"{suggest(k, options)}")
    return muon_hp, adamw_hp


def _check_rule_keys(spec: Mapping[str, Any], where: str) -> None:
    """A rule's dict of group keys may hold only keys its algorithm reads."""
    if spec.get("algorithm") == "adamw":
        allowed = (*ADAMW_GROUP_KEYS, "algorithm", "manifold")
        kind = "AdamW"
    else:
        allowed = (*muon_group_keys(), *_PLACEMENT_KEYS)
        kind = "Muon"
    for k in spec:
        if k not in allowed:
            raise ValueError(f"param_groups: rule {where}: key {k!r} is not read by {kind} groups"
                             f"{suggest(k, allowed)}")


def classify(model: nn.Module) -> list[tuple[str, nn.Parameter, str, str]]:
    """(name, param, role, layout) for every trainable parameter, in ``named_parameters`` order.

    layout is ``"in_out"`` for weights of modules named ``Conv1D`` (HF GPT-2), else ``"out_in"``.
    """
    owner: dict[int, nn.Module] = {}
    for _, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mod = owner.get(id(p))
        cls = type(mod).__name__ if mod is not None else ""
        layout = "in_out" if cls == "Conv1D" and p.ndim == 2 else "out_in"
        role = None
        if isinstance(mod, nn.Embedding):
            role = "embed"
        elif "norm" in cls.lower() or name.endswith(".bias") or name == "bias" or p.ndim < 2:
            role = "bias" if name.endswith("bias") else "norm"
        else:
            for pat, r in ROLE_PATTERNS:
                if re.search(pat, name):
                    role = r
                    break
        out.append((name, p, role or "other", layout))
    return out


def _spec_from_rule(value: Any, where: str) -> dict[str, Any]:
    """A rule's value → group spec. Strings: "adamw", "muon"/"none" (plain Muon), or a manifold name."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "adamw":
            return {"algorithm": "adamw", "manifold": None}
        if v in ("muon", "none", "unconstrained"):
            return {"algorithm": "muon", "manifold": None}
        try:
            manifolds.get(v)
        except ValueError as e:
            raise ValueError(f"param_groups: rule {where}: {e}") from e
        return {"algorithm": "muon", "manifold": v}
    if value is None:
        return {"algorithm": "muon", "manifold": None}
    if isinstance(value, Mapping):
        spec = dict(value)
        spec.setdefault("algorithm", "muon")
        spec.setdefault("manifold", None)
        _check_rule_keys(spec, where)
        return spec
    raise ValueError(f"param_groups: rule {where}: value must be a string or a dict of group keys, got {value!r}")


def param_groups(
    model: nn.Module,
    strategy: str = "unconstrained",
    rules: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
    split_qkv: bool = False,
    verbose: bool = False,
    adamw_hparams: Mapping[str, Any] | None = None,
    **hparams: Any,
) -> list[dict[str, Any]]:
    """Parameter groups for ``weightgeom.optim.Muon``; every trainable parameter is claimed exactly once.

    Args:
        model: any ``nn.Module`` (ours, HF GPT-2 / Llama / BERT, ...).
        strategy: one of ``STRATEGIES`` (see module docstring).
        rules: extra name rules applied *before* the strategy, in order: ``{regex: value}`` or ``[(regex, value)]``
            with value ``"adamw"``, ``"muon"`` (no manifold), a manifold name, or a dict of Muon group keys
            (e.g. ``{"manifold": "stiefel", "lr": 0.01}``). ``re.search`` on the full parameter name; a rule
            that matches no trainable parameter is an error.
        split_qkv: give fused QKV weights (``attn.c_attn.weight``) ``split=3`` so Q, K, V are separate matrices.
        verbose: print the assignment table (one line per parameter). Quiet by default: the table is logged at INFO
            on the ``weightgeom.optim.param_groups`` logger, and :func:`describe` gives it for any optimizer.
        adamw_hparams: AdamW group keys, e.g. ``{"lr": 6e-4, "weight_decay": 0.1}``, the same as the keywords
            ``adamw_lr=6e-4, adamw_weight_decay=0.1``. Weight decay applies to ≥2-D tensors only (1-D: 0).
        **hparams: routed by name as the module docstring says (``lr`` is Muon's, in spectral-norm units per step),
            e.g. ``param_groups(model, "hetero", lr=0.02, adamw_lr=3e-3)``.

    Returns:
        List of groups, each with ``params``, ``names``, ``algorithm``, ``manifold`` plus the hyperparameters (and
        ``layout`` / ``split`` where not default).

    Raises:
        ValueError: unknown strategy, a rule matching nothing, a bad rule value, a non-matrix parameter given to a
            Muon rule, a model in which the strategy finds no attention/MLP matrix to constrain, or a keyword
            (or ``adamw_hparams`` / rule key) that no group reads, naming it with a "did you mean".
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"param_groups: unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}"
                         f"{suggest(strategy, STRATEGIES)}")
    role_map = STRATEGIES[strategy]
    rule_list = list(rules.items()) if isinstance(rules, Mapping) else list(rules or [])
    compiled = []
    for i, item in enumerate(rule_list):
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"param_groups: rule #{i} must be a (regex, value) pair, got {item!r}")
        pat, value = item
        try:
            rx = re.compile(pat)
        except re.error as e:
            raise ValueError(f"param_groups: rule {pat!r} is not a valid regex: {e}") from e
        compiled.append((pat, rx, _spec_from_rule(value, repr(pat))))
    hparams, adamw_hp = _route(hparams, adamw_hparams)
    if "eps" in adamw_hp:  # Muon's AdamW groups read their ε as adamw_eps ("eps" is torch.optim.Muon's NS ε)
        adamw_hp["adamw_eps"] = adamw_hp.pop("eps")
    hits = {pat: 0 for pat, _, _ in compiled}

    rows: list[dict[str, Any]] = []
    for name, p, role, layout in classify(model):
        spec = None
        source = role
        for pat, rx, s in compiled:
            if rx.search(name):
                spec, source = dict(s), f"rule {pat}"
                hits[pat] += 1
                break
        if spec is None:
            target = role_map.get(role, "adamw") if role not in _ADAMW_ROLES else "adamw"
            spec = _spec_from_rule(target if target is not None else "muon", f"strategy {strategy!r}")
            if strategy == "auto" and role == "attn":  # a group of its own: AutoAssign may change its manifold
                spec["name"] = f"auto:{name}"
        if spec["algorithm"] == "muon":
            if p.ndim != 2:
                raise ValueError(f"param_groups: parameter {name!r} has shape {tuple(p.shape)}; {source} assigns "
                                 f"it to Muon, which needs 2-D matrices")
            if layout != "out_in":
                spec.setdefault("layout", layout)
            if split_qkv and _FUSED_QKV.search(name):
                spec.setdefault("split", 3)
            spec = {**hparams, **spec}
        else:
            spec = {**adamw_hp, **spec}
            if "eps" in spec:  # a rule's AdamW ε: Muon's AdamW groups read it as adamw_eps
                spec["adamw_eps"] = spec.pop("eps")
            if p.ndim < 2:
                spec["weight_decay"] = 0.0
        rows.append({"name": name, "param": p, "role": role, "source": source, "spec": spec})

    unmatched = [pat for pat, n in hits.items() if n == 0]
    if unmatched:
        raise ValueError(f"param_groups: rule(s) {unmatched} matched no trainable parameter of "
                         f"{type(model).__name__}")
    if strategy != "adamw" and not any(r["role"] in ("attn", "mlp") for r in rows) and not compiled:
        raise ValueError(f"param_groups: strategy {strategy!r} found no attention/MLP matrices in "
                         f"{type(model).__name__} (names like 'attn.c_attn.weight', 'self_attn.q_proj.weight', "
                         f"'mlp.c_fc.weight'); pass rules={{regex: manifold}} to assign them")

    groups: list[dict[str, Any]] = []
    index: dict[tuple, int] = {}
    for r in rows:
        key = tuple(sorted((k, repr(v)) for k, v in r["spec"].items()))
        if key not in index:
            index[key] = len(groups)
            groups.append({"params": [], "names": [], **r["spec"]})
        g = groups[index[key]]
        g["params"].append(r["param"])
        g["names"].append(r["name"])
    if verbose:
        print(format_table(rows, strategy))
    elif _log.isEnabledFor(logging.INFO):
        _log.info("%s", format_table(rows, strategy))
    return groups


_log = logging.getLogger(__name__)


def describe(optimizer: Any, model: nn.Module | None = None) -> str:
    """The assignment table of a built optimizer (or of a list of parameter groups): one line per parameter with its
    shape, role, algorithm, manifold and notes — the table ``param_groups(..., verbose=True)`` prints.

    Args:
        optimizer: a ``Muon``, ``MagnitudeDirection`` or any ``torch.optim.Optimizer`` (its ``param_groups``), or a
            list of groups as :func:`param_groups` returns them. Parameter names come from the groups' ``names``
            (``group<i>.param<j>`` where a group has none).
        model: the model, to name each parameter's role (``attn``, ``mlp``, ...); ``-`` without it.

    Returns:
        The table as text (no trailing newline), then one line per device with the numerics the optimizer resolved
        there (``opt.numerics``: msign dtype and steps, constraint products, C kernels, CUDA graphs, each with where it
        came from) for a Muon, or a MagnitudeDirection over one.
    """
    groups = optimizer.param_groups if hasattr(optimizer, "param_groups") else list(optimizer)
    roles = {name: role for name, _, role, _ in classify(model)} if model is not None else {}
    default = "muon" if isinstance(optimizer, Muon) else "adamw"
    rows = []
    for gi, g in enumerate(groups):
        names = list(g.get("names") or [f"group{gi}.param{j}" for j in range(len(g["params"]))])
        spec = {k: v for k, v in g.items() if k not in ("params", "names")}
        spec["algorithm"] = spec.get("algorithm") or default
        for name, p in zip(names, g["params"]):
            rows.append({"name": name, "param": p, "role": roles.get(name, "-"), "source": "group", "spec": spec})
    table = format_table(rows, title=f"{type(optimizer).__name__ if hasattr(optimizer, 'param_groups') else 'groups'}")
    holder = next((o for o in (optimizer, getattr(optimizer, "base_optimizer", None)) if hasattr(o, "numerics")), None)
    numerics = getattr(holder, "numerics", None) or {}
    return "\n".join([table, *(n.describe() for n in numerics.values())])


def format_table(rows: list[dict[str, Any]], strategy: str = "", title: str | None = None) -> str:
    """The assignment table printed by ``param_groups`` (one line per parameter); ``title`` replaces the first line's
    ``param_groups(strategy=...)``."""
    header = ("parameter", "shape", "role", "algorithm", "manifold", "note")
    lines = []
    for r in rows:
        p, s = r["param"], r["spec"]
        notes = []
        if r["source"].startswith("rule"):
            notes.append(r["source"])
        if s.get("layout") == "in_out":
            notes.append("Conv1D (in,out) storage")
        shape = tuple(p.shape)
        out_in = shape[::-1] if s.get("layout") == "in_out" else shape
        if s.get("split"):
            k = int(s["split"])
            notes.append(f"split {k}× along out dim")
            out_in = (out_in[0] // k, out_in[1]) if len(out_in) == 2 else out_in
        if s.get("manifold") and len(out_in) == 2 and out_in[0] < out_in[1]:
            notes.append("wide: constrained as its transpose (tall)")
        if s["algorithm"] == "adamw":
            notes.append(f"wd={s.get('weight_decay', 'optimizer default')}")
        lines.append((r["name"], "×".join(map(str, shape)), r["role"], s["algorithm"], str(s.get("manifold") or "-"),
                      "; ".join(notes)))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    head = title if title is not None else f"param_groups(strategy={strategy!r})"
    out = [f"{head}: {len(rows)} trainable parameters", fmt.format(*header).rstrip(),
           fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line).rstrip() for line in lines]
    n_muon = sum(r["param"].numel() for r in rows if r["spec"]["algorithm"] == "muon")
    n_all = sum(r["param"].numel() for r in rows)
    out.append(f"Muon-stepped elements: {n_muon:,} of {n_all:,}")
    return "\n".join(out)
