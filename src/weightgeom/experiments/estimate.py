"""What a planned sweep run will do and cost, before it runs: each arm's own settings and an expected run time.

Used by ``weightgeom sweep ... --dry-run`` (``launchers.dry_run``). The run time is a stated FLOP estimate, not a
measurement of the run: ``6 · N · tokens`` (a forward and a backward pass, N the model's non-embedding parameters,
tokens = ``train.max_steps`` × ``data.batch_size`` × ``data.block_size`` × ``train.grad_accum``), divided by a
training throughput recorded on a named device (:data:`GPU_TRAIN_FLOPS`, :data:`CPU_TRAIN_FLOPS_PER_CORE`). Muon's
orthogonalisations are added per step (:func:`optimizer_flops_per_step`: manifold Muon's dual ascent runs one msign
per dual iteration, which at the published algorithm's 20 iterations outweighs the forward and backward pass of a
small model ≈ 9×); MD's gains are not counted (≈ 11× an AdamW step, docs/benchmarks.md: small beside 6 · N · tokens).
The rate depends on the model's size too: on a GPU, models far below GPT-2's run below the recorded rate
(launch-bound); on a CPU, matrices wider than the demo's 64 run above it (the continuity sweep's estimate is ≈ 2×
what it took). Read the figure as the order of magnitude, for choosing ``--time-limit``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from weightgeom.experiments.runner import RunSpec

__all__ = ["GPU_TRAIN_FLOPS", "CPU_TRAIN_FLOPS_PER_CORE", "NON_SEQUENCE_DATA", "arm_settings", "shared_settings",
           "run_tokens", "nonembedding_params", "optimizer_flops_per_step", "expected_seconds"]

GPU_TRAIN_FLOPS = 6 * 85.0e6 * 331.7e3
"""Training FLOP/s (``6 · N · tokens/s``) recorded on one NVIDIA H200: weightgeom's trainer on GPT-2 124M (85.0 M
non-embedding parameters; T = 1024, B = 16, bf16 autocast, AdamW) at 331.7 k tokens/s — the
``train_throughput --preset gpt2`` row of docs/benchmarks.md (``weightgeom bench gpu_check``). ≈ 1.7e14."""

CPU_TRAIN_FLOPS_PER_CORE = 6 * 147_456 * (250 * 16 * 64) / 11.9
"""Training FLOP/s per CPU core recorded by ``weightgeom demo``'s strategy comparison on the 2-core Intel Xeon with
AMX: 16 runs of a 3-layer GPT of width 64 (147,456 non-embedding parameters), each 250 steps × 16 × 64 tokens, in
86–103 s on 2 cores (one run per core: ≈ 11.9 s a run; docs/experiments.md, "Measured at CPU scale"). ≈ 1.9e10."""

_SKIP = ("run.seed", "run.name")  # named by the run itself


NON_SEQUENCE_DATA = ("mnist",)
"""Data kinds whose examples are single vectors, not token sequences: ``data.block_size`` does not apply."""


def run_tokens(settings: dict[str, Any]) -> int:
    """Tokens (examples, for :data:`NON_SEQUENCE_DATA`) a run trains on: ``train.max_steps`` × ``data.batch_size``
    × ``data.block_size`` × ``train.grad_accum`` (from :func:`weightgeom.experiments.runner.resolved_settings`)."""
    per_example = 1 if settings.get("data.kind") in NON_SEQUENCE_DATA else int(settings.get("data.block_size", 0))
    return int(settings.get("train.max_steps", 0)) * int(settings.get("data.batch_size", 0)) * per_example \
        * int(settings.get("train.grad_accum", 1) or 1)


def nonembedding_params(model_config: dict[str, Any]) -> int:
    """Parameters of the model a run builds, without its embeddings and output head (``nn.Embedding`` weights, any
    matrix tied to one, and a (vocabulary, width) head), counted on the meta device (no memory, no data); 0 where the
    model cannot be built that way (a model that needs its data)."""
    import torch

    model_from_config = importlib.import_module("weightgeom.train.trainer").model_from_config
    try:
        with torch.device("meta"):
            model = model_from_config(dict(model_config))
    except Exception:  # noqa: BLE001 - an estimate: a model that needs its data to be built counts as unknown
        return 0
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    embedding = {id(m.weight) for m in embeddings}
    vocab = {m.num_embeddings for m in embeddings if m.num_embeddings > m.embedding_dim}  # token tables, not positions
    # the output head: an untied (vocab, d) matrix; its size depends on a vocabulary only the data fixes
    return sum(p.numel() for p in model.parameters()
               if id(p) not in embedding and not (p.dim() == 2 and p.shape[0] in vocab))


def optimizer_flops_per_step(settings: dict[str, Any], model_config: dict[str, Any]) -> float:
    """Multiply–add FLOPs of one Muon / manifold-Muon step's orthogonalisations (0 for other optimizers, and where
    the model cannot be built on the meta device), from the groups the run's strategy gives the model.

    Each Newton–Schulz / Polar Express iteration on a tall m×n matrix costs ≈ 4·m·n² + 2·n³ (the n×n Gram, its
    polynomial, the m×n product). A plain-Muon matrix takes one msign of ``ns_steps`` iterations per step; a
    manifold-constrained one takes one per dual iteration and a final one (``dual.steps + 1``), plus the constraint
    products (≈ 4·m·n² per dual iteration). The dual ascent's early stop on ``dual.tol`` is not modelled: the
    estimate is its upper end.
    """
    if settings.get("optim.name") != "muon":
        return 0.0
    import torch

    model_from_config = importlib.import_module("weightgeom.train.trainer").model_from_config
    param_groups = importlib.import_module("weightgeom.optim.param_groups").param_groups
    msign_presets = importlib.import_module("weightgeom.linalg").MSIGN_PRESETS
    try:
        with torch.device("meta"):
            model = model_from_config(dict(model_config))
        groups = param_groups(model, settings.get("optim.strategy") or "unconstrained",
                              split_qkv=bool(settings.get("optim.split_qkv")))
    except Exception:  # noqa: BLE001 - an estimate: a model that needs its data to be built counts as unknown
        return 0.0
    preset = msign_presets.get(str(settings.get("optim.muon.msign_method")))
    steps = int(settings.get("optim.muon.ns_steps") or (preset.steps if preset else 5))
    dual_steps = int(settings.get("optim.muon.dual.steps") or 1)
    flops = 0.0
    for group in groups:
        if group.get("algorithm") != "muon":
            continue
        split = int(group.get("split") or 1)
        for p in group["params"]:
            if p.dim() < 2:
                continue
            rows, cols = p.shape[0] // split, p.numel() // p.shape[0]
            m, n = max(rows, cols), min(rows, cols)
            per_msign = steps * (4.0 * m * n * n + 2.0 * n ** 3)
            if group.get("manifold") is None:
                flops += split * per_msign
            else:
                flops += split * ((dual_steps + 1) * per_msign + dual_steps * 4.0 * m * n * n)
    return flops


def expected_seconds(settings: dict[str, Any], params: int, gpus: int, cpus: int,
                     optimizer_flops: float = 0.0) -> float | None:
    """The FLOP estimate of one run's training time in seconds (module docstring), or None when it cannot be made
    (no parameter count, no tokens).

    Args:
        settings: the run's resolved settings (``section.key -> value``).
        params: the model's non-embedding parameters (:func:`nonembedding_params`).
        gpus: GPUs the run gets (0: CPU only); the GPU rate scales with their number.
        cpus: CPU cores of a CPU-only run (its threads).
        optimizer_flops: FLOPs of one optimizer step (:func:`optimizer_flops_per_step`), added per step.
    """
    tokens = run_tokens(settings)
    if params <= 0 or tokens <= 0:
        return None
    rate = GPU_TRAIN_FLOPS * gpus if gpus else CPU_TRAIN_FLOPS_PER_CORE * max(1, cpus)
    steps = int(settings.get("train.max_steps", 0))
    return (6 * params * tokens + optimizer_flops * steps) / rate


def shared_settings(runs: Sequence[RunSpec]) -> dict[str, Any]:
    """The settings every run has with the same value (``section.key -> value``)."""
    all_settings = [spec.resolved() for spec in runs]
    if not all_settings:
        return {}
    first = all_settings[0]
    return {k: v for k, v in first.items()
            if all(json.dumps(s.get(k), sort_keys=True, default=str) == json.dumps(v, sort_keys=True, default=str)
                   for s in all_settings[1:])}


def arm_settings(spec: RunSpec, shared: dict[str, Any]) -> str:
    """The settings that make ``spec`` its arm: every key whose value is not the one all runs share, as
    ``key=value`` separated by commas (``"(the shared settings)"`` when none)."""
    own = {k: v for k, v in spec.resolved().items() if k not in shared and k not in _SKIP}
    return ", ".join(f"{k}={json.dumps(v, default=str) if not isinstance(v, str) else v}"
                     for k, v in sorted(own.items())) or "(the shared settings)"
