"""The hostile-input table: every promise in README's "What weightgeom guarantees", one row per hostile input.

Rows live in ``tests/hostile_cases/<area>.py`` (each exports ``CASES``); this file only gathers them into one table
and runs each row's check in a fresh temporary working directory.
"""

from __future__ import annotations

import importlib

import pytest

from hostile_cases import Hostile

AREAS = ("loaders", "checkpoints", "rundir", "sweeps", "optim", "data", "reports")


def _all_cases() -> list[Hostile]:
    cases: list[Hostile] = []
    for area in AREAS:
        # a missing or broken area module fails collection (never skips)
        cases += importlib.import_module(f"hostile_cases.{area}").CASES
    return cases


CASES = _all_cases()


def test_ids_unique():
    ids = [f"{c.area}-{c.id}" for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.area}-{c.id}")
def test_hostile(case: Hostile, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    case.check(tmp_path)


def test_readme_lists_every_row():
    # README's "What weightgeom guarantees" table names every row, so the promises a user reads are the ones tested
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## What weightgeom guarantees", 1)[1].split("\n## ", 1)[0]
    missing = [f"{c.area}-{c.id}" for c in CASES if f"`{c.area}-{c.id}`" not in section]
    assert not missing, f"README's guarantees table lacks rows: {missing}"
