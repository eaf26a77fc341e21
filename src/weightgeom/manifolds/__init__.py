"""Gram-space matrix manifolds and their registry; see docs/manifolds.md.

Adding a manifold: one file with a ``Manifold`` subclass (with a unique ``name``), one ``register`` line below,
one line in the table of tests/test_manifolds.py.
"""

from __future__ import annotations

from weightgeom.manifolds.base import CheckResult, Manifold, tall, untall
from weightgeom.manifolds.dgram import DGram
from weightgeom.manifolds.euclidean import Euclidean
from weightgeom.manifolds.oblique import Oblique
from weightgeom.manifolds.stiefel import Stiefel

__all__ = [
    "Manifold", "CheckResult", "tall", "untall",
    "Stiefel", "DGram", "Oblique", "Euclidean",
    "get", "register", "available", "retraction_names",
]

_REGISTRY: dict[str, type[Manifold]] = {}
# Names that mean "no constraint"; get() maps them to Euclidean.
_ALIASES = {"none": "euclidean"}


def register(cls: type[Manifold]) -> type[Manifold]:
    """Add a Manifold subclass under ``cls.name`` (lower-cased); usable as a class decorator.

    Raises:
        ValueError: not a Manifold subclass, or the name is taken by a different class.
    """
    if not (isinstance(cls, type) and issubclass(cls, Manifold)):
        raise ValueError(f"register: expected a Manifold subclass, got {cls!r}")
    key = cls.name.lower()
    if key in _ALIASES or (key in _REGISTRY and _REGISTRY[key] is not cls):
        raise ValueError(f"register: manifold name {key!r} is already taken")
    _REGISTRY[key] = cls
    return cls


def available() -> list[str]:
    """Registered manifold names (sorted), plus the alias ``"none"`` (= euclidean)."""
    return sorted([*_REGISTRY, *_ALIASES])


def get(name: str | Manifold | None, **kwargs) -> Manifold:
    """Build a manifold by name (case-insensitive): ``get("dgram", retraction="paper")``.

    ``None`` and ``"none"`` give ``Euclidean()``; an existing ``Manifold`` instance is returned as is (no kwargs).

    Raises:
        ValueError: unknown name (the message lists the available ones), or kwargs with an instance.
    """
    if isinstance(name, Manifold):
        if kwargs:
            raise ValueError(f"get: cannot apply options {sorted(kwargs)} to an existing manifold {name!r}")
        return name
    key = "none" if name is None else str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise ValueError(f"unknown manifold {name!r}; available: {', '.join(available())}")
    return _REGISTRY[key](**kwargs)


register(Stiefel)
register(DGram)
register(Oblique)
register(Euclidean)


def retraction_names() -> tuple[str, ...]:
    """Every retraction variant some registered manifold accepts (the values ``optim.muon.retraction`` may take)."""
    return tuple(dict.fromkeys(r for cls in _REGISTRY.values() for r in cls.retractions))
