"""All-pairs tables for the property tests: every pair of values of any two factors appears in some row, in far fewer
rows than the Cartesian product (a 7 × 2 × 2 × 3 × 2 × 2 product of 336 rows is covered in 21).

A fault that needs one factor's value, or two factors' values together, to show is met by some row; faults that need
three specific values at once are the ones a table names explicitly (``required=``: e.g. split-bf16 products, which
only run on float32 matrices whose every dimension crosses ``SPLIT_MIN_DIM``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest


def all_pairs(factors: Mapping[str, Sequence[Any]], required: Sequence[Mapping[str, Any]] = ()) -> list[dict]:
    """Rows (``{factor: value}``) covering every pair of values of every two factors, plus the ``required`` rows
    (full rows, or partial ones completed with each missing factor's first value) first.

    Deterministic greedy construction: each new row is the candidate from the Cartesian product that covers the most
    pairs not yet covered (ties: the earliest in product order), until none is left. Fine for the small tables of the
    tests (products up to a few thousand rows).
    """
    names = list(factors)
    values = [list(factors[n]) for n in names]
    rows: list[tuple] = []
    for req in required:
        unknown = set(req) - set(names)
        assert not unknown, f"required row names unknown factors {sorted(unknown)}"
        rows.append(tuple(req.get(n, v[0]) for n, v in zip(names, values)))

    def pairs(row: tuple) -> set:
        return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(names)), 2)}

    todo = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2) for a in values[i] for b in values[j]}
    for row in rows:
        todo -= pairs(row)
    candidates = list(itertools.product(*values))
    while todo:
        best = max(candidates, key=lambda row: len(pairs(row) & todo))
        rows.append(best)
        todo -= pairs(best)
    out, seen = [], set()
    for row in rows:
        key = tuple(map(repr, row))
        if key not in seen:
            seen.add(key)
            out.append(dict(zip(names, row)))
    return out


def _label(value: Any) -> str:
    if hasattr(value, "id") and isinstance(getattr(value, "id", None), str):
        return value.id
    return str(value).replace("torch.", "").replace(" ", "")


def params(factors: Mapping[str, Sequence[Any]], required: Sequence[Mapping[str, Any]] = (),
           ids: Mapping[str, Sequence[str]] | None = None) -> pytest.MarkDecorator:
    """``pytest.mark.parametrize`` over :func:`all_pairs` rows, one argument per factor; ids join each value's label
    (``ids[factor]`` gives labels in the order of ``factors[factor]``)."""
    rows = all_pairs(factors, required)
    names = list(factors)

    def label(name: str, value: Any) -> str:
        if ids and name in ids:
            return ids[name][[repr(v) for v in factors[name]].index(repr(value))]
        return _label(value)

    return pytest.mark.parametrize(names, [pytest.param(*(r[n] for n in names),
                                                        id="-".join(label(n, r[n]) for n in names)) for r in rows])
