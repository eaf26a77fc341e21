"""The hostile-input table: every promise in docs/guarantees.md (generated from these rows), one row per hostile input.

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


def test_guarantees_page_lists_every_row():
    # docs/guarantees.md (generated from these rows; README links to it) names every row, so the promises a user
    # reads are the ones tested
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "guarantees.md").read_text()
    missing = [f"{c.area}-{c.id}" for c in CASES if f"`{c.area}-{c.id}`" not in page]
    assert not missing, (f"docs/guarantees.md lacks rows: {missing} "
                         "(.venv/bin/python docs/gen_docs.py guarantees --write)")
