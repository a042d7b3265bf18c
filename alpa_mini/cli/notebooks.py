"""Run the checkout's notebooks top to bottom (nbclient), as CI does, optionally keeping the
figures they draw: ``alpa-mini notebooks --figures docs/figures``.

Each notebook saves its figures under ``$ALPA_MINI_FIGURES`` when that is set, so the README's
images and the notebooks cannot drift apart. Executed copies are never written back: the
notebooks stay output-free in git.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["NOTEBOOKS_DIR", "find_notebooks", "run_notebook", "strip_outputs"]

#: The checkout's notebooks folder (beside the package).
NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"


def find_notebooks(only: Sequence[str] = (), folder: Path = NOTEBOOKS_DIR) -> list[Path]:
    """The notebooks in ``folder`` in name order; ``only`` keeps those whose names start with
    one of its prefixes (e.g. ``"01"``)."""
    if not folder.is_dir():
        raise FileNotFoundError(
            f"notebooks: no folder {folder}; the notebooks ship with the source checkout, not "
            "the installed package"
        )
    books = sorted(folder.glob("[0-9]*.ipynb"))
    if only:
        books = [b for b in books if any(b.name.startswith(p) for p in only)]
        if not books:
            names = ", ".join(b.name for b in sorted(folder.glob("[0-9]*.ipynb")))
            raise FileNotFoundError(f"notebooks: none of {list(only)} matches; there are {names}")
    return books


def run_notebook(path: Path, *, figures: Path | None = None, timeout: int = 900) -> Any:
    """Execute ``path`` in a fresh kernel (its folder as the working directory) and return
    the executed notebook; raises nbclient's ``CellExecutionError`` naming the failing cell."""
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.read(path, as_version=4)
    previous = os.environ.get("ALPA_MINI_FIGURES")
    if figures is not None:  # the kernel inherits this process's environment
        os.environ["ALPA_MINI_FIGURES"] = str(Path(figures).resolve())
    else:
        os.environ.pop("ALPA_MINI_FIGURES", None)
    try:
        client = NotebookClient(
            book,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute()
    finally:
        if previous is None:
            os.environ.pop("ALPA_MINI_FIGURES", None)
        else:
            os.environ["ALPA_MINI_FIGURES"] = previous
    return book


def strip_outputs(path: Path) -> bool:
    """Remove outputs and execution counts from ``path`` in place; True when it changed."""
    import nbformat

    book = nbformat.read(path, as_version=4)
    changed = False
    for cell in book.cells:
        if cell.cell_type != "code":
            continue
        if cell.outputs or cell.execution_count is not None:
            cell.outputs, cell.execution_count = [], None
            changed = True
    if changed:
        nbformat.write(book, path)
    return changed
