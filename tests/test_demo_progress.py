"""``weightgeom demo`` shows the whole run's progress: before each sweep, which of the three it is, the time so far
and the time the demo has left (the recorded sweep times scaled by this machine's pace so far)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weightgeom.experiments import demo


def test_time_left_scales_the_recorded_times_by_this_machines_pace():
    rec = demo.RECORDED_SWEEP_S
    assert demo.demo_time_left([], ["tiny-shakespeare"], 10.0) is None  # nothing done: no pace yet
    # twice as slow as the recorded machine over the first sweep: the other two take twice their recorded time
    left = demo.demo_time_left(["tiny-shakespeare"], ["boundary", "cpu"], 2 * rec["tiny-shakespeare"])
    assert left == pytest.approx(2 * (rec["boundary"] + rec["cpu"]))
    assert demo.demo_time_left(["tiny-shakespeare", "boundary", "cpu"], [], 300.0) == 0.0


def test_demo_prints_overall_progress_before_each_sweep(tmp_path, capsys, monkeypatch):
    import weightgeom.experiments.cli as ecli
    import weightgeom.experiments.report as rep

    clock = iter([0.0, 0.0, 190.0, 420.0, 600.0, 600.0])  # t0, then before each sweep, then at the end
    monkeypatch.setattr(demo.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(ecli, "execute", lambda *a, **k: ({"runs": []}, None))
    monkeypatch.setattr(rep, "make_report", lambda dirs, out, **k: Path(out) / "report.md")
    monkeypatch.setattr(demo, "print_claims", lambda *a, **k: None)
    args = demo.argparse.Namespace(out=str(tmp_path / "d"), quick=False, only=None, verbose=False, sets=[], jobs=2)
    assert demo.run(args) == 0
    heads = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("== weightgeom demo")]
    assert len(heads) == 3
    assert "(sweep 1 of 3; the whole demo took 5 min on an idle 2-core AMX Xeon" in heads[0]
    rec = demo.RECORDED_SWEEP_S
    left = 190.0 / rec["tiny-shakespeare"] * (rec["boundary"] + rec["cpu"]) / 60
    assert f"(sweep 2 of 3; demo 3.2 min so far, ~{left:.1f} min left) ==" in heads[1]
    m = re.search(r"sweep 3 of 3; demo 7\.0 min so far, ~([0-9.]+) min left", heads[2])
    assert m and float(m.group(1)) == pytest.approx(420.0 / (rec["tiny-shakespeare"] + rec["boundary"]) * rec["cpu"]
                                                    / 60, abs=0.06)
