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

Errors are :class:`SpecialFileError` / :class:`FileTooLargeError` (both ``ValueError``: bad input, one line, exit 2)
naming the path and what it is.
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

__all__ = ["write_atomic", "open_append", "open_regular", "read_bounded", "read_text_bounded", "read_json",
           "read_toml", "is_regular", "file_kind", "SpecialFileError", "FileTooLargeError", "SMALL_FILE_LIMIT",
           "fsync_dir"]

SMALL_FILE_LIMIT = 64 << 20
"""Size bound (bytes) for the small JSON/TOML files read from user and run folders (``config.json``, an index, a
run's ``status.json``, ``sweep.json`` …): the largest such file a real model has (a 70B model's
``model.safetensors.index.json``) is ~60 KB, so 64 MiB is three orders of magnitude of headroom."""


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
    and whatever was at ``path`` before is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.isdir(path) and not os.path.islink(path):
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(path))
    # a writer function keeps the final suffix, so tools that pick a format by it (savefig) see the right one
    suffix = ".tmp" + (path.suffix if callable(content) else "")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=suffix, dir=path.parent)
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
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


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
    read, or a filesystem that reports no size), so at most ``limit + 1`` bytes are ever held.
    """
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        label = f" ({what})" if what else ""
        if size > limit:
            raise FileTooLargeError(f"{path}{label}: {size} bytes, more than the {_mib(limit)} this file may hold")
        data = f.read(limit + 1)
        if len(data) > limit:
            raise FileTooLargeError(f"{path}{label}: more than the {_mib(limit)} this file may hold")
        return data


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
