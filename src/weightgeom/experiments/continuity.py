"""Recipe ``continuity`` (the continuity paper, arXiv:2605.04971): why adjacent layers' singular vectors line up.

Part ``resmlp`` — residual MLP on MNIST (paper: 16 blocks × 256), continuity recorded *during* training by the
trainer callback :class:`weightgeom.analysis.recorder.ContinuityRecorder` (declared as the control
``continuity_every``: weights, minibatch gradients, accumulated updates ΔW and the dominance ratio ‖ΔW‖/‖W₀‖):

=================  =========================================================  ==================================
variant            change                                                     paper figure
=================  =========================================================  ==================================
``res-relu``       baseline: residual + ReLU                                  continuity develops
``nores``          no skip connection                                         gradient ≈ 0.05 (random)
``res-none``       no activation (linear residual net)                        gradient 0.93, weight v1 0.22
``res-radial``     σ(x) = x·tanh(‖x‖) (rotation-equivariant)                  weight v1 ≈ 0.22
``init-small``     init scale × ``init_small`` (default 0.1)                  ΔW dominates W₀ earlier
``init-large``     init scale × ``init_large`` (default 3.0)                  ΔW dominates W₀ later
``adam-b2-0``      Adam with β2 = 0 (m_t/|g_t|: blows up where g_t ≈ 0)         not an optimizer artifact
``adam-b1-0-b2-0``  Adam with β1 = β2 = 0 (sign descent, the stable variant)   not an optimizer artifact
=================  =========================================================  ==================================

Part ``llama`` — Llama-style transformer (paper: 8 layers, 34M, WikiText-103) with the MLP activation ablated
(``silu`` = SwiGLU baseline, ``gelu``, ``relu``, ``none``); after training, the final checkpoint is analysed per
projection (Q, K, V, O, Gate, Up, Down: C_v and C_u between adjacent layers) into ``continuity.jsonl``
(:func:`weightgeom.analysis.recorder.continuity_rows`: the same rows and metrics as the recorder).

A preset is a sweep file with ``[parts.resmlp]`` and ``[parts.llama]`` trainer configs (either may be absent) and
a ``[sweep]`` table (``seeds``, ``continuity_every``, ``init_small``, ``init_large``, ``llama_activations``). With
``--steps N`` the recording interval shrinks to at most N // 8 (so a short run still records several points).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from weightgeom.analysis.recorder import CONTINUITY_FILE, continuity_rows
from weightgeom.experiments.runner import Recipe, RunSpec, Variant
from weightgeom.train.checkpoint import latest_checkpoint, load_checkpoint
from weightgeom.train.config import get_key


def variants(parts: dict[str, dict[str, Any]], sweep: dict[str, Any], steps: int | None = None) -> list[Variant]:
    """The residual-MLP ablations (part ``resmlp``) and the Llama activation ablation (part ``llama``)."""
    out: list[Variant] = []
    if "resmlp" in parts:
        every = int(sweep.get("continuity_every", 25))
        if steps is not None:
            every = max(1, min(every, steps // 8 or 1))
        base_scale = float(get_key(parts["resmlp"], "model.init_scale", 1.0))
        ctl = {"continuity_every": every}
        small = float(sweep.get("init_small", 0.1)) * base_scale
        large = float(sweep.get("init_large", 3.0)) * base_scale
        arms = [
            ("res-relu", {"model.residual": True, "model.activation": "relu"}, "Res+ReLU (baseline)"),
            ("nores", {"model.residual": False, "model.activation": "relu"}, "NoRes: no skip connection"),
            ("res-none", {"model.residual": True, "model.activation": "none"}, "Res+None: linear residual net"),
            ("res-radial", {"model.residual": True, "model.activation": "radial"},
             "Res+Radial: σ(x)=x·tanh(‖x‖)"),
            ("init-small", {"model.residual": True, "model.activation": "relu", "model.init_scale": small},
             f"Res+ReLU, init scale {small:g}"),
            ("init-large", {"model.residual": True, "model.activation": "relu", "model.init_scale": large},
             f"Res+ReLU, init scale {large:g}"),
            ("adam-b2-0", {"model.residual": True, "model.activation": "relu", "optim.name": "adamw",
                           "optim.adamw.betas": [0.9, 0.0]}, "Res+ReLU, Adam β2=0"),
            ("adam-b1-0-b2-0", {"model.residual": True, "model.activation": "relu", "optim.name": "adamw",
                                "optim.adamw.betas": [0.0, 0.0]}, "Res+ReLU, Adam β1=β2=0 (sign descent)"),
        ]
        for name, ov, desc in arms:
            out.append(Variant(name, ov, desc, part="resmlp", controls=dict(ctl), group="resmlp"))
    if "llama" in parts:
        for act in sweep.get("llama_activations", ["silu", "gelu", "relu", "none"]):
            out.append(Variant(f"llama-{act}", {"model.activation": act}, f"Llama, MLP activation {act}",
                               part="llama", group="llama"))
    if not out:
        raise ValueError("continuity recipe: the config has neither a resmlp nor a llama part")
    return out


def post_run(spec: RunSpec, run_dir: Path) -> None:
    """After a Llama run: analyse its final checkpoint per projection into ``continuity.jsonl``."""
    if spec.part != "llama" or (run_dir / CONTINUITY_FILE).exists():
        return
    ck = latest_checkpoint(run_dir / "checkpoints")
    if ck is None:
        raise FileNotFoundError(f"no checkpoint in {run_dir / 'checkpoints'} to analyse")
    payload = load_checkpoint(ck)
    try:
        rows = continuity_rows(payload["model"], int(payload.get("step", -1)))
    except ValueError:
        rows = []
    if not rows:
        raise ValueError(f"{ck}: no Llama projection weights (layers.N.self_attn.q_proj.weight …) found")
    with open(run_dir / CONTINUITY_FILE, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


RECIPE = Recipe(
    name="continuity",
    default_config="cpu",
    default_seeds=(0,),
    variants=variants,
    post_run=post_run,
    doc="continuity paper: residual-MLP ablations over training + Llama activation ablation (per projection)",
)
