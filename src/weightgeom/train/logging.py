"""Run logging: ``metrics.jsonl`` (one JSON object per line), TensorBoard scalars, and a tqdm progress bar.

Every line of ``metrics.jsonl`` has ``step`` (optimizer steps taken), ``split`` (``train`` | ``val`` | ``diag``) and
numbers; non-finite floats are written as the strings ``"nan"``, ``"inf"``, ``"-inf"`` so the file stays valid JSON.
Only rank 0 writes (the other ranks get a logger whose methods do nothing).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from weightgeom._files import open_append, open_regular, write_atomic

__all__ = ["MetricsLogger", "read_metrics", "parse_jsonl_line", "truncate_jsonl", "Progress", "write_json_atomic"]


def _clean(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    return v


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (tmp + os.replace)."""
    write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


class MetricsLogger:
    """Appends metrics to ``run_dir/metrics.jsonl`` and TensorBoard (``run_dir/tb``).

    Args:
        run_dir: the run directory.
        enabled: False on non-zero ranks (all methods become no-ops).
        tensorboard: also write TensorBoard scalars (skipped with a warning if tensorboard is not importable).
        resume_step: when resuming from the checkpoint at this step (optimizer updates done), the TensorBoard events
            an earlier, interrupted session logged for later steps are purged (``SummaryWriter(purge_step=
            resume_step + 1)``: TensorBoard hides them), so each step appears once. The JSONL side is handled by
            :meth:`truncate_after`.
    """

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, tensorboard: bool = True,
                 resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._f = None
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._f = open_append(self.run_dir / "metrics.jsonl", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                purge = None if resume_step is None else int(resume_step) + 1
                self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=purge)
            except Exception as e:  # tensorboard missing or broken: JSONL is the record of truth
                print(f"weightgeom: TensorBoard disabled ({e})", file=sys.stderr)

    def log(self, step: int, split: str, metrics: dict[str, Any]) -> None:
        """Write one line ``{"step": step, "split": split, **metrics}`` and the scalars to TensorBoard."""
        if not self.enabled:
            return
        row = {"step": int(step), "split": split, **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k in ("step", "split"):
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{split}/{k}", v, step)

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._f is not None:
            self.flush()
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def truncate_after(self, step: int) -> int:
        """On resume: move lines with ``step > step`` to ``metrics.dropped.jsonl`` (kept, not deleted).

        Returns:
            The number of lines moved.
        """
        if not self.enabled:
            return 0
        path = self.run_dir / "metrics.jsonl"
        if self._f is not None:
            self._f.close()
        dropped = truncate_jsonl(path, step)
        self._f = open_append(path, buffering=1)
        return dropped


def parse_jsonl_line(line: str | bytes) -> dict[str, Any] | None:
    """One line of a run's JSON-lines file as a dict, or None when it is not one (a killed writer's partial line, or a
    doctored one: not JSON, not UTF-8, nested too deeply, an integer too long, not an object). Never raises."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None
    return row if isinstance(row, dict) else None


def truncate_jsonl(path: Path, step: int) -> int:
    """On resume at ``step``: move the lines of the JSON-lines file ``path`` whose ``step`` is later (or that do not
    parse) to ``<name>.dropped.jsonl`` beside it — kept byte for byte, never deleted — and keep the rest in place
    (atomically).

    Returns:
        The number of lines moved (0 when ``path`` does not exist).
    """
    keep: list[bytes] = []
    drop: list[bytes] = []
    if path.exists():
        with open_regular(path) as f:
            data = f.read()
        for line in data.splitlines():
            row = parse_jsonl_line(line)
            s = row.get("step", 0) if row is not None else math.inf
            ok = isinstance(s, (int, float)) and not isinstance(s, bool) and s <= step
            (keep if ok else drop).append(line)
    if drop:
        with open_append(path.with_name(path.name.removesuffix(".jsonl") + ".dropped.jsonl"), text=False) as f:
            f.write(b"\n".join(drop) + b"\n")
        write_atomic(path, b"\n".join(keep) + (b"\n" if keep else b""))
    return len(drop)


def read_metrics(run_dir: str | os.PathLike, split: str | None = None) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (optionally only one split), with "nan"/"inf" strings as floats; lines
    that are not JSON objects are skipped (:func:`parse_jsonl_line`)."""
    rows = []
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return rows
    with open_regular(path) as f:
        data = f.read()
    for line in data.splitlines():
        r = parse_jsonl_line(line) if line.strip() else None
        if r is None:
            continue
        for k, v in r.items():
            if v in ("nan", "inf", "-inf") and k != "split":
                r[k] = float(v)
        if split is None or r.get("split") == split:
            rows.append(r)
    return rows


class Progress:
    """A tqdm progress bar over optimizer steps (disabled → silent).

    Args:
        total: final step.
        initial: starting step (resume).
        enabled: show the bar (rank 0 and ``progress=True``).
    """

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train"):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)

    def update(self, n: int = 1, **postfix: Any) -> None:
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                  refresh=False)
        self._bar.update(n)

    def write(self, msg: str) -> None:
        if self._bar is not None:
            self._bar.write(msg)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
