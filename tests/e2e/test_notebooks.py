"""The notebooks: output-free in git, and each runs top to bottom on the CPU test mode and
draws the figures the README shows (CI executes them here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alpa_mini.cli.notebooks import NOTEBOOKS_DIR, find_notebooks, run_notebook

BOOKS = find_notebooks()
#: Figures each notebook must save when ALPA_MINI_FIGURES is set.
FIGURES = {
    "01_sharding_ilp.ipynb": {"01_cost_breakdown.png", "01_explain.png", "01_memory_whatif.png"},
    "02_stage_dp.ipynb": {"02_cost_table.png", "02_tmax.png", "02_slicing.png"},
    "03_pipeline_timeline.ipynb": {"03_timelines.png"},
}


def test_the_three_notebooks_exist():
    assert {b.name for b in BOOKS} == set(FIGURES)


@pytest.mark.parametrize("book", BOOKS, ids=lambda b: b.stem)
def test_notebook_is_stored_without_outputs(book: Path):
    cells = json.loads(book.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code, f"{book.name} has no code"
    for c in code:
        assert c["outputs"] == [] and c["execution_count"] is None, (
            f"{book.name}: cell {c.get('id')} keeps outputs; run "
            "`python -c 'from alpa_mini.cli.notebooks import strip_outputs as s, "
            "find_notebooks as f; [s(b) for b in f()]'`"
        )


@pytest.mark.slow
@pytest.mark.parametrize("book", BOOKS, ids=lambda b: b.stem)
def test_notebook_runs_and_saves_its_figures(book: Path, tmp_path: Path):
    executed = run_notebook(book, figures=tmp_path)
    errors = [
        o
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("output_type") == "error"
    ]
    assert errors == []
    saved = {p.name for p in tmp_path.glob("*.png")}
    assert saved == FIGURES[book.name]
    for name in saved:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert book.parent == NOTEBOOKS_DIR
