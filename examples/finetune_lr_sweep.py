"""Pick a manifold-Muon learning rate for fine-tuning: an lr sweep on the bundled MiniLM and a real held-out task.

The model, loss and optimizer are those of ``examples/finetune_hf.py`` (all-MiniLM-L6-v2, mean-pooled unit
embeddings, mean squared error between the cosine of a pair and its 0/1 label, ``param_groups(model, "hetero",
init="keep")``); only the data and the learning rates change.

The task (built deterministically from the Shakespeare plays bundled with weightgeom, nothing downloaded): *does line
B follow line A?* A positive pair is two consecutive verse lines of one speech; a negative pair is the same line A
with a line of another speech of the same play. Lines have at least 4 words; speaker names and stage directions are
dropped. The 36 plays whose speeches parse (sorted by file name) are numbered; training pairs come from the
even-numbered ones, held-out pairs from the odd-numbered ones, so the score is on plays never trained on.

For each arm (manifold Muon at several ``lr``, AdamW at the usual fine-tuning rates) the script fine-tunes a fresh
copy of the pretrained model for the same steps and batches (constant lr, dropout off) and prints:

- the task: held-out loss (the training objective), accuracy (cos > 0.5 read as "follows") and ROC AUC of the cosine
  (threshold-free: 0.5 is chance);
- what fine-tuning did to the pretrained model: the mean cosine between each held-out sentence's embedding before and
  after (1 = unchanged), and the largest relative spectral change max ‖ΔW‖₂/‖W‖₂ over the encoder's weight matrices
  (the ones manifold Muon steps; a manifold-Muon step moves each by at most ``lr`` in spectral norm);
- the wall time per step on this machine.

Run:
    python examples/finetune_lr_sweep.py               # the sweep in docs/training.md (6 layers, 30 steps of 16)
    python examples/finetune_lr_sweep.py --markdown    # the same, as the markdown table of docs/training.md
    python examples/finetune_lr_sweep.py --tiny        # one encoder layer, 2 steps, 2 arms (what the tests run)

Time: the full sweep is about 10 CPU-minutes on one thread of a 2-core AMD EPYC (one manifold-Muon step on the 36
MiniLM matrices about 1.8 s there, an AdamW step 0.15 s, the forward and backward of 32 sentences 0.8 s); the
recorded table took 33 minutes of wall time with the machine shared at load ≈ 14. Threads:
``--threads`` (default 1, so the sweep shares a machine politely). Writes no file.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is on disk: never try the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the model, loss and optimizer of finetune_hf.py
from finetune_hf import SentenceEncoder, load_encoder, make_optimizer  # noqa: E402

from weightgeom.data import shakespeare_files  # noqa: E402

# The sweep of docs/training.md: manifold Muon lr (the AdamW groups inside it at MUON_ADAMW_LR), and plain AdamW.
MUON_LRS = (1e-4, 1e-3, 3e-3, 1e-2, 2e-2)
MUON_ADAMW_LR = 2e-5
ADAMW_LRS = (2e-5, 5e-5)
MIN_SPEECHES = 50  # files with fewer parsed speeches (the poems; one play laid out otherwise) are left out
SPEAKER = re.compile(r"^[A-Z][A-Za-z .'-]{0,40}\.$")  # "DUKE.", "Romeo.", "Cor. and Volt.": a speech follows
MAX_TOKENS = 32

Pair = tuple[str, str, float]


def speeches(path: Path) -> list[list[str]]:
    """The speeches of one play: each a list of its verse lines (≥ 4 words), stage directions dropped; ≥ 2 lines.

    A speech is a block of lines between blank lines whose first line is its speaker (a short line ending in ".").
    """
    out: list[list[str]] = []
    for block in re.split(r"\n\s*\n", path.read_text(encoding="utf-8", errors="replace")):
        lines = [s.strip() for s in block.strip().splitlines()]
        if len(lines) < 3 or not SPEAKER.match(lines[0]) or len(lines[0].split()) > 4:
            continue
        verse = [s for s in lines[1:] if len(s.split()) >= 4 and not s.startswith(("[", "Enter", "Exit", "Exeunt"))]
        if len(verse) >= 2:
            out.append(verse)
    return out


def make_pairs(plays: list[list[list[str]]], n: int, seed: int) -> list[Pair]:
    """``n`` pairs (half positive, interleaved) drawn with ``random.Random(seed)`` from ``plays`` (speeches each)."""
    rng = random.Random(seed)
    out: list[Pair] = []
    while len(out) < n:
        play = rng.choice(plays)
        speech = rng.choice(play)
        i = rng.randrange(len(speech) - 1)
        out.append((speech[i], speech[i + 1], 1.0))
        other = rng.choice([s for s in play if s is not speech] or [speech])
        out.append((speech[i], rng.choice(other), 0.0))
    return out[:n]


def task_pairs(n_train: int, n_eval: int, seed: int = 0) -> tuple[list[Pair], list[Pair], int]:
    """Training pairs from the even-numbered plays, held-out pairs from the odd-numbered ones, and the plays' count."""
    parsed = [s for s in (speeches(p) for p in shakespeare_files()) if len(s) >= MIN_SPEECHES]
    return make_pairs(parsed[0::2], n_train, seed), make_pairs(parsed[1::2], n_eval, seed + 1), len(parsed)


def encode(model: SentenceEncoder, tok, sentences: list[str], batch: int = 64) -> torch.Tensor:
    """Unit sentence embeddings (one row each), in eval mode, without gradients."""
    model.eval()
    rows = []
    with torch.no_grad():
        for i in range(0, len(sentences), batch):
            t = tok(sentences[i:i + batch], padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt")
            rows.append(model.embed(t["input_ids"], t["attention_mask"]))
    return torch.cat(rows)


def roc_auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Probability that a random positive scores above a random negative (ties count half)."""
    pos, neg = score[label > 0.5], score[label <= 0.5]
    diff = pos[:, None] - neg[None, :]
    return float((diff > 0).double().mean() + 0.5 * (diff == 0).double().mean())


def evaluate(model: SentenceEncoder, tok, pairs: list[Pair],
             sentences: list[str]) -> tuple[dict[str, float], torch.Tensor]:
    """Held-out loss, accuracy and AUC of ``pairs``, and the embeddings of ``sentences`` (all the pairs' sentences)."""
    emb = encode(model, tok, sentences)
    index = {s: i for i, s in enumerate(sentences)}
    a = emb[[index[p[0]] for p in pairs]]
    b = emb[[index[p[1]] for p in pairs]]
    cos = (a * b).sum(-1)
    y = torch.tensor([p[2] for p in pairs], dtype=cos.dtype)
    return {"loss": float(((cos - y) ** 2).mean()), "acc": float(((cos > 0.5) == (y > 0.5)).double().mean()),
            "auc": roc_auc(cos, y)}, emb


def encoder_matrices(model: SentenceEncoder) -> dict[str, torch.Tensor]:
    """The encoder layers' weight matrices (attention and MLP: what manifold Muon steps under "hetero")."""
    return {n: p for n, p in model.named_parameters() if p.ndim == 2 and ".encoder.layer." in f".{n}"}


def max_relative_change(before: dict[str, torch.Tensor], model: SentenceEncoder) -> float:
    """max over the encoder matrices of ‖W_after − W_before‖₂ / ‖W_before‖₂ (spectral norms)."""
    after = encoder_matrices(model)
    return max(float(torch.linalg.matrix_norm(after[n].detach() - w, ord=2) / torch.linalg.matrix_norm(w, ord=2))
               for n, w in before.items())


def batches(pairs: list[Pair], tok, size: int) -> list[dict[str, torch.Tensor]]:
    """The training pairs tokenised in order, ``size`` pairs per batch (every arm sees the same batches)."""
    out = []
    for i in range(0, len(pairs) - size + 1, size):
        chunk = pairs[i:i + size]
        a = tok([p[0] for p in chunk], padding="max_length", max_length=MAX_TOKENS, truncation=True,
                return_tensors="pt")
        b = tok([p[1] for p in chunk], padding="max_length", max_length=MAX_TOKENS, truncation=True,
                return_tensors="pt")
        out.append({"a_input_ids": a["input_ids"], "a_attention_mask": a["attention_mask"],
                    "b_input_ids": b["input_ids"], "b_attention_mask": b["attention_mask"],
                    "labels": torch.tensor([p[2] for p in chunk])})
    return out


def finetune(model: SentenceEncoder, opt: torch.optim.Optimizer, data: list[dict[str, torch.Tensor]]) -> float:
    """One step per batch at a constant lr, dropout off; returns the mean wall seconds per step."""
    model.eval()  # no dropout: the arms differ by their optimizer only
    start = time.perf_counter()
    for batch in data:
        model(**batch)["loss"].backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / max(1, len(data))


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run every arm, print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="one encoder layer, 2 steps of 4 pairs, 2 arms (seconds)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per arm (default 30; --tiny 2)")
    p.add_argument("--batch", type=int, default=None, help="pairs per step (default 16; --tiny 4)")
    p.add_argument("--eval-pairs", type=int, default=None, help="held-out pairs (default 512; --tiny 32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: a shared machine)")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown (docs/training.md)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    steps = args.steps if args.steps is not None else (2 if args.tiny else 30)
    size = args.batch if args.batch is not None else (4 if args.tiny else 16)
    n_eval = args.eval_pairs if args.eval_pairs is not None else (32 if args.tiny else 512)
    arms: list[tuple[str, float]] = ([("muon", 1e-3), ("adamw", 2e-5)] if args.tiny
                                     else [("muon", lr) for lr in MUON_LRS] + [("adamw", lr) for lr in ADAMW_LRS])

    torch.manual_seed(0)
    base, tok = load_encoder(1 if args.tiny else None)
    train, held, n_plays = task_pairs(steps * size, n_eval)
    data = batches(train, tok, size)
    sentences = sorted({s for pair in held for s in pair[:2]})
    pre, e0 = evaluate(base, tok, held, sentences)
    w0 = {n: w.detach().clone() for n, w in encoder_matrices(base).items()}
    layers = base.bert.config.num_hidden_layers
    print(f"task: does line B follow line A (Shakespeare, bundled, {n_plays} plays); {len(data)} steps of {size} "
          f"pairs from the even-numbered plays; {len(held)} held-out pairs ({len(sentences)} sentences) from the "
          f"odd-numbered plays; all-MiniLM-L6-v2, {layers} encoder layer(s), {len(w0)} encoder matrices; "
          f"{torch.get_num_threads()} thread(s); constant lr, dropout off", flush=True)

    rows = [("pretrained", "—", pre, 1.0, 0.0, float("nan"))]
    for algo, lr in arms:
        model = copy.deepcopy(base)
        if algo == "muon":
            opt = make_optimizer(model, lr=lr, adamw_lr=MUON_ADAMW_LR)
            name = f"manifold Muon (adamw_lr {MUON_ADAMW_LR:g})"
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            name = "AdamW"
        sec = finetune(model, opt, data)
        metrics, emb = evaluate(model, tok, held, sentences)
        kept = float((emb * e0).sum(-1).mean())
        rows.append((name, f"{lr:g}", metrics, kept, max_relative_change(w0, model), sec))
        print(f"  done: {name} lr {lr:g}: held-out loss {metrics['loss']:.3f} acc {metrics['acc']:.3f} AUC "
              f"{metrics['auc']:.3f}; embedding cosine {kept:.3f}; max ‖ΔW‖₂/‖W‖₂ {rows[-1][4]:.4f}; {sec:.2f} s/step",
              flush=True)

    head = ("optimizer", "lr", "held-out loss", "held-out acc", "held-out AUC", "embedding cosine to pretrained",
            "max ‖ΔW‖₂/‖W‖₂", "s/step")
    lines = []
    for name, lr, m, kept, dw, sec in rows:
        lines.append((name, lr, f"{m['loss']:.3f}", f"{m['acc']:.3f}", f"{m['auc']:.3f}", f"{kept:.3f}",
                      f"{dw:.4f}", "—" if sec != sec else f"{sec:.2f}"))
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
        print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
        for line in lines:
            print("  ".join(c.ljust(w) for c, w in zip(line, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
