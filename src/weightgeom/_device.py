"""The CPU's matrix-unit class (AMX, AVX512-BF16, AVX512, AVX2): what decides how fast a bf16 product runs here.

Used to describe the machine wherever a figure or a run is recorded (the trainer's meta.json, the benchmarks' tables,
the golden tests' CPU class). Reads ``/proc/cpuinfo`` and the oneDNN ISA cap variables; no timing.
"""

from __future__ import annotations

import os

import torch

__all__ = ["cpu_kind", "capped_kind", "KINDS"]


def cpu_kind() -> str:
    """The matrix-unit class a bf16 matmul in this process runs on, which decides how fast it is: ``"AMX"`` (AMX-BF16
    tiles), ``"AVX512-BF16"`` (AVX-512 with bf16 dot products), ``"AVX512"``, ``"AVX2"``, or torch's capability string
    (e.g. ``"NEON"``/``"DEFAULT"``) where ``/proc/cpuinfo`` is missing or lists none of these.

    Only the first two have bf16 units; on the others a bf16 matmul is emulated and typically 10–40× slower than fp32.
    A process whose oneDNN is capped below the CPU's class (``ONEDNN_MAX_CPU_ISA``/``DNNL_MAX_CPU_ISA``, e.g. ``AVX2``
    on an AMX CPU) runs at the cap's speed: the cap's class is returned, marked, e.g. ``"AVX2 (capped; CPU: AMX)"``.
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = set()
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[-1].split())
    except OSError:
        flags = set()
    if "amx_bf16" in flags:
        kind = "AMX"
    elif "avx512_bf16" in flags:
        kind = "AVX512-BF16"
    elif "avx512f" in flags:
        kind = "AVX512"
    elif "avx2" in flags:
        kind = "AVX2"
    else:
        return str(torch.backends.cpu.get_cpu_capability()).upper()
    return capped_kind(kind, os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "")


KINDS = ("AVX2", "AVX512", "AVX512-BF16", "AMX")
"""The classes :func:`cpu_kind` names, from the slowest bf16 matmul to the fastest."""


def capped_kind(kind: str, cap: str) -> str:
    """``kind`` (one of ``cpu_kind``'s classes) under a oneDNN ISA cap (``ONEDNN_MAX_CPU_ISA``'s value: ``"AVX2"``,
    ``"AVX512_CORE"``, ``"AVX512_CORE_BF16"``, ``"AVX512_CORE_AMX"``, ``"ALL"``, ...): the lower of the two classes,
    marked ``"(capped; CPU: kind)"`` when the cap lowers it; an empty, ``ALL``/``DEFAULT`` or unknown cap leaves it."""
    c = cap.strip().upper()
    if "AMX" in c:
        limit = "AMX"
    elif "BF16" in c or "FP16" in c:
        limit = "AVX512-BF16"
    elif c.startswith("AVX512"):
        limit = "AVX512"
    elif c.startswith(("AVX2", "AVX", "SSE")):
        limit = "AVX2"  # AVX2 or below: no bf16 units either way
    else:
        return kind
    if kind in KINDS and KINDS.index(limit) < KINDS.index(kind):
        return f"{limit} (capped; CPU: {kind})"
    return kind
