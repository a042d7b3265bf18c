"""The layout's rules (docs/ARCHITECTURE.md): one-way dependencies between the folders, small
modules and functions, and a small public surface whose former names say where they went."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import alpa_mini

ROOT = Path(__file__).resolve().parents[1]
#: Installed package name of each source folder (pyproject's package-dir).
PACKAGES = {
    "alpa_mini": "alpa_mini",
    "solvers": "alpa_mini.solvers",
    "runtime": "alpa_mini.runtime",
}
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 100
MAX_LONG_FUNCTIONS = 2


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    """Absolute names of every module a file imports (relative imports resolved)."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            out += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return out


def _offenders(folders: list[str], banned: tuple[str, ...], skip: str = "") -> list[str]:
    return [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder in folders
        for path in _sources(folder)
        if not (skip and _module_name(path).startswith(skip))
        for name in _imports(path)
        if any(name == b or name.startswith(b + ".") for b in banned)
    ]


def test_solvers_import_only_numpy_pulp_highspy_and_stdlib() -> None:
    banned = ("jax", "jaxlib", "ray", "flax", "optax", *(p for p in PACKAGES.values()))
    found = _offenders(["solvers"], banned)
    assert [f for f in found if " imports alpa_mini.solvers" not in f] == []


def test_runtime_never_imports_the_planner() -> None:
    found = _offenders(["runtime"], ("alpa_mini",))
    assert [f for f in found if " imports alpa_mini.runtime" not in f] == []


def test_graph_and_shard_import_nothing_from_pipeline() -> None:
    paths = [p for p in _sources("alpa_mini") if p.parent.name in ("graph", "shard")]
    assert paths
    found = [
        f"{p.relative_to(ROOT)} imports {n}"
        for p in paths
        for n in _imports(p)
        if n.startswith("alpa_mini.pipeline")
    ]
    assert found == []


def test_nothing_imports_the_cli_or_the_benchmarks() -> None:
    banned = ("alpa_mini.cli", "benchmarks")
    assert _offenders(["alpa_mini", "solvers", "runtime"], banned, skip="alpa_mini.cli") == []


def test_importing_alpa_mini_or_the_solvers_loads_neither_jax_nor_ray() -> None:
    for module in ("alpa_mini", "alpa_mini.solvers", "alpa_mini.cluster"):
        code = (
            f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'ray')))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
        )
        assert out.stdout.strip() == "[]", module


def test_few_top_level_modules_and_none_too_long() -> None:
    top = [p.name for p in (ROOT / "alpa_mini").glob("*.py")]
    assert len(top) <= 8, top
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for folder in PACKAGES
        for p in _sources(folder)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert long == []


def test_at_most_two_long_functions_each_saying_why() -> None:
    long = []
    for folder in PACKAGES:
        for path in _sources(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                if is_function and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long.append((f"{path.relative_to(ROOT)}:{node.name}", node))
    assert len(long) <= MAX_LONG_FUNCTIONS, [name for name, _ in long]
    for name, node in long:
        assert "long" in (ast.get_docstring(node) or "").lower(), f"{name}: say why it is long"


def test_public_api_is_small_explicit_and_importable() -> None:
    assert len(alpa_mini.__all__) == len(set(alpa_mini.__all__))
    assert len(alpa_mini.__all__) <= 30
    for name in alpa_mini.__all__:
        assert getattr(alpa_mini, name) is not None
    assert set(dir(alpa_mini)) >= set(alpa_mini.__all__)


@pytest.mark.parametrize("name", sorted(alpa_mini._MOVED))
def test_a_former_public_name_says_where_it_went(name: str) -> None:
    home = alpa_mini._MOVED[name]
    with pytest.raises(AttributeError, match=f"alpa_mini.{name} moved: use {home}"):
        getattr(alpa_mini, name)
    module, attr = home.rsplit(".", 1)
    assert getattr(importlib.import_module(module), attr) is not None
