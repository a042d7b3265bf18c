"""The solvers print nothing unless asked: HiGHS's banner and log, and CBC's messages, appear
only with the ``alpa_mini.solvers`` logger at DEBUG."""

from __future__ import annotations

import subprocess
import sys

import pytest

SOLVE = """
import logging, sys
if sys.argv[1] == "debug":
    logging.basicConfig(stream=sys.stderr)
    logging.getLogger("alpa_mini.solvers").setLevel(logging.DEBUG)
from alpa_mini.solvers import ShardingProblem, solve_sharding
problem = ShardingProblem.from_lists(
    costs=[[1.0, 2.0], [3.0, 1.0], [2.0, 2.0]],
    usages=[[1.0, 2.0], [2.0, 1.0], [1.0, 1.0]],
    intervals=[(0, 2), (1, 3), (2, 4)],
    edges=[(0, 1), (1, 2)],
    edge_costs=[[0.0, 5.0, 5.0, 0.0], [0.0, 1.0, 1.0, 0.0]],
    usage_limit=3.5,
)
solution = solve_sharding(problem, backend=sys.argv[2], simplify_graph=False)
assert solution.status == "optimal", solution.status
"""


def _run(mode: str, backend: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SOLVE, mode, backend],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_solving_prints_nothing_by_default(backend: str) -> None:
    out = _run("quiet", backend)
    assert out.stdout == "" and out.stderr == ""


def test_debug_logging_shows_the_highs_log() -> None:
    out = _run("debug", "highs")
    assert "Running HiGHS" in out.stdout + out.stderr
