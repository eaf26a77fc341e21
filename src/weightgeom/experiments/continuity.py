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
``adam-b2-0``      Adam with β2 = 0, ε = :data:`ADAM_B2_0_EPS` (table below)     not an optimizer artifact
``adam-b1-0-b2-0`` Adam with β1 = β2 = 0 (sign descent, the stable variant)   not an optimizer artifact
``res-ln``         LayerNorm pre-norm, no activation (Res+LN)                 LayerNorm spreads continuity over
                                                                              several singular directions
``res-relu-ln``    LayerNorm pre-norm + ReLU (Res+ReLU+LN)                    the activation's v1 mode dominates
=================  =========================================================  ==================================

Adam with β2 = 0 divides the momentum by the current |g_t| + ε: where a coordinate's gradient is momentarily tiny
(a dead ReLU unit) the step is m_t/ε. The continuity paper ran this ablation but gives no ε or LR, and
with PyTorch's ε = 1e-8 it diverges within a few steps at every LR tried. Measured on the CPU preset (16 × 256,
MNIST, batch 128, 500 steps, cosine schedule, grad clip 1, β1 = 0.9; 2-core AMD EPYC), final val loss / accuracy:

=========  =====================  =====================  ===============  ===============  ===============
LR         ε = 1e-8               ε = 1e-6               ε = 1e-4         ε = 1e-3         ε = 1e-2
=========  =====================  =====================  ===============  ===============  ===============
1e-3       diverged at step 4     diverged at step 11    0.137 / 0.959    0.096 / 0.978    0.212 / 0.941
3e-4       diverged at step 5     diverged at step 11    0.113 / 0.970    0.140 / 0.962    —
1e-4       diverged at step 9     0.160 / 0.958          0.132 / 0.965    0.268 / 0.923    —
=========  =====================  =====================  ===============  ===============  ===============

ε decides whether the arm trains (only at LR 1e-4 does ε = 1e-6 suffice); the arm uses ε = 1e-3, the best of the
grid, at the preset's LR 1e-3, so it differs from the baseline in β2 and ε only (Res+ReLU with the default Adam
reaches 0.975 accuracy there). "—": not measured.

Part ``llama`` — Llama-style transformer (paper: 8 layers, 34M, WikiText-103) with the MLP activation ablated
(``silu`` = SwiGLU baseline, ``gelu``, ``relu``, ``none``); after training, the final checkpoint is analysed per
projection (Q, K, V, O, Gate, Up, Down: C_v and C_u between adjacent layers) into ``continuity.jsonl``
(:func:`weightgeom.analysis.recorder.continuity_rows`: the same rows and metrics as the recorder).

The LayerNorm arms set ``model.norm = "layernorm"`` (a pre-norm on each block's input,
:class:`weightgeom.models.ResMLPConfig`). Every weight row of the record also carries the top-k spread columns
(:func:`weightgeom.analysis.recorder.spread_columns`: C_v of v_1..v_8, v1's share of Σ_i C_v(i)², the mean C_v of
v_2..v_8, the top-8 subspace overlap) for the paper's claim that an element-wise activation concentrates continuity
in v1, LayerNorm spreads it over several directions, and with both the activation's v1 mode dominates.

A preset is a sweep file with ``[parts.resmlp]`` and ``[parts.llama]`` trainer configs (either may be absent) and
a ``[sweep]`` table (``seeds``, ``continuity_every``, ``init_small``, ``init_large``, ``llama_activations``). With
``--steps N`` the recording interval shrinks to at most N // 8 (so a short run still records several points).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from weightgeom._files import write_atomic
from weightgeom.analysis.recorder import CONTINUITY_FILE, continuity_rows
from weightgeom.experiments.runner import Recipe, RunSpec, Variant
from weightgeom.train.checkpoint import latest_checkpoint, load_checkpoint
from weightgeom.train.config import get_key

ADAM_B2_0_EPS = 1e-3
"""Adam ε of the ``adam-b2-0`` arm: the smallest-loss setting of the measured grid (module docstring); with
PyTorch's default 1e-8 the arm diverges within a few steps."""


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
                           "optim.adamw.betas": [0.9, 0.0], "optim.adamw.eps": ADAM_B2_0_EPS},
             f"Res+ReLU, Adam β2=0, ε={ADAM_B2_0_EPS:g}"),
            ("adam-b1-0-b2-0", {"model.residual": True, "model.activation": "relu", "optim.name": "adamw",
                                "optim.adamw.betas": [0.0, 0.0]}, "Res+ReLU, Adam β1=β2=0 (sign descent)"),
            ("res-ln", {"model.residual": True, "model.activation": "none", "model.norm": "layernorm"},
             "Res+LN: LayerNorm pre-norm, no activation"),
            ("res-relu-ln", {"model.residual": True, "model.activation": "relu", "model.norm": "layernorm"},
             "Res+ReLU+LN: LayerNorm pre-norm and ReLU"),
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
    write_atomic(run_dir / CONTINUITY_FILE, "".join(json.dumps(r) + "\n" for r in rows))


RECIPE = Recipe(
    name="continuity",
    default_config="cpu",
    default_seeds=(0,),
    variants=variants,
    post_run=post_run,
    doc="continuity paper: residual-MLP ablations over training + Llama activation ablation (per projection)",
)
