"""The house rules (benchmarks/house.py): short functions, a README that is a manual, no links out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# loaded by path: benchmarks/ on sys.path would shadow packages by its scripts' names (executor.py, search.py)
_SPEC = importlib.util.spec_from_file_location("house", Path(__file__).resolve().parents[1] / "benchmarks" / "house.py")
house = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(house)


def test_no_function_runs_past_the_limit():
    over = [(n, name) for n, name in house.function_lengths() if n > house.MAX_FUNCTION_LINES]
    assert over == [], "split these by concern"


def test_the_function_lengths_are_measured():
    lengths = dict((name, n) for n, name in house.function_lengths())
    assert lengths["planner/search/rules.py:message"] == 3  # a def line, a docstring, a return


def test_the_readme_is_short_and_no_link_leaves_the_repository(tmp_path, monkeypatch):
    assert (house.REPO / "README.md").stat().st_size <= house.MAX_README_BYTES
    assert house.links_leaving_the_repo() == []
    assert house.issue_numbers() == []
    fake = tmp_path / "repo"
    (fake / "docs").mkdir(parents=True)
    (fake / "README.md").write_text("[ok](docs/a.md) [web](https://pytorch.org) [out](../shared/DESIGN.md)\n")
    (fake / "docs" / "a.md").write_text("[up](../README.md) [out](../../elsewhere.md)\n")
    monkeypatch.setattr(house, "REPO", fake)
    assert house.links_leaving_the_repo() == ["README.md: ../shared/DESIGN.md", "docs/a.md: ../../elsewhere.md"]
    (fake / "docs" / "b.md").write_text("fine: NCCL issue #812\nsince issue 23 the rows...\n")
    assert house.issue_numbers() == ["docs/b.md:2"]
