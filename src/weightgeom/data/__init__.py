"""weightgeom.data: offline tokenizers, token datasets, corpora, MNIST, ``weightgeom data prepare`` (docs/models.md).

Submodules import lazily-heavy dependencies (tiktoken, pyarrow, scikit-learn) only when used.
"""

from weightgeom._lazy import lazy_exports

__all__ = [
    "CharTokenizer",
    "GPT2Tokenizer",
    "TokenDataset",
    "cache_dir",
    "get_tokenizer",
    "gpt2_encoding",
    "iter_documents",
    "load_mnist",
    "load_token_dataset",
    "prepare",
    "prepare_cached",
    "prepare_shakespeare",
    "shakespeare_files",
    "shakespeare_text",
    "tokenizer_from_meta",
    "write_token_dataset",
]

# imported on first use, so `weightgeom data --help` (which imports weightgeom.data.cli) needs no torch
lazy_exports(__name__, {
    "iter_documents": ".corpora", "shakespeare_files": ".corpora", "shakespeare_text": ".corpora",
    "load_mnist": ".mnist",
    "cache_dir": ".prepare", "load_token_dataset": ".prepare", "prepare": ".prepare", "prepare_cached": ".prepare",
    "prepare_shakespeare": ".prepare", "write_token_dataset": ".prepare",
    "CharTokenizer": ".tokenizers", "GPT2Tokenizer": ".tokenizers", "get_tokenizer": ".tokenizers",
    "gpt2_encoding": ".tokenizers", "tokenizer_from_meta": ".tokenizers",
    "TokenDataset": ".tokens",
})
