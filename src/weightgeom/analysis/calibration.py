"""Calibration statistics for activation-aware compression: one streamed forward pass, per compressed (role, layer)
the mean input Gram G = (1/T) Σ_t x_t x_tᵀ (float64, n×n) of the matrix's input.

Forward hooks on the modules that hold the role matrices (found by the same role assignment as the analysis) add
xᵀx of each window's inputs (a float32 product per window) to a float64 accumulator and drop the activations: the
memory is the Grams (Σ n² per matrix input; matrices fed the same tensor — Q, K, V; Gate, Up — share one Gram) plus
one window's forward pass. The output-space fit needs the output covariance W G Wᵀ, computed from W and G
(:mod:`weightgeom.analysis.compress_fit`).

With ``holdout`` > 0 the last fraction of the calibration tokens is kept apart as well: :attr:`Grams.held` holds the
Grams of that part alone and :meth:`Grams.fit_part` those of the rest, so ``auto`` can fit each space on one part and
score it on the other (:mod:`weightgeom.analysis.compress_choice`); :attr:`Grams.grams` is always the whole text's.

The default calibration text is the bundled Shakespeare corpus without its held-out tail (:func:`calibration_text`),
disjoint from the text ``weightgeom eval`` evaluates on by default
(:func:`~weightgeom.analysis.perplexity.heldout_text`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightgeom.analysis.compress_fit import CALIBRATION_HOLDOUT, CALIBRATION_TOKENS
from weightgeom.analysis.perplexity import DEFAULT_CONTEXT, HELDOUT_FRACTION, CausalLM, load_causal_lm
from weightgeom.analysis.roles import assign_roles
from weightgeom.data.corpora import shakespeare_text

__all__ = ["CALIBRATION_HOLDOUT", "CALIBRATION_TOKENS", "DEFAULT_CALIBRATION", "Grams", "calibration_text",
           "collect_grams", "runnable_lm", "source_grams"]

DEFAULT_CALIBRATION = "shakespeare"
"""The name of the default calibration text: the bundled Shakespeare corpus without its held-out tail."""


@dataclass
class Grams:
    """Mean input Grams per (role, layer).

    Attributes:
        grams: (role, layer) → G (n×n float64, mean over ``tokens`` tokens); roles fed the same input share one tensor.
        tokens: calibration tokens seen.
        text: what the text was (``shakespeare`` or the file's path).
        seconds: wall time of the pass.
        held: (role, layer) → the mean Gram over the last ``held_tokens`` tokens alone (empty: no part held out).
        held_tokens: tokens of the held-out part (0: none).
        held_ids: the held-out part's token ids (None: none), and ``context`` the window length used, so a choice
            can also be scored by the model's loss on them.
    """

    grams: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    tokens: int = 0
    text: str = ""
    seconds: float = 0.0
    held: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    held_tokens: int = 0
    held_ids: torch.Tensor | None = None
    context: int = 0

    def fit_part(self) -> Grams:
        """The Grams of the tokens before the held-out part (``self`` when nothing is held out), each
        (T·G − T_h·G_h)/(T − T_h) computed when it is asked for (no third copy of every Gram is kept)."""
        if not self.held or self.held_tokens <= 0 or self.held_tokens >= self.tokens:
            return self
        return _FitPart(self)

    def get(self, role: str, layer: int) -> torch.Tensor:
        """G of (role, layer).

        Raises:
            KeyError: no Gram was collected for it (one line naming it).
        """
        try:
            return self.grams[(role, layer)]
        except KeyError:
            raise KeyError(f"no calibration Gram for role {role} layer {layer}") from None


class _FitPart(Grams):
    """The fit part of a :class:`Grams` with a held-out part (see :meth:`Grams.fit_part`)."""

    def __init__(self, whole: Grams):
        super().__init__({}, whole.tokens - whole.held_tokens, whole.text, whole.seconds)
        self._whole = whole

    def get(self, role: str, layer: int) -> torch.Tensor:
        w = self._whole
        G, H = w.get(role, layer), w.held[(role, layer)]
        return (G * w.tokens - H * w.held_tokens) / self.tokens


def calibration_text(spec: str | Path | None = None) -> str:
    """The calibration text: ``spec`` = a UTF-8 file path, or None / :data:`DEFAULT_CALIBRATION` for the bundled
    Shakespeare corpus up to its held-out tail (the first 1 − ``HELDOUT_FRACTION`` of it, disjoint from
    :func:`~weightgeom.analysis.perplexity.heldout_text`).

    Raises:
        ValueError: the file is missing, unreadable or empty (one line naming it).
    """
    if spec is None or str(spec) == DEFAULT_CALIBRATION:
        text = shakespeare_text()
        return text[:int(len(text) * (1.0 - HELDOUT_FRACTION))]
    p = Path(spec)
    if not p.is_file():
        raise ValueError(f"--calibration {spec}: no such file (give a UTF-8 text file, or {DEFAULT_CALIBRATION} for "
                         "the bundled text)")
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise ValueError(f"--calibration {spec}: cannot read ({e.strerror or e})") from None
    if not text.strip():
        raise ValueError(f"--calibration {spec}: empty (nothing to calibrate on)")
    return text


def _module_of(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The module holding parameter ``name`` (``….weight``), or None."""
    path, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return None
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


@torch.no_grad()
def collect_grams(lm: CausalLM, text: str, roles: Sequence[str] | None = None, *,
                  role_map: Mapping[str, str] | str | None = None, tokens: int = CALIBRATION_TOKENS,
                  context: int | None = None, progress: bool = False, label: str = "",
                  holdout: float = 0.0) -> Grams:
    """One forward pass over the first ``tokens`` tokens of ``text`` (windows of ``context``), accumulating the mean
    input Gram of every (role, layer) matrix of ``roles`` (default: every recognised role).

    Args:
        holdout: fraction of the tokens (the last ones, in windows of their own) whose Grams are also kept apart in
            :attr:`Grams.held` (0: none; at least 1 token is left on each side).

    Raises:
        ValueError: the text has fewer than 2 tokens, or a role's matrix is not a module's ``weight`` (one line).
    """
    t0 = time.perf_counter()
    by_role = assign_roles(lm.model.state_dict(), role_map)
    wanted = [r for r in (roles if roles is not None else by_role) if r in by_role]
    need = max(64, 8 * (tokens + 1))
    ids = lm.encode(text[:need])
    while len(ids) < tokens and need < len(text):
        need *= 2
        ids = lm.encode(text[:need])
    ids = torch.as_tensor(ids[:tokens], dtype=torch.long)
    if ids.numel() < 2:
        raise ValueError("calibration text has fewer than 2 tokens")
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout must be a fraction in [0, 1), got {holdout!r}")
    ctx = min(int(context or DEFAULT_CONTEXT), lm.max_context)
    n_held = min(max(int(round(holdout * ids.numel())), 1), ids.numel() - 1) if holdout > 0 else 0
    grams: dict[tuple[str, int], torch.Tensor] = {}
    held: dict[tuple[str, int], torch.Tensor] = {}
    alias: dict[tuple[str, int], tuple[str, int]] = {}
    first: dict[int, tuple[torch.Tensor, tuple[str, int]]] = {}  # id(input) → (input held alive, key), window 1
    state = {"first": True, "held": False}
    handles = []

    def hook_for(key: tuple[str, int]):
        def hook(mod, inp, out):
            if key in alias:
                return
            x = inp[0]
            if state["first"]:
                seen = first.get(id(x))
                if seen is not None and seen[0] is x:
                    alias[key] = seen[1]
                    return
                first[id(x)] = (x, key)
            x2 = x.reshape(-1, x.shape[-1]).float()
            g = grams.get(key)
            if g is None:
                g = grams[key] = torch.zeros(x2.shape[-1], x2.shape[-1], dtype=torch.float64)
            xx = (x2.mT @ x2).double()  # one window's product in float32, the running sums in float64
            g += xx
            if state["held"]:
                h = held.get(key)
                if h is None:
                    h = held[key] = torch.zeros_like(g)
                h += xx
        return hook

    try:
        for role in wanted:
            for rw in by_role[role]:
                mod = _module_of(lm.model, rw.name)
                if mod is None:
                    raise ValueError(f"role {role} layer {rw.layer}: {rw.name} is not a module's weight; calibration "
                                     "needs the matrix's module (use --calibration none for weight-only fits)")
                handles.append(mod.register_forward_hook(hook_for((role, rw.layer))))
        cut = ids.numel() - n_held  # the held-out part starts a window of its own
        spans = [(a, min(a + ctx, cut)) for a in range(0, cut, ctx)] + [
            (a, min(a + ctx, ids.numel())) for a in range(cut, ids.numel(), ctx)]
        n_win = len(spans)
        for j, (start, stop) in enumerate(spans):
            state["held"] = start >= cut
            lm.logits(ids[start:stop][None])
            state["first"] = False
            first.clear()
            if progress:
                el = time.perf_counter() - t0
                done = stop
                print(f"  [{j + 1}/{n_win} calibration windows] {label or lm.name}: {done} tokens  {el:.1f} s "
                      f"elapsed, ETA {el / done * (ids.numel() - done):.1f} s", file=sys.stderr, flush=True)
    finally:
        for h in handles:
            h.remove()
    T = int(ids.numel())
    for g in grams.values():
        g.div_(T)
    for h in held.values():
        h.div_(n_held)
    for key, src in alias.items():
        grams[key] = grams[src]
        if src in held:
            held[key] = held[src]
    return Grams(grams, T, "", time.perf_counter() - t0, held, n_held, ids[T - n_held:].clone() if n_held else None,
                 ctx)


def runnable_lm(source, progress: bool = False) -> CausalLM:
    """``source`` as a causal LM that calibration can run (:func:`~weightgeom.analysis.perplexity.load_causal_lm`).

    Raises:
        ValueError: the source cannot be run (one line saying to use weight-only fits, ``--calibration none``).
    """
    if isinstance(source, CausalLM):
        return source
    if not isinstance(source, (str, Path)):
        raise ValueError("calibration needs a model path (an HF directory, .gguf file or weightgeom checkpoint), not "
                         "an in-memory model; pass calibration=None for weight-only fits")
    t0 = time.perf_counter()
    if progress:
        print(f"loading {source} for calibration ...", file=sys.stderr, flush=True)
    try:
        lm = load_causal_lm(source)
    except (ValueError, FileNotFoundError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"calibration needs a model it can run ({first}); pass --calibration none for "
                         "weight-only fits") from None
    if progress:
        print(f"loaded {lm.name} ({lm.kind}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return lm


def source_grams(source, roles: Sequence[str], *, text: str | Path | None = None,
                 role_map: Mapping[str, str] | str | None = None, tokens: int = CALIBRATION_TOKENS,
                 progress: bool = False, holdout: float = 0.0) -> Grams:
    """Load ``source`` as a causal LM (:func:`~weightgeom.analysis.perplexity.load_causal_lm`: an HF directory, a
    .gguf file, a weightgeom checkpoint or run directory, or an already loaded ``CausalLM``) and :func:`collect_grams`
    on the calibration text ``text`` (:func:`calibration_text`), ``holdout`` of it kept apart as well.

    Raises:
        ValueError: the source cannot be run (an in-memory state dict, a bare weights file without config or
            tokenizer): one line saying to use weight-only fits (``--calibration none``).
    """
    body = calibration_text(text)
    lm = runnable_lm(source, progress)
    try:
        g = collect_grams(lm, body, roles, role_map=role_map, tokens=tokens, progress=progress, holdout=holdout)
    except ValueError:
        if role_map is None:
            raise
        # the runnable model's own names
        g = collect_grams(lm, body, roles, tokens=tokens, progress=progress, holdout=holdout)
    g.text = str(text) if text is not None else DEFAULT_CALIBRATION
    return g
