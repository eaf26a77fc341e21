"""Importing the optional packages behind the pip extras (submitit, ray, wandb, mlflow) with one clear line."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["import_extra"]


def import_extra(module: str, extra: str, wanted_by: str) -> ModuleType:
    """Import ``module``, which the pip extra ``extra`` installs.

    Args:
        module: the package to import (e.g. ``"submitit"``).
        extra: weightgeom's extra that installs it (e.g. ``"slurm"``).
        wanted_by: what asked for it, as the user wrote it (``"--launcher slurm"``,
            ``"config key logging.wandb=true"``).

    Raises:
        ValueError: it is not installed (one line naming what wanted it and the pip command).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{wanted_by} needs the {module} package, which is not installed ({e.name or module}): "
                         f"pip install 'weightgeom[{extra}]'") from None
