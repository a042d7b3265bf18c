"""``alpa_mini.session.local``: init / shutdown / current_cluster and the CPU device count.

JAX fixes its CPU device count when its backend starts, once per process, and this test
session already runs with 8 CPU devices (conftest.py). Everything that depends on the backend
state therefore runs in a fresh interpreter; the rest runs in-process and restores the
module's state afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from alpa_mini.cluster.spec import ClusterSpec, available_clusters
from alpa_mini.errors import ConfigError
from alpa_mini.session import local as device_setup
from alpa_mini.session.local import current_cluster, init, is_initialized, shutdown

CLUSTERS = Path(__file__).resolve().parents[2] / "configs" / "clusters"
ENV = device_setup.NUM_CPU_DEVICES_ENV


def run_fresh(script: str, **env: str) -> str:
    """Run ``script`` in a fresh CPU-only interpreter; fail with its output if it fails."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in {ENV, "XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS"}
    }
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**clean, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture
def restore_state(monkeypatch: pytest.MonkeyPatch):
    """No env override and no current cluster; afterwards put back whatever was current."""
    monkeypatch.delenv(ENV, raising=False)
    saved = device_setup._current
    device_setup._current = None
    yield
    device_setup._current = saved


# ---------------------------------------------------------------------- fresh processes
def test_init_sets_the_cpu_device_count_and_detects_one_host() -> None:
    run_fresh(
        """
        import jax, pytest
        from jax._src import xla_bridge
        from alpa_mini.cluster.spec import ClusterSpec
        from alpa_mini.errors import ConfigError
        from alpa_mini.session.local import current_cluster, init, is_initialized, shutdown

        assert not is_initialized()
        with pytest.raises(RuntimeError, match=r"alpa_mini.init\\(\\) has not been called"):
            current_cluster()
        # A bad cluster value is rejected before JAX is touched.
        with pytest.raises(ConfigError):
            init("nope", num_cpu_devices=2)
        assert jax.config.jax_num_cpu_devices == -1
        assert not xla_bridge.backends_are_initialized()

        spec = init(num_cpu_devices=4)
        assert len(jax.devices()) == 4, jax.devices()
        assert (spec.num_hosts, spec.devices_per_host) == (1, 4), spec
        assert spec.device == ClusterSpec.named("cpu-1x8").device
        assert current_cluster() == spec and is_initialized()

        assert init(num_cpu_devices=4) == spec          # same count after start: accepted
        with pytest.raises(RuntimeError) as err:        # another count: refused
            init(num_cpu_devices=2)
        msg = str(err.value)
        assert "num_cpu_devices=2" in msg and "4 CPU devices" in msg, msg
        assert "before any JAX computation" in msg, msg
        assert current_cluster() == spec                # a failed init changes nothing

        shutdown()
        assert not is_initialized()
        with pytest.raises(RuntimeError, match="has not been called"):
            current_cluster()
        shutdown()                                      # idempotent
        assert init(num_cpu_devices=4) == spec          # re-init after shutdown, same count
        """
    )


@pytest.mark.parametrize(("env_value", "arg", "expected"), [("3", None, 3), ("3", 2, 2)])
def test_env_var_sets_the_count_and_the_argument_wins(
    env_value: str, arg: int | None, expected: int
) -> None:
    run_fresh(
        f"""
        import jax
        from alpa_mini.session.local import init
        spec = init(num_cpu_devices={arg!r})
        assert len(jax.devices()) == {expected}, jax.devices()
        assert spec.num_devices == {expected}, spec
        """,
        **{ENV: env_value},
    )


def test_backend_started_by_a_computation_is_detected() -> None:
    # Started with JAX's default single CPU device, then asked for 4.
    run_fresh(
        """
        import jax.numpy as jnp, pytest
        from alpa_mini.session.local import init, is_initialized
        assert float(jnp.ones(3).sum()) == 3.0
        with pytest.raises(RuntimeError) as err:
            init(num_cpu_devices=4)
        msg = str(err.value)
        assert "num_cpu_devices=4" in msg and "with 1 CPU devices" in msg, msg
        assert "restart the process" in msg, msg
        assert not is_initialized()
        """
    )


def test_same_count_set_by_xla_flags_is_accepted_after_start() -> None:
    # The backend's count came from XLA_FLAGS, so jax_num_cpu_devices is still -1 and JAX's
    # own config.update(4) would refuse; init compares live devices instead.
    run_fresh(
        """
        import jax, jax.numpy as jnp
        from alpa_mini.session.local import init
        jnp.ones(3).block_until_ready()
        assert jax.config.jax_num_cpu_devices == -1
        spec = init(num_cpu_devices=4)
        assert spec.num_devices == 4 == len(jax.devices())
        """,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )


# ---------------------------------------------------------------------- in-process
@pytest.mark.parametrize("value", ["abc", "0", "-2", "2.5"])
def test_bad_env_value_names_the_variable(
    restore_state, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError, match=rf"{ENV}='{value}' is invalid"):
        init()


@pytest.mark.parametrize("value", [0, -1, True, "8", 2.0])
def test_bad_num_cpu_devices_argument(restore_state, value: object) -> None:
    with pytest.raises(ConfigError, match=r"num_cpu_devices: .* is invalid"):
        init(num_cpu_devices=value)  # type: ignore[arg-type]


def test_local_init_in_this_session_detects_its_8_devices(restore_state) -> None:
    spec = init("local", num_cpu_devices=8)  # the session's count: accepted
    assert (spec.num_hosts, spec.devices_per_host) == (1, 8)
    assert spec.device == ClusterSpec.named("cpu-1x8").device
    assert current_cluster() is spec and is_initialized()
    shutdown()
    assert not is_initialized()


def test_a_description_is_used_for_planning(restore_state) -> None:
    spec = init("cpu-2x4")
    assert spec == ClusterSpec.named("cpu-2x4") and current_cluster() == spec
    from_path = init(str(CLUSTERS / "cpu-2x4.yaml"))
    assert from_path == spec
    assert init(CLUSTERS / "cpu-1x8.yaml") == ClusterSpec.named("cpu-1x8")
    custom = ClusterSpec.named("dgx-a100").with_hosts(1)
    assert init(custom) is custom  # 8 described devices on 8 CPU devices is allowed


def test_a_description_larger_than_the_devices_is_refused(restore_state) -> None:
    with pytest.raises(ConfigError, match=r"describes 16 devices .* JAX has 8"):
        init(ClusterSpec.named("dgx-h100", num_hosts=2))
    assert not is_initialized()


@pytest.mark.parametrize("value", ["nope", "Ray", 42, None])
def test_unsupported_cluster_values_list_the_valid_ones(restore_state, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        init(value)  # type: ignore[arg-type]
    msg = str(err.value)
    assert f"cluster={value!r} is not supported" in msg
    assert "'local'" in msg and "path of a cluster YAML" in msg and "ClusterSpec" in msg
    assert all(name in msg for name in available_clusters())


def test_missing_yaml_path_is_a_config_error(restore_state, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such cluster file"):
        init(str(tmp_path / "missing.yaml"))
