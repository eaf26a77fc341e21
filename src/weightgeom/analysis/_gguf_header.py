"""A bounded walk over a GGUF file's header, run before ``gguf.GGUFReader`` is given the file.

``GGUFReader`` trusts the counts a header declares: a metadata array that claims 2⁶² items in a 200-byte file makes it
loop without end (each item past the end of the file reads as nothing and moves nothing), allocating as it goes, and a
real array costs it ~7 µs and ~650 bytes per item. This walk reads the same header with ``struct`` only, checks every
declared count against the bytes left in the file, and bounds the items of all metadata arrays together by
:data:`GGUF_MAX_ARRAY_ITEMS`, so a crafted header is one line naming the file and the count, never a hang or an
out-of-memory kill. It allocates nothing per item and takes ~0.3 s for a tokenizer of 500k strings.
"""

from __future__ import annotations

import mmap
import os
import struct

from weightgeom._files import open_regular

__all__ = ["GGUF_MAX_ARRAY_ITEMS", "check_gguf_header"]

GGUF_MAX_ARRAY_ITEMS = 1 << 21
"""Most items all metadata arrays of a GGUF file may hold together (2,097,152): the largest tokenizers of current
models (Gemma 3's 262k tokens with their scores and types, Llama 3's 128k tokens and 280k merges) hold under 0.8M, and
``GGUFReader`` needs ~1.4 GB and ~15 s for this many."""

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType → size
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 8


class _Walk:
    """A cursor over a GGUF header that refuses any read past the end of the file (``ValueError``)."""

    def __init__(self, buf, order: str, offs: int) -> None:
        self.buf, self.order, self.offs, self.items = buf, order, offs, 0

    def _fixed(self, fmt: str, what: str) -> int:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(self.order + fmt, self.buf, self.offs)
        self.offs += n
        return v

    def need(self, n: int, what: str) -> None:
        """Refuse when fewer than ``n`` bytes are left for ``what``."""
        left = len(self.buf) - self.offs
        if n > left:
            raise ValueError(f"truncated or corrupt: {what}: {n} bytes needed at offset {self.offs}, the file "
                             f"has {max(left, 0)} left")

    def count(self, n: int, each: int, what: str) -> int:
        """A declared count ``n`` of things of at least ``each`` bytes, refused when the rest of the file cannot hold
        them."""
        self.need(n * each, f"{what} ({n} declared)")
        return n

    def u32(self, what: str) -> int:
        return self._fixed("I", what)

    def u64(self, what: str) -> int:
        return self._fixed("Q", what)

    def string(self, what: str) -> str:
        """Skip a string; returns its first 200 bytes, decoded (for messages)."""
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        self.offs += n
        return bytes(self.buf[self.offs - n:self.offs - n + min(n, 200)]).decode("utf-8", "replace")

    def value(self, vtype: int, key: str, depth: int = 0) -> None:
        """Skip one metadata value of type ``vtype`` (GGUFValueType), counting array items."""
        if vtype in _SCALAR_BYTES:
            self.need(_SCALAR_BYTES[vtype], f"the value of {key}")
            self.offs += _SCALAR_BYTES[vtype]
        elif vtype == _STRING:
            self.string(f"the value of {key}")
        elif vtype == _ARRAY:
            self.array(key, depth)
        else:
            raise ValueError(f"metadata {key} has an unknown value type {vtype}")

    def array(self, key: str, depth: int) -> None:
        if depth >= _MAX_NESTING:
            raise ValueError(f"metadata {key} nests arrays more than {_MAX_NESTING} deep")
        itype = self.u32(f"the item type of {key}")
        n = self.u64(f"the item count of {key}")
        self.items += n
        if self.items > GGUF_MAX_ARRAY_ITEMS:
            much = (f"metadata array {key} declares {n} items" if n > GGUF_MAX_ARRAY_ITEMS else
                    f"metadata arrays declare over {self.items} items (up to {key})")
            raise ValueError(f"{much}, more than the {GGUF_MAX_ARRAY_ITEMS} weightgeom reads (the largest "
                             "tokenizers hold under 1M)")
        if itype in _SCALAR_BYTES:
            self.need(n * _SCALAR_BYTES[itype], f"the {n} items of {key}")
            self.offs += n * _SCALAR_BYTES[itype]
            return
        for _ in range(self.count(n, 8 if itype == _STRING else 12, f"the items of {key}")):
            self.value(itype, key, depth + 1)


def _walk(buf) -> None:
    """Walk the metadata and tensor infos of a GGUF file in ``buf``; files that are not GGUF are left to the reader."""
    if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
        return
    order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"  # as GGUFReader tells the byte order
    w = _Walk(buf, order, 8)
    n_tensors = w.u64("the tensor count")
    for _ in range(w.count(w.u64("the metadata count"), 12, "metadata entries")):
        name = w.string("a metadata key")
        w.value(w.u32(f"the value type of {name}"), name)
    for _ in range(w.count(n_tensors, 24, "tensor infos")):
        w.string("a tensor name")
        n_dims = w.count(w.u32("a tensor's dimension count"), 8, "tensor dimensions")
        w.offs += 8 * n_dims
        w.u32("a tensor type")
        w.u64("a tensor offset")


def check_gguf_header(path: str | os.PathLike) -> None:
    """Refuse a GGUF file whose header declares more than the file holds, or metadata arrays of more than
    :data:`GGUF_MAX_ARRAY_ITEMS` items, before ``GGUFReader`` reads it (see the module docstring).

    Raises:
        ValueError: one line naming the file and the count.
    """
    with open_regular(path, "GGUF") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                _walk(mm)
            except ValueError as e:
                raise ValueError(f"{path}: GGUF header: {e}") from None
