"""Continuity analysis of a checkpoint: train a small model, save it as safetensors, analyse it, read the result.

What it shows:

1. Training a small character-level GPT (this package's ``weightgeom.models.GPT``, 6 layers) on the bundled
   Shakespeare text for 200 steps, then saving its weights as ``model.safetensors`` — any safetensors file,
   HF model folder or torch checkpoint of a GPT-2 / Llama / BERT-style model can be analysed the same way.
2. ``weightgeom.analysis.analyze_full(path, suggest=True)``: the Python API behind the command line

       weightgeom analyze OUT/model.safetensors --suggest --out OUT/analysis

   which compares each projection role (Q, K, V, O, Up, Down) of layer l with the same role of layer l+1.
3. What the numbers mean (printed at the end as well, by ``weightgeom.analysis.report.format_legend``, the legend
   ``weightgeom analyze`` ends with):

   * **C_v** = |cos(v1_l, v1_l+1)|: the top right singular vectors (the *input* direction each matrix amplifies most)
     of two adjacent layers; **C_u** the same for the top left singular vectors (the *output* space). 1 means the
     two layers share their dominant direction, 0 that they are orthogonal.
   * **The random level** (in parentheses beside each value): what |cos| of two independent random unit vectors in
     R^d gives, sqrt(2/(π d)) — about 0.1 for d = 64. A value near it means "no more alike than chance"; the reading
     calls a space continuous from 2× the random level.
   * **gram_in / gram_out**: the same question for the whole σ²-weighted spectrum instead of the top vector.
   * **--suggest**: for each adjacent pair, how much of W_l+1's energy (squared Frobenius norm) layer l's top-k
     singular basis keeps in the role's space (k = 1, 8, 64; random level k/d), and the layer runs where one shared
     rank-k basis would lose least — candidates for sharing or low-rank tying. "none" is an answer too: it says no
     run keeps half the energy, so sharing a basis is not advised for this model.
4. ``write_report``: the CSV/JSON/PNG files ``weightgeom analyze`` writes (pairs.csv, layers.csv, summary.csv,
   analysis.json, plots).

Run:
    python examples/analyze_checkpoint.py                  # 200 training steps, files in a temporary folder
    python examples/analyze_checkpoint.py --out runs/ana   # keep the checkpoint and the report
    python examples/analyze_checkpoint.py --tiny           # 3 steps, no plots (what the tests run)

Time on a 2-core CPU: full size about 2 minutes (1.7 CPU-minutes measured, nearly all of it training; the analysis
itself takes about a second); ``--tiny`` a few seconds after the imports. Writes only into ``--out`` or a temporary
folder deleted at the end.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_model

from weightgeom.analysis import analyze_full, shared_basis_runs, write_report
from weightgeom.analysis.report import format_legend, format_reading, format_suggestions, format_summary
from weightgeom.data import shakespeare_text
from weightgeom.models import GPT, GPTConfig


def train_small_gpt(steps: int, width: int, seed: int = 0) -> GPT:
    """A 6-layer character-level GPT trained ``steps`` AdamW steps on the bundled Shakespeare text.

    Separate Q/K/V projections (``separate_qkv=True``) so every role is its own matrix in the checkpoint (a fused
    GPT-2 ``c_attn`` is split into Q, K, V by the analysis as well).
    """
    torch.manual_seed(seed)
    text = shakespeare_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text[:200_000]], dtype=torch.long)
    block = 64
    cfg = GPTConfig(n_layer=6, n_head=4, n_embd=width, vocab_size=len(chars), block_size=block, separate_qkv=True)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        starts = torch.randint(0, len(data) - block - 1, (16,), generator=g)
        x = torch.stack([data[s:s + block] for s in starts])
        y = torch.stack([data[s + 1:s + block + 1] for s in starts])
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0 or (step + 1) % max(1, steps // 4) == 0:
            print(f"  step {step + 1:4d}  loss {float(loss.detach()):.3f}")
    return model


def main(argv: list[str] | None = None) -> int:
    """Train, save, analyse, print the tables and the legend, write the report."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="3 training steps, width 32, no plots (seconds)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200; --tiny 3)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for model.safetensors and analysis/ (default: a temporary folder, deleted)")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.tiny else 200)
    width = 32 if args.tiny else 64

    with tempfile.TemporaryDirectory(prefix="wg-analyze-") as tmp:
        out = args.out if args.out is not None else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)

        print(f"training a 6-layer GPT (width {width}) for {steps} steps on the bundled Shakespeare text:")
        model = train_small_gpt(steps, width)
        ckpt = out / "model.safetensors"
        # save_model (not save_file) because the token embedding and the LM head share one tensor
        save_model(model, str(ckpt))
        print(f"saved {ckpt} ({ckpt.stat().st_size / 1e6:.1f} MB)\n")

        # The analysis reads the file lazily (one matrix at a time), recognises the roles from the tensor names and
        # compares each layer with the next. suggest=True adds the shared-basis columns share_k1/k8/k64.
        # (reference=W0_checkpoint would add the accumulated-update metrics delta_* and the dominance ratio.)
        result = analyze_full(str(ckpt), suggest=True)
        print(format_summary(result))  # per role: mean metric (random level) over the adjacent pairs
        print()
        print(format_suggestions(shared_basis_runs(result.pairs), pairs=result.pairs))
        print()
        print(format_reading(result))  # the same in plain words
        print()
        print(format_legend(result, suggest=True))  # the legend `weightgeom analyze` ends with, too
        print("  Same analysis from the shell: weightgeom analyze CHECKPOINT --suggest --out DIR")

        # result.pairs: one row per (role, layer pair); result.layers: one row per matrix (σ1, stable rank, ...)
        first = result.pairs.iloc[0]
        print(f"\nfirst pair row: role {first['role']}, layers {first['layer']}-{first['layer_next']}, "
              f"C_v {first['cv']:.3f} (random {first['cv_rand']:.3f}), C_u {first['cu']:.3f} "
              f"(random {first['cu_rand']:.3f})")
        paths = write_report(result, out / "analysis", plots=not args.tiny, title="examples/analyze_checkpoint.py")
        print(f"wrote {len(paths)} report files to {out / 'analysis'}: {', '.join(p.name for p in paths)}")
        if args.out is None:
            print("(a temporary folder: pass --out DIR to keep them)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
