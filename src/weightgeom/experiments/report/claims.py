"""The three papers' claims as data: each claim, the rule that decides its verdict, and the findings of the runs.

A :class:`Claim` states what a paper says and the rule — a named margin or tolerance, never a judgement — that turns
measurements into a verdict (:data:`VERDICTS`). :func:`findings` measures every claim a set of runs tests, one
:class:`Finding` per claim and sweep; :func:`make_report` puts them at the top of ``report.md`` and into
``claims.json``. ``weightgeom claims`` merges the ``claims.json`` of several reports (the demo's and the recorded
sweeps') into the README's claims table and ``docs/results.md`` (:mod:`.claims_page`), so the report, the README and
the docs show one set of verdicts.

Verdicts are decided here and only here; the report sections' own verdict lines (e.g. the continuity section's) are
rendered from the same findings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from weightgeom.analysis.continuity import random_level_cos
from weightgeom.experiments.report.common import (
    RunData,
    diag_aggregate,
    final_value,
    group_runs,
    loss_series,
    run_file,
    tagged,
)
from weightgeom.experiments.report.continuity_data import EXPECTED_SPACE
from weightgeom.experiments.report.continuity_data import cont_curve as _cont_curve
from weightgeom.experiments.report.continuity_data import cont_summary as _cont_summary
from weightgeom.experiments.report.continuity_data import spread_mean as _spread_mean
from weightgeom.experiments.report.inputs import MANIFEST, META, Problems, load_json
from weightgeom.experiments.report.manifolds import _attn_manifold, head_saturation_series, study
from weightgeom.experiments.report.md import (
    ABLATION_CLAIMS,
    _tag,
    ablation_data,
    ablation_verdict,
    grid_edge_optima,
    lr_table,
    optimal_lrs,
    warmup_difference,
    warmup_points,
)

# ------------------------------------------------------------------------------------------------ the vocabulary
VERDICTS: dict[str, str] = {
    "reproduced": "the paper's direction holds beyond the claim's margin and, where the paper gives a figure, the "
                  "measurement lies within the claim's tolerance of it",
    "partly reproduced": "the direction holds beyond the margin, but the paper's figure lies outside the tolerance "
                         "or only part of the claim holds",
    "not reproduced": "the difference lies within the margin (no effect at this scale), or the parts disagree",
    "reversed": "the opposite direction, beyond the margin",
    "gain": "a future-work item built here beats every alternative beyond the margin",
    "no gain": "a future-work item built here does not beat every alternative beyond the margin",
    "inconclusive": "the runs cannot carry a verdict: decided from fewer than two seeds (\"1 seed\"), or the "
                    "difference lies inside the measured seed noise (\"within noise\"); the evidence names the "
                    "reason first and what the rule alone would read",
    "not tested": "no run here tests it",
}
"""Every verdict a claim can get, with what it means. "Not reproduced" means *not at this scale*, never "false"."""

# ------------------------------------------------------------------------------------------- named margins
COUNT_MARGIN = 0.25
"""Difference in the fraction of runs (diverged, or saturated) between DGram and Stiefel attention that counts as an
effect: a quarter of the runs, i.e. at least 2 of the 8 runs per geometry of the long sweep."""
GROWTH_FACTOR = 1.5
"""Factor by which one geometry's largest growth (last / first diagnostics step) must exceed the other's."""
SATURATION_SEEN = 0.05
"""A run saturates when, at some step, more than this fraction of a head's (or layer's) softmax rows is saturated
(largest probability above 0.99)."""
SEED_NOISE = 2.0
"""A val-loss difference between strategies counts when it exceeds this many times the largest seed standard
deviation among the compared strategies."""
CV_MARGIN = 0.1
"""Continuity difference (C_v, C_u in [0, 1]) that counts as an effect: twice the random level of C_v at width 256
(0.05). The continuity recipes run one seed, so no seed spread is available to set it."""
CV_TOLERANCE = 0.1
"""Distance from a figure the continuity paper gives (e.g. gradient C_v 0.93) within which ours matches it."""
PPL_MARGIN = 0.05
"""Relative perplexity difference between two compressed models that counts (5 %): the compression recipe evaluates
1024 tokens, over which the perplexity of the same model moves by less than this between text windows."""
LOSS_MARGIN = 0.005
"""Val-loss difference (nats) below which an MD comparison counts as no difference (the MD recipe runs one seed)."""
MATCH_MARGIN = 0.05
"""Val-loss difference (nats) within which a scale-controlled DGram-attention arm "matches" HETERO (the demo's
250-step strategy comparison measured a seed std of 0.04 nats). A val-loss comparison needs :data:`MIN_SEEDS` seeds
like any other: learning rates are not seeds, and a difference within :data:`SEED_NOISE` × the seed std of this
margin is undecided."""
MIN_SEEDS = 2
"""Fewest seeds a comparison needs for a verdict. Below it the verdict reads ``inconclusive`` with the reason
:data:`ONE_SEED`. The DGram-against-Stiefel chain claims pool runs over a learning-rate ladder, so there each side
needs this many independent settings: distinct (seed, Muon learning rate) pairs (two strategies at one seed and one
learning rate are not two replicates)."""
ONE_SEED = "1 seed"
"""Reason of an ``inconclusive`` verdict decided from fewer than :data:`MIN_SEEDS` seeds (or runs per side)."""
WITHIN_NOISE = "within noise"
"""Reason of an ``inconclusive`` verdict whose difference lies inside :data:`SEED_NOISE` × the seed std."""


# ---------------------------------------------------------------------------------------------- data classes
@dataclass(frozen=True)
class Claim:
    """One claim of one paper and the rule that decides its verdict.

    Attributes:
        key: stable identifier (``paper-topic``), the join key between reports, README and docs.
        paper: ``"manifold assignment"``, ``"continuity"`` or ``"MD"`` (the papers' short names).
        text: the claim as the paper makes it.
        rule: how the verdict is decided from the measurements, naming its margins.
        recipe: the recipe whose runs test it (``None``: no recipe here can).
        untested: why it is not tested, where no recipe is given.
    """

    key: str
    paper: str
    text: str
    rule: str
    recipe: str | None
    untested: str = ""


@dataclass(frozen=True)
class Finding:
    """A claim's verdict from one sweep.

    Attributes:
        key: the :class:`Claim`'s key.
        verdict: one of :data:`VERDICTS`.
        evidence: the measured numbers behind it, one sentence.
        source: the command that reproduces the sweep (e.g. ``weightgeom sweep manifolds long``).
        steps: the most training steps of a run in it (the longest-run finding heads a merged claim).
        runs: how many finished runs it used.
        device: the device kind the runs recorded (``"not recorded"`` for runs older than the record).
    """

    key: str
    verdict: str
    evidence: str
    source: str
    steps: int
    runs: int
    device: str

    def to_json(self) -> dict[str, Any]:
        """The finding as a JSON object (``claims.json``)."""
        return asdict(self)


R_DIVERGE = (f"fraction of runs diverged under DGram attention minus under Stiefel attention (same learning rates "
             f"and seeds): reproduced above {COUNT_MARGIN:g}, reversed below −{COUNT_MARGIN:g}, else not reproduced")
R_GROWTH = ("largest growth (last / first diagnostics step, largest layer) over the DGram-attention runs against the "
            f"Stiefel-attention runs: reproduced when it is more than {GROWTH_FACTOR:g}× larger, reversed when "
            f"{GROWTH_FACTOR:g}× smaller, else not reproduced")
UNTESTED_LONG_CONST = ("needs the sweep weightgeom sweep manifolds long-const (10,000 steps at a constant learning "
                       "rate, with QK-clip and σ-cap arms; ~12 CPU-hours); no recorded run yet")
R_CONTROL = ("over the (strategy, learning rate) settings of the constant-lr long runs where the plain DGram-attention "
             f"arm (ALL-DGRAM, HETERO-INV) saturates (a head's peak saturated fraction above {SATURATION_SEEN:g}) or "
             "diverges, the same arm with {control}: gain when it does neither at every such setting, no gain when it "
             f"still does at any; inconclusive (1 seed) when those settings span fewer than {MIN_SEEDS} learning rates "
             "or seeds (two strategies at one learning rate and seed are one replicate); no finding while no plain "
             "arm saturates or diverges")
CLAIMS: tuple[Claim, ...] = (
    Claim("ma-dgram-unstable", "manifold assignment", "DGram attention is unstable (ALL-DGRAM, HETERO-INV diverge; "
          "Stiefel attention does not)", R_DIVERGE, "manifolds"),
    Claim("ma-sigma-growth", "manifold assignment", "DGram lets σ_max(W_Q)·σ_max(W_K) grow",
          "σ_max(W_Q)·σ_max(W_K): " + R_GROWTH, "manifolds"),
    Claim("ma-logit-growth", "manifold assignment", "σ growth → attention-logit growth",
          "attention-logit max: " + R_GROWTH, "manifolds"),
    Claim("ma-saturation", "manifold assignment", "logit growth → softmax saturation",
          f"fraction of runs whose peak saturated fraction (a head's, else a layer's) exceeds {SATURATION_SEEN:g}, "
          f"DGram attention minus Stiefel attention: reproduced above {COUNT_MARGIN:g}, reversed below "
          f"−{COUNT_MARGIN:g}, else not reproduced", "manifolds"),
    Claim("ma-hetero-best", "manifold assignment", "Stiefel attention + DGram MLP (HETERO) is the best assignment",
          "mean final val loss of HETERO against the other constrained strategies (ALL-STIEFEL, ALL-DGRAM, "
          f"HETERO-INV): reproduced when HETERO is lowest by more than {SEED_NOISE:g}× the largest seed std, reversed "
          "when another strategy is lower by more than that, else inconclusive (within noise); inconclusive (1 seed) "
          f"when HETERO or the best other has fewer than {MIN_SEEDS} finished seeds", "manifolds"),
    Claim("ma-auto", "manifold assignment", "automatic assignment (the paper's future work)",
          f"gain when AUTO's mean final val loss is below every fixed constrained strategy's by more than "
          f"{SEED_NOISE:g}× the largest seed std, no gain when above it by more than that, else inconclusive "
          f"(within noise); inconclusive (1 seed) when AUTO or the best fixed strategy has fewer than {MIN_SEEDS} "
          "finished seeds", "manifolds"),
    Claim("ma-qk-clip", "manifold assignment", "QK-clip removes DGram attention's saturation or divergence (future "
          "work: the paper leaves open whether explicit scale control stabilises DGram attention)",
          R_CONTROL.format(control="QK-clip"), "manifolds", untested=UNTESTED_LONG_CONST),
    Claim("ma-sigma-cap", "manifold assignment", "the σ cap removes DGram attention's saturation or divergence (future "
          "work, as for QK-clip)", R_CONTROL.format(control="the σ cap"), "manifolds", untested=UNTESTED_LONG_CONST),
    Claim("ma-controlled-match", "manifold assignment", "with scale control, ALL-DGRAM / HETERO-INV match or beat "
          "HETERO (future work)",
          f"at each learning rate of the constant-lr long runs, the lowest mean final val loss over seeds of a "
          f"scale-controlled DGram-attention arm (ALL-DGRAM or HETERO-INV with QK-clip or the σ cap; a diverged seed "
          f"counts as worse) minus HETERO's mean: gain when at most {MATCH_MARGIN:g} nats at every learning rate, no "
          f"gain when above at any; inconclusive (1 seed) with fewer than {MIN_SEEDS} seeds of either, inconclusive "
          f"(within noise) when the deciding differences lie within {SEED_NOISE:g}× the seed std of the "
          f"{MATCH_MARGIN:g}-nat margin", "manifolds",
          untested=UNTESTED_LONG_CONST),
    Claim("c-nores", "continuity", "without residual connections gradient continuity collapses (≈ 0.05, the random "
          "level)", f"NoRes gradient C_v against Res+ReLU's: the direction holds when lower by more than "
          f"{CV_MARGIN:g}; reproduced when also within {CV_TOLERANCE:g} of the paper's 0.05, partly reproduced when "
          f"not; reversed when higher by more than {CV_MARGIN:g}", "continuity"),
    Claim("c-symmetry", "continuity", "residuals without a symmetry-breaking activation: gradients continuous, "
          "weights not (gradient C_v 0.93, weight C_v 0.22)",
          f"Res+None and Res+Radial: the direction holds when weight C_v is below Res+ReLU's by more than "
          f"{CV_MARGIN:g} and (Res+None) gradient C_v above its weight C_v by more than {CV_MARGIN:g}; reproduced when "
          f"also within {CV_TOLERANCE:g} of the paper's 0.93 / 0.22, partly reproduced when not", "continuity"),
    Claim("c-dominance", "continuity", "weight continuity follows once ‖ΔW‖ dominates ‖W₀‖",
          "over every arm: reproduced when each arm whose final weight C_v exceeds 0.5 has crossed "
          "‖ΔW‖/‖W₀‖ = 1; not reproduced when an arm exceeds 0.5 without crossing", "continuity"),
    Claim("c-optimizer", "continuity", "continuity is not an optimizer artifact (Adam β2 = 0)",
          "Adam β2 = 0 weight C_v at least half of Res+ReLU's (Adam): reproduced, else not reproduced",
          "continuity"),
    Claim("c-v1", "continuity", "an element-wise activation concentrates continuity in v1",
          "Res+ReLU C_v(v1) at least twice the mean C_v(v2..vk): reproduced; reversed when the mean is at least "
          "C_v(v1); else not reproduced", "continuity"),
    Claim("c-layernorm", "continuity", "LayerNorm spreads continuity over several singular directions",
          "Res+LN mean C_v(v2..vk) above Res+ReLU's and Res+None's, and its v1 share below Res+ReLU's: reproduced "
          "when both hold, reversed when neither, else not reproduced", "continuity"),
    Claim("c-both", "continuity", "activation + LayerNorm: the activation's v1 mode dominates",
          "Res+ReLU+LN v1 share nearer Res+ReLU's than Res+LN's: reproduced; reversed when at or past Res+LN's; "
          "else not reproduced", "continuity"),
    Claim("c-llama", "continuity", "Llama: Q, K, Gate, Up continuous in input space; O, Down in output space; V low "
          "in both", "per activation arm, Q, K, Gate, Up with C_v > C_u, O, Down with C_u > C_v, V below every other "
          "projection in its space: reproduced when all 7 match in every arm, partly reproduced when the 6 other "
          "than V do, else not reproduced", "continuity"),
    Claim("c-pretrained", "continuity", "pretrained checkpoints are continuous; sharing a basis must respect each "
          "projection's space (input for Q, K, Gate, Up; output for O, Down)",
          f"every projection compressed at once with activation-aware fits, at matched parameter savings: each role "
          f"shared in the paper's space against each in the other space and against per-layer whitened SVD; "
          f"reproduced when the paper's spaces give a perplexity lower than both by more than {PPL_MARGIN:.0%} at "
          f"every level, partly reproduced when lower than the other space's only, reversed when the other space's "
          f"is lower by more than that at every level, inconclusive when a difference lies within {PPL_MARGIN:.0%} "
          f"(the window-to-window noise of 1024 tokens) at some level or the models disagree, else not reproduced "
          f"(per-role weight-only sweeps: a role counts when its space wins by more than {PPL_MARGIN:.0%} at every "
          f"level)", "compress"),
    Claim("md-transfer", "MD", "the optimal LR transfers across width with MD",
          "spread of the optimal LR over widths (grid steps), MD against its base optimizer: reproduced when "
          "smaller for every base, reversed when larger for every base, else not reproduced", "md"),
    Claim("md-beats-base", "MD", "MD beats its base optimizer",
          f"best val loss per width, MD minus base: reproduced when below −{LOSS_MARGIN:g} at every (base, width), "
          f"reversed when above {LOSS_MARGIN:g} at every one, partly reproduced when below at some and above at "
          "none, else not reproduced", "md"),
    Claim("md-warmup", "MD", "MD needs no warmup",
          "val loss with warmup minus without, per MD optimizer: reproduced when warmup helps none by more than "
          "0.01, reversed when it helps every one by more, else not reproduced", "md"),
    Claim("md-gains", "MD", "row+col gains beat scalar and single-axis gains",
          f"row+col against every other setting, per MD optimizer: reproduced when better by more than "
          f"{LOSS_MARGIN:g} nats, reversed when worst, else not reproduced; partly reproduced when the optimizers "
          "disagree and one reproduces", "md"),
    Claim("md-softplus", "MD", "softplus gains are slightly more consistent than exp or direct",
          f"softplus against exp and direct, per MD optimizer: as for the gains ({LOSS_MARGIN:g} nats)", "md"),
    Claim("md-frobenius", "MD", "the Frobenius sphere is about as good as row / col spheres",
          "Frobenius against row and col, per MD optimizer: reproduced when all lie within 0.02 nats, reversed "
          "when Frobenius is worst beyond that, else not reproduced", "md"),
    Claim("md-embeddings", "MD", "unit-L2-norm embeddings are slightly better than unconstrained ones",
          f"unit rows against unconstrained embeddings, per MD optimizer: as for the gains ({LOSS_MARGIN:g} nats)",
          "md"),
    Claim("md-compute", "MD", "Muon+MD saves about 2× compute over AdamW (large MoE)", "", None,
          "needs a large mixture-of-experts model; the MD benchmark measures MD's per-step overhead only"),
)
"""Every claim, in the order the README shows them."""

CLAIM_BY_KEY = {c.key: c for c in CLAIMS}


# ------------------------------------------------------------------------------------------------ helpers
def _mean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return float(np.mean(xs)) if xs else math.nan


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) and math.isfinite(x) else "—"


def _steps(runs: Sequence[RunData]) -> int:
    steps = [int(s) for r in runs if isinstance(s := r.status.get("step"), int) and not isinstance(s, bool)]
    return max(steps, default=0)


def _device(runs: Sequence[RunData], meta: Callable[[RunData], dict]) -> str:
    kinds = sorted({str(k) for r in runs if isinstance(k := meta(r).get("device_kind"), str) and k})
    return ", ".join(kinds) if kinds else "not recorded"


def inconclusive(verdict: str, evidence: str, reason: str) -> tuple[str, str]:
    """``("inconclusive", evidence)`` for a comparison the runs cannot carry: the evidence starts with ``reason``
    (:data:`ONE_SEED` or :data:`WITHIN_NOISE`) and ends with what the claim's rule alone would read."""
    return "inconclusive", f"{reason} — {evidence}; by its rule alone: {verdict}"


def inconclusive_reason(finding: Finding) -> str:
    """The reason an ``inconclusive`` finding names (its evidence up to the first " — "); ``""`` for any other."""
    return finding.evidence.split(" — ")[0] if finding.verdict == "inconclusive" else ""


def seeds_of(runs: Sequence[RunData]) -> int:
    """How many distinct seeds ``runs`` were trained with (a run without a recorded seed counts as seed 0)."""
    return len({r.seed if r.seed is not None else 0 for r in runs})


def replicates(runs: Sequence[RunData]) -> int:
    """How many distinct (seed, Muon learning rate) settings ``runs`` were trained at (the chain claims' replicates,
    :data:`MIN_SEEDS`)."""
    def lr(r: RunData) -> Any:
        return ((r.config.get("optim") or {}).get("muon") or {}).get("lr")
    return len({(r.seed if r.seed is not None else 0, lr(r)) for r in runs})


def seed_gate(out: list[tuple[str, str, str, list[RunData]]]) -> list[tuple[str, str, str, list[RunData]]]:
    """Each finding decided from fewer than :data:`MIN_SEEDS` seeds made ``inconclusive`` (:data:`ONE_SEED`)."""
    return [(k, *inconclusive(v, e, ONE_SEED), used) if v != "inconclusive" and seeds_of(used) < MIN_SEEDS
            else (k, v, e, used) for k, v, e, used in out]


def _meta(run: RunData) -> dict:
    return run_file(run, "meta.json", META) or {}


def source_of(directory: Path, problems: Problems | None = None) -> str:
    """The command that reproduces the sweep in ``directory``, from its ``sweep.json`` (``weightgeom sweep RECIPE
    PRESET``, noting ``weightgeom demo`` where the demo ran it); the directory's name without one."""
    man = load_json(Path(directory) / "sweep.json", MANIFEST, problems or Problems())
    if not man or not man.get("recipe") or not man.get("label"):
        return f"runs in {Path(directory).name}"
    cmd = f"weightgeom sweep {man['recipe']} {man['label']}"
    ran = str(man.get("command") or "")
    return cmd + (" (in weightgeom demo)" if " demo" in ran else "")


UNFINISHED_NOTE = re.compile(r" \(decided while (at least \d+ of the sweep's|\d+ of the sweep's \d+) runs were not "
                             r"finished\)$")
"""The note :func:`unfinished_note` appends to a finding's evidence (matched to tell a finding read mid-sweep from
the same finding read when the sweep was done)."""


def unfinished_note(directory: Path, finished: Sequence[RunData]) -> str:
    """``" (decided while N of the sweep's M runs were not finished)"`` when the ``sweep.json`` in ``directory``
    lists runs (each name counted once) that are pending, running or failed and not among ``finished`` (a sweep
    still running, or stopped to be resumed), so a verdict read from part of a sweep says so; ``""`` otherwise or
    without a readable manifest. Runs the sweep skipped by its own rule, and runs it records as done whose directory
    is elsewhere, are not counted."""
    problems = Problems()
    man = load_json(Path(directory) / "sweep.json", MANIFEST, problems)
    status: dict[str, Any] = {}
    for r in (man or {}).get("runs") or []:
        if isinstance(r, dict) and isinstance(r.get("name"), str):
            status.setdefault(r["name"], r.get("status"))
    done = {r.path.name for r in finished}
    left = [n for n, st in status.items() if n not in done and st not in ("done", "diverged", "skipped")]
    if not left:
        return ""
    if problems:  # a manifest the reader cut short (e.g. over its list limit): the counts are lower bounds
        return f" (decided while at least {len(left)} of the sweep's runs were not finished)"
    return f" (decided while {len(left)} of the sweep's {len(status)} runs were not finished)"


# ------------------------------------------------------------------------------- manifold assignment
def _attn(run: RunData) -> str:
    """The run's attention geometry as the manifold report names it, marked ``+md`` under the MD wrapper (whose
    sphere fixes the attention scale, so it is compared with neither plain geometry)."""
    name = str((run.config.get("optim") or {}).get("name", ""))
    return _attn_manifold(run) + ("+md" if name.endswith("-md") else "")


def _growth(s: pd.Series) -> float:
    s = s[np.isfinite(s.values)] if len(s) else s
    if len(s) < 2 or not float(s.iloc[0]) > 0:
        return math.nan
    return float(s.iloc[-1]) / float(s.iloc[0])


def chain_record(run: RunData) -> dict[str, Any]:
    """One run's links of the chain: attention geometry, diverged, σQ·σK and logit-max growth (last / first
    diagnostics step, largest layer), and peak saturation (largest head's where ``heads.jsonl`` exists, else the
    largest layer's)."""
    sat = head_saturation_series(run)
    if not len(sat):
        sat = diag_aggregate(run, "saturation")
    sat = sat[np.isfinite(sat.values)] if len(sat) else sat
    return {"attn": _attn(run), "diverged": run.diverged,
            "sigma": _growth(diag_aggregate(run, "qk_sigma_prod")), "logit": _growth(diag_aggregate(run, "logit_max")),
            "sat": float(sat.max()) if len(sat) else math.nan}


def _fraction(recs: Sequence[dict], pred: Callable[[dict], bool]) -> tuple[float, int]:
    n = sum(bool(pred(r)) for r in recs)
    return (n / len(recs) if recs else math.nan), n


def _count_verdict(diff: float) -> str:
    if diff > COUNT_MARGIN:
        return "reproduced"
    if diff < -COUNT_MARGIN:
        return "reversed"
    return "not reproduced"


def _growth_verdict(d: float, s: float) -> str | None:
    if not (math.isfinite(d) and math.isfinite(s)) or d <= 0 or s <= 0:
        return None
    if d > GROWTH_FACTOR * s:
        return "reproduced"
    if s > GROWTH_FACTOR * d:
        return "reversed"
    return "not reproduced"


STUDY_NAMES = {"main": "strategy comparison", "boundary": "stability boundary", "mechanism": "mechanism",
               "long": "long runs", "attribution": "attribution"}


def manifolds_findings(runs: Sequence[RunData]) -> list[tuple[str, str, str, list[RunData]]]:
    """(key, verdict, evidence, runs used) for the manifold-assignment claims these runs test."""
    out: list[tuple[str, str, str, list[RunData]]] = []
    by_study: dict[str, list[RunData]] = {}
    for r in runs:
        by_study.setdefault(study(r), []).append(r)
    for name, rs in by_study.items():
        recs = [(r, chain_record(r)) for r in rs]
        dg = [(r, c) for r, c in recs if c["attn"] == "dgram"]
        st = [(r, c) for r, c in recs if c["attn"] == "stiefel"]
        if not dg or not st:
            continue
        used = [r for r, _ in dg + st]
        dgc, stc = [c for _, c in dg], [c for _, c in st]
        chain_from = len(out)
        fd, nd = _fraction(dgc, lambda c: c["diverged"])
        fs, ns = _fraction(stc, lambda c: c["diverged"])
        out.append(("ma-dgram-unstable", _count_verdict(fd - fs),
                    f"{nd} of {len(dgc)} DGram-attention and {ns} of {len(stc)} Stiefel-attention runs diverge "
                    f"({STUDY_NAMES.get(name, name)})", used))
        for key, link, label in (("ma-sigma-growth", "sigma", "σ_max(W_Q)·σ_max(W_K)"),
                                 ("ma-logit-growth", "logit", "logit max")):
            d = max((c[link] for c in dgc if math.isfinite(c[link])), default=math.nan)
            s = max((c[link] for c in stc if math.isfinite(c[link])), default=math.nan)
            v = _growth_verdict(d, s)
            if v is not None:
                out.append((key, v, f"{label} ×{_f(d, 1)} under DGram attention vs ×{_f(s, 1)} under Stiefel "
                                    f"(largest growth, {STUDY_NAMES.get(name, name)})", used))
        if any(math.isfinite(c["sat"]) for c in dgc + stc):
            fd, nd = _fraction(dgc, lambda c: c["sat"] > SATURATION_SEEN)
            fs, ns = _fraction(stc, lambda c: c["sat"] > SATURATION_SEEN)
            peak_d = max((c["sat"] for c in dgc if math.isfinite(c["sat"])), default=math.nan)
            peak_s = max((c["sat"] for c in stc if math.isfinite(c["sat"])), default=math.nan)
            out.append(("ma-saturation", _count_verdict(fd - fs),
                        f"saturated fraction above {SATURATION_SEEN:g} in {nd} of {len(dgc)} DGram-attention runs "
                        f"(peak {_f(peak_d)}) vs {ns} of {len(stc)} Stiefel (peak {_f(peak_s)}) "
                        f"({STUDY_NAMES.get(name, name)})", used))
        if min(replicates([r for r, _ in dg]), replicates([r for r, _ in st])) < MIN_SEEDS:
            out[chain_from:] = [(k, *inconclusive(v, e, ONE_SEED), u) for k, v, e, u in out[chain_from:]]
        if name == "main":
            out += _strategy_findings(rs)
    if "long" in by_study:
        out += scale_control_findings(by_study["long"])
    return out


CONSTRAINED = ("all-stiefel", "all-dgram", "hetero", "hetero-inv")
CONTROL_CLAIMS = {"qk-clip": "ma-qk-clip", "sigma-cap": "ma-sigma-cap"}
"""A long run's ``control`` tag -> the claim on whether that scale control stabilises DGram attention."""


def scale_control_findings(runs: Sequence[RunData]) -> list[tuple[str, str, str, list[RunData]]]:
    """(key, verdict, evidence, runs used) of the scale-control claims (``ma-qk-clip``, ``ma-sigma-cap``,
    ``ma-controlled-match``) from long runs tagged ``strategy``, ``lr_multiplier`` and, for a scale-controlled arm,
    ``control`` (preset ``long-const``), each seed its own setting; nothing without a controlled arm."""
    def key(r: RunData) -> tuple[str, Any, int]:
        return str(r.tags.get("strategy")), r.tags.get("lr_multiplier"), r.seed if r.seed is not None else 0

    plain = {key(r): r for r in runs if not r.tags.get("control")}
    ctrl = {(str(r.tags["control"]), *key(r)): r for r in runs if r.tags.get("control")}
    if not ctrl:
        return []
    several = len({k[-1] for k in (*plain, *ctrl)}) > 1

    def bad(r: RunData) -> bool:
        return r.diverged or chain_record(r)["sat"] > SATURATION_SEEN

    def what(r: RunData) -> str:
        return "diverges" if r.diverged else f"peak saturation {_f(chain_record(r)['sat'])}"

    def label(k: tuple[str, Any, int]) -> str:
        return f"{k[0].upper()} ×{k[1]:g}" + (f" seed {k[2]}" if several else "")

    def setting(r: RunData) -> str:
        """The control's own setting from the run's experiment.json, e.g. ``" (τ 10)"``; "" when unreadable."""
        c = r.experiment.get("controls")
        c = c if isinstance(c, dict) else {}
        qk = c.get("qk_clip")
        tau = qk.get("tau") if isinstance(qk, dict) else None
        cap = c.get("sigma_cap")
        if isinstance(tau, (int, float)) and not isinstance(tau, bool):
            return f" (τ {tau:g})"
        return f" (σ ≤ {cap:g})" if isinstance(cap, (int, float)) and not isinstance(cap, bool) else ""

    out: list[tuple[str, str, str, list[RunData]]] = []
    hit = {k: r for k, r in plain.items() if k[0] in ("all-dgram", "hetero-inv") and bad(r)}
    for c, claim in CONTROL_CLAIMS.items():
        pairs = [(k, r, ctrl.get((c, *k))) for k, r in hit.items()]
        pairs = [x for x in pairs if x[2] is not None]
        if not pairs:
            continue
        kept = [(k, r, rc) for k, r, rc in pairs if bad(rc)]
        ev = "; ".join(f"{label(k)}: {what(r)} → with {c}{setting(rc)} {what(rc)}" for k, r, rc in pairs)
        used = [r for _, r, rc in pairs for r in (r, rc)]
        verdict = "no gain" if kept else "gain"
        if replicates([r for _, r, _ in pairs]) < MIN_SEEDS:
            verdict, ev = inconclusive(verdict, ev, ONE_SEED)
        out.append((claim, verdict, ev, used))
    match = controlled_match(plain, ctrl)
    return out + ([match] if match else [])


def controlled_match(plain: dict[tuple, RunData], ctrl: dict[tuple, RunData]
                     ) -> tuple[str, str, str, list[RunData]] | None:
    """``ma-controlled-match`` from the constant-lr long runs keyed (strategy, lr multiplier, seed) and, for the
    scale-controlled arms, (control, strategy, lr multiplier, seed): per learning rate the best controlled
    DGram-attention arm's mean final val loss over seeds (a diverged seed makes it infinite) minus HETERO's; None
    when no learning rate has both."""
    def val(r: RunData) -> float:
        return math.inf if r.diverged else final_value(loss_series(r, "val"))

    def std(v: Sequence[float]) -> float:
        v = [x for x in v if math.isfinite(x)]
        return float(np.std(v, ddof=1)) if len(v) > 1 else 0.0

    rows, used = [], []
    for m in sorted({k[1] for k in plain if k[0] == "hetero"}, key=float):
        het = [r for k, r in plain.items() if k[:2] == ("hetero", m)]
        hv = [val(r) for r in het]
        arms: dict[tuple[str, str], list[RunData]] = {}
        for (c, s, mm, _), r in ctrl.items():
            if mm == m and s in ("all-dgram", "hetero-inv"):
                arms.setdefault((s, c), []).append(r)
        means = {a: float(np.mean([val(r) for r in rs])) for a, rs in arms.items()}
        means = {a: v for a, v in means.items() if not math.isnan(v)}
        if not means or not all(math.isfinite(v) for v in hv):
            continue
        best = min(means, key=means.get)
        h = float(np.mean(hv))
        bv = [val(r) for r in arms[best]]
        rows.append((m, means[best] - h, best, h, min(len(hv), len(bv)), max(std(hv), std(bv))))
        used += [*het, *(r for rs in arms.values() for r in rs)]
    if not rows:
        return None
    verdict = "no gain" if any(not d <= MATCH_MARGIN for _, d, *_ in rows) else "gain"
    ev = "; ".join(f"×{m:g}: best controlled {s}+{c} {_f(h + d, 3)} vs HETERO {h:.3f} ({d:+.3f}"
                   + (f", mean of {n} seeds, seed std {sd:.3f})" if n > 1 else ")")
                   for m, d, (s, c), h, n, sd in rows) + f" (match margin {MATCH_MARGIN:g} nats)"
    if min(n for *_, n, _ in rows) < MIN_SEEDS:
        return ("ma-controlled-match", *inconclusive(verdict, ev, ONE_SEED), used)
    if verdict == "no gain":  # some rate clearly above the margin
        decided = any(d > MATCH_MARGIN + SEED_NOISE * sd for _, d, _, _, _, sd in rows)
    else:  # every rate clearly within it
        decided = all(d <= MATCH_MARGIN - SEED_NOISE * sd for _, d, _, _, _, sd in rows)
    if not decided:
        return ("ma-controlled-match", *inconclusive(verdict, ev, WITHIN_NOISE), used)
    return "ma-controlled-match", verdict, ev, used


def _strategy_findings(runs: Sequence[RunData]) -> list[tuple[str, str, str, list[RunData]]]:
    groups = group_runs(runs)
    finals = {n: [final_value(loss_series(r, "val")) for r in groups[n] if not r.diverged]
              for n in (*CONSTRAINED, "auto") if n in groups}
    finals = {n: [x for x in v if math.isfinite(x)] for n, v in finals.items()}
    finals = {n: v for n, v in finals.items() if v}
    fixed = {n: v for n, v in finals.items() if n in CONSTRAINED}
    out: list[tuple[str, str, str, list[RunData]]] = []
    if "hetero" not in fixed or len(fixed) < 2:
        return out
    noise = max((float(np.std(v, ddof=1)) for v in finals.values() if len(v) > 1), default=0.0)
    margin = SEED_NOISE * noise
    means = {n: float(np.mean(v)) for n, v in finals.items()}
    others = {n: m for n, m in means.items() if n in CONSTRAINED and n != "hetero"}
    best_other = min(others, key=others.get)
    gap = means["hetero"] - others[best_other]
    verdict = "reproduced" if gap < -margin else ("reversed" if gap > margin else "not reproduced")
    rank = sorted((means[n], n) for n in fixed).index((means["hetero"], "hetero")) + 1
    used = [r for n in finals for r in groups[n]]
    ev = (f"HETERO {means['hetero']:.3f} ranks {rank} of {len(fixed)} constrained strategies; best "
          f"{best_other.upper()} {others[best_other]:.3f} (margin {margin:.3f} = {SEED_NOISE:g}× seed std {noise:.3f})")
    out.append(("ma-hetero-best", *_evidence_gate(verdict, ev, gap, margin,
                                                  [finals["hetero"], finals[best_other]]), used))
    if "auto" in means:
        best_fixed = min((n for n in fixed), key=means.get)
        d = means["auto"] - means[best_fixed]
        ev = (f"AUTO {means['auto']:.3f} vs the best fixed strategy {best_fixed.upper()} {means[best_fixed]:.3f} "
              f"(margin {margin:.3f})")
        out.append(("ma-auto", *_evidence_gate("gain" if d < -margin else "no gain", ev, d, margin,
                                               [finals["auto"], finals[best_fixed]]), used))
    return out


def _evidence_gate(verdict: str, evidence: str, gap: float, margin: float,
                   compared: Sequence[Sequence[float]]) -> tuple[str, str]:
    """A seed-noise comparison's verdict, ``inconclusive`` when a compared strategy has fewer than
    :data:`MIN_SEEDS` finished seeds (its noise is unmeasured) or the gap lies inside the margin."""
    if min(len(v) for v in compared) < MIN_SEEDS:
        return inconclusive(verdict, evidence, ONE_SEED)
    if abs(gap) <= margin:
        return inconclusive(verdict, evidence, WITHIN_NOISE)
    return verdict, evidence


# ------------------------------------------------------------------------------------------------ continuity
def _cv(groups: dict[str, list[RunData]], name: str, kind: str, key: str) -> float:
    return _mean([_cont_summary(r, kind).get(key, math.nan) for r in groups.get(name) or [] if not r.diverged])


def _direction_verdict(direction: bool, opposite: bool, figure_ok: bool) -> str:
    if direction:
        return "reproduced" if figure_ok else "partly reproduced"
    return "reversed" if opposite else "not reproduced"


def continuity_findings(runs: Sequence[RunData]) -> list[tuple[str, str, str, list[RunData]]]:
    """(key, verdict, evidence, runs used) for the continuity claims these runs test (residual-MLP and Llama
    parts)."""
    mlp = [r for r in runs if r.experiment.get("part", r.config.get("model", {}).get("kind")) != "llama"]
    llama = [r for r in runs if r.experiment.get("part", r.config.get("model", {}).get("kind")) == "llama"]
    out: list[tuple[str, str, str, list[RunData]]] = []
    g = group_runs(mlp) if mlp else {}
    base_w, base_g = _cv(g, "res-relu", "weight", "cv"), _cv(g, "res-relu", "grad", "cv")
    widths = sorted({int(r.config.get("model", {}).get("width", 256)) for r in mlp}) or [256]
    rnd = random_level_cos(widths[0])
    nores = _cv(g, "nores", "grad", "cv")
    if math.isfinite(nores) and math.isfinite(base_g):
        out.append(("c-nores", _direction_verdict(nores < base_g - CV_MARGIN, nores > base_g + CV_MARGIN,
                                                  abs(nores - 0.05) <= CV_TOLERANCE),
                    f"NoRes gradient C_v {nores:.2f} vs Res+ReLU {base_g:.2f} (random level {rnd:.2f}, paper 0.05)",
                    g["nores"] + g["res-relu"]))
    gn, wn = _cv(g, "res-none", "grad", "cv"), _cv(g, "res-none", "weight", "cv")
    wr = _cv(g, "res-radial", "weight", "cv")
    if math.isfinite(gn) and math.isfinite(wn) and math.isfinite(base_w):
        ws = [w for w in (wn, wr) if math.isfinite(w)]
        direction = gn > wn + CV_MARGIN and all(w < base_w - CV_MARGIN for w in ws)
        opposite = all(w > base_w + CV_MARGIN for w in ws)
        figure = abs(gn - 0.93) <= CV_TOLERANCE and all(abs(w - 0.22) <= CV_TOLERANCE for w in ws)
        used = g["res-none"] + g.get("res-radial", []) + g["res-relu"]
        out.append(("c-symmetry", _direction_verdict(direction, opposite, figure),
                    f"Res+None gradient / weight C_v {gn:.2f} / {wn:.2f}"
                    + (f", Res+Radial weight {wr:.2f}" if math.isfinite(wr) else "")
                    + f" vs Res+ReLU weight {base_w:.2f} (paper 0.93 / 0.22)", used))
    dom = _dominance(g)
    if dom:
        early = [(n, w, d) for n, w, d in dom if w > 0.5 and d < 1.0]
        high = [x for x in dom if x[1] > 0.5]
        if early:
            n, w, d = max(early, key=lambda x: x[1])
            ev = (f"{len(early)} of {len(high)} arms reach weight C_v > 0.5 without ‖ΔW‖/‖W₀‖ crossing 1 (e.g. "
                  f"{n}: C_v {w:.2f} at {d:.2f})")
            verdict = "not reproduced"
        else:
            ev = f"every arm with weight C_v > 0.5 ({len(high)}) crossed ‖ΔW‖/‖W₀‖ = 1"
            verdict = "reproduced" if high else "not reproduced"
        out.append(("c-dominance", verdict, ev, [r for rs in g.values() for r in rs]))
    rs_b2 = g.get("adam-b2-0") or []
    wb = _cv(g, "adam-b2-0", "weight", "cv")
    if rs_b2 and math.isfinite(wb) and math.isfinite(base_w):
        db, dbase = _cv(g, "adam-b2-0", "delta", "cv"), _cv(g, "res-relu", "delta", "cv")
        dom_b = _cv(g, "adam-b2-0", "delta", "dominance")
        out.append(("c-optimizer", "reproduced" if wb >= 0.5 * base_w else "not reproduced",
                    f"β2 = 0 weight C_v {wb:.2f} vs Adam {base_w:.2f}; its update's C_v {_f(db)} vs {_f(dbase)} at "
                    f"‖ΔW‖/‖W₀‖ {_f(dom_b)}", rs_b2 + g["res-relu"]))
    out += _spread_findings(g)
    if llama:
        out += _llama_findings(llama)
    return seed_gate(out)


def _dominance(g: dict[str, list[RunData]]) -> list[tuple[str, float, float]]:
    """(arm, final weight C_v, largest ‖ΔW‖/‖W₀‖ reached) per residual-MLP arm."""
    out = []
    for name, rs in g.items():
        w = _cv(g, name, "weight", "cv")
        dmax = _mean([float(s.max()) for r in rs if not r.diverged
                      and len(s := _cont_curve(r, "delta", "dominance").dropna())])
        if math.isfinite(w) and math.isfinite(dmax):
            out.append((name, w, dmax))
    return out


def spread_findings(groups: dict[str, list[RunData]]) -> list[tuple[str, str, str]]:
    """(key, verdict, evidence) of the three activation / LayerNorm claims from the top-k spread of the final
    weights."""

    def get(name: str, key: str) -> float:
        return _spread_mean(groups.get(name) or [], key)

    out = []
    c1, rest, share = get("res-relu", "cv_dir1"), get("res-relu", "cv_rest"), get("res-relu", "v1_share")
    if math.isfinite(c1) and math.isfinite(rest):
        verdict = "reproduced" if c1 >= 2 * rest else ("reversed" if rest >= c1 else "not reproduced")
        out.append(("c-v1", verdict, f"Res+ReLU C_v(v1) {c1:.2f} vs mean C_v(v2..vk) {rest:.2f} (v1 share "
                                     f"{share:.2f})"))
    ln_rest, ln_share = get("res-ln", "cv_rest"), get("res-ln", "v1_share")
    none_rest = get("res-none", "cv_rest")
    if math.isfinite(ln_rest) and math.isfinite(rest):
        more = ln_rest > rest and (not math.isfinite(none_rest) or ln_rest > none_rest)
        less_v1 = math.isfinite(ln_share) and math.isfinite(share) and ln_share < share
        verdict = "reproduced" if more and less_v1 else ("reversed" if not more and not less_v1
                                                          else "not reproduced")
        out.append(("c-layernorm", verdict,
                    f"Res+LN mean C_v(v2..vk) {ln_rest:.2f} vs Res+ReLU {rest:.2f}"
                    + (f" and Res+None {none_rest:.2f}" if math.isfinite(none_rest) else "")
                    + f"; v1 share {ln_share:.2f} vs {share:.2f}"))
    both = get("res-relu-ln", "v1_share")
    if all(map(math.isfinite, (both, share, ln_share))):
        closer = abs(both - share) < abs(both - ln_share)
        beyond = (both - ln_share) * (share - ln_share) <= 0
        out.append(("c-both", "reproduced" if closer else ("reversed" if beyond else "not reproduced"),
                    f"Res+ReLU+LN v1 share {both:.2f} (C_v(v1) {get('res-relu-ln', 'cv_dir1'):.2f}) vs Res+ReLU "
                    f"{share:.2f} and Res+LN {ln_share:.2f}"))
    runs = [r for rs in groups.values() for r in rs]
    return [(k, v, e) for k, v, e, _ in seed_gate([(k, v, e, runs) for k, v, e in out])]


def _spread_findings(g: dict[str, list[RunData]]) -> list[tuple[str, str, str, list[RunData]]]:
    names = ("res-relu", "res-ln", "res-none", "res-relu-ln")
    used = [r for n in names for r in g.get(n, [])]
    return [(k, v, e, used) for k, v, e in spread_findings(g)]


def llama_matches(runs: Sequence[RunData]) -> dict[str, tuple[int, int, bool]]:
    """Per Llama arm: (projections matching the paper's space other than V, how many were measured, V low)."""
    out = {}
    for name, rs in group_runs(runs).items():
        vals = {}
        for role in EXPECTED_SPACE:
            cv = _mean([final_value(_cont_curve(r, "weight", "cv", role)) for r in rs])
            cu = _mean([final_value(_cont_curve(r, "weight", "cu", role)) for r in rs])
            if math.isfinite(cv) and math.isfinite(cu):
                vals[role] = (cv, cu)
        six = [k for k in vals if k != "v"]
        match = sum((vals[k][0] > vals[k][1]) == (EXPECTED_SPACE[k] == "v1") for k in six)
        others = [vals[k][0 if EXPECTED_SPACE[k] == "v1" else 1] for k in six]
        v_low = "v" in vals and bool(others) and max(vals["v"]) < min(others)
        out[name] = (match, len(six), v_low)
    return out


def _llama_findings(runs: Sequence[RunData]) -> list[tuple[str, str, str, list[RunData]]]:
    m = llama_matches(runs)
    if not m:
        return []
    six = all(a == b == 6 for a, b, _ in m.values())
    seven = six and all(v for _, _, v in m.values())
    verdict = "reproduced" if seven else ("partly reproduced" if six else "not reproduced")
    arms = "; ".join(f"{n} {a + v}/{b + 1}" for n, (a, b, v) in m.items())
    v_low = sum(v for _, _, v in m.values())
    return [("c-llama", verdict, f"projections matching the paper's space per activation arm: {arms} (V low in both "
                                 f"in {v_low} of {len(m)} arms)", list(runs))]


# ------------------------------------------------------------------------------------------------------- MD
MD_PAIRS = (("adamw", "adamw-md"), ("muon", "muon-md"))
"""(base optimizer, the same wrapped in MD) as the MD recipe names them."""


def md_findings(runs: Sequence[RunData]) -> list[tuple[str, str, str, list[RunData]]]:
    """(key, verdict, evidence, runs used) for the MD claims these runs test."""
    runs = tagged(runs, ("optimizer", "width", "lr"), "the MD claims")
    lr_runs = [r for r in runs if _tag(r, "kind", "lr") == "lr"]
    out: list[tuple[str, str, str, list[RunData]]] = []
    table = lr_table(lr_runs)
    best = optimal_lrs(table)
    pairs = [(b, m) for b, m in MD_PAIRS if any(k[0] == b for k in best) and any(k[0] == m for k in best)]
    if pairs:
        def spread(o: str) -> int | None:
            grid = sorted({lr for (o2, _, lr) in table if o2 == o})
            idx = [grid.index(best[k][0]) for k in best if k[0] == o and math.isfinite(best[k][1])]
            return max(idx) - min(idx) if len(idx) > 1 else None

        sp = [(b, m, spread(b), spread(m)) for b, m in pairs]
        sp = [x for x in sp if x[2] is not None and x[3] is not None]
        if sp:
            smaller = [m_s < b_s for _, _, b_s, m_s in sp]
            larger = [m_s > b_s for _, _, b_s, m_s in sp]
            verdict = "reproduced" if all(smaller) else ("reversed" if all(larger) else "not reproduced")
            edges = grid_edge_optima(best, table)
            ev = "; ".join(f"{m} {m_s} vs {b} {b_s}" for b, m, b_s, m_s in sp) + " grid steps"
            ev += f" ({len(edges)} optima at a grid edge)" if edges else " (no optimum at a grid edge)"
            out.append(("md-transfer", verdict, ev, lr_runs))
        diffs = []
        for b, m in pairs:
            for w in sorted({k[1] for k in best if k[0] == b}):
                if (m, w) in best and all(math.isfinite(best[k][1]) for k in ((b, w), (m, w))):
                    diffs.append((m, w, best[(m, w)][1] - best[(b, w)][1]))
        if diffs:
            better = [x for x in diffs if x[2] < -LOSS_MARGIN]
            worse = [x for x in diffs if x[2] > LOSS_MARGIN]
            verdict = ("reproduced" if len(better) == len(diffs) else "reversed" if len(worse) == len(diffs)
                       else "partly reproduced" if better and not worse else "not reproduced")
            ev = (f"MD better by more than {LOSS_MARGIN:g} at {len(better)} of {len(diffs)} (optimizer, width) points"
                  + (" (" + ", ".join(f"{m} width {w} by {-d:.3f}" for m, w, d in better) + ")" if better else "")
                  + f", worse at {len(worse)}")
            out.append(("md-beats-base", verdict, ev, lr_runs))
    wu = [r for r in runs if _tag(r, "kind") == "warmup"]
    if wu:
        diffs = [(o, warmup_difference(p)) for (o, _, _), p in warmup_points(wu, lr_runs).items()
                 if o.endswith("-md")]
        diffs = [(o, d) for o, d in diffs if math.isfinite(d)]
        if diffs:
            helps = [d < -0.01 for _, d in diffs]
            verdict = "reproduced" if not any(helps) else ("reversed" if all(helps) else "not reproduced")
            out.append(("md-warmup", verdict, "val loss with warmup minus without: "
                        + ", ".join(f"{o} {d:+.3f}" for o, d in diffs), wu))
    abl = tagged([r for r in runs if _tag(r, "kind") == "ablation"], ("axis", "value"), "the MD claims")
    keys = {"gains": "md-gains", "parameterization": "md-softplus", "sphere": "md-frobenius",
            "embeddings": "md-embeddings"}
    for axis, per_opt in ablation_data(abl, lr_runs).items():
        verdicts = {o: ablation_verdict(axis, vals) for o, vals in per_opt.items()}
        verdicts = {o: v for o, v in verdicts.items() if v != "—"}
        if not verdicts:
            continue
        plain = {o: v.split(" (")[0] for o, v in verdicts.items()}
        kinds = set(plain.values())
        verdict = kinds.pop() if len(kinds) == 1 else (
            "partly reproduced" if "reproduced" in plain.values() else "not reproduced")
        pref = ABLATION_CLAIMS[axis][0]
        ev = "; ".join(f"{o}: {pref} {_gap_text(vals, pref)} — {verdicts[o]}" for o, vals in per_opt.items()
                       if o in verdicts)
        out.append((keys[axis], verdict, ev, [r for r in abl if _tag(r, "axis") == axis]))
    return seed_gate(out)


def _gap_text(vals: dict[str, float], pref: str) -> str:
    finite = {k: v for k, v in vals.items() if math.isfinite(v)}
    if pref not in finite or len(finite) < 2:
        return "not measured"
    others = {k: v for k, v in finite.items() if k != pref}
    k = min(others, key=others.get)
    return f"{finite[pref] - others[k]:+.3f} vs the best other ({k})"


# ------------------------------------------------------------------------------------- pretrained compression
PAPER_SPACE = {"Q": "input", "K": "input", "Gate": "input", "Up": "input", "O": "output", "Down": "output"}
"""The continuity paper's continuous space per projection role."""


def _ppl_budget(record: dict[str, Any]) -> str:
    """``", over 1024 tokens of the held-out Shakespeare text"``: the text and token budget of a compression record's
    perplexities ("" when the record does not say), so that a perplexity is never quoted without them."""
    tokens = (record.get("baseline") or {}).get("tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        return ""
    text = (record.get("settings") or {}).get("text")
    where = f"of {Path(str(text)).name}" if text else "of the held-out Shakespeare text"
    return f", over {tokens} tokens {where}"


def _model_scope_verdict(by: dict[tuple[str, float], float], levels: list[float]) -> tuple[str, str]:
    """(verdict, reason) of the whole-model rule on perplexities ``by[(method, level)]`` (see the claim's rule)."""
    def beats(a: str, b: str) -> bool:
        return all(by[(a, lv)] < by[(b, lv)] / (1 + PPL_MARGIN) for lv in levels)

    near = any(abs(math.log(by[("paper-a", lv)] / by[(m, lv)])) <= math.log(1 + PPL_MARGIN)
               for lv in levels for m in ("paper-rev-a", "svd-w"))
    if beats("paper-a", "paper-rev-a") and beats("paper-a", "svd-w"):
        return "reproduced", ""
    if beats("paper-a", "paper-rev-a"):
        return "partly reproduced", "per-layer whitened SVD not beaten at every level"
    if beats("paper-rev-a", "paper-a"):
        return "reversed", ""
    if near:
        return "inconclusive", f"within {PPL_MARGIN:.0%} at some level"
    return "not reproduced", ""


MODEL_SCOPE_EVIDENCE = "perplexity in the paper's spaces vs the other space vs per-layer whitened SVD"
"""How the evidence of a whole-model compression finding reads after the model's name: what marks a finding as one
model's whole-model measurement (``claims_page.pool_models`` pools those over the models)."""


def compress_model_findings(records: Sequence[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(key, verdict, evidence) of the pretrained-sharing claim from whole-model compression records (``scope =
    "model"``, the methods ``paper-a``, ``paper-rev-a`` and ``svd-w`` at common savings levels), one or more models:
    each model is judged by the claim's rule; models that disagree make it ``inconclusive``."""
    verdicts, parts = [], []
    for rec in records:
        rows = [r for r in rec.get("rows") or [] if isinstance(r, dict) and "method" in r]
        by = {(r["method"], r["savings_target"]): float(r["ppl"]) for r in rows}
        levels = sorted(lv for lv in {lv for _, lv in by}
                        if all((m, lv) in by for m in ("paper-a", "paper-rev-a", "svd-w")))
        if not levels:
            continue
        verdict, reason = _model_scope_verdict(by, levels)
        verdicts.append(verdict)
        pts = "; ".join(f"{lv:.0%}: {by[('paper-a', lv)]:.1f} vs {by[('paper-rev-a', lv)]:.1f} vs "
                        f"{by[('svd-w', lv)]:.1f}" for lv in levels)
        parts.append(f"{rec.get('model', 'the model')}: {MODEL_SCOPE_EVIDENCE} at {pts} (uncompressed "
                     f"{rec.get('baseline', {}).get('ppl', math.nan):.1f}"
                     f"{_ppl_budget(rec)}) — {verdict}" + (f" ({reason})" if reason else ""))
    if not verdicts:
        return []
    verdict = verdicts[0] if len(set(verdicts)) == 1 else "inconclusive"
    lead = "" if len(set(verdicts)) == 1 else "inconclusive (the models disagree); "
    return [("c-pretrained", verdict, lead + "; ".join(parts))]


def compress_findings(record: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(key, verdict, evidence) of the pretrained-sharing claim from a compression sweep's record
    (``compress.json``: rows of role, arm, savings target and perplexity; the spaces' continuity over random; a
    whole-model record, ``scope = "model"``, is judged by :func:`compress_model_findings`)."""
    if record.get("scope") == "model":
        return compress_model_findings([record])
    rows = [r for r in record.get("rows") or [] if isinstance(r, dict)]
    spaces = record.get("spaces") or {}
    per_role: dict[str, str] = {}
    for role, paper in PAPER_SPACE.items():
        other = "output" if paper == "input" else "input"
        by = {(r["arm"], r["savings_target"]): r["ppl"] for r in rows if r.get("role") == role}
        levels = sorted({lv for arm, lv in by if arm in (paper, other)})
        pairs = [(by[(paper, lv)], by[(other, lv)]) for lv in levels if (paper, lv) in by and (other, lv) in by]
        if not pairs:
            continue
        if all(a < b / (1 + PPL_MARGIN) for a, b in pairs):
            per_role[role] = "for"
        elif all(a > b * (1 + PPL_MARGIN) for a, b in pairs):
            per_role[role] = "against"
        else:
            per_role[role] = "mixed"
    if not per_role:
        return []
    votes = list(per_role.values())
    verdict = ("reproduced" if all(v == "for" for v in votes) else "reversed" if all(v == "against" for v in votes)
               else "partly reproduced" if "for" in votes else "not reproduced")
    cont = [f"{role} {spaces[role][PAPER_SPACE[role]]:.0f}×" for role in per_role
            if isinstance(spaces.get(role), dict) and isinstance(spaces[role].get(PAPER_SPACE[role]), (int, float))]
    groups = {k: [r for r, v in per_role.items() if v == k] for k in ("for", "against", "mixed")}
    levels = sorted({r["savings_target"] for r in rows})
    ev = (f"{record.get('model', 'the model')}: continuity over random in the paper's space {', '.join(cont)}; at "
          f"{'/'.join(f'{lv:.0%}' for lv in levels)} of a role's parameters the paper's space wins for "
          f"{', '.join(groups['for']) or 'no role'}, the other space for {', '.join(groups['against']) or 'no role'}"
          + (f", mixed for {', '.join(groups['mixed'])}" if groups["mixed"] else "")
          + f" (perplexity {record.get('baseline', {}).get('ppl', math.nan):.1f} uncompressed{_ppl_budget(record)})")
    return [("c-pretrained", verdict, ev)]


# --------------------------------------------------------------------------------------------- collecting
EVALUATORS: dict[str, Callable[[Sequence[RunData]], list[tuple[str, str, str, list[RunData]]]]] = {
    "manifolds": manifolds_findings, "continuity": continuity_findings, "md": md_findings}
"""Recipe -> the function that measures its claims."""


def findings(runs: Sequence[RunData]) -> list[Finding]:
    """Every claim these runs test, one :class:`Finding` per claim and sweep directory (finished runs only)."""
    runs = [r for r in runs if r.state in ("done", "diverged")]
    by_sweep: dict[tuple[str, Path], list[RunData]] = {}
    for r in runs:
        if r.recipe in EVALUATORS:
            by_sweep.setdefault((r.recipe, r.path.parent), []).append(r)
    out: list[Finding] = []
    for (recipe, directory), rs in by_sweep.items():
        source = source_of(directory)
        left = unfinished_note(directory, rs)
        for key, verdict, evidence, used in EVALUATORS[recipe](rs):
            assert key in CLAIM_BY_KEY and verdict in VERDICTS, (key, verdict)
            evidence += left
            used = list({id(r): r for r in used}.values())
            out.append(Finding(key, verdict, evidence, source, _steps(used), len(used), _device(used, _meta)))
    order = {c.key: i for i, c in enumerate(CLAIMS)}
    return sorted(out, key=lambda f: (order[f.key], -f.steps, -f.runs, f.source))
