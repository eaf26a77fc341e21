"""weightgeom.data: offline tokenizers, token datasets, corpora, MNIST, ``weightgeom data prepare`` (docs/models.md).

Submodules import lazily-heavy dependencies (tiktoken, pyarrow, scikit-learn) only when used.
"""

from .corpora import iter_documents, shakespeare_files, shakespeare_text
from .mnist import load_mnist
from .prepare import (
    cache_dir,
    load_token_dataset,
    prepare,
    prepare_cached,
    prepare_shakespeare,
    write_token_dataset,
)
from .tokenizers import CharTokenizer, GPT2Tokenizer, get_tokenizer, gpt2_encoding, tokenizer_from_meta
from .tokens import TokenDataset

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
