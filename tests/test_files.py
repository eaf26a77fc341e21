"""weightgeom._files: every write replaces (never follows) a link and is atomic; every read of a user's file refuses
special files before blocking on them and is size-bounded; JSON/TOML parse errors of every kind are one ValueError."""

from __future__ import annotations

import errno
import io
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from weightgeom._files import (
    READ_CHUNK,
    FileTooLargeError,
    OutputAliasError,
    SpecialFileError,
    distinct_outputs,
    open_append,
    open_regular,
    read_bounded,
    read_json,
    read_text_bounded,
    read_toml,
    read_upto,
    write_atomic,
)


# -------------------------------------------------------------------------------------------------------- writes
def _plant(path: Path, planted: str, target: Path, old: str) -> None:
    """Put ``planted`` at ``path``: nothing, a file holding ``old``, a link to ``target``, a dangling link (to
    ``nowhere`` beside ``target``) or a link to a link to ``target``."""
    if planted == "file":
        path.write_text(old)
    elif planted == "link to a file":
        path.symlink_to(target)
    elif planted == "dangling link":
        path.symlink_to(target.parent / "nowhere")
    elif planted == "link to a link":
        (target.parent / "hop").symlink_to(target)
        path.symlink_to(target.parent / "hop")


@pytest.mark.parametrize("content,expect", [
    (b"bytes", b"bytes"),
    ("text ✓", "text ✓".encode()),
    ([b"chunk1", b"chunk2"], b"chunk1chunk2"),
    (lambda p: Path(p).write_bytes(b"by a writer"), b"by a writer"),
])
@pytest.mark.parametrize("planted", ["nothing", "file", "link to a file", "dangling link", "link to a link"])
def test_write_atomic_replaces_whatever_is_at_the_name(tmp_path, content, expect, planted):
    target = tmp_path / "victim.sh"
    target.write_text("original")
    path = tmp_path / "out" / "report.md"
    path.parent.mkdir()
    _plant(path, planted, target, "old")
    write_atomic(path, content)
    assert path.read_bytes() == expect and not path.is_symlink()
    assert target.read_text() == "original" and not (tmp_path / "nowhere").exists()
    assert [p.name for p in path.parent.iterdir()] == ["report.md"]  # no temporary file left


def test_write_atomic_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("complete")

    def broken(p: Path) -> None:
        Path(p).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(path, broken)
    assert path.read_text() == "complete" and [p.name for p in tmp_path.iterdir()] == ["a.csv"]


def test_write_atomic_writer_sees_the_final_suffix_and_permissions_follow_the_umask(tmp_path):
    seen = []
    write_atomic(tmp_path / "plot.png", lambda p: (seen.append(Path(p).suffix), Path(p).write_bytes(b"x")))
    assert seen == [".png"]
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "s.json", b"{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "s.json").stat().st_mode) == 0o640


def test_write_atomic_refuses_a_directory(tmp_path):
    (tmp_path / "report.md").mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomic(tmp_path / "report.md", "x")


@pytest.mark.parametrize("planted", ["nothing", "file", "link to a file", "dangling link"])
def test_open_append_never_writes_through_a_link(tmp_path, planted):
    target = tmp_path / "victim"
    target.write_text("original\n")
    path = tmp_path / "metrics.jsonl"
    _plant(path, planted, target, "kept\n")
    with open_append(path) as f:
        f.write("new\n")
    assert path.read_text() == ("kept\n" if planted == "file" else "") + "new\n" and not path.is_symlink()
    assert target.read_text() == "original\n" and not (tmp_path / "nowhere").exists()


def test_open_append_refuses_a_fifo_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "metrics.jsonl")
    with pytest.raises(SpecialFileError, match="FIFO"):
        open_append(tmp_path / "metrics.jsonl")


# --------------------------------------------------------------------------------------------------------- reads
def _special(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "directory":
        p.mkdir()
    elif kind == "char device":
        p.symlink_to("/dev/null")
    elif kind == "fifo behind a link":
        os.mkfifo(tmp_path / "pipe")
        p.symlink_to(tmp_path / "pipe")
    return p


@pytest.mark.parametrize("kind,words", [("fifo", "FIFO"), ("directory", "directory"),
                                        ("char device", "character device"), ("fifo behind a link", "FIFO")])
@pytest.mark.parametrize("reader", [open_regular, read_bounded, read_json, read_toml])
def test_special_files_are_refused_at_once(tmp_path, kind, words, reader):
    p = _special(tmp_path, kind)
    done = threading.Event()
    err: list[BaseException] = []

    def go() -> None:
        try:
            reader(p)
        except BaseException as e:  # noqa: BLE001 -- collected for the assertion
            err.append(e)
        done.set()

    threading.Thread(target=go, daemon=True).start()
    assert done.wait(10), f"{reader.__name__} blocked on a {kind}"
    assert err and isinstance(err[0], SpecialFileError) and words in str(err[0]) and str(p) in str(err[0])


def test_reads_are_bounded(tmp_path):
    p = tmp_path / "model.safetensors.index.json"
    with open(p, "wb") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB on paper
    with pytest.raises(FileTooLargeError, match="3221225472 bytes, more than the 64 MiB"):
        read_bounded(p)
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(SpecialFileError):
        read_bounded(tmp_path / "zero")
    q = tmp_path / "small.json"
    q.write_text('{"a": 1}')
    assert read_json(q) == {"a": 1}
    with pytest.raises(FileTooLargeError):
        read_bounded(q, limit=4)


class _Reads(io.BytesIO):
    """A stream that records the size of every read asked of it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.asked: list[int] = []

    def read(self, n=-1):
        self.asked.append(n)
        return super().read(n)


@pytest.mark.parametrize("data,first,limit,largest", [
    (b"x" * 1000, 1001, 8 << 30, 1001),  # the file's size + 1, never the 8 GiB bound
    (b"x" * 1000, 1, 8 << 30, READ_CHUNK),  # a size that was not reported: 1 MiB pieces
    (b"x" * (3 * READ_CHUNK), 11, 8 << 30, READ_CHUNK),  # a file that grew after fstat
    (b"x" * 1000, READ_CHUNK, 100, 101),  # never more than the bound + 1
])
def test_read_upto_reserves_what_is_there_not_the_bound(data, first, limit, largest):
    f = _Reads(data)
    got = read_upto(f, limit, first=first)
    assert got == data[:limit + 1] and max(f.asked) == largest


def test_bounded_read_of_a_small_file_under_an_address_space_limit(tmp_path):
    # ulimit -v as clusters set it: an 8 GiB bound must not reserve 8 GiB (it was a MemoryError for a 1 KB file)
    p = tmp_path / "small.txt"
    p.write_text("to be or not to be\n" * 50)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
            "from weightgeom._files import read_bounded; "
            "sys.stdout.write(str(len(read_bounded(sys.argv[1], 8 << 30))))")
    res = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == "950", res.stderr[-2000:]


def test_distinct_outputs_refuses_one_file_under_two_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("a.md").write_text("keep")
    Path("link.md").symlink_to("a.md")
    os.link("a.md", "hard.md")
    Path("sub").mkdir()
    for other in ("a.md", "./a.md", "sub/../a.md", str(tmp_path / "a.md"), "link.md", "hard.md"):
        with pytest.raises(OutputAliasError, match=r"--readme a\.md and --page .* name one file") as e:
            distinct_outputs([("--readme", "a.md"), ("--page", other)])
        assert "\n" not in str(e.value) and other in str(e.value)
    distinct_outputs([("--readme", "a.md"), ("--page", "b.md"), ("--record", None), ("--x", "sub/a.md")])
    assert Path("a.md").read_text() == "keep"


@pytest.mark.parametrize("fault", ["ENOSPC at fsync", "EROFS at mkstemp"])
def test_write_atomic_errors_name_the_file_asked_for(tmp_path, monkeypatch, fault):
    import tempfile

    import weightgeom._files as files

    target = tmp_path / "page.md"
    target.write_text("old")
    if fault.startswith("ENOSPC"):  # a full disk: the system names no file
        def fail(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(files.os, "fsync", fail)
    else:  # a read-only filesystem: the system names the temporary file
        def fail(**kw):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / ".page.md.x1y2.tmp"))
        monkeypatch.setattr(tempfile, "mkstemp", fail)
    with pytest.raises(OSError) as e:
        write_atomic(target, "new")
    monkeypatch.undo()
    assert e.value.filename == str(target) and e.value.errno in (errno.ENOSPC, errno.EROFS)
    assert target.read_text() == "old" and sorted(q.name for q in tmp_path.iterdir()) == ["page.md"]


@pytest.mark.parametrize("reader,text,words", [
    (read_json, "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (read_json, "1" * 5000, "not valid JSON"),
    (read_json, '{"a": ', "not valid JSON"),
    (read_toml, "a = " + "[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (read_toml, "[[[ x", "not valid TOML"),
])
def test_parse_errors_are_one_value_error(tmp_path, reader, text, words):
    p = tmp_path / "f"
    p.write_text(text)
    with pytest.raises(ValueError, match=words) as e:
        reader(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_text_that_is_not_utf8_names_the_file(tmp_path):
    p = tmp_path / "status.json"
    p.write_bytes(b'{"reason": "\xff"}')
    with pytest.raises(ValueError, match=r"status.json: not UTF-8 text \(byte 12"):
        read_text_bounded(p)
