"""Shared by the tests that check a result does not depend on the number of threads."""

from __future__ import annotations

import subprocess
import sys


def outputs_per_thread_count(code: str, threads: tuple[str, ...] = ("1", "2")) -> list[str]:
    """stdout of ``python -c code N`` in a fresh process for each thread count N (the code reads it as sys.argv[1]
    and calls torch.set_num_threads itself); asserts every run exits 0."""
    outs = [subprocess.run([sys.executable, "-c", code, t], capture_output=True, text=True, timeout=120)
            for t in threads]
    assert all(o.returncode == 0 for o in outs), "\n".join(o.stderr for o in outs)
    return [o.stdout for o in outs]
