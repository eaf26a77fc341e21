"""weightgeom.train: configs, the training loop, checkpoints, logging, schedules, distributed helpers.

Entry points:
    train(config, run_dir=None, overrides=(), progress=True, resume="auto", callbacks=None) -> dict: see
        ``trainer.train``; callbacks (``Callback`` subclasses) are its extension point (``callbacks`` module).
    load_config(source, overrides) -> Config: the resolved, checked config (``config.load_config``).
CLI: ``weightgeom train CONFIG [--set section.key=value ...] [--resume RUN_DIR] [--out DIR]``; docs/training.md.
"""

from weightgeom._lazy import lazy_exports

__all__ = ["train", "load_config", "Config", "model_from_config", "read_status", "Callback", "TrainContext"]

# imported on first use, so `weightgeom train --help` (which imports weightgeom.train.cli) needs no torch
lazy_exports(__name__, {"Config": ".config", "load_config": ".config", "model_from_config": ".trainer",
                        "read_status": ".rundir", "train": ".trainer", "Callback": ".callbacks",
                        "TrainContext": ".callbacks"})
