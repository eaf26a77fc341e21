"""Magnitude–direction decoupling (MD; the MD paper, arXiv:2606.25971): a wrapper that lets any optimizer train
the *direction* of each weight matrix on a sphere while learned row/column gains carry its magnitude.

    W = diag(γ_r) · Ŵ · diag(γ_c),    γ = φ(θ) (φ = softplus by default, θ₀ = φ⁻¹(1)),    Ŵ on a sphere of fixed radius.

The model keeps one fused tensor W and never sees Ŵ or the gains. Each ``MagnitudeDirection.step()``:

1. reads G = ∂L/∂W from the model's ``.grad``;
2. splits it (``split_gradient``): ∂L/∂γ_r = Σ_j (Ŵ⊙G)_ij γ_c,j, ∂L/∂γ_c = Σ_i γ_r,i (Ŵ⊙G)_ij (then × φ'(θ)), and
   the direction gradient Ĝ = γ_r G γ_c (for softplus/exp gains the same numbers come from the cheaper log-gain
   form ``split_gradient_log``: Ĝ first, then row/column sums of Ŵ⊙Ĝ);
3. lets the base optimizer step Ŵ with Ĝ: around ``base.step()`` the parameter's ``.data``/``.grad`` are swapped to
   Ŵ/Ĝ, so the base optimizer's state (momentum, Adam moments) is the state of Ŵ and is keyed by the model's parameter;
4. re-projects Ŵ onto its sphere (``project_to_sphere_``);
5. updates θ by Adam at ``gain_lr`` (``adam_update_``);
6. recomposes W = γ_r Ŵ γ_c into the model's tensor, in place (``compose``).

On the CPU (float32/float64, softplus or exp gains) the passes over each matrix run in C: over torch's Adam/AdamW the
whole step, base included, in two passes (``md_fused``: path "fused"); over any other base (Muon, SGD, ...) steps
1–2 in one pass and 4 + 6 in two (``kernels.md_split``/``md_finish``: path "eager-C") around the unchanged base
step. ``fused=False`` keeps every pass in torch (path "eager").

The maths lives in small pure functions (``md_functional.py``, re-exported here); the class only moves tensors.
``docs/md.md`` has the design notes (why the swap, manifold groups, weight decay, checkpoint format, measured
overhead).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from weightgeom.optim import md_checks, md_core, md_fused, md_setup, md_state, md_torch
from weightgeom.optim.checks import (
    check_new_group,
)
from weightgeom.optim.functional import NonFiniteGradientError
from weightgeom.optim.md_functional import (  # noqa: F401 (re-exported: the public names of this module)
    _ZERO_NORM,
    EMBEDDINGS,
    GAINS,
    PARAMETERIZATIONS,
    SPHERES,
    _check_choice,
    adam_update_,
    adam_update_many_,
    compose,
    gain_chain,
    gain_chain_log,
    gain_init,
    gain_value,
    is_embedding_name,
    normalize_rows_,
    project_to_sphere_,
    sphere_norm,
    split_gradient,
    split_gradient_log,
)
from weightgeom.optim.muon import ON_NONFINITE, Muon
from weightgeom.optim.sharded import holds_dtensors, step_on_owners

__all__ = [
    "MagnitudeDirection",
    "GAINS",
    "PARAMETERIZATIONS",
    "SPHERES",
    "EMBEDDINGS",
    "gain_init",
    "gain_value",
    "gain_chain",
    "split_gradient",
    "split_gradient_log",
    "gain_chain_log",
    "sphere_norm",
    "project_to_sphere_",
    "normalize_rows_",
    "compose",
    "adam_update_",
    "adam_update_many_",
    "is_embedding_name",
]


# ---------------------------------------------------------------------------------------------------------------------
# The wrapper.
# ---------------------------------------------------------------------------------------------------------------------
class MagnitudeDirection(Optimizer):
    """Magnitude–direction decoupling around any base optimizer (the MD paper; docs/md.md).

    Each selected matrix W (m×n, PyTorch (out, in) layout) is trained as W = diag(γ_r) Ŵ diag(γ_c): the base
    optimizer steps the direction Ŵ (kept on a sphere of its initial norm), the gains γ = φ(θ) are trained by a
    separate Adam at ``gain_lr``. The model keeps its one fused tensor; the forward is unchanged at construction.

    ``param_groups`` is the base optimizer's groups followed by one gains group without parameters (keys ``lr`` =
    ``gain_lr``, ``betas``, ``eps``, ``weight_decay`` = 0, ``md_role`` = ``"gains"``): LR schedulers built on the
    wrapper schedule both; the gains θ are not model parameters and are held in ``state``. ``state`` holds the MD
    state (per matrix: ``direction``, ``radius``, ``gain_row``, ``gain_col``; per gain tensor: its Adam moments); the
    base optimizer's own state stays in ``base_optimizer.state``. ``state_dict`` has torch's layout: each decoupled
    matrix's entry holds the base's state and MD's (``md.*`` keys), the gains group comes last (``md_state``), so
    ``torch.distributed.checkpoint``'s optimizer helpers round-trip it. Step hooks, state-dict hooks and ``maximize``
    behave as for torch's optimizers, and parameters on the meta device get their MD state at the first step
    (``md_torch``).

    Weight decay: decoupled (and unit-row) params never get weight decay — the sphere already fixes their norm. Base
    groups with ``weight_decay`` ≠ 0 are edited at construction: if every param of the group is MD-handled its
    ``weight_decay`` is set to 0, otherwise those params move to a new group (same hyperparameters, ``weight_decay``
    = 0). The names affected are in ``weight_decay_overridden``.

    Manifold-Muon groups (group key ``manifold``): a scale-invariant manifold (DGram) is intersected with the sphere
    (Ŵ is projected as usual, which keeps its Gram off-diagonal zero). A norm-fixing manifold (Stiefel, Oblique: ‖Q‖_F =
    sqrt(min(m, n))) is stepped on the scaled point Q = Ŵ/s, s = radius/sqrt(min(m, n)), with gradient s·Ĝ (chain
    rule), so Ŵ = s·Q is on both the manifold (up to s) and the sphere; such groups require ``sphere="frobenius"``.

    Args:
        base_optimizer: any ``torch.optim.Optimizer`` (AdamW, ``weightgeom.optim.Muon`` incl. manifold groups, ...).
        gains: ``"row+col"`` (default), ``"row"``, ``"col"``, ``"scalar"`` or ``"none"`` (pure spherical training).
        parameterization: γ = softplus(θ) (default), exp(θ) or θ (``"direct"``).
        sphere: ``"frobenius"`` (‖Ŵ‖_F = ‖W₀‖_F, default), ``"row"`` (each row keeps its initial norm) or ``"col"``.
        gain_lr: Adam learning rate of θ (dimensionless per step); 0 freezes the gains.
        gain_betas: Adam (β₁, β₂) of θ.
        gain_eps: Adam ε of θ.
        params: which base params to decouple. None: every 2-D param of the base optimizer except embeddings. Else
            an iterable of tensors and/or names (exact or ``fnmatch`` patterns); listed embeddings are decoupled.
        exclude: names or patterns never decoupled by the default rule (e.g. ``("lm_head.*",)``).
        embeddings: ``"exclude"`` (default: embeddings are left to the base optimizer), ``"unit_rows"`` (each row is
            projected to L2 norm ``embedding_radius`` after every step, and once at construction — this changes the
            forward) or ``"decouple"`` (treat embeddings like any matrix).
        model: the ``nn.Module`` the params belong to; used for names (errors name parameters) and to recognise
            ``nn.Embedding`` weights. Without it, names come from group ``"names"``/``"param_names"`` keys, and
            embeddings are recognised by name only.
        embedding_radius: row norm of unit-row embeddings.
        fused: the fused CPU path over ``torch.optim.Adam``/``AdamW`` (``md_fused``: the same maths in two C passes
            per matrix instead of the base step plus nine eager passes). None (default): used for every matrix it
            covers, eager elsewhere (``summary()`` says which and why). True: required — raises where it cannot run.
            False: always eager.
        on_nonfinite: what ``step`` does when a gradient holds NaN/Inf. ``"raise"`` (default):
            ``NonFiniteGradientError`` naming the parameter, nothing changed. ``"skip"``: the whole step is a no-op
            (parameters, directions, gains, every state tensor, the base's included, bitwise unchanged), counted in
            ``skipped_steps``; eagerly the check is one host read, on the host-free path (``host_free``; inside
            ``torch.compile``) a 0-dim device flag masking every write (``md_core``), so that a step over
            torch's Adam/AdamW or a Muon with ``on_nonfinite="skip"`` reads nothing on the host and traces as one
            graph (``compile_step``).

    Attributes:
        host_free: None (default): the host-free step (``md_core``: same-shape matrices batched, every host
            decision a device mask) inside a ``torch.compile`` trace only; True: also eagerly; False: never.
        skipped_steps: 0-dim int64 tensor: the steps ``on_nonfinite="skip"`` skipped.

    Raises:
        ValueError: unknown option value; a base-optimizer param whose dtype is not float16, bfloat16, float32 or
            float64, or that is listed twice; a param marked for decoupling that is not 2-D, not in the base
            optimizer, has zero norm (or a zero row/column on a row/col sphere) or non-finite entries — the message
            names it.
            ``step`` is all or nothing: what it refuses (a NaN/Inf gradient as ``NonFiniteGradientError``, see
            ``step``) is refused before any parameter or state changes.
        TypeError: base_optimizer is not a torch optimizer, or is itself a MagnitudeDirection.
    """

    def __init__(
        self,
        base_optimizer: Optimizer,
        gains: str = "row+col",
        parameterization: str = "softplus",
        sphere: str = "frobenius",
        gain_lr: float = 1e-3,
        gain_betas: tuple[float, float] = (0.9, 0.95),
        gain_eps: float = 1e-8,
        params: Iterable[torch.Tensor | str] | None = None,
        exclude: Iterable[str] = (),
        embeddings: str = "exclude",
        model: torch.nn.Module | None = None,
        embedding_radius: float = 1.0,
        fused: bool | None = None,
        on_nonfinite: str = "raise",
    ) -> None:
        if isinstance(base_optimizer, MagnitudeDirection):
            raise TypeError("MagnitudeDirection: the base optimizer is already a MagnitudeDirection")
        if not isinstance(base_optimizer, Optimizer):
            raise TypeError(f"MagnitudeDirection: base_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(base_optimizer).__name__}")
        _check_choice("gains", gains, GAINS)
        _check_choice("parameterization", parameterization, PARAMETERIZATIONS)
        _check_choice("sphere", sphere, SPHERES)
        _check_choice("embeddings", embeddings, EMBEDDINGS)
        if not gain_lr >= 0:
            raise ValueError(f"MagnitudeDirection: gain_lr must be ≥ 0, got {gain_lr}")
        b1, b2 = gain_betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"MagnitudeDirection: gain_betas must lie in [0, 1), got {gain_betas}")
        if not gain_eps > 0:
            raise ValueError(f"MagnitudeDirection: gain_eps must be > 0, got {gain_eps}")
        if not embedding_radius > 0:
            raise ValueError(f"MagnitudeDirection: embedding_radius must be > 0, got {embedding_radius}")
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"MagnitudeDirection: on_nonfinite={on_nonfinite!r} is invalid: choose one of "
                             f"{list(ON_NONFINITE)}")
        if fused not in (None, True, False):
            raise ValueError(f"MagnitudeDirection: fused must be None, True or False, got {fused!r}")
        missing = md_fused.kernel_missing()
        if fused:
            why = md_fused.base_fusable(base_optimizer) or missing
            if why:
                raise ValueError(f"MagnitudeDirection: fused=True cannot run: {why}")
        self.fused = fused
        # the backend of the core's passes over each matrix on the CPU: the C kernels where they load (resolved once,
        # here, and passed to the core as a value; ``fused=False``: torch everywhere)
        self.kernels: bool = fused is not False and missing is None
        self.on_nonfinite = on_nonfinite
        # the host-free step (``md_core``): None = inside a torch.compile trace only, True = also eagerly (the
        # path a compiled step runs, e.g. to count its operations; a Muon base is set alike), False = never
        self._host_free_mode: bool | None = None
        groups = base_optimizer.param_groups
        for gi, group in enumerate(groups):  # what MD steps (and its finiteness scan reads): supported, listed once
            check_new_group("MagnitudeDirection", groups[:gi], group)

        self.base_optimizer = base_optimizer
        self.gains = gains
        self.parameterization = parameterization
        self.sphere = sphere
        self.embeddings = embeddings
        self.embedding_radius = float(embedding_radius)
        self._gain_groups: list[dict[str, Any]] = []

        names = md_setup.param_names(self, model)
        self._name = names
        decoupled, unit_rows = md_setup.select(self, names, params, exclude, embeddings, model)
        for p in decoupled:
            md_torch.validate_matrix(p, names[p], sphere)
        for p in unit_rows:
            if p.ndim != 2:
                raise ValueError(f"MagnitudeDirection: embedding {names[p]!r} has shape {tuple(p.shape)}; "
                                 "unit-row embeddings must be 2-D (rows = tokens)")
        self._decoupled: list[torch.Tensor] = decoupled
        self._unit_rows: list[torch.Tensor] = unit_rows
        self.weight_decay_overridden: list[str] = md_setup.override_weight_decay(
            self, set(decoupled) | set(unit_rows), names)

        gain_group = {"params": [], "names": [], "lr": float(gain_lr), "betas": tuple(gain_betas),
                      "eps": float(gain_eps), "weight_decay": 0.0, "md_role": "gains"}
        defaults = {k: v for k, v in gain_group.items() if k not in ("params", "names")}
        # torch's Optimizer machinery (hooks, profiling, state); param_groups is a property (see below).
        super().__init__([gain_group], defaults)
        self.state = md_torch.MDState()  # false until the first step or load, as torch's (``md_torch``)

        self._versions: dict[torch.Tensor, int | None] = {}
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        # how each matrix was stepped last: "fused", "eager-C (why)" or "eager (why)"
        self._path: dict[torch.Tensor, str] = {}
        for p in decoupled:  # meta-device parameters: meta state, made from their values at the first step
            self.state[p].update(md_torch.init_state(self, p))
            self._versions[p] = p._version
        self._deferred = any(md_torch.on_meta(p) for p in decoupled)
        for p in decoupled:
            self._scale_for(p, self._group_of(p))  # validates manifold/sphere compatibility up front
        first = next((q for g in base_optimizer.param_groups for q in g["params"]), None)
        self._skipped = torch.zeros((), dtype=torch.int64, device=first.device if first is not None else "cpu")
        with torch.no_grad():
            for p in unit_rows:
                normalize_rows_(p, self.embedding_radius)

    @property
    def host_free(self) -> bool | None:
        """Whether ``step`` takes the host-free path (``md_core``): None (default) inside a ``torch.compile``
        trace only, True also eagerly, False never. Setting it sets a Muon base's ``host_free`` alike."""
        return self._host_free_mode

    @host_free.setter
    def host_free(self, value: bool | None) -> None:
        if value not in (None, True, False):
            raise ValueError(f"MagnitudeDirection: host_free must be None, True or False, got {value!r}")
        self._host_free_mode = value
        if isinstance(self.base_optimizer, Muon):
            self.base_optimizer.host_free = value

    def _host_free(self) -> bool:
        """Whether this step takes the host-free path (``host_free``; by default inside a torch.compile trace)."""
        return bool(self._host_free_mode) or (self._host_free_mode is None and torch.compiler.is_compiling())

    @property
    def skipped_steps(self) -> torch.Tensor:
        """Steps skipped for a NaN/Inf gradient (``on_nonfinite="skip"``): a 0-dim int64 tensor on the parameters'
        device (``int()`` it only when needed: a host sync on a GPU). Not part of ``state_dict()``."""
        return self._skipped

    # ---- torch.optim citizenship -----------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The base optimizer's param groups, then the gains group (a new list each access; the dicts are live)."""
        return [*self.base_optimizer.param_groups, *self._gain_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        # Only torch's Optimizer.__init__ assigns this (to []); the wrapper owns just its gains group.
        self._gain_groups = [g for g in groups if g.get("md_role") == "gains"]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: a gains group (``md_role="gains"``, internal) or a base group (not decoupled), whose
        parameters must have a supported dtype and not be in the optimizer already (ValueError naming it)."""
        if param_group.get("md_role") == "gains":
            self._gain_groups.append(param_group)
        else:
            check_new_group("MagnitudeDirection", self.base_optimizer.param_groups, param_group)
            self.base_optimizer.add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "kernels" not in state:  # pickled before the backend was resolved at construction: resolve it now
            state["kernels"] = state.get("fused") is not False and md_fused.kernel_missing() is None
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"MagnitudeDirection(gains={self.gains!r}, parameterization={self.parameterization!r}, "
                f"sphere={self.sphere!r}, gain_lr={self._gain_groups[0]['lr']}, decoupled={len(self._decoupled)}, "
                f"unit_rows={len(self._unit_rows)},\n  base={self.base_optimizer!r})")

    @property
    def decoupled_names(self) -> list[str]:
        """Names of the decoupled matrices, in order."""
        return [self._name[p] for p in self._decoupled]

    @property
    def unit_row_names(self) -> list[str]:
        """Names of the unit-row-norm embeddings."""
        return [self._name[p] for p in self._unit_rows]

    def direction(self, p: torch.Tensor) -> torch.Tensor:
        """The direction Ŵ of a decoupled parameter (live tensor; do not modify)."""
        return self.state[p]["direction"]

    def gain_values(self, p: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(γ_r as (m, 1) or (1, 1) for a scalar gain, γ_c as (1, n)); None where that gain is absent."""
        st = self.state[p]
        r = st.get("gain_row")
        c = st.get("gain_col")
        gr = None if r is None else gain_value(r, self.parameterization).reshape(-1, 1)
        gc = None if c is None else gain_value(c, self.parameterization).reshape(1, -1)
        return gr, gc

    def summary(self) -> str:
        """A table: each decoupled matrix with its shape, radius, mean gains and how the last step ran it ("fused",
        "eager-C (why)" or "eager (why)": why the base step is not fused; "-" before the first step)."""
        rows = [f"{'name':40s} {'shape':>12s} {'radius':>10s} {'γ_r mean':>9s} {'γ_c mean':>9s}  path"]
        for p in self._decoupled:
            gr, gc = self.gain_values(p)
            radius = self.state[p]["radius"]
            rad = f"{float(radius):.4g}" if radius.numel() == 1 else f"{float(radius.mean()):.3g}*"
            rows.append(f"{self._name[p]:40s} {str(tuple(p.shape)):>12s} {rad:>10s} "
                        f"{'-' if gr is None else f'{float(gr.mean()):.4g}':>9s} "
                        f"{'-' if gc is None else f'{float(gc.mean()):.4g}':>9s}  {self._path.get(p, '-')}")
        for p in self._unit_rows:
            rows.append(f"{self._name[p]:40s} {str(tuple(p.shape)):>12s} {'unit rows':>10s}")
        return "\n".join(rows)

    # ---- the step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One MD step (module docstring, 1–6). ``closure`` re-evaluates the loss with gradients, as in torch.optim.

        All or nothing: every gradient the step would use (all base params, decoupled or not), every re-derivation
        of a direction from a changed W, and every path decision are checked before any parameter or state changes.

        DTensor parameters (FSDP2 ``fully_shard``; every rank calls ``step``): each decoupled matrix (and each Muon
        matrix of the base) is gathered whole onto one owner rank with its direction, stepped there by this same code
        — its gains are trained there — and scattered back; elementwise base groups (AdamW) step the local shards; a
        NaN/Inf gradient shard on any rank makes every rank raise before anything changes
        (``weightgeom.optim.sharded.step_on_owners``; ``state_dict()`` is then per rank).

        Returns:
            The closure's loss, or None.

        Raises:
            NonFiniteGradientError: (a ValueError) a gradient holds NaN/Inf, naming the parameter; nothing changed.
            ValueError: a sparse gradient on a decoupled matrix, a W changed outside the optimizer that has no
                direction (NaN/Inf, zero norm, too large for its gains), a parameter whose gradient, direction or base
                state no longer fits it (its dtype, shape or device changed after a step: ``p.data = ...``,
                ``model.half()``), or ``fused=True`` with a matrix the kernel cannot take — naming the parameter;
                nothing changed.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._deferred:  # built over meta-device parameters: their MD state from their values now
            md_torch.materialize(self)
        undo = md_torch.dcp_init_step(self)  # DCP's zero step on a fresh wrapper: nothing but state changes
        try:
            if holds_dtensors(self.base_optimizer.param_groups):  # FSDP2: each matrix whole on its owner rank
                step_on_owners(self, self._update, who="MagnitudeDirection", states=[self.base_optimizer.state],
                               whole=self.whole_matrix,
                               name=lambda gi, g, i: md_checks.param_label(self, g["params"][i]), swap=self._standins,
                               merge_stats=[self.base_optimizer] if isinstance(self.base_optimizer, Muon) else [])
            elif self._host_free():  # inside a torch.compile trace, or host_free=True
                md_core.step_host_free(self)
            else:
                self._update()
        except NonFiniteGradientError:  # refused before anything changed
            if self.on_nonfinite == "raise":
                raise
            self._skipped += 1
            return loss
        if undo is not None:
            undo()
        self.state.live = True
        return loss

    # Never traced by torch.compile: a trace runs ``md_core`` instead (buckets keyed by the parameters,
    # their state read inside the step). Tracing this body, dynamo guarded a traced per-matrix pass on the tensors'
    # shapes, not on which parameter they were: over AdamW (the fused C path) three 256×64 matrices came out 3.3e-3 off.
    @torch.compiler.disable
    def _update(self) -> None:
        """The eager step on plain tensors (a single process, or this rank's matrices under ``step_on_owners``):
        every refusal first (``_plan``), Ŵ re-derived where W's version changed, each matrix's backend chosen, then
        ``md_core.run`` (the same core as the host-free step)."""
        plan = self._plan()  # every refusal happens here, before anything changes
        try:
            entries = []
            for p, G, group, why, resync in plan:
                self._adopt(p, resync)
                kern = why is None or (self.kernels and self.fused is None and self._scale_for(p, group) is None
                                       and md_fused.kernel_passes(self, p, G))
                self._path[p] = "fused" if why is None else f"{'eager-C' if kern else 'eager'} ({why})"
                entries.append((p, group, why is None, kern))
            md_core.run(self, md_core.buckets(self, entries, eager=True), None)
        except BaseException:
            # the model's W served as scratch: whatever failed, leave the model at γ_r Ŵ γ_c
            for p, *_ in plan:
                compose(self.state[p]["direction"], *self.gain_values(p), out=p)
                self._versions[p] = p._version
            raise
        for p, *_ in plan:
            self._versions[p] = p._version

    def _standins(self, mapping: dict[int, tuple[torch.Tensor, torch.Tensor | None]]):
        """For ``step_on_owners``: point the per-matrix bookkeeping at the stand-ins (id(param) → (param, its whole
        matrix or local shard on this rank, or None: not stepped here)) and return the undo. A stand-in is new at
        every step, so W is compared with γ_r Ŵ γ_c (``md_checks.rederive``) at every step."""
        saved = (self._decoupled, self._unit_rows)
        pairs = [(p, q) for p, q in mapping.values() if q is not None]

        def sub(ps: list[torch.Tensor]) -> list[torch.Tensor]:
            return [mapping[id(p)][1] if id(p) in mapping else p for p in ps
                    if id(p) not in mapping or mapping[id(p)][1] is not None]

        self._decoupled, self._unit_rows = sub(self._decoupled), sub(self._unit_rows)
        for p, q in pairs:
            if p in self._name:
                self._name[q] = self._name[p]
            for d in (self._buffers, self._path):
                if p in d:
                    d[q] = d.pop(p)
            self._versions[q] = None

        def undo() -> None:
            self._decoupled, self._unit_rows = saved
            for p, q in pairs:
                self._name.pop(q, None)
                self._versions.pop(q, None)
                for d in (self._buffers, self._path):
                    if q in d:
                        d[p] = d.pop(q)
                self._versions[p] = None

        return undo

    def _plan(self) -> list[tuple]:
        """Everything that can refuse the step, with nothing changed yet: the gradients
        (``md_checks.check_gradients``), each decoupled matrix's group and path, and the re-derivation of Ŵ where W
        changed outside the optimizer.

        Returns:
            Per decoupled matrix with a gradient: (p, G, its base group, why it is not fused (None: fused),
            the re-derived (Ŵ, radius) or None when W still equals γ_r Ŵ γ_c or never changed).
        """
        self.check_groups()
        md_checks.check_gradients(self)
        plan = []
        for p, group in md_checks.with_gradients(self):
            G = p.grad
            scaled = self._scale_for(p, group) is not None
            why = "fused=False" if self.fused is False else md_fused.fusable(
                self.base_optimizer, group, p, G, self.gains, self.parameterization, scaled, self.kernels)
            if why is not None and self.fused:
                raise ValueError(f"MagnitudeDirection(fused=True): {self._name[p]!r} cannot take the fused path: "
                                 f"{why}; step refused, nothing was changed")
            resync = md_checks.rederive(self, p) if self._versions.get(p) != p._version else None
            plan.append((p, G, group, why, resync))
        check_step = getattr(self.base_optimizer, "check_step", None)
        if check_step is not None:  # what the base (Muon) would refuse, before MD's passes change anything
            check_step()
        return plan

    def check_groups(self) -> None:
        """Refuse the step for a value set in a group since it was added on which a later part of the step would
        raise (``md_checks.check_groups``). Every eager step runs it first; ``compile_step`` runs it before each
        compiled step, whose trace sees a scheduled lr as a symbol it cannot test.

        Raises:
            ValueError: one line naming the group and key; nothing was changed.
        """
        md_checks.check_groups(self)

    def whole_matrix(self, group: dict[str, Any], q: torch.Tensor) -> bool:
        """Whether parameter ``q`` of ``group`` is stepped whole on one owner rank under FSDP2 (a decoupled matrix, a
        unit-row embedding, a Muon base matrix: ``sharded.step_on_owners``)."""
        return any(q is r for r in (*self._decoupled, *self._unit_rows)) or group.get("algorithm") == "muon"

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's layout: ``state`` (per parameter the base's state; a decoupled matrix's entry also holds its
        direction, radius, raw gains θ and their Adam state under ``md.*`` keys) and ``param_groups`` (the base's, then
        the gains group without parameters: its hyperparameters, scheduler keys included, and MD's options);
        ``md_state`` has the layout. The hooks
        registered with ``register_state_dict_pre_hook``/``post_hook`` run as torch runs them (a post-hook may return
        a replacement).

        Tensors are references (like torch's state_dict): serialise or clone before stepping on.
        """
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)
        sd = md_state.state_dict(self)
        for hook in list(self._optimizer_state_dict_post_hooks.values()):
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def check_state_dict(self, state_dict: Any) -> None:
        """Validate a ``state_dict()`` for this optimizer without loading anything (``load_state_dict`` runs it first).

        Checked (``md_state.check``): the layout — torch's with MD's ``md.*`` entries and gains group, or an older one
        (another optimizer's state dict, or the base's own, is named as such); the options that decide what
        the MD state means (gains, parameterization, sphere, embeddings); one entry per decoupled matrix holding
        exactly the tensors this optimizer keeps for it, each of the same shape (the gains' Adam state too), every
        one finite (direction, radius, θ, the gains' moments: ``state_checks.check_state_finite``), radius > 0; the
        gains group's keys and values; and the base optimizer's part, by the base (``Muon.check_state_dict``) or,
        for a torch optimizer, by ``checks.check_torch_state``.

        Raises:
            ValueError: one line naming what does not fit; nothing is loaded.
        """
        md_state.check(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore a ``state_dict()`` (any layout it has had) — all of it, after ``check_state_dict`` accepted all of
        it, or nothing. Hooks registered with ``register_load_state_dict_pre_hook`` (which may return a replacement) run
        before the checks, ``..._post_hook`` after the load, as torch runs them. The model's weights are not written;
        at the next step each W is checked against γ_r Ŵ γ_c (exact equality, as after loading the same checkpoint
        into the model) and, if it differs, the direction is re-derived from W so that the model's weights win.

        Raises:
            ValueError: not an MD state dict, different options, different decoupled matrices (count or shape),
                state of another shape or kind than this optimizer keeps, a NaN/Inf state tensor (naming the matrix
                and the tensor), a radius not > 0, or a base part that does not fit the base optimizer, naming it;
                nothing is loaded then.
        """
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict  # as torch: hooks may edit it
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        base_sd, own = md_state.check(self, state_dict)
        md_state.load(self, base_sd, own)
        self.state.live = True
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    # ---- internals -------------------------------------------------------------------------------------------------

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for group in self.base_optimizer.param_groups:
            for q in group["params"]:
                if q is p:
                    return group
        raise ValueError(f"MagnitudeDirection: parameter {self._name[p]!r} is no longer in the base optimizer")

    def _scale_for(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        """None for a free / scale-invariant group; else s = radius/κ, κ = the manifold's fixed ‖Q‖_F."""
        kappa = md_setup.scale_divisor(self, p, group)
        return None if kappa is None else self.state[p]["radius"].reshape(()) / kappa

    def _resync(self, p: torch.Tensor) -> None:
        """W was changed outside this optimizer: keep W, re-derive Ŵ = W / γ_r / γ_c and re-measure the radius
        (``md_checks.rederive``, then ``_adopt``; raises naming p, with nothing changed, where W has no direction)."""
        self._adopt(p, md_checks.rederive(self, p))

    def _adopt(self, p: torch.Tensor, rederived: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Commit a ``md_checks.rederive`` result (None: keep Ŵ) and record W's version as in sync."""
        if rederived is not None:
            st = self.state[p]
            st["direction"].copy_(rederived[0])
            st["radius"].copy_(rederived[1])
        self._versions[p] = p._version
