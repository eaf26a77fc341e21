"""Perplexity of a causal language model on a text, in bounded time: ``perplexity(model, text, tokens=N)``.

Models (:func:`load_causal_lm`): a Hugging Face model directory (``config.json`` + weights) or a llama.cpp ``.gguf``
file, both through ``transformers`` with ``local_files_only`` (nothing is downloaded; GGUF tensors are dequantised to
float32 by transformers); this package's own GPT / Llama checkpoints (a verified trainer checkpoint or a run
directory: the model rebuilt from the checkpoint's config, the tokenizer from its ``[data]`` section); and a
directory written by ``weightgeom compress``: its base model (recorded in the index, or ``base=``) with the compressed
roles' dense reconstructions written into the weights (:func:`~weightgeom.analysis.compress.apply_compressed`).

The text (default: the held-out tail of the bundled Shakespeare corpus, :func:`heldout_text`) is tokenized, the
first ``tokens`` + 1 token ids kept, and cut into non-overlapping windows of ``context`` tokens; each window predicts
its next tokens from the tokens before them in the same window. Perplexity = exp(mean next-token negative
log-likelihood in nats) over the ``tokens`` predicted tokens. The cost is linear in ``tokens`` (one forward pass per
window), so the token budget bounds the time.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from weightgeom._files import read_json
from weightgeom.analysis.compress import INDEX_FILE, apply_compressed, compressed_source
from weightgeom.analysis.loaders import _strip, open_lazy
from weightgeom.data.corpora import shakespeare_text
from weightgeom.data.tokenizers import get_tokenizer
from weightgeom.train.batches import char_encode, read_text_file, shakespeare_corpus
from weightgeom.train.checkpoint import is_checkpoint_file, latest_checkpoint, load_checkpoint
from weightgeom.train.trainer import model_from_config

__all__ = ["CausalLM", "PerplexityResult", "load_causal_lm", "perplexity", "perplexity_of_ids", "heldout_text",
           "DEFAULT_TOKENS", "DEFAULT_CONTEXT", "HELDOUT_FRACTION"]

DEFAULT_TOKENS = 2048
"""Default token budget: predicted tokens per evaluation."""
DEFAULT_CONTEXT = 512
"""Default window length in tokens (capped at the model's context length)."""
HELDOUT_FRACTION = 0.1
"""Share of the bundled Shakespeare corpus at its end used as held-out text (the trainer's default val split)."""


@dataclass
class CausalLM:
    """A causal language model ready for :func:`perplexity`.

    Attributes:
        model: the nn.Module (eval mode, CPU).
        encode: text → token ids.
        name: for messages and tables.
        kind: ``hf`` | ``gguf`` | ``weightgeom``.
        max_context: the longest input the model takes, in tokens.
        source: the path it was loaded from.
    """

    model: torch.nn.Module
    encode: Callable[[str], list[int]]
    name: str
    kind: str
    max_context: int
    source: str = ""

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits (B, T, V) for token ids (B, T)."""
        out = self.model(ids)
        if isinstance(out, tuple):  # this package's models return (logits, loss)
            return out[0]
        return out.logits


@dataclass
class PerplexityResult:
    """Attributes: ``ppl`` = exp(``nll``), ``nll`` mean next-token negative log-likelihood (nats/token),
    ``tokens`` predicted tokens, ``windows``, ``context`` (tokens per window), ``seconds`` wall time, ``model``."""

    ppl: float
    nll: float
    tokens: int
    windows: int
    context: int
    seconds: float
    model: str = ""

    def as_dict(self) -> dict:
        """The fields as a plain dict."""
        return dict(self.__dict__)


def heldout_text(fraction: float = HELDOUT_FRACTION) -> str:
    """The last ``fraction`` of the bundled Shakespeare corpus (``weightgeom.data.corpora.shakespeare_text``), the part
    the trainer holds out for validation at its default ``data.val_fraction``."""

    text = shakespeare_text()
    return text[int(len(text) * (1.0 - fraction)):]


def _transformers():
    """``transformers``, offline; one line when it is missing."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ValueError("evaluating Hugging Face and GGUF models needs the transformers package: "
                         "pip install transformers (or weightgeom[test])") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


@contextmanager
def _quiet_gguf() -> Iterator[None]:
    """No per-tensor progress bar while transformers dequantises a GGUF file: it draws one with ``tqdm`` itself,
    which neither its logging verbosity nor ``disable_progress_bar`` switches off."""
    try:
        mod = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:  # no GGUF support in this transformers: nothing to silence
        yield
        return
    bar = getattr(mod, "tqdm", None)
    if bar is not None:
        mod.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            mod.tqdm = bar


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""Files of which a Hugging Face model directory needs one for its tokenizer."""


def _first(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _hf_lm(path: Path) -> CausalLM:
    """A Hugging Face model directory or a ``.gguf`` file through transformers (local files only).

    A directory's weights are first opened as tensors only (:func:`~weightgeom.analysis.loaders.open_lazy`), so a
    pickled ``pytorch_model.bin`` is refused with the loaders' one line before transformers sees it.
    """
    if path.is_file():
        kw = {"gguf_file": path.name}
        where, kind = str(path.parent), "gguf"
    else:
        kw, where, kind = {}, str(path), "hf"
        _refuse_not_causal(path)  # an encoder or a classifier: before transformers bolts a random LM head onto it
        open_lazy(path)  # tensors only: a pickle, a truncated or missing weights file is one line naming it
        if not any((path / f).exists() for f in TOKENIZER_FILES):
            raise ValueError(f"{path}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); eval needs the model's "
                             "tokenizer — save it beside the weights with tokenizer.save_pretrained()")
    tf = _transformers()
    try:
        tok = tf.AutoTokenizer.from_pretrained(where, local_files_only=True, **kw)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        raise ValueError(f"{path}: its tokenizer cannot be loaded ({_first(e)})") from None
    try:
        with _quiet_gguf():
            model, info = tf.AutoModelForCausalLM.from_pretrained(where, local_files_only=True, dtype=torch.float32,
                                                                  output_loading_info=True, **kw)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"{path}: transformers cannot load it as a causal language model ({_first(e)})") from None
    fresh = sorted({str(k) for k in info.get("missing_keys") or ()}
                   | {str(k[0] if isinstance(k, (tuple, list)) else k) for k in info.get("mismatched_keys") or ()})
    if fresh:  # transformers fills what the file lacks with random weights: its perplexity would mean nothing
        more = f" and {len(fresh) - 3} more" if len(fresh) > 3 else ""
        raise ValueError(f"{path}: not a causal language model as saved — {len(fresh)} of the weights transformers "
                         f"needs for {type(model).__name__} are not in it ({', '.join(fresh[:3])}{more}) and would "
                         "be random, so its perplexity would mean nothing; eval a causal LM saved with its "
                         "language-model head")
    model.eval()
    ctx = int(getattr(model.config, "max_position_embeddings", 0) or getattr(model.config, "n_positions", 0)
              or DEFAULT_CONTEXT)
    return CausalLM(model, lambda s: list(tok(s, add_special_tokens=False)["input_ids"]), path.name, kind, ctx,
                    str(path))


CAUSAL_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")
"""Endings of the ``architectures`` names in a ``config.json`` that are causal language models (``LlamaForCausalLM``,
``GPT2LMHeadModel`` …); a model saved as anything else (``BertModel``, ``…ForMaskedLM``, ``…ForSequenceClassification``)
has no trained next-token head."""


def _refuse_not_causal(path: Path) -> None:
    """Refuse a Hugging Face directory whose ``config.json`` says it is not a causal LM (an encoder, an
    encoder-decoder, a classifier), before transformers bolts a random LM head onto it.

    Raises:
        ValueError: one line naming the path, the architecture and what to do.
    """
    cfg = read_json(path / "config.json", what="model config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}/config.json: not a JSON object; eval needs a Hugging Face causal LM's config")
    archs = cfg.get("architectures")
    names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if cfg.get("is_encoder_decoder") is True or names and not any(a.endswith(CAUSAL_ARCHITECTURES) for a in names):
        what = names[0] if names else "an encoder-decoder model"
        raise ValueError(f"{path}: is {what} (config.json), not a causal language model (…ForCausalLM, "
                         "…LMHeadModel); eval measures next-token perplexity, which only a decoder with its "
                         "trained language-model head has — evaluate a causal LM")


def _own_lm(path: Path) -> CausalLM:
    """This package's GPT / Llama from a verified trainer checkpoint (or a run directory's newest one)."""

    ck = latest_checkpoint(path / "checkpoints") if path.is_dir() else path
    if ck is None:
        raise ValueError(f"{path}: neither a Hugging Face model (config.json), a .gguf file, a weightgeom checkpoint "
                         "nor a run directory with checkpoints/")
    with open(ck, "rb") as f:
        head = f.read(16)
    if not is_checkpoint_file(head):
        raise ValueError(f"{ck}: not a weightgeom trainer checkpoint (eval reads Hugging Face directories, .gguf "
                         "files, weightgeom checkpoints / run directories and weightgeom compress outputs)")
    payload = load_checkpoint(ck)
    cfg = payload.get("config") or {}
    mcfg = dict(cfg.get("model") or {})
    if mcfg.get("kind") not in ("gpt", "llama"):
        raise ValueError(f"{ck}: model kind {mcfg.get('kind')!r} is not a causal language model (gpt, llama)")
    model = model_from_config(mcfg)
    model.load_state_dict(_strip(payload["model"]))
    model.eval()
    data = cfg.get("data") or {}
    if data.get("tokenizer", "gpt2") == "gpt2":
        tok = get_tokenizer("gpt2")
    else:

        text = read_text_file(data["path"]) if data.get("kind") == "text" else shakespeare_corpus()
        tok = get_tokenizer("char", chars=char_encode(text)[1]["chars"])
    return CausalLM(model, lambda s: list(tok.encode(s)), path.name, "weightgeom", int(model.context_length()),
                    str(path))


def load_causal_lm(path: str | Path, *, base: str | Path | None = None) -> CausalLM:
    """Load a causal LM for :func:`perplexity` (see the module docstring for the kinds).

    Args:
        path: HF directory, ``.gguf`` file, weightgeom checkpoint / run directory, or a ``weightgeom compress`` output.
        base: for a compress output, the uncompressed model (default: the source path its index records, which must
            be unchanged since it was compressed).

    Raises:
        FileNotFoundError: no such path.
        ValueError: a file of no supported kind, one that cannot be loaded or holds pickled Python objects, ``base``
            for a model that is not a compress output, or a compress output whose base is missing, changed, or loops
            back to a compress output (one line naming it).
    """

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    if p.is_dir() and (p / INDEX_FILE).exists():
        lm = load_causal_lm(compressed_source(p, base))  # never a compress output itself: no recursion
        n = apply_compressed(lm.model, p)
        lm.name = f"{p.name} ({n} matrices from {lm.name})"
        lm.source = str(p)
        return lm
    if base is not None:
        raise ValueError(f"{p}: is not a compress output (no {INDEX_FILE}); a base model is only for one")
    if p.is_file() and p.suffix == ".gguf" or p.is_dir() and (p / "config.json").exists():
        return _hf_lm(p)
    return _own_lm(p)


@torch.no_grad()
def perplexity_of_ids(lm: CausalLM, ids: list[int] | torch.Tensor, *, tokens: int = DEFAULT_TOKENS,
                      context: int | None = None, progress: bool = False) -> PerplexityResult:
    """Perplexity over the first ``tokens`` predicted tokens of ``ids`` (windows of ``context`` tokens).

    Raises:
        ValueError: fewer than 2 token ids, or a non-positive budget / context.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    ctx = min(int(context or DEFAULT_CONTEXT), lm.max_context)
    if ctx < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    if ids.numel() < 2:
        raise ValueError("the text has fewer than 2 tokens: nothing to predict")
    ids = ids[:tokens + 1]
    n_pred = ids.numel() - 1
    t0 = time.perf_counter()
    nll_sum, done, windows = 0.0, 0, 0
    for start in range(0, n_pred, ctx):
        w = ids[start:min(start + ctx, n_pred) + 1]
        logits = lm.logits(w[None, :-1]).float()
        nll_sum += float(torch.nn.functional.cross_entropy(logits[0], w[1:], reduction="sum"))
        done += w.numel() - 1
        windows += 1
        if progress:
            el = time.perf_counter() - t0
            print(f"  [{done}/{n_pred} tokens] {lm.name}: ppl so far {math.exp(nll_sum / done):.3f}  {el:.1f} s "
                  f"elapsed, ETA {el / done * (n_pred - done):.1f} s", file=sys.stderr, flush=True)
    nll = nll_sum / n_pred
    return PerplexityResult(math.exp(nll), nll, n_pred, windows, ctx, time.perf_counter() - t0, lm.name)


def perplexity(model: CausalLM | str | Path, text: str | None = None, *, tokens: int = DEFAULT_TOKENS,
               context: int | None = None, base: str | Path | None = None,
               progress: bool = False) -> PerplexityResult:
    """Perplexity of a causal LM on ``text`` (default :func:`heldout_text`) over ``tokens`` predicted tokens.

    Args:
        model: a :class:`CausalLM` or a path for :func:`load_causal_lm`.
        text: the evaluation text.
        tokens: the token budget (predicted tokens; the time is linear in it).
        context: window length in tokens (default :data:`DEFAULT_CONTEXT`, capped at the model's).
        base: for a compress output, its uncompressed base model.
        progress: one stderr line per window.
    """
    lm = model if isinstance(model, CausalLM) else load_causal_lm(model, base=base)
    text = heldout_text() if text is None else text
    # tokenize only what the budget needs (≈ 8 characters per token is generous for BPE and char tokenizers alike)
    need = max(64, 8 * (tokens + 1))
    ids = lm.encode(text[:need])
    while len(ids) < tokens + 1 and need < len(text):
        need *= 2
        ids = lm.encode(text[:need])
    return perplexity_of_ids(lm, ids, tokens=tokens, context=context, progress=progress)
