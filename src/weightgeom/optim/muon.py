"""``Muon``: one torch.optim optimizer for Muon, manifold Muon and AdamW parameter groups (docs/muon.md).

Per group, ``algorithm="muon"`` (2-D parameters) runs

    momentum (EMA or sum form) → direction → shape scale → decoupled decay → lr step [→ retraction]

where the direction is msign(U) without a manifold, or the manifold-Muon direction (dual ascent, warm-started Λ,
``optim/manifold_muon.py``) with one; ``algorithm="adamw"`` groups take an AdamW step. The maths lives in
``optim/functional.py``; this class only keeps state and loops. Derivations: ``docs/muon.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from weightgeom import manifolds
from weightgeom.linalg import full_precision, msign_choice
from weightgeom.linalg.numerics import NOT_RESOLVED, Numerics, resolve_numerics
from weightgeom.optim import manifold_step, muon_summary, state_compat
from weightgeom.optim.checks import check_new_group
from weightgeom.optim.dual import DualAscent, legacy_message, resolve_dual, take_legacy
from weightgeom.optim.functional import (
    NonFiniteGradientError,
    adamw_update,
    all_finite,
    momentum_direction,
    momentum_step,
)
from weightgeom.optim.manifold_muon import lanczos_start
from weightgeom.optim.muon_checks import (
    ALGORITHMS,
    FarRetractionWarning,
    StepChecks,
    check_group_keys,
    expand_dual,
    resolve_manifold,
    uses_msign_choice,
)
from weightgeom.optim.muon_checks import MUON_DEFAULTS as _D
from weightgeom.optim.muon_checks import validate_values as _validate_values
from weightgeom.optim.muon_core import Orthogonaliser, muon_update
from weightgeom.optim.muon_layout import dual_dtype, dual_shape, param_name, step_counter
from weightgeom.optim.sharded import holds_dtensors, is_dtensor, step_on_owners

__all__ = ["Muon", "ALGORITHMS", "ON_NONFINITE", "FarRetractionWarning"]

# ``on_nonfinite``: what a step does when a gradient holds NaN/Inf (see the class docstring).
ON_NONFINITE = ("raise", "skip")


class Muon(StepChecks, torch.optim.Optimizer):
    """Muon / manifold Muon / AdamW in one optimizer; every keyword but ``on_nonfinite`` is also a per-group key.

    torch.optim.Muon's keywords (``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``ns_coefficients``, ``eps``,
    ``ns_steps``, ``adjust_lr_fn``) are spelled and mean as there; every default is ``muon_checks.MUON_DEFAULTS``.

    Args:
        params: parameters or groups (dicts). A group may carry ``"names": [...]`` (one per param, as
            ``param_groups`` produces) so errors and ``last_stats`` name parameters; torch-style named
            parameters (``model.named_parameters()``) also work.
        lr: step size. Muon: spectral-norm units per step (‖ΔW‖₂ = lr·s, s the shape scale); AdamW: parameter
            units per step.
        momentum: β of the momentum buffer, in [0, 1).
        nesterov: use the Nesterov look-ahead U = (1−β)G + βM (EMA) / G + βM (sum).
        weight_decay: decoupled decay coefficient; W ← W(1 − lr·wd) before the step.
        ns_steps: msign polynomial steps (None: the preset's default, except with Polar Express below float64: the
            per-device choice's step count, see msign_dtype — for plain Muon and manifold groups alike; 5, torch's,
            with ``ns_coefficients``).
        ns_coefficients: None (the ``msign_method`` preset) or (a, b, c), as torch.optim.Muon takes it: plain-Muon
            groups then orthogonalise by ``ns_steps`` steps of that one quintic in torch's arithmetic
            (``functional.newton_schulz``: bf16 unless ``msign_dtype`` says otherwise, normalised by
            max(‖U‖_F, eps)), and ``msign_method`` is not used. Refused for manifold groups (a fixed quintic does not
            converge to singular values of 1). torch.optim.Muon's default: (3.4445, -4.775, 2.0315).
        eps: torch.optim.Muon's ε: the Frobenius norm ``ns_coefficients``' iteration divides by is at least eps.
            The preset msigns need none (their power-of-two prescale keeps a zero matrix at zero). The AdamW groups'
            ε is ``adamw_eps``; an AdamW group's ``eps`` key and an older checkpoint's ``eps`` (the AdamW ε there)
            load as ``adamw_eps`` with a DeprecationWarning (``optim.state_compat`` says how they are told apart).
        msign_method: ``"polar_express"`` (default, accurate), ``"muon"`` (Keller Jordan's quintic, what
            torch.optim.Muon uses; refused for manifold groups, whose step must stay in the unit spectral ball),
            ``"polar_express_paper"`` (Polar Express in the published bf16 arithmetic and evaluation order, as the
            manifold-assignment paper's code runs it) or ``"svd"`` (exact, slow).
        msign_dtype: msign compute dtype; an explicit dtype always wins (with the preset's steps unless ``ns_steps``
            is set). None (Polar Express): the per-device choice of ``weightgeom.linalg.msign_choice``, made when the
            group is added — bf16 only where it is faster than fp32, with the fewest steps (when ``ns_steps`` is None
            too) at least as orthogonal as torch.optim.Muon's; in ``msign_auto`` and ``summary()``;
            ``WEIGHTGEOM_MSIGN=float32`` (or ``bfloat16[:steps]``) forces it. fp64 params keep fp64. Manifold groups
            take the choice for the dual msign with ``dual.project`` (the default; the rest of the step stays
            float32), float32 without it (docs/muon.md, "The direction's dtype and step count").
        adjust_lr_fn: shape scale s: ``"original"`` sqrt(max(1, rows/cols)), ``"match_rms_adamw"``
            0.2·sqrt(max(rows, cols)), ``"none"`` 1. None: ``"original"`` without a manifold, ``"none"`` with one
            (the manifold-assignment paper steps W − lr·A with ‖A‖₂ = 1).
        momentum_form: ``"ema"`` (M ← βM + (1−β)G, torch.optim.Muon) or ``"sum"`` (M ← βM + G,
            the manifold-assignment paper's code).
        algorithm: ``"muon"`` or ``"adamw"``.
        manifold: None (plain Muon) or a registry name (``"stiefel"``, ``"dgram"``, ``"oblique"``, ...).
            Constrained matrices are retracted onto the manifold at their first step, then after every step; a
            pretrained-looking matrix far from it is refused at the default ``init="auto"`` (see ``init``).
        dual: manifold Muon's dual-ascent settings (ignored without a manifold): a ``DualAscent`` value
            (``weightgeom.optim.DualAscent``: steps, lr, tol, schedule, ns_steps, project, normalize, warm_start,
            keep), a preset name — ``"default"`` (one warm-started dual step projected onto the tangent space:
            tangent residual ~1e-8 at 2.0× (Stiefel) / 2.2× (DGram) our plain Muon step on 768×768, 2-core AVX2
            CPU, ``weightgeom bench optimizer_step --quick``) or ``"published"`` (the manifold-assignment paper's 20
            cold-started steps, last iterate) — or, in a param group, a dict of fields over the optimizer's value.
            A group holds it as the keys ``dual_steps``, ``dual_lr``, … (``DualAscent.group_keys``; what
            ``state_dict()`` saves). Written by hand, those keys (keywords, group keys) are the older spelling: they
            still work, with one DeprecationWarning naming ``dual=``.
        retraction: passed to the manifold's constructor when not None. ``"paper"`` is accepted by every manifold
            and selects the manifold-assignment paper's published retraction (Stiefel: msign(W) with this group's
            msign settings; DGram: (U Vᵀ)·diag(σ sorted); Oblique: columns / max(‖w_j‖, 1e-8)).
        betas: AdamW (β1, β2).
        adamw_eps: AdamW denominator epsilon (``algorithm="adamw"`` groups).
        adamw_lr: lr given to ``algorithm="adamw"`` groups that set no ``"lr"`` themselves (None: ``lr``).
        layout: how 2-D weights are stored: ``"out_in"`` (nn.Linear) or ``"in_out"`` (HF GPT-2 ``Conv1D``); the
            shape scale and ``split`` use the (out, in) view.
        split: None, or k: the weight is k equal matrices stacked along the output dimension (fused QKV, k = 3);
            each block gets its own msign / manifold direction, multiplier, retraction and shape scale.
        init: what happens to a manifold-constrained matrix's given value (ignored without a manifold).
            ``"auto"`` (default): a matrix that looks like a fresh random initialisation (``looks_fresh``: stable
            rank near an i.i.d. matrix's) is retracted as with ``"retract"``, silently; one that does not (pretrained
            weights) and that the first retraction would move by more than ``FAR_RETRACTION`` (0.1) of its norm
            (‖R(W) − W‖_F/‖W‖_F) is refused when the optimizer is built (``add_param_group``), with one line naming
            the matrix and the two choices: ``"retract"`` or ``"keep"`` (a meta-device parameter — deferred
            initialisation — and one whose values changed since are checked at their first step instead, before
            anything changed). ``"retract"``: retracted onto the manifold at its
            first step and after every step, whatever it holds; a pretrained-looking matrix moved that far gets one
            warning per optimizer (``FarRetractionWarning``). ``"keep"`` (fine-tuning pretrained weights): the
            matrix is never retracted; the same dual ascent at the current W then holds P(WᵀW) at its pretrained
            value to first order only (docs/manifolds.md, "What init="keep" trains on"), and ``dual.project=True``
            uses the manifold's closed-form projection, exact only on the manifold.
        on_nonfinite: what ``step`` does when a gradient holds NaN/Inf (optimizer-wide, not a group key).
            ``"raise"`` (default): raise ``NonFiniteGradientError`` naming the parameter, nothing changed.
            ``"skip"``: the check's 0/1 result stays on the device, and the whole step becomes a no-op when it
            fails — parameters, momentum buffers, AdamW moments and step counters bitwise unchanged
            (``torch.where``, so NaN never leaks) — counted in ``skipped_steps``. What each costs in host
            synchronisation: ``step``.

    Attributes:
        msign_auto: {device: the per-device msign choice (``MsignChoice.as_dict()``: dtype, steps, source, measured
            step seconds and probe errors)} for every device a plain-Muon group uses it on, filled when the group is
            added; empty when every group sets ``msign_dtype`` and ``ns_steps``.
        numerics: {device: ``weightgeom.linalg.numerics.Numerics``}: the arithmetic on each device of a Muon group
            (msign dtype and steps where a group leaves them to the device, constraint products, C kernels, CUDA
            graphs, each with where it came from: the autotuner's cache or benchmark, a ``WEIGHTGEOM_*`` override, a
            default), resolved once when the groups are added (``resolve_numerics``) and passed to the maths from
            there; shown by ``describe(opt)`` and ``summary()``, saved as plain values in ``state_dict()["numerics"]``
            and in a run's ``meta.json``.
        skipped_steps: 0-dim int64 tensor on the parameters' device: the steps ``on_nonfinite="skip"`` skipped.
            Reading it (``int(opt.skipped_steps)``) is a host sync on a GPU: do it when you need the number. Not
            part of ``state_dict()``.
        host_free: manifold groups' host-free step (``manifold_step``): None (default) inside a torch.compile trace
            only, True also eagerly (the path a compiled step runs, e.g. to count its operations), False never.
        last_stats: after each ``step``, {param name: {"tangent_residual": float, "dual_iters": int,
            "dual_residual": float}} for every manifold-constrained parameter that had a gradient (tangent_residual
            is that of the direction actually used; dual_residual the dual ascent's before any projection; 0-dim
            device tensors on the host-free path).

    Raises:
        ValueError: (when built or a group is added) unknown group key or value, a non-2-D parameter in a Muon
            group, a parameter whose dtype is not float16, bfloat16, float32 or float64, or one listed twice (naming
            it). What a step refuses: ``step``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = _D["lr"],
        momentum: float = _D["momentum"],
        nesterov: bool = _D["nesterov"],
        weight_decay: float = _D["weight_decay"],
        ns_steps: int | None = _D["ns_steps"],
        ns_coefficients: tuple[float, float, float] | None = _D["ns_coefficients"],
        eps: float = _D["eps"],
        msign_method: str = _D["msign_method"],
        msign_dtype: torch.dtype | None = _D["msign_dtype"],
        adjust_lr_fn: str | None = _D["adjust_lr_fn"],
        momentum_form: str = _D["momentum_form"],
        algorithm: str = _D["algorithm"],
        manifold: str | None = _D["manifold"],
        dual: DualAscent | str | Mapping[str, Any] | None = _D["dual"],
        retraction: str | None = _D["retraction"],
        betas: tuple[float, float] = _D["betas"],
        adamw_eps: float = _D["adamw_eps"],
        adamw_lr: float | None = _D["adamw_lr"],
        layout: str = _D["layout"],
        split: int | None = _D["split"],
        init: str = _D["init"],
        on_nonfinite: str = _D["on_nonfinite"],
        **deprecated: Any,
    ) -> None:
        if algorithm == "adamw" and eps != state_compat.TORCH_MUON["eps"] and adamw_eps == state_compat.ADAMW_EPS:
            warnings.warn(f"Muon(algorithm='adamw', eps={eps!r}): 'eps' is the old spelling of the AdamW ε; taken as "
                          "adamw_eps (write adamw_eps=)", DeprecationWarning, stacklevel=2)
            adamw_eps, eps = eps, state_compat.TORCH_MUON["eps"]
        legacy = take_legacy(deprecated, where="Muon()")
        if deprecated:
            raise TypeError(f"Muon() got an unexpected keyword argument {next(iter(deprecated))!r}")
        dual = resolve_dual(dual)
        if legacy:
            warnings.warn(legacy_message("Muon()", {f"dual_{k}": v for k, v in legacy.items()}), DeprecationWarning,
                          stacklevel=2)
            dual = dual.replace(**legacy)
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, ns_steps=ns_steps,
            ns_coefficients=None if ns_coefficients is None else tuple(ns_coefficients), eps=eps,
            msign_method=msign_method, msign_dtype=msign_dtype, adjust_lr_fn=adjust_lr_fn,
            momentum_form=momentum_form, algorithm=algorithm, manifold=manifold, **dual.group_keys(),
            retraction=retraction,
            betas=tuple(betas), adamw_eps=adamw_eps, adamw_lr=adamw_lr, layout=layout, split=split, init=init,
        )
        self._manifolds: dict[tuple[Any, Any], Any] = {}
        self.last_stats: dict[str, dict[str, float]] = {}
        self.msign_auto: dict[str, dict[str, Any]] = {}
        self._far_retractions: dict[str, tuple[float, str]] = {}  # name -> (distance, manifold) since last warning
        # init="auto" matrices checked when their group was added: id -> (data_ptr, version) then; the first step checks
        # only those that were not (meta-device parameters, deferred) or that changed since
        self._init_checked: dict[int, tuple[int, int]] = {}
        self._warned_far_retraction = False
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"Muon(): on_nonfinite={on_nonfinite!r} is invalid: choose one of {list(ON_NONFINITE)}")
        self.on_nonfinite = on_nonfinite
        self.numerics: dict[str, Numerics] = {}
        self.host_free: bool | None = None
        _validate_values(defaults, where="Muon()")
        super().__init__(params, defaults)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        self._skipped = torch.zeros((), dtype=torch.int64, device=first.device if first is not None else "cpu")

    @classmethod
    def torch_defaults(cls, params: Iterable[Any], **overrides: Any) -> Muon:
        """A Muon with torch.optim.Muon's defaults and arithmetic (``state_compat.TORCH_MUON``): lr 1e-3, weight
        decay 0.1, momentum 0.95 (EMA, Nesterov), Keller Jordan's quintic (3.4445, -4.775, 2.0315) for 5 steps in
        bf16 with ε 1e-7, the "original" shape scale. Its steps equal torch.optim.Muon's to rounding (bitwise in the
        tests); its state dicts load into torch.optim.Muon and back. ``overrides``: any other Muon keyword (e.g.
        ``lr``)."""
        return cls(params, **{**state_compat.TORCH_MUON, **overrides})

    @property
    def skipped_steps(self) -> torch.Tensor:
        """Steps skipped for a NaN/Inf gradient (``on_nonfinite="skip"``): a 0-dim int64 tensor on the device (read
        it with ``int()`` only when needed — that is a host sync on a GPU)."""
        return self._skipped

    _OWN_ATTRS = ("on_nonfinite", "host_free", "_skipped", "numerics", "msign_auto", "_manifolds",
                  "last_stats", "_far_retractions", "_warned_far_retraction")

    def __getstate__(self) -> dict[str, Any]:
        """torch's state (defaults, state, param_groups) plus Muon's own attributes, so ``copy.deepcopy`` and pickling
        keep ``on_nonfinite`` and the rest."""
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in self._OWN_ATTRS if k in self.__dict__}}

    # ---- groups ----------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate the group's keys, values and parameters (dtype, each listed once), then add it (see
        torch.optim.Optimizer.add_param_group); a refused group is not added."""
        if not isinstance(param_group, dict):
            raise TypeError(f"Muon: a param group must be a dict, got {type(param_group).__name__}")
        state_compat.rename_old_adamw_eps(param_group, param_group.get("algorithm", self.defaults["algorithm"]),
                                          self.defaults)
        if isinstance(param_group.get("ns_coefficients"), list):
            param_group["ns_coefficients"] = tuple(param_group["ns_coefficients"])
        expand_dual(param_group, len(self.param_groups), self.defaults)
        check_group_keys(param_group, self.defaults)
        check_new_group("Muon", self.param_groups, param_group)
        algorithm = param_group.get("algorithm", self.defaults["algorithm"])
        if algorithm == "adamw" and "lr" not in param_group and self.defaults["adamw_lr"] is not None:
            param_group["lr"] = self.defaults["adamw_lr"]
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1], len(self.param_groups) - 1)
        except BaseException:
            self.param_groups.pop()  # refused: the optimizer stays as it was
            raise

    def _check_group(self, group: dict[str, Any], gi: int) -> None:
        """Validate a group torch has just added (names, values, shapes) and resolve its per-device choices."""
        names = group.get("names")
        if names is not None:
            names = list(names)
            if len(names) != len(group["params"]):
                raise ValueError(f"Muon: group {gi} has {len(group['params'])} params but {len(names)} names")
            group["names"] = names
        _validate_values(group, where=f"Muon group {gi}")
        for i, p in enumerate(group["params"]):
            self._check_matrix(group, gi, i, p)
        self._resolve_choices(group)
        if group["algorithm"] == "muon" and group["manifold"] is not None and group["init"] == "auto":
            for i, p in enumerate(group["params"]):  # pretrained weights refused now, not after a forward/backward
                if p.device.type != "meta" and not is_dtensor(p) and "momentum_buffer" not in self.state.get(p, {}):
                    self._refuse_pretrained(gi, group, i, p, "the optimizer was not built")
                    self._init_checked[id(p)] = (p.data_ptr(), p._version)

    def _resolve_choices(self, group: dict[str, Any]) -> None:
        """Resolve a group's manifold and its devices' numerics (``resolve_numerics``: msign, constraint products,
        kernels) now, so a step never measures or reads the environment and an unknown manifold fails here."""
        if group["manifold"] is not None:
            self._manifold(group)  # resolve now so an unknown name fails at construction
            for p in group["params"]:
                if p.ndim == 2:  # the norm estimate's start vector, made here: a compiled step cannot run a Generator
                    lanczos_start(dual_shape(group, p)[-1], dual_dtype(p), p.device)
        if group["algorithm"] == "muon":
            for p in group["params"]:  # the constraint products' choice may measure, or reject the env var
                self._numerics_for(p.device, products=group["manifold"] is not None and p.dtype != torch.float64)
        if uses_msign_choice(group):
            for p in group["params"]:
                if p.dtype != torch.float64:
                    self._msign_choice_for(p.device)

    def _numerics_for(self, device: torch.device, products: bool = False) -> Numerics:
        """``opt.numerics[str(device)]``, resolved at its first use (``products``: with the constraint products, which
        a CPU may time once per process)."""
        memo = self.__dict__.setdefault("numerics", {})
        key = str(device)
        if key not in memo or (products and memo[key].products_source == NOT_RESOLVED):
            memo[key] = resolve_numerics(device, constraint_products=products)
        return memo[key]

    def _msign_choice_for(self, device: torch.device) -> tuple[torch.dtype, int]:
        """(dtype, steps) of the per-device msign choice on ``device`` (``opt.numerics``; also recorded in
        ``msign_auto``)."""
        n = self._numerics_for(device)
        self.msign_auto.setdefault(str(device), msign_choice(device).as_dict())
        return n.msign_dtype, n.msign_steps

    def _products_for(self, X: torch.Tensor) -> str:
        """How a manifold step on X (its float32 working copy) runs its constraint products (one of
        ``autotune.PRODUCTS``: IEEE through torch's BLAS or oneDNN, or split-bf16): a CPU float32 X takes its
        device's ``opt.numerics`` kind, resolved when the group was added, so a step never measures or reads the
        environment; anything else ``"ieee"``."""
        if X.dtype != torch.float32 or X.device.type != "cpu":
            return "ieee"
        return self._numerics_for(X.device, products=True).products

    _name = staticmethod(param_name)

    def _manifold(self, group: dict[str, Any]) -> manifolds.Manifold:
        """The group's manifold object (``muon_checks.resolve_manifold``, built once per name and retraction)."""
        return resolve_manifold(group, self._manifolds)

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def check_state_dict(self, state_dict: Any) -> list[dict[str, Any]]:
        """Validate a state dict for this optimizer without loading anything (``load_state_dict`` runs it first): a
        Muon state dict (also an older one) or torch.optim.Muon's, checked by ``state_compat.check_state_dict``.

        Returns:
            The param groups to load: each saved group over this optimizer's (its ``names`` kept).

        Raises:
            ValueError: one line naming the group, key or parameter that does not fit, and what to do.
        """
        return state_compat.check_state_dict(self.param_groups, self.defaults, state_dict)

    def adopt_manifolds(self, state_dict: Any) -> dict[int, Any]:
        """Put each group that is on a manifold onto the manifold its saved group names, where that is another one —
        for a run's own checkpoint whose groups moved between manifolds while it trained (``AutoAssign`` moves
        attention groups from DGram to Stiefel). The dual state of every manifold has the same shape, so
        ``load_state_dict`` then checks the state against the manifold it was made on. A group without a manifold,
        or a saved group without one, is left as it is (``load_state_dict`` refuses that change).

        Args:
            state_dict: a ``state_dict()`` of a Muon over the same groups; anything else changes nothing.

        Returns:
            group index → the manifold it had, for each group changed (give it to ``restore_manifolds`` to undo).
        """
        return state_compat.adopt_manifolds(self.param_groups, state_dict, self._resolve_choices)

    def restore_manifolds(self, before: dict[int, Any]) -> None:
        """Undo ``adopt_manifolds`` (its return value)."""
        state_compat.restore_manifolds(self.param_groups, before)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of a Muon with the same groups — all of it, after ``check_state_dict`` accepted
        all of it, or nothing.

        Hyperparameters (lr, momentum, ...) come from the state dict, as in torch; keys it lacks (an older version's)
        keep this optimizer's values.

        Raises:
            ValueError: the state dict does not fit this optimizer (``check_state_dict``), naming what; the optimizer
                is left exactly as it was.
        """
        groups = self.check_state_dict(state_dict)
        super().load_state_dict({"state": state_dict["state"], "param_groups": groups})
        state_compat.restore_dual_dtype(self.state, self.param_groups, state_dict)
        for group in self.param_groups:
            self._resolve_choices(group)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict (``state``, ``param_groups``) plus ``"numerics"``: {device: ``Numerics.as_dict()``}, the
        arithmetic the state was made with, as plain strings and numbers (``load_state_dict`` does not need it: a
        state dict without it, an older one or torch.optim.Muon's, loads the same)."""
        sd = super().state_dict()
        sd["numerics"] = {dev: n.as_dict() for dev, n in self.__dict__.get("numerics", {}).items()}
        return sd

    # ---- the step --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One optimisation step over all groups; returns the closure's loss when one is given.

        All or nothing: every gradient of every group is checked before any parameter or state changes
        (``on_nonfinite``: raise, or skip the whole step on the device).

        Host synchronisation (docs/muon.md §6): the finite check is one fused reduction; with ``"raise"`` it costs one
        sync per device. With ``"skip"``, plain-Muon and AdamW groups step without any (step counters and AdamW bias
        corrections kept as device tensors), so a GPU step is queued without waiting and ``torch.compile(opt.step,
        fullgraph=True)`` traces it whole. Manifold groups read host numbers eagerly (the first retraction's
        distance, the dual ascent's early stop, ``last_stats``; with ``"skip"`` the flag, once) and none on the
        host-free path (``host_free``).

        DTensor parameters (FSDP2 ``fully_shard``; every rank calls ``step``): each Muon matrix is gathered whole onto
        one owner rank, stepped there by this same code and scattered back; AdamW groups are stepped on each rank's
        local shard; a NaN/Inf gradient shard on any rank makes every rank raise before anything changes
        (``weightgeom.optim.sharded.step_on_owners``; ``state_dict()`` is then per rank).

        Raises:
            NonFiniteGradientError: (a ValueError; ``on_nonfinite="raise"``) a gradient holds NaN/Inf, naming the
                parameter; nothing changed.
            ValueError: a sparse gradient, or a gradient or state that no longer fits its parameter (changed after a
                step: ``p.data = ...``, ``model.half()``), naming the parameter; nothing changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        undo = state_compat.dcp_init_step(self.param_groups, self.state)  # DCP's zero step: parameters kept
        if holds_dtensors(self.param_groups):  # FSDP2: Muon matrices whole on owner ranks, AdamW on local shards
            try:  # a NaN/Inf shard on any rank raises on every rank before anything changed
                step_on_owners(self, self._update, whole=lambda g, p: g["algorithm"] == "muon",
                               name=lambda gi, g, i: self._name(g, i, gi), who="Muon", merge_stats=[self])
            except NonFiniteGradientError:
                if self.on_nonfinite == "raise":
                    raise
                self._skipped += 1
        else:
            self._update()
        if undo is not None:
            undo()
        return loss

    def check_step(self) -> None:
        """Raise what ``step`` would refuse other than a NaN/Inf gradient — a sparse gradient, a parameter of an
        unsupported dtype, a gradient or state that no longer fits its parameter, a manifold-constrained matrix
        holding NaN/Inf — changing nothing. A wrapper that changes its own state before calling ``step``
        (``MagnitudeDirection``, which checks the gradients itself) calls it first, so that the whole step stays all
        or nothing.

        Raises:
            ValueError: naming the parameter.
        """
        self._check_manifold_weights(self._with_grads())

    def _update(self) -> None:
        """The step body on plain tensors (a single process, or this rank's matrices under ``step_on_owners``)."""
        work = self._with_grads()
        ok = None  # "skip": 0-dim bool device tensor, True when every gradient is finite
        # "raise" inside a torch.compile trace: no host read mid-step (a graph break there made the resumed frame guard
        # on the gradients, which zero_grad frees: one recompile per step, up to dynamo's limit). The trace steps with
        # every write masked by the device-side check, and ``_refuse_masked`` raises after it, nothing changed.
        deferred = self.on_nonfinite == "raise" and torch.compiler.is_compiling() and (
            self._host_free() or not self._manifold_items(work))
        if self.on_nonfinite == "raise" and not deferred:
            self._check_finite(work)
        elif deferred:
            grads = [p.grad for _, _, items in work for _, p in items]
            weights = [p.detach() for *_, p in self._manifold_items(work)]
            ok = all_finite(grads + weights, device=grads[0].device if grads else None)
        else:
            grads = [p.grad for _, _, items in work for _, p in items]
            device = grads[0].device if grads else self._skipped.device
            if self._skipped.device != device:
                self._skipped = self._skipped.to(device)
            ok = all_finite(grads, device=device)
            weights = self._manifold_items(work)
            if weights and self._host_free():  # NaN/Inf manifold weights cannot be named without a read: skipped
                ok = ok & all_finite([p.detach() for *_, p in weights], device=device)
            elif weights:  # manifold groups read their dual ascent on the host anyway: one sync here, for both checks
                grads_ok, weights_ok = torch.stack([ok, all_finite([p.detach() for *_, p in weights],
                                                                   device=device)]).tolist()
                if not weights_ok:
                    self._check_manifold_weights(work)  # finds and names the matrix; raises
                if not grads_ok:
                    self._skipped += 1
                    return
                ok = None
            if ok is not None:
                self._skipped.add_(~ok)
        if torch.compiler.is_compiling():  # torch 2.11's dynamo cannot rebind an optimizer's attribute in a step
            self.last_stats.clear()
        else:  # a fresh dict per step: callers may keep the previous step's (benchmarks, monitors)
            self.last_stats = {}
        for gi, group, items in work:
            if group["algorithm"] == "adamw":
                for _, p in items:
                    self._adamw_step(group, p, ok)
            elif group["manifold"] is None:
                self._muon_group_batched(group, [p for _, p in items], ok)
            else:  # host-free (``manifold_step``; ``ok`` masks every write) where the manifold, as configured, has a
                # host-free retraction; inside a trace full precision is set around it (``compile_step``)
                entries = [(self._name(group, i, gi), p) for i, p in items]
                if self._host_free() and manifold_step.host_free_supported(self._manifold(group)):
                    manifold_step.group_step(self, group, entries, ok, host_free=True)
                else:
                    self._manifold_group(group, entries, ok)
        self._warn_far_retraction()
        if deferred:  # last: the graph break it makes resumes into nothing, so it guards on nothing
            self._refuse_masked(work, ok)

    def _host_free(self) -> bool:
        """Whether manifold groups take the host-free step (``host_free``; by default inside a torch.compile trace)."""
        return bool(self.host_free) or (self.host_free is None and torch.compiler.is_compiling())

    def _with_grads(self) -> list[tuple[int, dict[str, Any], list[tuple[int, torch.Tensor]]]]:
        """(group index, group, [(param index, param)]) for every group with at least one gradient, each checked
        (``_check_step_group``) before anything changes."""
        work = []
        for gi, group in enumerate(self.param_groups):
            items = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            if items:
                self._check_step_group(gi, group, items)
                work.append((gi, group, items))
        if self._host_free():  # a manifold class without a host-free retraction: refused before any group steps
            self.check_host_free([group for _, group, _ in work])
        for gi, group, items in work:  # init="auto": a matrix's first step only (no host read on later steps)
            if group["algorithm"] == "muon" and group["manifold"] is not None and group["init"] == "auto":
                for i, p in items:
                    if "momentum_buffer" not in self.state.get(p, {}) and not is_dtensor(p) \
                            and not torch.compiler.is_compiling() and not self._checked_at_build(p):
                        # a trace cannot read W: ``compile_step`` steps a first step eagerly, so this check runs
                        self._refuse_pretrained(gi, group, i, p, "step refused")
        return work

    def one_graph(self) -> bool:
        """Whether ``torch.compile(opt.step)`` traces one graph: ``on_nonfinite="skip"`` (with ``"raise"`` the check
        is a host read) and every manifold group's manifold has a host-free retraction (else that group steps
        eagerly, a graph break; ``manifold_step.host_free_supported``)."""
        return self.on_nonfinite == "skip" and all(
            group["algorithm"] != "muon" or group["manifold"] is None
            or manifold_step.host_free_supported(self._manifold(group)) for group in self.param_groups)

    def check_host_free(self, groups: Iterable[dict[str, Any]] | None = None) -> None:
        """Raise, changing nothing, the TypeError a host-free or compiled step raises for a manifold group whose
        manifold class does not implement ``retract_host_free`` (``manifold_step.host_free_supported``), over
        ``groups`` (None: all). ``compile_step`` calls it when it is built; a host-free step, for its groups with
        gradients before any of them steps."""
        for group in self.param_groups if groups is None else groups:
            if group["algorithm"] == "muon" and group["manifold"] is not None:
                manifold_step.host_free_supported(self._manifold(group))

    def _msign_settings(self, group: dict[str, Any], U: torch.Tensor) -> tuple[int | None, torch.dtype | None]:
        """(steps, dtype) of a plain-Muon msign: the group's ``ns_steps``/``msign_dtype`` where set; where unset (and
        the method is Polar Express, the input not float64) the per-device choice of ``msign_choice`` (recorded in
        ``msign_auto``). An explicit ``msign_dtype`` keeps the preset's step count unless ``ns_steps`` is set."""
        steps, dtype = group["ns_steps"], group["msign_dtype"]
        if not uses_msign_choice(group) or U.dtype == torch.float64:
            return steps, dtype
        n = self.__dict__.get("numerics", {}).get(str(U.device))  # resolved when the group was added
        choice_dtype, choice_steps = (n.msign_dtype, n.msign_steps) if n is not None else \
            self._msign_choice_for(U.device)  # a parameter moved since: looked up here
        if dtype is None:
            dtype = choice_dtype
            steps = choice_steps if steps is None else steps
        return steps, dtype

    def _orthogonaliser(self, group: dict[str, Any], U: torch.Tensor) -> Orthogonaliser:
        """A plain-Muon group's direction numerics for matrices like U: torch.optim.Muon's Newton–Schulz where the
        group sets ``ns_coefficients``, else msign with the group's (or the per-device) settings."""
        if group["ns_coefficients"] is not None:
            return Orthogonaliser(coefficients=tuple(group["ns_coefficients"]), eps=group["eps"],
                                  steps=group["ns_steps"] or state_compat.TORCH_MUON["ns_steps"],
                                  dtype=group["msign_dtype"] or torch.bfloat16)
        steps, dtype = self._msign_settings(group, U)
        n = self.__dict__.get("numerics", {}).get(str(U.device))
        return Orthogonaliser(group["msign_method"], steps, dtype,
                              cuda_graphs_max_mb=None if n is None else n.graphs_max_mb)

    def summary(self) -> str:
        """One line per parameter group (algorithm, size, manifold, msign settings) plus, per device, the msign choice
        (``msign_auto``) and the numerics (``opt.numerics``), resolved when the groups were added."""
        return muon_summary.summary(self.param_groups, self.__dict__.get("numerics", {}), self.msign_auto)

    def _adamw_step(self, group: dict[str, Any], p: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step = step_counter(state, p)
        step.add_(1 if ok is None else ok)
        adamw_update(
            p, p.grad, state["exp_avg"], state["exp_avg_sq"], step, float(group["lr"]),
            group["betas"], group["adamw_eps"], group["weight_decay"], ok=ok,
        )

    def _muon_group_batched(self, group: dict[str, Any], params: list[torch.Tensor],
                            ok: torch.Tensor | None = None) -> None:
        """Plain-Muon step of one group: parameters of the same shape, dtype and device are stacked (B, *shape), stepped
        by the one batched core ``muon_core.muon_update`` (a bucket of one is B = 1) and written back with one
        ``_foreach_copy_`` into the parameters and one into the momentum buffers: a constant number of operations
        per bucket, no host read, the same function eagerly and under torch.compile."""
        buckets: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for p in params:
            buckets.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
        for ps in buckets.values():
            bufs = self._momentum_buffers(ps)
            new, new_m = muon_update(
                torch.stack([p.detach() for p in ps]), torch.stack([p.grad for p in ps]), torch.stack(bufs),
                lr=float(group["lr"]), momentum=group["momentum"], nesterov=group["nesterov"],
                momentum_form=group["momentum_form"], weight_decay=group["weight_decay"],
                adjust_lr_fn=group["adjust_lr_fn"], layout=group["layout"], split=group["split"],
                orthogonalise=self._orthogonaliser(group, ps[0]), ok=ok)
            torch._foreach_copy_(bufs, list(new_m.unbind(0)))
            torch._foreach_copy_(ps, list(new.unbind(0)))
            self._count_steps(ps, ok)

    def _momentum_buffers(self, ps: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters' momentum buffers, created as zeros at a first step."""
        for p in ps:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return [self.state[p]["momentum_buffer"] for p in ps]

    def _count_steps(self, ps: list[torch.Tensor], ok: torch.Tensor | None) -> None:
        """Advance the parameters' step counters by one (by ``ok`` under ``on_nonfinite="skip"``), one foreach op."""
        counters = [step_counter(self.state[p], p) for p in ps]
        if ok is None:
            torch._foreach_add_(counters, 1.0)
        else:  # a list of 0-dim tensors: the Tensor-scalar overload reads its scalar on the host
            torch._foreach_add_(counters, [ok.to(torch.float32)] * len(counters))

    def _stacked_momentum(self, group: dict[str, Any], ps: list[torch.Tensor], ok: torch.Tensor | None
                          ) -> torch.Tensor:
        """The bucket's momentum step on the stacked buffers (``functional.momentum_step``), written back with one
        ``_foreach_copy_``; returns the stacked direction U (B, *shape) msign is taken of."""
        bufs = self._momentum_buffers(ps)
        M = torch.stack(bufs)
        new, U = momentum_step(M, torch.stack([p.grad for p in ps]), group["momentum"], group["nesterov"],
                               group["momentum_form"])
        torch._foreach_copy_(bufs, list((new if ok is None else torch.where(ok, new, M)).unbind(0)))
        return U

    def _momentum(self, group: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """Update p's momentum buffer (created at the first step) with its gradient; return the direction input U."""
        return momentum_direction(self._momentum_buffers([p])[0], p.grad, group["momentum"], group["nesterov"],
                                  group["momentum_form"])

    # Never traced by torch.compile: a compiled `opt.step` runs an eager manifold step eagerly (one graph break). Its
    # buckets are lists built during the step, and dynamo guarded a traced bucket on its tensors' shapes, not on which
    # parameter they are: the bucket of one 256×64 matrix replayed for the next one with the first one's optimizer
    # state (its momentum updated twice, the other's never: 6e-3 off the eager step), and C kernels wrote through the
    # stale buffers (heap corruption). The eager step reads its dual ascent on the host anyway, so nothing is lost; a
    # trace takes the host-free step (``group_step(host_free=True)``), whose buckets are keyed by what they hold.
    @torch.compiler.disable
    def _manifold_group(self, group: dict[str, Any], entries: list[tuple[str, torch.Tensor]],
                        ok: torch.Tensor | None = None) -> None:
        """A manifold group's eager step (``manifold_step.group_step``), the constraint arithmetic in IEEE float32
        whatever the process's matmul precision. ``ok``: the skip flag of a host-free step whose manifold has no
        host-free retraction, read here; False steps nothing (the rest of that step is masked by it)."""
        if ok is not None and not bool(ok):
            return
        with full_precision():
            manifold_step.group_step(self, group, entries)
