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

import fnmatch
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from weightgeom import kernels, manifolds
from weightgeom.optim import md_fused, md_host_free, md_state, md_torch
from weightgeom.optim.checks import (
    PARAM_SHAPED_STATE,
    check_fits_param,
    check_group_kinds,
    check_new_group,
    dtype_supported,
    is_torch_optimizer,
    torch_state_shapes,
    unsupported_dtype,
)
from weightgeom.optim.functional import NonFiniteGradientError, first_nonfinite
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


# How a base group's manifold interacts with the sphere: "free" (no manifold, or a constraint invariant under
# scaling, e.g. DGram: off-diagonal Gram = 0) → project Ŵ on the sphere directly; "fixed" (Stiefel, Oblique: the
# manifold fixes ‖Ŵ‖_F = sqrt(min(m, n))) → the base steps Q = Ŵ/s with s = radius/sqrt(min(m, n)). Decided from the
# manifold's target Gram P(I) (_manifold_kind_uncached), so a registered manifold needs no entry here.


def _manifold_kind(manifold: Any, k: int) -> str:
    if not (manifold is None or isinstance(manifold, str)):
        return _manifold_kind_uncached(manifold, k)
    key = (manifold, k)
    kind = _KIND_CACHE.get(key)
    if kind is None:
        kind = _KIND_CACHE[key] = _manifold_kind_uncached(manifold, k)
    return kind


_KIND_CACHE: dict[tuple[Any, int], str] = {}


def _manifold_kind_uncached(manifold: Any, k: int) -> str:
    if manifold is None:
        return "free"
    try:
        obj = manifolds.get(manifold)
    except ValueError as e:
        raise ValueError(f"MagnitudeDirection: unknown manifold {manifold!r} in a base param group ({e})") from None
    target = obj.P(torch.eye(k, dtype=torch.float64))
    if bool(torch.all(target == 0)):
        return "free"
    if bool(torch.all(target.diagonal() == 1)):
        return "fixed"
    raise ValueError(f"MagnitudeDirection: manifold {obj.name!r} neither fixes ‖W‖_F nor is scale-invariant; "
                     "MD cannot combine its sphere with it")


# W counts as still γ_r Ŵ γ_c (no re-derivation of Ŵ) when every entry agrees to this many units in the last place:
# the fused kernel computes γ = softplus(θ) with the C library's log1p/exp, torch with its own; they differ by ≤ 1 ulp,
# so γ_r Ŵ γ_c recomputed in torch differs from the kernel's W by a few ulp (measured ≤ 3.3·eps·|W| over 30 fused
# steps of 10 matrices, softplus and exp). Any real change to W (a different checkpoint, an edit) is far larger.
_RESYNC_ULPS = 16


def _same_weight(composed: torch.Tensor, W: torch.Tensor) -> bool:
    if torch.equal(composed, W):
        return True
    if not W.is_floating_point():
        return False
    tol = _RESYNC_ULPS * torch.finfo(W.dtype).eps
    return bool(((composed - W).abs() <= tol * W.abs()).all())


# torch optimizers whose step takes sparse gradients; any other base (Adam, AdamW, Muon, ...) would refuse one inside
# its step, after MD had stepped the decoupled matrices, so MD refuses it before anything changes.
_SPARSE_BASES = (torch.optim.SGD, torch.optim.SparseAdam, torch.optim.Adagrad)


# ---------------------------------------------------------------------------------------------------------------------
# The wrapper.
# ---------------------------------------------------------------------------------------------------------------------
def _vector(gain: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A gain of ``gain_values`` as a contiguous vector of k entries in ``dtype`` (a scalar gain repeated)."""
    if gain is None:
        return None
    g = gain.to(dtype).reshape(-1)
    return (g.expand(k) if g.numel() == 1 else g).contiguous()


_BATCH_ON_CPU = False  # tests set it to run the batched (GPU) path of _elementwise_many on the CPU


def _elementwise_many(fn: Callable[..., torch.Tensor], firsts: list[torch.Tensor],
                      seconds: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """``[fn(a) for a in firsts]`` (or ``fn(a, b)`` pairwise) for an elementwise ``fn``; off the CPU, tensors of one
    device and dtype go through ``fn`` as one concatenated vector (a few kernels instead of a few per tensor: the
    gains' maps are launch-bound on a GPU, two small vectors per matrix). The CPU keeps one call per tensor (its
    vectorised kernels may round a vector's tail differently from its body, and launches cost little there)."""
    out: list[torch.Tensor | None] = [None] * len(firsts)
    groups: dict[tuple, list[int]] = {}
    for i, a in enumerate(firsts):
        groups.setdefault((a.device, a.dtype), []).append(i)
    for (dev, _dtype), idx in groups.items():
        if (dev.type == "cpu" and not _BATCH_ON_CPU) or len(idx) == 1:
            for i in idx:
                out[i] = fn(firsts[i]) if seconds is None else fn(firsts[i], seconds[i])
            continue
        flat_a = torch.cat([firsts[i].reshape(-1) for i in idx])
        res = fn(flat_a) if seconds is None else fn(flat_a, torch.cat([seconds[i].reshape(-1) for i in idx]))
        for i, piece in zip(idx, res.split([firsts[i].numel() for i in idx])):
            out[i] = piece.view(firsts[i].shape)
    return out  # type: ignore[return-value]


class MagnitudeDirection(Optimizer):
    """Magnitude–direction decoupling around any base optimizer (the MD paper; docs/md.md).

    Each selected matrix W (m×n, PyTorch (out, in) layout) is trained as W = diag(γ_r) Ŵ diag(γ_c): the base
    optimizer steps the direction Ŵ (kept on a sphere of its initial norm), the gains γ = φ(θ) are trained by a
    separate Adam at ``gain_lr``. The model keeps its one fused tensor; the forward is unchanged at construction.

    ``param_groups`` is the base optimizer's groups followed by one gains group (keys ``lr`` = ``gain_lr``,
    ``betas``, ``eps``, ``weight_decay`` = 0, ``md_role`` = ``"gains"``, ``names``): LR schedulers built on the wrapper
    schedule both. ``state`` holds the MD state (per matrix: ``direction``, ``radius``, ``gain_row``, ``gain_col``; per
    gain tensor: its Adam moments); the base optimizer's own state stays in ``base_optimizer.state``. ``state_dict``
    has torch's layout: the base's ``state`` and ``param_groups``, MD's part beside them under ``"md"``
    (``md_state``). Step hooks, state-dict hooks and ``maximize`` behave as for torch's optimizers, and parameters on
    the meta device get their MD state at the first step (``md_torch``).

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
            ``torch.compile``) a 0-dim device flag masking every write (``md_host_free``), so that a step over
            torch's Adam/AdamW or a Muon with ``on_nonfinite="skip"`` reads nothing on the host and traces as one
            graph (``compile_step``).

    Attributes:
        host_free: None (default): the host-free step (``md_host_free``: same-shape matrices batched, every host
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
        if fused:
            why = md_fused.base_fusable(base_optimizer) or md_fused.kernel_missing()
            if why:
                raise ValueError(f"MagnitudeDirection: fused=True cannot run: {why}")
        self.fused = fused
        self.on_nonfinite = on_nonfinite
        # the host-free step (``md_host_free``): None = inside a torch.compile trace only, True = also eagerly (the
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

        names = self._param_names(model)
        self._name = names
        decoupled, unit_rows = self._select(names, params, exclude, embeddings, model)
        for p in decoupled:
            md_torch.validate_matrix(p, names[p], sphere)
        for p in unit_rows:
            if p.ndim != 2:
                raise ValueError(f"MagnitudeDirection: embedding {names[p]!r} has shape {tuple(p.shape)}; "
                                 "unit-row embeddings must be 2-D (rows = tokens)")
        self._decoupled: list[torch.Tensor] = decoupled
        self._unit_rows: list[torch.Tensor] = unit_rows
        self.weight_decay_overridden: list[str] = self._override_weight_decay(set(decoupled) | set(unit_rows), names)

        gain_group = {"params": [], "names": [], "lr": float(gain_lr), "betas": tuple(gain_betas),
                      "eps": float(gain_eps), "weight_decay": 0.0, "md_role": "gains"}
        defaults = {k: v for k, v in gain_group.items() if k not in ("params", "names")}
        # torch's Optimizer machinery (hooks, profiling, state); param_groups is a property (see below).
        super().__init__([gain_group], defaults)

        self._versions: dict[torch.Tensor, int | None] = {}
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}
        # how each matrix was stepped last: "fused", "eager-C (why)" or "eager (why)"
        self._path: dict[torch.Tensor, str] = {}
        self._stepped: set[torch.Tensor] = set()
        self._fresh: set[int] = set()  # ids of the θ given a gradient by this step (a stale θ.grad is not stepped)
        group = self._gain_groups[0]
        for p in decoupled:  # meta-device parameters: meta state, made from their values at the first step
            st = self.state[p]
            st.update(md_torch.init_state(self, p))
            for key in ("gain_row", "gain_col"):
                if key in st:
                    group["params"].append(st[key])
                    group["names"].append(f"{names[p]}.{key}")
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
        """Whether ``step`` takes the host-free path (``md_host_free``): None (default) inside a ``torch.compile``
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

    def _gain_values_many(self, ps: list[torch.Tensor]) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """``gain_values(p)`` for each p (keyed by ``id(p)``), the gains' φ evaluated together
        (``_elementwise_many``)."""
        thetas = [self.state[p][k] for p in ps for k in ("gain_row", "gain_col") if k in self.state[p]]
        vals = dict(zip(map(id, thetas), _elementwise_many(lambda t: gain_value(t, self.parameterization), thetas)))
        out = {}
        for p in ps:
            r, c = self.state[p].get("gain_row"), self.state[p].get("gain_col")
            out[id(p)] = (None if r is None else vals[id(r)].reshape(-1, 1),
                          None if c is None else vals[id(c)].reshape(1, -1))
        return out

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
        try:
            if holds_dtensors(self.base_optimizer.param_groups):  # FSDP2: each matrix whole on its owner rank
                handled = {id(q) for q in (*self._decoupled, *self._unit_rows)}
                step_on_owners(self, self._update, who="MagnitudeDirection", states=[self.base_optimizer.state],
                               whole=lambda g, q: id(q) in handled or g.get("algorithm") == "muon",
                               name=lambda gi, g, i: self._param_label(g["params"][i]), swap=self._standins,
                               merge_stats=[self.base_optimizer] if isinstance(self.base_optimizer, Muon) else [])
            elif self._host_free():  # inside a torch.compile trace, or host_free=True
                md_host_free.step(self)
            else:
                self._update()
        except NonFiniteGradientError:  # refused before anything changed
            if self.on_nonfinite == "raise":
                raise
            self._skipped += 1
        return loss

    # Never traced by torch.compile: a trace runs ``md_host_free.step`` instead (buckets keyed by the parameters, their
    # state read inside the step). Tracing this body, dynamo guarded a traced per-matrix pass on the tensors' shapes,
    # not on which parameter they were: over AdamW (the fused C path) three 256×64 matrices came out 3.3e-3 off.
    @torch.compiler.disable
    def _update(self) -> None:
        """The step body on plain tensors (a single process, or this rank's matrices under ``step_on_owners``)."""
        plan = self._plan()  # every refusal happens here, before anything changes
        work: list[list] = []
        try:
            self._prepare(plan, work)
            self._base_step(work)
            self._update_gains()
            self._finish(work)
        except BaseException:
            # the model's W served as scratch: whatever failed, leave the model at γ_r Ŵ γ_c
            for item in work:
                p = item[0]
                compose(self.state[p]["direction"], *self.gain_values(p), out=p)
                self._versions[p] = p._version
            raise
        for p in self._unit_rows:
            normalize_rows_(p, self.embedding_radius)

    def _standins(self, mapping: dict[int, tuple[torch.Tensor, torch.Tensor | None]]):
        """For ``step_on_owners``: point the per-matrix bookkeeping at the stand-ins (id(param) → (param, its whole
        matrix or local shard on this rank, or None: not stepped here)) and return the undo. A stand-in is new at
        every step, so W is compared with γ_r Ŵ γ_c (``_rederive``) at every step."""
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
        """Everything that can refuse the step, with nothing changed yet: the gradients (``_check_gradients``), each
        decoupled matrix's group and path, and the re-derivation of Ŵ where W changed outside the optimizer.

        Returns:
            Per decoupled matrix with a gradient: (p, G, its base group, why it is not fused (None: fused),
            the re-derived (Ŵ, radius) or None when W still equals γ_r Ŵ γ_c or never changed).
        """
        self.check_groups()
        self._check_gradients()
        group_of = {id(q): g for g in self.base_optimizer.param_groups for q in g["params"]}
        plan = []
        for p in self._decoupled:
            G = p.grad
            if G is None:
                continue
            if id(p) not in group_of:
                raise ValueError(f"MagnitudeDirection: parameter {self._name[p]!r} is no longer in the base optimizer")
            group = group_of[id(p)]
            scaled = self._scale_for(p, group) is not None
            why = "fused=False" if self.fused is False else md_fused.fusable(
                self.base_optimizer, group, p, G, self.gains, self.parameterization, scaled)
            if why is not None and self.fused:
                raise ValueError(f"MagnitudeDirection(fused=True): {self._name[p]!r} cannot take the fused path: "
                                 f"{why}; step refused, nothing was changed")
            resync = self._rederive(p) if self._versions.get(p) != p._version else None
            plan.append((p, G, group, why, resync))
        check_step = getattr(self.base_optimizer, "check_step", None)
        if check_step is not None:  # what the base (Muon) would refuse, before MD's passes change anything
            check_step()
        return plan

    def check_groups(self) -> None:
        """Refuse the step for a value set in a group since it was added on which a later part of the step would
        raise: the gains group's (``_invalid_gain_key``, stepped after the base) and, for one of torch's optimizers,
        a base group's numeric hyperparameter of another kind than its default (``checks.check_group_kinds``; MD's
        passes run before the base step). A Muon base checks its own groups (``Muon.check_step``). Every eager step
        runs it first; ``compile_step`` runs it before each compiled step, whose trace sees a scheduled lr as a
        symbol it cannot test.

        Raises:
            ValueError: one line naming the group and key; nothing was changed.
        """
        gains = self._gain_groups[0]
        bad = md_state.invalid_gain_key(gains)
        if bad is not None:
            raise ValueError(f"MagnitudeDirection: the gains group has {bad}={gains[bad]!r}, which the constructor "
                             "refuses (gain_lr ≥ 0, gain_betas in [0, 1), gain_eps > 0, weight_decay 0); step refused, "
                             "nothing was changed")
        base = self.base_optimizer
        if is_torch_optimizer(base):
            for gi, group in enumerate(base.param_groups):
                check_group_kinds("MagnitudeDirection", base, gi, group, "it was set since the group was added; step "
                                  "refused, nothing was changed")

    def _check_gradients(self) -> None:
        """Refuse the step, naming the parameter, if a base param's dtype is unsupported, its gradient, direction or
        base state no longer fits it (``_check_fits``), a decoupled matrix has a sparse gradient (or any param does,
        where the base cannot step one: ``_SPARSE_BASES``) or any gradient of the base optimizer's params holds
        NaN/Inf (one read of every gradient: the C scan, else one fused torch norm and one host sync,
        ``first_nonfinite``)."""
        params = [q for g in self.base_optimizer.param_groups for q in g["params"] if q.grad is not None]
        self._check_metadata(params)
        bad = first_nonfinite([q.grad for q in params], cpu_scan=self._cpu_scan())
        if bad is not None:
            q = params[bad]
            raise NonFiniteGradientError.refused("MagnitudeDirection", self._param_label(q), tuple(q.shape))

    def _check_metadata(self, params: list[torch.Tensor]) -> None:
        """``_check_gradients`` without the finiteness scan (no tensor is read): dtypes, fits, sparse gradients."""
        decoupled = {id(p) for p in self._decoupled}
        sparse_ok = isinstance(self.base_optimizer, _SPARSE_BASES)
        for q in params:
            if not dtype_supported(q):  # its dtype was changed after construction (``q.data = ...``)
                raise ValueError(f"{unsupported_dtype('MagnitudeDirection', f'parameter {self._param_label(q)!r}', q)}"
                                 "; step refused, nothing was changed")
            self._check_fits(q, id(q) in decoupled)
            if q.grad.is_sparse and id(q) in decoupled:
                raise ValueError(f"MagnitudeDirection: parameter {self._name[q]!r} has a sparse gradient; "
                                 "decoupled matrices need dense gradients; step refused, nothing was changed")
            if q.grad.is_sparse and not sparse_ok:  # the base would raise in its step, after MD's passes ran
                raise ValueError(f"MagnitudeDirection: parameter {self._param_label(q)!r} has a sparse gradient, "
                                 f"which the base optimizer ({type(self.base_optimizer).__name__}) cannot step; step "
                                 "refused, nothing was changed")

    def _check_fits(self, q: torch.Tensor, decoupled: bool) -> None:
        """Refuse the step if q's gradient, its direction Ŵ (a decoupled matrix) or, for one of torch's optimizers,
        the base's state no longer fits q — q was changed after they were made (``q.data = ...``, ``model.half()``),
        and the base would raise on it after MD's passes ran (``checks.check_fits_param``). A Muon base checks its
        own state (``Muon.check_step``)."""
        who, label = "MagnitudeDirection", f"parameter {self._param_label(q)!r}"
        if decoupled:
            check_fits_param(who, label, q, self.state[q], {"direction": tuple(q.shape)}, ("direction",),
                             remedy="build MagnitudeDirection again (it keeps W's direction in W's shape, dtype and "
                                    "device)")
        base = self.base_optimizer
        torch_base = is_torch_optimizer(base)
        check_fits_param(who, label, q, base.state.get(q, {}) if torch_base else {},
                         torch_state_shapes(q) if torch_base else {}, PARAM_SHAPED_STATE)

    def _cpu_scan(self):
        """The C finiteness scan where this optimizer uses its kernels anyway (``fused`` not False: the fused Adam
        step or the C passes around any other base) and they load; None otherwise (a torch norm is used)."""
        if self.fused is False or md_fused.kernel_missing():
            return None
        return kernels.any_nonfinite

    def _param_label(self, q: torch.Tensor) -> str:
        """q's name; for a param added to the base after construction, its position in the base's groups."""
        if q in self._name:
            return self._name[q]
        for gi, group in enumerate(self.base_optimizer.param_groups):
            for pi, r in enumerate(group["params"]):
                if r is q:
                    return f"param_groups[{gi}].params[{pi}]"
        return f"a parameter of shape {tuple(q.shape)}"

    def _prepare(self, plan: list[tuple], work: list[list]) -> None:
        """Steps 1–2: adopt re-derived directions, split G into gain gradients (on θ.grad) and Ĝ; fill ``work``.

        Matrices on the fused path (``md_fused``) also take their base Adam step here, in the same pass.
        """
        self._stepped = set()  # gains already stepped on the fused path
        for p, _G, _group, _why, resync in plan:
            self._adopt(p, resync)
        gains = self._gain_values_many([p for p, _G, _group, why, _r in plan if why is not None])
        pending: list[tuple] = []  # (θ, ∂L/∂γ or the log-gain sum, chain): θ.grad set together after the loop
        for p, G, group, why, _resync in plan:
            st = self.state[p]
            D = st["direction"]
            s = self._scale_for(p, group)
            # p, W, G, Ŵ, what the base steps, its gradient, True once stepped on the fused path (else None),
            # whether the eager passes run in C (``_kernel_passes``)
            item = [p, p.data, G, D, None, None, None, False]
            work.append(item)
            if why is None:
                md_fused.step(self.base_optimizer, group, p, G, st, self.state, self._gain_groups[0],
                              self.parameterization, self.sphere)
                item[6] = True
                self._path[p] = "fused"
                for key in ("gain_row", "gain_col"):
                    if key in st:
                        self._stepped.add(st[key])
                continue
            ckernel = self.fused is None and s is None and self._kernel_passes(p, G, D, st)
            item[7] = ckernel
            self._path[p] = f"{'eager-C' if ckernel else 'eager'} ({why})"
            gr, gc = gains[id(p)]
            up = md_torch.ascends(group)  # a maximize group: the gains ascend with its direction
            if gr is None and gc is None:
                Gd = G  # W = Ŵ: the base sees the model's gradient itself
            else:
                buf = self._buffers.get(p)
                if buf is None:
                    # row-major whatever G's layout: a later step's G may differ, and the C pass needs a plain buffer
                    buf = self._buffers[p] = torch.empty_like(G, memory_format=torch.contiguous_format)
                if ckernel:  # Ĝ and the log-gain sums in one C pass
                    m, n = D.shape
                    s_r, s_c = kernels.md_split(G, D, _vector(gr, m, D.dtype), _vector(gc, n, D.dtype), buf,
                                                gr is not None, gc is not None)
                    if s_r is not None and gr.numel() == 1:  # one scalar row gain: the sum over every entry
                        s_r = s_r.sum().reshape(1)
                    self._pend_gain_grads(pending, st, s_r, s_c, gain_chain_log, up)
                    Gd = buf
                elif self.parameterization != "direct":  # W's storage is scratch until it is recomposed
                    g_row, g_col, Gd = split_gradient_log(G, D, gr, gc, out=buf, scratch=item[1])
                    self._pend_gain_grads(pending, st, g_row, g_col, gain_chain_log, up)
                else:
                    g_row, g_col, Gd = split_gradient(G, D, gr, gc, out=buf)
                    self._pend_gain_grads(pending, st, g_row, g_col, gain_chain, up)
            target = D
            if s is not None:  # norm-fixing manifold: the base steps Q = Ŵ/s with ∂L/∂Q = s·Ĝ
                target = D / s.to(D.dtype)
                Gd = Gd * s.to(Gd.dtype)
            item[4], item[5] = target, Gd
        for chain in dict.fromkeys(c for _t, _g, c in pending):  # one chain per parameterization, in order
            part = [(t, g) for t, g, c in pending if c is chain]
            grads = _elementwise_many(lambda th, g, chain=chain: chain(th, g, self.parameterization),
                                      [t for t, _ in part], [g for _, g in part])
            for (theta, _), grad in zip(part, grads):
                theta.grad = grad
        self._fresh = {id(theta) for theta, _g, _c in pending}

    def _kernel_passes(self, p: torch.Tensor, G: torch.Tensor, D: torch.Tensor, st: dict) -> bool:
        """Whether this eager matrix's MD passes can run in C (``kernels.md_split``/``md_finish``): plain contiguous
        CPU float32/float64 tensors of one dtype (W, G, Ŵ, the radius, the Ĝ buffer), not empty, softplus/exp gains,
        and the kernel loads — checked before anything changes, so the kernels cannot refuse after the base step."""
        if self.parameterization not in ("softplus", "exp") or md_fused.kernel_missing() is not None:
            return False
        ts = (p.data, G, D, st["radius"], self._buffers.get(p, D))
        return all(type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype == D.dtype and t.is_contiguous()
                   for t in ts) and D.dtype in (torch.float32, torch.float64) and D.ndim == 2 and D.numel() > 0

    @staticmethod
    def _pend_gain_grads(pending: list[tuple], st: dict, g_row: torch.Tensor | None, g_col: torch.Tensor | None,
                         chain, ascend: bool) -> None:
        """Queue the gains' gradients (θ.grad is set from them after the loop); ``ascend`` (a maximize group):
        negated, so that the gains' Adam ascends (the chain rule is linear in them)."""
        for key, g in (("gain_row", g_row), ("gain_col", g_col)):
            if g is not None:
                theta = st[key]
                g = g.reshape(theta.shape).to(theta.dtype)
                pending.append((theta, g.neg() if ascend else g, chain))

    def _base_step(self, work: list[list]) -> None:
        """Step 3: the base optimizer steps Ŵ with Ĝ (``.data``/``.grad`` swapped around its step); matrices already
        stepped on the fused path have their ``.grad`` hidden from it."""
        try:
            for p, _W, _G, _D, target, Gd, fused, _c in work:
                if fused is None:
                    p.data = target
                p.grad = Gd
            md_torch.step_base(self.base_optimizer)  # the global step hooks fire around MD's step only
        finally:
            for item in work:
                p, W, G = item[0], item[1], item[2]
                if item[6] is None:
                    item[4] = p.data  # what the base left (it may have rebound .data instead of writing in place)
                p.data = W
                p.grad = G

    def _update_gains(self) -> None:
        """Step 5: Adam on every θ whose matrix gave it a gradient in this step, batched per (device, dtype, step
        count). A θ.grad left from an earlier step (its matrix has no gradient now, e.g. after ``model.zero_grad()``
        instead of this optimizer's) is not stepped: the gains would move while W is not recomposed."""
        group = self._gain_groups[0]
        batches: dict[tuple, list[torch.Tensor]] = {}
        for theta in group["params"]:
            if theta.grad is None or theta in self._stepped or id(theta) not in self._fresh:
                continue
            gst = md_fused.gain_adam_state(self.state, theta)
            gst["step"] += 1
            batches.setdefault((theta.device, theta.dtype, int(gst["step"])), []).append(theta)
        for (_dev, _dtype, step), thetas in batches.items():
            # the gradient the gains step with, as the C kernel writes it back (θ.grad too): clamped, and a NaN —
            # only products of both signs past the dtype's range make one (|Ŵ| > 1 times a saturated Ĝ; NaN
            # gradients were refused) — counts as 0, so that gain does not move
            states = [self.state[t] for t in thetas]
            adam_update_many_(thetas, [t.grad for t in thetas], [st["exp_avg"] for st in states],
                              [st["exp_avg_sq"] for st in states], step, group["lr"], group["betas"], group["eps"])

    def _finish(self, work: list[list]) -> None:
        """Steps 4 and 6: Ŵ back on its sphere; W = γ_r Ŵ γ_c written into the model's tensor."""
        group_of = {id(q): g for g in self.base_optimizer.param_groups for q in g["params"]}
        gains = self._gain_values_many([item[0] for item in work if item[6] is None])
        for p, _W, _G, D, new, _Gd, fused, ckernel in work:
            st = self.state[p]
            if fused is not None:  # already recomposed by the fused step
                self._versions[p] = p._version
                continue
            s = self._scale_for(p, group_of[id(p)])
            if s is not None:
                torch.mul(new, s.to(new.dtype), out=D)
            elif new.data_ptr() != D.data_ptr():
                D.copy_(new)
            if ckernel:  # sphere and recomposition in two C passes
                m, n = D.shape
                gr, gc = gains[id(p)]
                kernels.md_finish(D, p.detach(), self.sphere, st["radius"], _vector(gr, m, D.dtype),
                                  _vector(gc, n, D.dtype))
                torch.autograd.graph.increment_version(p)  # written through a pointer: as an in-place op would
            else:
                project_to_sphere_(D, st["radius"], self.sphere)
                compose(D, *gains[id(p)], out=p)
            self._versions[p] = p._version

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's layout: the base optimizer's ``state`` and ``param_groups`` at the top, MD's own part beside them
        under ``"md"`` — options, names, per decoupled matrix its direction, radius, raw gains θ and their Adam state,
        and the gains group's hyperparameters (incl. scheduler keys); ``md_state`` has the layout. The hooks
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

        Checked (``md_state.check``): the layout — torch's with MD's ``"md"`` part, or the older nested ``{"base",
        "md"}`` (another optimizer's state dict, or the base's own, is named as such); the options that decide what
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
        """Restore a ``state_dict()`` (either layout) — all of it, after ``check_state_dict`` accepted all of it, or
        nothing. Hooks registered with ``register_load_state_dict_pre_hook`` (which may return a replacement) run
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
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    # ---- internals -------------------------------------------------------------------------------------------------
    def _param_names(self, model: torch.nn.Module | None) -> dict[torch.Tensor, str]:
        model_names = {}
        if model is not None:
            for n, q in model.named_parameters():
                model_names.setdefault(q, n)
        names: dict[torch.Tensor, str] = {}
        for gi, group in enumerate(self.base_optimizer.param_groups):
            given = group.get("names", group.get("param_names"))
            for pi, q in enumerate(group["params"]):
                if given is not None and pi < len(given):
                    names[q] = str(given[pi])
                elif q in model_names:
                    names[q] = model_names[q]
                else:
                    names[q] = f"param_groups[{gi}].params[{pi}]"
        return names

    def _select(self, names, params, exclude, embeddings, model):
        base_params = list(names)
        embed_ids = set()
        if model is not None:
            for mod in model.modules():
                if isinstance(mod, torch.nn.Embedding):
                    embed_ids.add(id(mod.weight))

        def is_embedding(q):
            return id(q) in embed_ids or is_embedding_name(names[q])

        def matches(name, patterns):
            return any(name == pat or fnmatch.fnmatchcase(name, pat) for pat in patterns)

        exclude = [exclude] if isinstance(exclude, str) else list(exclude)
        unused = [pat for pat in exclude if not any(matches(names[q], [pat]) for q in base_params)]
        if unused:  # a pattern that excludes nothing is a typo (or a regex where a glob is meant), never silent
            raise ValueError(f"MagnitudeDirection: exclude pattern {unused[0]!r} matches no parameter name (names or "
                             "fnmatch globs over the whole name, e.g. 'transformer.h.*.attn.*')")
        if params is None:
            chosen = [q for q in base_params if q.ndim == 2 and not matches(names[q], exclude)
                      and (embeddings == "decouple" or not is_embedding(q))]
        else:
            if isinstance(params, (str, torch.Tensor)):
                params = [params]
            chosen_set: dict[int, torch.Tensor] = {}
            for item in params:
                if isinstance(item, torch.Tensor):
                    if item not in names:
                        raise ValueError(f"MagnitudeDirection: a tensor of shape {tuple(item.shape)} marked for "
                                         "decoupling is not a parameter of the base optimizer")
                    chosen_set[id(item)] = item
                elif isinstance(item, str):
                    hits = [q for q in base_params if matches(names[q], [item])]
                    if not hits:
                        raise ValueError(f"MagnitudeDirection: no base-optimizer parameter is named {item!r} "
                                         f"(known: {sorted(names.values())[:8]}...)")
                    for q in hits:
                        chosen_set[id(q)] = q
                else:
                    raise TypeError(f"MagnitudeDirection: params entries must be tensors or names, got {type(item)}")
            chosen = [q for q in base_params if id(q) in chosen_set]  # base order
        chosen_ids = {id(q) for q in chosen}
        unit_rows = []
        if embeddings == "unit_rows":
            unit_rows = [q for q in base_params if is_embedding(q) and id(q) not in chosen_ids]
        return chosen, unit_rows

    def _override_weight_decay(self, handled: set, names) -> list[str]:
        changed: list[str] = []
        base = self.base_optimizer
        for group in list(base.param_groups):
            if not group.get("weight_decay", 0):
                continue
            mine = [q for q in group["params"] if q in handled]
            if not mine:
                continue
            changed += [names[q] for q in mine]
            if len(mine) == len(group["params"]):
                group["weight_decay"] = 0.0
                continue
            name_key = "names" if "names" in group else ("param_names" if "param_names" in group else None)
            keep_idx = [i for i, q in enumerate(group["params"]) if q not in handled]
            move_idx = [i for i, q in enumerate(group["params"]) if q in handled]
            new = {k: v for k, v in group.items() if k not in ("params", "names", "param_names")}
            new["params"] = [group["params"][i] for i in move_idx]
            if name_key is not None:
                new[name_key] = [group[name_key][i] for i in move_idx]
                group[name_key] = [group[name_key][i] for i in keep_idx]
            group["params"] = [group["params"][i] for i in keep_idx]
            new["weight_decay"] = 0.0
            base.add_param_group(new)
        return changed

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for group in self.base_optimizer.param_groups:
            for q in group["params"]:
                if q is p:
                    return group
        raise ValueError(f"MagnitudeDirection: parameter {self._name[p]!r} is no longer in the base optimizer")

    def _scale_for(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor | None:
        """None for a free / scale-invariant group; else s = radius/κ, κ = the manifold's fixed ‖Q‖_F."""
        kappa = self._scale_divisor(p, group)
        return None if kappa is None else self.state[p]["radius"].reshape(()) / kappa

    def _scale_divisor(self, p: torch.Tensor, group: dict[str, Any]) -> float | None:
        """κ = the fixed ‖Q‖_F of p's group's norm-fixing manifold (``_scale_for``), or None for a free group."""
        manifold = group.get("manifold")
        if manifold is None:
            return None
        # Muon's group keys: layout "in_out" stores (in, out); split=k stacks k blocks along the output dim, each
        # its own manifold point, so κ² = Σ_blocks min(block rows, cols) = k·min(out/k, in).
        out_dim, in_dim = (p.shape[1], p.shape[0]) if group.get("layout") == "in_out" else tuple(p.shape)
        k = int(group.get("split") or 1)
        block = min(out_dim // k, in_dim)
        if _manifold_kind(manifold, block) == "free":
            return None
        if self.sphere != "frobenius":
            raise ValueError(f"MagnitudeDirection: parameter {self._name[p]!r} is in a {manifold!r} manifold group, "
                             f"which fixes ‖W‖_F; only sphere='frobenius' is supported there (got {self.sphere!r})")
        return math.sqrt(k * block)

    def _resync(self, p: torch.Tensor) -> None:
        """W was changed outside this optimizer: keep W, re-derive Ŵ = W / γ_r / γ_c and re-measure the radius
        (``_rederive``, then ``_adopt``; raises naming p, with nothing changed, where W has no direction)."""
        self._adopt(p, self._rederive(p))

    def _rederive(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The direction and radius W implies with the current gains, or None if W still equals γ_r Ŵ γ_c (e.g. the
        same checkpoint loaded into the model: the stored Ŵ is then kept bit for bit). Changes nothing.

        Gains are at least ``GAIN_MIN`` in magnitude, so the division is always defined; the result is refused
        (ValueError naming p) when W holds NaN/Inf, W/γ overflows the dtype, or the norm is zero.
        """
        st = self.state[p]
        gr, gc = self.gain_values(p)
        W = p.detach()
        if _same_weight(compose(st["direction"], gr, gc), W):
            return None
        name = self._name[p]
        if not bool(torch.isfinite(W).all()):
            raise ValueError(f"MagnitudeDirection: parameter {name!r} was changed outside the optimizer and now holds "
                             "NaN/Inf entries; it has no direction; step refused, nothing was changed")
        D = W.clone()
        for g in (gr, gc):
            if g is not None:
                D.div_(g.to(D.dtype))
        radius = sphere_norm(D, self.sphere).to(st["radius"].dtype)
        if not (bool(torch.isfinite(D).all()) and bool(torch.isfinite(radius).all())):
            gains = [float(g.abs().min()) for g in (gr, gc) if g is not None]
            smallest = f" (smallest gain {min(gains):.3g})" if gains else ""
            raise ValueError(f"MagnitudeDirection: cannot re-derive the direction of {name!r} from its changed "
                             f"weight: W / gains overflows {D.dtype}{smallest}; step refused, nothing was changed")
        if bool((radius <= _ZERO_NORM).any()):
            what = {"frobenius": "zero norm", "row": "a zero row", "col": "a zero column"}[self.sphere]
            raise ValueError(f"MagnitudeDirection: parameter {name!r} was changed outside the optimizer and now has "
                             f"{what}; its direction is undefined; step refused, nothing was changed")
        return D, radius

    def _adopt(self, p: torch.Tensor, rederived: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Commit a ``_rederive`` result (None: keep Ŵ) and record W's version as in sync."""
        if rederived is not None:
            st = self.state[p]
            st["direction"].copy_(rederived[0])
            st["radius"].copy_(rederived[1])
        self._versions[p] = p._version
