"""Test-session setup: 8 simulated CPU devices, set before any test starts JAX's backend.

The count is process-global and fixed once the backend starts, so it is set here, at
collection time, and every in-process test sees the same 8 devices. Tests of other counts
run in a subprocess.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
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
