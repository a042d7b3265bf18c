"""Test-session setup: 8 simulated CPU devices, set before any test starts JAX's backend.

The count is process-global and fixed once the backend starts, so it is set here, at
collection time, and every in-process test sees the same 8 devices. Tests of other counts
run in a subprocess.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
#: XLA:CPU compile options for sessions that set ``ALPA_MINI_FAST_COMPILE=1`` (what
#: ``./scripts/test`` does), since the suite's time is mostly compiling small programs: LLVM
#: at -O0, the classic loop emitters. They change how the backend generates machine code, not
#: the HLO passes (SPMD partitioning, collectives) the tests read; the whole suite ran in
#: 568 s instead of 1523 s (2 cores, 2026-11-27), six small GPT train steps compile in 2.2x
#: less time (``tests/helpers/compile_speed.py``). -O0 also sums some reductions in another
#: order (an MoE loss 1.2e-6 off serial JAX), so the modules marked ``optimized_codegen``
#: (fp32 agreement with serial JAX at 1e-6 is what they are for) run in a second session,
#: ``ALPA_MINI_FAST_COMPILE=numerics``, with ``NUMERICS_XLA_FLAGS``: the same flags but LLVM
#: at its default optimisation level, the one among them that moves that sum (every test of
#: tests/e2e/test_parallel_numerics.py passes; 82 s instead of 105-110 s with XLA's defaults,
#: 2 cores, 2026-11-27). Set before JAX starts, so subprocesses and Ray workers inherit them.
NUMERICS_XLA_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes=true "
    "--xla_cpu_parallel_codegen_split_count=1"
)
TEST_XLA_FLAGS = f"--xla_backend_optimization_level=0 {NUMERICS_XLA_FLAGS}"
_SESSION_FLAGS = {"": "", "1": TEST_XLA_FLAGS, "numerics": NUMERICS_XLA_FLAGS}
_SESSION = os.environ.get("ALPA_MINI_FAST_COMPILE", "")
if _SESSION not in _SESSION_FLAGS:
    raise ValueError(f"ALPA_MINI_FAST_COMPILE: {_SESSION!r} is not one of '1', 'numerics' or unset")
FAST_COMPILE = _SESSION == "1"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_SESSION_FLAGS[_SESSION]}".strip()
NUM_TEST_DEVICES = 8

try:
    import jax
except ImportError:  # the solver tests do not need JAX
    jax = None
else:
    jax.config.update("jax_num_cpu_devices", NUM_TEST_DEVICES)
    jax.config.update("jax_enable_x64", False)


import pytest  # noqa: E402

from helpers.ray_heads import ray_head  # noqa: E402, F401  (a fixture for the Ray tests)


@pytest.fixture
def devices4():
    """``alpa_mini.init`` on 4 of the test devices (one host of ``cpu-1x8`` cut to 4)."""
    import dataclasses

    import alpa_mini

    cpu = alpa_mini.ClusterSpec.named("cpu-1x8")
    alpa_mini.init(cluster=dataclasses.replace(cpu, devices_per_host=4))
    yield
    alpa_mini.shutdown()


@pytest.fixture
def devices8():
    """``alpa_mini.init`` on all 8 test devices (``cpu-1x8``)."""
    import alpa_mini

    alpa_mini.init(cluster=alpa_mini.ClusterSpec.named("cpu-1x8"))
    yield
    alpa_mini.shutdown()


#: Test modules that take the most worker time in the whole suite, longest first (seconds
#: on two loaded workers with the fast-compile flags, `./scripts/test --durations=0` on a
#: fresh clone, 2026-11-27 night: 434 s for the first session). The whole suite runs with
#: `--dist loadscope --no-loadscope-reorder`: one module per worker at a time, in collection
#: order, so the long modules start first and the short ones fill the gaps
#: (longest-processing-time-first) instead of one long module starting last. (Three workers
#: on the two cores took as long, 430 s: the suite is CPU-bound.)
LONGEST_FIRST = (
    "tests/runtime/test_ray_runtime.py",  # ~160 s: a Ray session, a 3-host mesh, a Ray job
    "tests/pipeline/test_pipeshard.py",  # ~105 s
    "tests/runtime/test_ray_setup.py",  # ~65 s
    "tests/e2e/test_ray_recovery.py",  # ~65 s
    "tests/e2e/test_notebooks.py",  # ~65 s
    "tests/e2e/test_cli.py",  # ~35 s
    "tests/pipeline/test_stage_definition.py",  # ~30 s
    "tests/pipeline/test_grad_sync.py",  # ~25 s
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the modules of ``LONGEST_FIRST`` to the front, in that order (a stable sort:
    every other test keeps its place). Under ``ALPA_MINI_FAST_COMPILE=1``, tests marked
    ``optimized_codegen`` are skipped, saying why: -O0 moves their fp32 sums."""
    if FAST_COMPILE:
        for item in items:
            if item.get_closest_marker("optimized_codegen") is not None:
                item.add_marker(
                    pytest.mark.skip(
                        reason="optimized_codegen under ALPA_MINI_FAST_COMPILE=1: "
                        "./scripts/test runs it in its own session, LLVM not at -O0"
                    )
                )
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def key(item: pytest.Item) -> int:
        path = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return rank.get(path, len(rank))

    items.sort(key=key)
