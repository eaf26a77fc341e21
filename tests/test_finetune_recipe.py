"""The fine-tuning recipe says one thing everywhere, backed by its sweep; every param group's lr gets a log name.

The recipe's numbers live in ``examples/finetune_hf.py`` (``LR``, ``ADAMW_LR``); the README's "Fine-tuning a
pretrained model" paragraph, docs/training.md's section of the same name and every ``param_groups(..., init="keep")``
call in the README and docs/*.md must use them. docs/training.md's sweep table (between ``<!-- finetune sweep -->``
markers) is ``python examples/finetune_lr_sweep.py --markdown`` output: its arms are the script's, and the recipe's
lr is the swept manifold-Muon rate with the best held-out AUC.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from weightgeom.train.lr_logging import group_lrs, group_names

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune_hf.py"
SWEEP = ROOT / "examples" / "finetune_lr_sweep.py"
README = ROOT / "README.md"
TRAINING = ROOT / "docs" / "training.md"


def _constants(path: Path) -> dict[str, object]:
    """The module-level ``NAME = literal`` assignments of a script (read, never run)."""
    out: dict[str, object] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def _section(text: str, heading: str) -> str:
    """The markdown section ``heading`` (a whole heading line) up to the next heading of its level, or the paragraph
    that starts with ``heading`` when it is bold text (``**...**``)."""
    if heading.startswith("**"):
        start = text.index(heading)
        return text[start:text.find("\n\n", start)]
    level = heading.split(" ")[0]
    start = text.index(heading + "\n")
    nxt = re.search(rf"^{re.escape(level)} ", text[start + len(heading):], re.M)
    return text[start:start + len(heading) + (nxt.start() if nxt else len(text))]


def _keep_calls(text: str) -> list[tuple[float, float]]:
    """(lr, adamw_lr) of every ``param_groups(...)`` call written with ``init="keep"`` in ``text``."""
    calls = re.findall(r"param_groups\(([^()]*init=\"keep\"[^()]*)\)", text)
    out = []
    for call in calls:
        lr = re.search(r"(?<![_\w])lr=([0-9.eE+-]+)", call)
        adamw = re.search(r"adamw_lr=([0-9.eE+-]+)", call)
        assert lr and adamw, f"a fine-tuning call without both rates: param_groups({call})"
        out.append((float(lr.group(1)), float(adamw.group(1))))
    return out


RECIPE = _constants(EXAMPLE)
DOCS = {"README.md": (README, "**Fine-tuning a pretrained model**"),
        "docs/training.md": (TRAINING, "## Fine-tuning a pretrained model")}


@pytest.mark.parametrize("name", sorted(DOCS))
def test_recipe_section_uses_the_example_numbers(name: str) -> None:
    path, heading = DOCS[name]
    text = path.read_text(encoding="utf-8")
    assert heading in text, f"{name} lost its section {heading!r}"
    calls = _keep_calls(_section(text, heading))
    assert calls, f"{name}: the section shows no param_groups(..., init=\"keep\") call"
    want = (RECIPE["LR"], RECIPE["ADAMW_LR"])
    assert all(c == want for c in calls), f"{name}: {calls} is not examples/finetune_hf.py's (LR, ADAMW_LR) {want}"
    # and nowhere else in the file does a fine-tuning call show other rates (the old lr=0.02, adamw_lr=1e-3)
    assert all(c == want for c in _keep_calls(text)), f"{name}: a fine-tuning call with other rates than {want}"


def test_every_fine_tuning_call_in_the_docs_uses_the_recipe() -> None:
    want = (RECIPE["LR"], RECIPE["ADAMW_LR"])
    for path in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        calls = _keep_calls(path.read_text(encoding="utf-8"))
        assert all(c == want for c in calls), f"{path.name}: param_groups(..., init=\"keep\") at {calls}, not {want}"


def _sweep_table() -> list[dict[str, str]]:
    text = TRAINING.read_text(encoding="utf-8")
    block = text[text.index("<!-- finetune sweep -->"):text.index("<!-- end finetune sweep -->")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines()
            if line.startswith("|")]
    head, body = rows[0], [r for r in rows[2:]]
    return [dict(zip(head, r)) for r in body]


def test_sweep_table_is_the_scripts_arms_and_backs_the_recipe() -> None:
    sweep = _constants(SWEEP)
    rows = _sweep_table()
    muon = {float(r["lr"]): r for r in rows if r["optimizer"].startswith("manifold Muon")}
    adamw = {float(r["lr"]): r for r in rows if r["optimizer"] == "AdamW"}
    assert sorted(muon) == sorted(sweep["MUON_LRS"]) and sorted(adamw) == sorted(sweep["ADAMW_LRS"]), rows
    assert any(r["optimizer"] == "pretrained" for r in rows)
    assert sweep["MUON_ADAMW_LR"] == RECIPE["ADAMW_LR"], "the sweep's Muon arms use the recipe's adamw_lr"
    # the recipe's lr is the swept Muon rate with the best held-out AUC (what docs/training.md says it is)
    best = max(muon, key=lambda lr: float(muon[lr]["held-out AUC"]))
    assert RECIPE["LR"] == best, (RECIPE["LR"], best, rows)
    # "manifold Muon moves by at most steps·lr in spectral norm": every Muon row's drift within 30·lr/min‖W‖₂ (2.26)
    assert all(0 < float(r["max ‖ΔW‖₂/‖W‖₂"]) <= 30 * lr / 2.26 for lr, r in muon.items()), muon


def _opt(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], **g} for g in groups], lr=0.1)


# group keys -> the names group_names gives (one optimizer per row)
NAMES = [
    ([{}], ["group"]),
    ([{"algorithm": "adamw", "manifold": None}, {"algorithm": "adamw", "manifold": None, "weight_decay": 0.0},
      {"algorithm": "muon", "manifold": "stiefel"}, {"algorithm": "muon", "manifold": "dgram"}],
     ["adamw", "adamw-2", "muon-stiefel", "muon-dgram"]),
    ([{"algorithm": "muon", "manifold": "none"}, {"name": "head", "algorithm": "adamw"}, {}, {}],
     ["muon", "head", "group", "group-2"]),
]


@pytest.mark.parametrize(("groups", "names"), NAMES)
def test_group_names(groups: list[dict], names: list[str]) -> None:
    opt = _opt(groups)
    assert group_names(opt) == names
    opt.param_groups[-1]["lr"] = torch.tensor(0.25)  # a tensor lr is read as a float
    rates = group_lrs(opt, prefix="x/")
    assert list(rates) == [f"x/{n}" for n in names] and rates[f"x/{names[-1]}"] == 0.25
