"""The dependency rules of the layout: solvers are pure, runtime never imports the planner."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import alpa_mini

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, relative level) of every import in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.module or "", node.level))
    return out


def _escapes(path: Path, package_root: Path) -> bool:
    """Whether a relative import climbs above ``package_root``."""
    depth = len(path.relative_to(package_root).parts) - 1  # 0 for a top-level module
    return any(level > depth + 1 for _, level in _imports(path))


def test_solvers_import_only_numpy_pulp_highspy_and_stdlib() -> None:
    banned = ("jax", "jaxlib", "ray", "alpa_mini", "flax", "optax")
    for path in (ROOT / "solvers").rglob("*.py"):
        for module, level in _imports(path):
            if level == 0:
                assert module.split(".")[0] not in banned, f"{path}: imports {module}"
        assert not _escapes(path, ROOT / "solvers"), f"{path}: relative import leaves solvers/"


def test_runtime_never_imports_the_planner() -> None:
    for path in (ROOT / "runtime").rglob("*.py"):
        for module, level in _imports(path):
            if level == 0 and module.startswith("alpa_mini"):
                assert module.startswith("alpa_mini.runtime"), f"{path}: imports {module}"
        assert not _escapes(path, ROOT / "runtime"), f"{path}: relative import leaves runtime/"


def test_importing_the_solvers_loads_neither_jax_nor_ray() -> None:
    code = (
        "import sys, alpa_mini.solvers; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'ray')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_api_is_explicit_and_importable() -> None:
    assert len(alpa_mini.__all__) == len(set(alpa_mini.__all__))
    for name in alpa_mini.__all__:
        assert getattr(alpa_mini, name) is not None
