"""Every file weightgeom writes, and every file it reads from a user's folder, goes through this module.

Writing (:func:`write_atomic`, :func:`open_append`): a file is never written *through* a symbolic link. A whole file
is written to a fresh temporary file beside it (created exclusively, never following anything) and ``os.replace``-d
onto its name: a link planted at that name (``report.md -> ~/.bashrc``) is replaced by the new file and its target
is left alone; a reader sees the old file or the new one, never half of it. An append-only log
(``metrics.jsonl``) is opened with ``O_NOFOLLOW``: a link at its name is removed and a fresh file created in its place.

Reading (:func:`open_regular`, :func:`read_bounded`): a FIFO, device, socket or directory at a path the user handed
us is refused before anything blocks on it (the file is opened non-blocking and checked with ``fstat``, so there is
no window between the check and the open), and whole-file reads carry a size bound, so ``config.json -> /dev/zero``
or a 2 GB sparse file is one clear line rather than an out-of-memory kill.

Several outputs of one command (:func:`distinct_outputs`): two output flags that name one file — alike, through a
link, ``..`` or a hard link — are refused before anything is written, so one output can never replace another.

Errors are :class:`SpecialFileError` / :class:`FileTooLargeError` / :class:`OutputAliasError` (all ``ValueError``: bad
input, one line, exit 2) naming the path and what it is.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["write_atomic", "open_append", "open_regular", "read_bounded", "read_upto", "read_text_bounded", "read_json",
           "read_toml", "is_regular", "file_kind", "distinct_outputs", "SpecialFileError", "FileTooLargeError",
           "OutputAliasError", "SMALL_FILE_LIMIT", "READ_CHUNK", "fsync_dir"]

SMALL_FILE_LIMIT = 64 << 20
"""Size bound (bytes) for the small JSON/TOML files read from user and run folders (``config.json``, an index, a
run's ``status.json``, ``sweep.json`` …): the largest such file a real model has (a 70B model's
``model.safetensors.index.json``) is ~60 KB, so 64 MiB is three orders of magnitude of headroom."""


READ_CHUNK = 1 << 20
"""Bytes :func:`read_bounded` reserves per read once a file turns out longer than ``fstat`` said (1 MiB)."""


class SpecialFileError(ValueError):
    """A path that should hold a regular file is a FIFO, device, socket or directory."""


class FileTooLargeError(ValueError):
    """A file is larger than the bound its reader sets."""


def file_kind(mode: int) -> str:
    """``"a FIFO (named pipe)"``, ``"a directory"`` … for an ``st_mode`` (the words an error line uses)."""
    for test, words in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return words
    return "not a regular file"


def fsync_dir(d: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives a crash (best effort: some filesystems refuse)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask, read without changing it where Linux reports it (``os.umask`` is a racy set-and-restore)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


Content = bytes | bytearray | memoryview | str | Iterable[bytes] | Callable[[Path], object]


def write_atomic(path: str | os.PathLike, content: Content, *, fsync: bool = True) -> Path:
    """Write a whole file at ``path`` atomically, replacing (never following) whatever link or file is there.

    Args:
        path: the final name. Its parent directories are created. A symbolic link at ``path`` is replaced by the new
            file; its target is not touched. A directory at ``path`` raises ``IsADirectoryError``.
        content: bytes, a str (written as UTF-8), an iterable of byte chunks, or a function ``write(tmp_path)`` that
            writes the file at the temporary path it is given (``fig.savefig``, ``DataFrame.to_csv``).
        fsync: flush the file and its directory to disk before returning (off for throw-away outputs).

    Returns:
        ``path`` as a ``Path``.

    The file gets the permissions an ordinary ``open(path, "w")`` would give (0666 less the umask), not the 0600 of a
    temporary file, so collaborators on a shared filesystem can read it. On any error the temporary file is removed
    and whatever was at ``path`` before is left as it was; an ``OSError`` (a full disk, a read-only filesystem) names
    ``path`` itself as its ``filename``, never the temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(path) and not os.path.islink(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    # a writer function keeps the final suffix, so tools that pick a format by it (savefig) see the right one
    suffix = ".tmp" + (path.suffix if callable(content) else "")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=suffix, dir=path.parent)
    except OSError as e:  # a read-only or full filesystem: name the file asked for, not the temporary one
        raise _naming(e, path) from None
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        if callable(content):
            os.close(fd)
            fd = -1
            content(tmp)
            if fsync:
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
        else:
            with os.fdopen(fd, "wb") as f:
                fd = -1
                chunks = [content.encode("utf-8")] if isinstance(content, str) else (
                    [content] if isinstance(content, (bytes, bytearray, memoryview)) else content)
                for c in chunks:
                    f.write(c)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):  # a full disk names no file: name the one asked for
            raise _naming(e, path) from None
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


class OutputAliasError(ValueError):
    """Two output flags of one command name one file (directly, through a link, ``..`` or a hard link)."""


def _file_keys(path: str | os.PathLike) -> set:
    """Every identity under which a write to ``path`` could land: the fully resolved path (links followed), the
    resolved folder + the name (a link at the name, which :func:`write_atomic` replaces rather than follows), and
    the device + inode of what is there (a hard link)."""
    p = os.path.abspath(os.fspath(path))
    keys: set = {os.path.realpath(p), os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))}
    try:
        st = os.stat(p)
        keys.add((st.st_dev, st.st_ino))
    except OSError:
        pass
    return keys


def distinct_outputs(outputs: Iterable[tuple[str, str | os.PathLike | None]]) -> None:
    """Refuse two output flags that name one file, before anything is read or written.

    Every command with several output files (``weightgeom claims --readme/--page/--record`` …) calls this first, so
    ``--readme same.md --page same.md`` cannot write one output over the other, whether the two name the file
    alike, through a symbolic link, through ``..`` or through a hard link.

    Args:
        outputs: ``(flag, path)`` pairs as the user gave them; a ``None`` or empty path (flag not given) is skipped.

    Raises:
        OutputAliasError: one line naming both flags, both paths and the file they share.
    """
    seen: list[tuple[str, str, set]] = []
    for flag, value in outputs:
        if value is None or value == "":
            continue
        keys = _file_keys(value)
        for other_flag, other_value, other_keys in seen:
            if keys & other_keys:
                raise OutputAliasError(
                    f"{other_flag} {other_value} and {flag} {value} name one file "
                    f"({os.path.realpath(value)}); give each output a file of its own (nothing was written)")
        seen.append((flag, os.fspath(value), keys))


def _naming(e: OSError, path: Path) -> OSError:
    """``e`` naming ``path`` (the file a caller asked for) instead of a temporary file or nothing; its class (from
    the errno: ``PermissionError``, ``FileNotFoundError`` …) and reason kept."""
    if e.errno is None or e.filename == str(path):
        return e
    return OSError(e.errno, e.strerror or str(e), str(path))


def open_append(path: str | os.PathLike, *, text: bool = True, buffering: int = -1) -> IO:
    """Open ``path`` for appending without following a symbolic link at its name.

    A link at ``path`` (planted, or left by anything else) is removed and a new regular file created in its place;
    its target is never written. A FIFO, device, socket or directory at ``path`` raises :class:`SpecialFileError`
    (opening a FIFO for writing would block until a reader appears).
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    for _ in range(3):
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as e:
            if e.errno == errno.ELOOP and os.path.islink(path):  # a link at the name: replace it, never follow
                os.unlink(path)
                continue
            if e.errno == errno.ENXIO:  # a FIFO with no reader (O_NONBLOCK)
                raise SpecialFileError(f"{path}: is a FIFO (named pipe), not a regular file; refusing to write "
                                       "to it") from None
            raise
        break
    else:  # pragma: no cover - a link re-planted between unlink and open three times over
        raise OSError(errno.ELOOP, "a symbolic link keeps reappearing", str(path))
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SpecialFileError(f"{path}: is {file_kind(st.st_mode)}, not a regular file; refusing to write to it")
    os.set_blocking(fd, True)
    if text:
        return os.fdopen(fd, "a", buffering=buffering, encoding="utf-8")
    return os.fdopen(fd, "ab", buffering=buffering)


def is_regular(path: str | os.PathLike, what: str = "") -> bool:
    """Whether a regular file is at ``path`` (links followed): False when nothing is there, True for a regular file,
    :class:`SpecialFileError` for anything else (a FIFO, device, socket or directory), where ``Path.is_file()`` would
    say "absent" and a caller then report the wrong problem. Only ``stat``: nothing is opened, nothing blocks.

    Raises:
        SpecialFileError: something other than a regular file is there.
        OSError: a loop of links, or a path that cannot be looked at (the system's reason).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISREG(st.st_mode):
        return True
    raise SpecialFileError(f"{path}{_label(what)}: is {file_kind(st.st_mode)}, not a regular file")


def open_regular(path: str | os.PathLike, what: str = "") -> IO[bytes]:
    """Open ``path`` for reading (binary) only if it is a regular file; links are followed as usual.

    The open is non-blocking (a FIFO opens at once instead of waiting for a writer) and the opened file is checked
    with ``fstat``, so nothing blocks and nothing can be swapped in between the check and the read.

    Args:
        path: the file.
        what: words for the error line (e.g. ``"model config"``); the path is always named.

    Raises:
        SpecialFileError: a FIFO, device, socket or directory.
        OSError: missing, unreadable, a dangling link or a loop of links (the system's reason).
    """
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            label = f" ({what})" if what else ""
            raise SpecialFileError(f"{path}{label}: is {file_kind(st.st_mode)}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike, limit: int = SMALL_FILE_LIMIT, what: str = "") -> bytes:
    """The whole of a regular file, refused if it is larger than ``limit`` bytes (see :func:`open_regular`).

    The bound is checked on the size ``fstat`` reports and again on the bytes read (a file that grows while it is
    read, or a filesystem that reports no size), so at most ``limit + 1`` bytes are ever held. Memory is reserved
    for what the file holds (+1 byte), then in :data:`READ_CHUNK` pieces if it turns out longer — never for the
    whole bound, so a generous bound costs nothing under an address-space limit (``ulimit -v``).
    """
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        label = f" ({what})" if what else ""
        if size > limit:
            raise FileTooLargeError(f"{path}{label}: {size} bytes, more than the {_mib(limit)} this file may hold")
        data = read_upto(f, limit, first=min(size, limit) + 1)
        if len(data) > limit:
            raise FileTooLargeError(f"{path}{label}: more than the {_mib(limit)} this file may hold")
        return data


def read_upto(f: IO[bytes], limit: int, first: int = READ_CHUNK) -> bytes:
    """At most ``limit + 1`` bytes of an open binary stream (a file, a ``gzip`` stream), reserving memory only for
    what is there: ``first`` bytes, then :data:`READ_CHUNK` pieces.

    ``f.read(limit + 1)`` would reserve the whole bound up front (Python allocates a read's size before reading), so
    an 8 GiB bound under an address-space limit (``ulimit -v``) is a ``MemoryError`` even for a 1 MB file. A caller
    that gets more than ``limit`` bytes back refuses the file.
    """
    chunks: list[bytes] = []
    total, want = 0, max(1, first)
    while total <= limit:
        asked = min(want, limit + 1 - total)
        chunk = f.read(asked)
        chunks.append(chunk)
        total += len(chunk)
        if len(chunk) < asked:  # a buffered read returns less only at the end of the stream
            break
        want = READ_CHUNK  # longer than expected (it grew, or its size was unknown): go on piece by piece
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_text_bounded(path: str | os.PathLike, limit: int = SMALL_FILE_LIMIT, what: str = "") -> str:
    """:func:`read_bounded` decoded as UTF-8; bytes that are not UTF-8 raise ``ValueError`` naming the path."""
    data = read_bounded(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        label = f" ({what})" if what else ""
        raise ValueError(f"{path}{label}: not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None


def read_json(path: str | os.PathLike, limit: int = SMALL_FILE_LIMIT, what: str = "") -> Any:
    """Parse a JSON file read with :func:`read_text_bounded`; every way it can be bad is one ``ValueError`` line.

    Bad JSON, bytes that are not UTF-8, nesting deeper than Python's parser can follow (``RecursionError``) and
    integers longer than Python converts (``int_max_str_digits``) all raise ``ValueError`` naming the path. A missing
    or unreadable file raises ``OSError`` as usual; a FIFO or an oversized file the errors of :func:`read_bounded`.
    """
    text = read_text_bounded(path, limit, what)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path}{_label(what)}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # JSONDecodeError, and an integer too long to convert
        raise ValueError(f"{path}{_label(what)}: not valid JSON ({_first_line(e)})") from None


def read_toml(path: str | os.PathLike, limit: int = SMALL_FILE_LIMIT, what: str = "") -> dict[str, Any]:
    """Parse a TOML file read with :func:`read_text_bounded`; errors as :func:`read_json`'s."""
    text = read_text_bounded(path, limit, what)
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ValueError(f"{path}{_label(what)}: not valid TOML (nested too deeply)") from None
    except ValueError as e:  # TOMLDecodeError is a ValueError
        raise ValueError(f"{path}{_label(what)}: not valid TOML ({_first_line(e)})") from None


def _label(what: str) -> str:
    return f" ({what})" if what else ""


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n} bytes"
