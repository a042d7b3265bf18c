"""`alpa-mini solve`, the README's main job, on the bundled example and on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alpa_mini.cli.main import _example_path, main
from alpa_mini.solvers.brute_force.sharding import brute_force_sharding
from alpa_mini.solvers.sharding.problem import evaluate, load_iopddl
from alpa_mini.solvers.sharding.solve import ShardingSolution


def test_solve_bundled_example_prints_the_brute_force_optimum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    problem = load_iopddl(_example_path())
    _, best = brute_force_sharding(problem)
    out_json = tmp_path / "sol.json"
    assert main(["solve", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "optimal" in printed
    assert f"{best.cost:,.6g}" in printed
    sol = ShardingSolution.from_json(out_json.read_text())
    assert sol.objective == best.cost
    ev = evaluate(problem, sol.choice)  # ties exist: check the choice, not its identity
    assert ev.feasible and ev.cost == best.cost
    # The memory limit binds in this example: without it the optimum is cheaper.
    assert main(["solve", "--no-limit"]) == 0
    free = brute_force_sharding(problem.with_usage_limit(None))[1].cost
    assert free < best.cost
    assert f"{free:,.6g}" in capsys.readouterr().out


def test_unreachable_limit_reports_the_smallest_peak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["solve", "--usage-limit", "10"]) == 1
    printed = capsys.readouterr().out
    assert "InfeasibleError" in printed and "cannot be met" in printed


def test_malformed_file_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(_example_path().read_text())
    del data["problem"]["edges"]["costs"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["solve", str(bad)]) == 2
    assert "problem.edges.costs: missing field" in capsys.readouterr().out


SHARD_ARGS = ("--steps", "3", "--mesh", "2,4")


@pytest.mark.slow
def test_shard_demo_matches_serial_jax() -> None:
    """The ShardParallel demo: GPT on 8 simulated devices, checked against serial JAX.

    Runs in a subprocess: the demo starts JAX's backend itself (alpa_mini.init).
    """
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "alpa_mini.cli", "demo", "--method", "shard", *SHARD_ARGS],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "120"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "matches serial JAX" in out.stdout
    assert "ShardingPlan on mesh (2, 4)" in out.stdout


@pytest.mark.slow
def test_demo_main_job_pipeshard_matches_serial_jax() -> None:
    """The README's main command: GPT with auto layers and auto stages on 8 simulated
    devices, run by the local pipeline runtime and checked against serial JAX."""
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "alpa_mini.cli", "demo", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "COLUMNS": "120"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Pipeshard plan:" in out.stdout
    assert "4 layers" in out.stdout
    assert "matches serial JAX" in out.stdout
