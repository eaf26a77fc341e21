"""Hugging Face ``transformers.Trainer``: log every param group's learning rate, not only the first group's.

``Trainer`` logs one ``learning_rate`` (its scheduler's first group: with ``param_groups(model, "hetero")`` the AdamW
embeddings' ``adamw_lr``), so the manifold-Muon groups' ``lr`` never reaches the logs. :func:`log_group_lrs` adds
``lr/<group name>`` for every group (names: :func:`weightgeom.train.lr_logging.group_names`, e.g. ``lr/adamw``,
``lr/muon-stiefel``, ``lr/muon-dgram``) to each training log, where every reporter (``report_to``: TensorBoard,
W&B, MLflow, …), the console and ``trainer.state.log_history`` (``trainer_state.json``) see it::

    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))
    log_group_lrs(trainer)
    trainer.train()

Importing this module imports ``transformers``.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from weightgeom.train.lr_logging import group_lrs, group_names

__all__ = ["GroupLRCallback", "log_group_lrs"]


class GroupLRCallback(transformers.TrainerCallback):
    """Adds ``<prefix><group name>: lr`` of every param group to each training log of ``transformers.Trainer``.

    A training log is one that carries Trainer's ``learning_rate`` (evaluation logs and the end-of-training summary
    are left as they are). The rates are those the last optimizer step used (read right after it, before the
    scheduler's step), as Trainer's ``learning_rate`` is: for the first group the two are equal.

    Trainer calls its callbacks in order and puts the reporters of ``report_to`` before those passed in
    ``callbacks=[...]``: register it with :func:`log_group_lrs`, which puts it first, so that the reporters see the
    rates. Passed in ``callbacks=`` it still reaches the console and ``state.log_history``, not the reporters.

    Args:
        prefix: put before each group's name (default ``"lr/"``).
    """

    def __init__(self, prefix: str = "lr/") -> None:
        self.prefix = prefix
        self._rates: dict[str, float | torch.Tensor] = {}

    def on_optimizer_step(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                          control: transformers.TrainerControl, optimizer: torch.optim.Optimizer | None = None,
                          **kwargs: Any) -> None:
        """Keep the rates the step just used (Trainer steps its scheduler after this hook); read on the host at log
        time only (a tensor lr is copied on its device here, not read)."""
        if optimizer is not None:
            lrs = [g["lr"] for g in optimizer.param_groups]
            self._rates = {self.prefix + name: lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
                           for name, lr in zip(group_names(optimizer), lrs)}

    def on_log(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
               control: transformers.TrainerControl, logs: dict[str, Any] | None = None,
               optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        """Add the group rates to ``logs`` (in place) and to the copy Trainer already put in ``state.log_history``."""
        if logs is None or optimizer is None or "learning_rate" not in logs:
            return
        rates = {k: float(v) for k, v in self._rates.items()} or group_lrs(optimizer, self.prefix)
        logs.update(rates)
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and "learning_rate" in last:
            last.update(rates)


def log_group_lrs(trainer: transformers.Trainer, prefix: str = "lr/") -> GroupLRCallback:
    """Make ``trainer`` log every param group's lr as ``<prefix><group name>``; returns the callback it added.

    The callback goes first in ``trainer.callback_handler.callbacks``, before the ``report_to`` reporters and the
    console printer, so all of them see the rates. Call it once, before ``trainer.train()``.
    """
    callback = GroupLRCallback(prefix)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
