"""The ``OptimizerInfo`` inputs the installed torch ships (``torch.testing._internal.common_optimizers``), imported
without leaving torch's backend flags frozen.

Importing ``torch.testing._internal.common_utils`` calls ``torch.backends.disable_global_flags()``: from then on any
assignment to a ``torch.backends`` flag raises for the rest of the process, so every test that runs after a
torch-compatibility test and sets a matmul precision (tests/test_precision.py) would fail. The import happens here
once and the flag is put back as it was.
"""

import torch
import torch.backends

# torch's own context manager: whatever the import sets, the flag is as before once it exits
with getattr(torch.backends, "__allow_nonbracketed_mutation")():
    from torch.testing._internal import common_optimizers

optim_db = common_optimizers.optim_db
OptimizerErrorEnum = common_optimizers.OptimizerErrorEnum

__all__ = ["common_optimizers", "optim_db", "OptimizerErrorEnum"]
