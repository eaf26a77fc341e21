"""Lazy package exports, so that ``weightgeom --help`` and ``--version`` never import torch.

A package's ``__init__`` calls :func:`lazy_exports` with ``{public name: submodule}``; each name is imported from its
submodule on first attribute access (PEP 562) and then cached on the package. ``from weightgeom.data import prepare``
and ``weightgeom.train.train`` work as with eager imports, and ``import weightgeom.train.cli`` runs no torch import.

One subtlety is kept as eager imports had it: where a public name equals its submodule's name (``weightgeom.data``
exports the function ``prepare`` from the submodule ``prepare``), the import system binds the submodule on the package
once anything imports it; the package keeps the public object of that name instead, as after
``from .prepare import prepare``.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping

__all__ = ["lazy_exports"]


class _LazyPackage(types.ModuleType):
    """Module type of a package with lazy exports (set by :func:`lazy_exports`)."""

    _lazy_exports: Mapping[str, str]

    def __getattr__(self, name: str):
        exports = self.__dict__.get("_lazy_exports", {})
        if name not in exports:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], self.__name__), name)
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        exports = self.__dict__.get("_lazy_exports", {})
        if (name in exports and isinstance(value, types.ModuleType) and exports[name].lstrip(".") == name
                and value.__name__ == f"{self.__name__}.{name}"):
            value = getattr(value, name)  # the submodule just imported: keep its public object of the same name
        types.ModuleType.__setattr__(self, name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.__dict__.get("_lazy_exports", {})))


def lazy_exports(package: str, exports: Mapping[str, str]) -> None:
    """Make ``exports`` (public name -> submodule, relative like ``".trainer"`` or absolute) lazy attributes of
    ``package`` (the calling package's ``__name__``). Names already bound on the package are left as they are."""
    module = sys.modules[package]
    module._lazy_exports = dict(exports)
    module.__class__ = _LazyPackage
