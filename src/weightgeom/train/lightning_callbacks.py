"""PyTorch Lightning: log every param group's learning rate under the same names as the HF Trainer callback.

``GroupLRMonitor`` logs ``lr/<group name>`` (names: :func:`weightgeom.train.lr_logging.group_names`, e.g.
``lr/adamw``, ``lr/muon-stiefel``, ``lr/muon-dgram``) through ``LightningModule.log`` at each training step, so
every logger of the Trainer (CSV, TensorBoard, W&B, …) gets it at its ``log_every_n_steps``::

    trainer = lightning.Trainer(..., callbacks=[GroupLRMonitor()])

Lightning's own ``LearningRateMonitor`` also logs each group, named ``lr-Muon/pg1`` … ``lr-Muon/pg4`` (it uses a
group's ``"name"`` key only). Importing this module imports ``lightning``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from weightgeom.train.lr_logging import group_lrs

__all__ = ["GroupLRMonitor"]


class GroupLRMonitor(pl.Callback):
    """Logs every param group's lr as ``<prefix><group name>`` at the start of each training batch.

    The rate logged at a step is the one that step uses (read before its optimizer step). With several optimizers
    the keys are ``<prefix><optimizer index>/<group name>``.

    Args:
        prefix: put before each group's name (default ``"lr/"``).
    """

    def __init__(self, prefix: str = "lr/") -> None:
        self.prefix = prefix

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Log the rates of every optimizer's groups (step-level values, not averaged over the epoch)."""
        rates: dict[str, float] = {}
        many = len(trainer.optimizers) > 1
        for i, opt in enumerate(trainer.optimizers):
            rates.update(group_lrs(opt, f"{self.prefix}{i}/" if many else self.prefix))
        if rates:
            pl_module.log_dict(rates, on_step=True, on_epoch=False, prog_bar=False, logger=True)
