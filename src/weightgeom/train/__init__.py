"""weightgeom.train: configs, the training loop, checkpoints, logging, schedules, distributed helpers.

Entry points:
    train(config, run_dir=None, overrides=(), progress=True, resume="auto") -> dict: see ``trainer.train``.
    load_config(source, overrides) -> dict: the resolved, validated config (``config.load_config``).
CLI: ``weightgeom train CONFIG [--set section.key=value ...] [--resume RUN_DIR] [--out DIR]``; docs/training.md.
"""

from weightgeom.train.config import DEFAULTS, load_config
from weightgeom.train.trainer import build_model, read_status, train

__all__ = ["train", "load_config", "DEFAULTS", "build_model", "read_status"]
