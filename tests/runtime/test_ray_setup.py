"""``init(cluster="ray")``: an embedded Ray head of our own, one worker per simulated host,
the cluster described from the workers' devices, and ``shutdown`` leaving nothing behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import alpa_mini
from alpa_mini import ConfigError
from alpa_mini.session.ray import describe_workers, gpu_node_counts
from helpers.ray_heads import alive, gone, listening_outside_loopback


@pytest.mark.slow
def test_cpu_mode_one_worker_per_simulated_host_failure_and_clean_shutdown():
    import ray

    alpa_mini.shutdown()
    try:
        spec = alpa_mini.init(cluster="ray", num_hosts=2, num_cpu_devices=4)
        assert (spec.num_hosts, spec.devices_per_host, spec.device.name) == (2, 4, "cpu")
        # Two simulated hosts: the inter-host link is cpu-2x4's (gloo over loopback).
        assert spec.inter_host == alpa_mini.ClusterSpec.named("cpu-2x4").inter_host
        session = alpa_mini.session.ray_session()
        info = session.worker_info
        assert [w["host"] for w in info] == [0, 1]
        assert [len(w["devices"]) for w in info] == [4, 4]
        assert all(d["platform"] == "cpu" for w in info for d in w["devices"])
        pids = [w["pid"] for w in info]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        assert ray.get([w.ping.remote() for w in session.workers]) == [0, 1]
        assert alpa_mini.current_cluster() == spec
        # ShardParallel steps run locally: on a Ray cluster that is a clear error.
        step = alpa_mini.parallelize(lambda p, b: p, method=alpa_mini.ShardParallel())
        with pytest.raises(RuntimeError, match="the workers run PipeshardParallel steps"):
            step(1.0, 2.0)

        # Fault injection: a killed worker is reported by host, promptly, not as a hang.
        session.check_workers()
        ray.kill(session.workers[1], no_restart=True)  # asynchronous: wait for the death
        assert gone([info[1]["pid"]])
        t0 = time.monotonic()
        with pytest.raises(alpa_mini.WorkerFailedError, match="worker of host 1") as err:
            session.check_workers(timeout=10.0)
        assert err.value.host == 1 and time.monotonic() - t0 < 30.0

        alpa_mini.shutdown()
        assert not ray.is_initialized()
        assert alpa_mini.session.ray_session() is None and not alpa_mini.is_initialized()
        assert gone(pids), "a worker process outlived shutdown()"

        # The same process can connect again, with another layout.
        again = alpa_mini.init(cluster="ray", num_hosts=1, num_cpu_devices=2)
        assert (again.num_hosts, again.devices_per_host) == (1, 2)
        pids = [w["pid"] for w in alpa_mini.session.ray_session().worker_info]
        # Every socket our embedded cluster listens on is loopback; its files are private.
        outside = listening_outside_loopback()
        assert outside == [], outside
        temp_dir = alpa_mini.session.ray_session().temp_dir
        assert os.stat(temp_dir).st_mode & 0o777 == 0o700
        token = Path.home() / ".ray" / "auth_token"
        if token.is_file() and token.stat().st_uid == os.getuid():
            assert token.stat().st_mode & 0o777 == 0o600
    finally:
        alpa_mini.shutdown()
    assert gone(pids)


def test_workers_on_gpu_nodes_describe_a_gpu_cluster():
    info = [
        {
            "host": h,
            "devices": [
                {
                    "id": 8 * h + k,
                    "platform": "gpu",
                    "device_kind": "NVIDIA A100-SXM4-80GB",
                    "bytes_limit": 80 * 2**30,
                }
                for k in range(8)
            ],
        }
        for h in range(2)
    ]
    spec = describe_workers(info)
    assert (spec.num_hosts, spec.devices_per_host) == (2, 8)
    assert spec.device.memory_bytes == 80 * 2**30
    assert spec.intra_host == alpa_mini.ClusterSpec.named("dgx-a100").intra_host
    info[1]["devices"].pop()
    with pytest.raises(ConfigError, match="uneven devices per process"):
        describe_workers(info)


def test_gpu_nodes_are_counted_from_ray_node_records():
    nodes = [
        {"Alive": True, "Resources": {"CPU": 64.0, "GPU": 8.0}},
        {"Alive": True, "Resources": {"CPU": 8.0}},  # a CPU-only head
        {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},  # a dead node
        {"Alive": True, "Resources": {"CPU": 64.0, "GPU": 4.0}},
    ]
    assert gpu_node_counts(nodes) == [8, 4]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cluster": "local", "address": "auto"}, "only used with cluster='ray'"),
        ({"cluster": "cpu-1x8", "num_hosts": 2}, "only used with cluster='ray'"),
        ({"cluster": "ray", "address": " "}, "address"),
    ],
)
def test_bad_ray_arguments_name_the_field(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        alpa_mini.init(**kwargs)


def test_an_unreachable_or_malformed_address_fails_fast_and_names_it():
    import socket

    alpa_mini.shutdown()  # whatever an earlier test on this worker left

    with socket.socket() as s:  # a port of this machine where nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"no Ray head answers at 127\.0\.0\.1:{port}"):
        alpa_mini.init(cluster="ray", address=f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 30.0
    with pytest.raises(ConfigError, match=r"address: 'nohost' is invalid; expected 'auto' or"):
        alpa_mini.init(cluster="ray", address="nohost")
    assert not alpa_mini.is_initialized()


@pytest.mark.slow
def test_connecting_to_a_running_head_leaves_it_running(ray_head):
    import ray

    address, _, head_pids = ray_head
    alpa_mini.shutdown()
    spec = alpa_mini.init(cluster="ray", address=address, num_hosts=2, num_cpu_devices=2)
    assert (spec.num_hosts, spec.devices_per_host) == (2, 2)
    workers = [w["pid"] for w in alpa_mini.session.ray_session().worker_info]
    alpa_mini.shutdown()
    assert not ray.is_initialized()
    assert gone(workers)  # our actors are gone ...
    assert all(alive(p) for p in head_pids)  # ... the head we only connected to is not


_DRIVER = """
import json, signal, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (xdist ignores it)
import alpa_mini
alpa_mini.init(cluster="ray", num_hosts=1, num_cpu_devices=2)
session = alpa_mini.session.ray_session()
print(json.dumps({"temp_dir": session.temp_dir}), flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_a_driver_that_dies_leaves_no_process_port_or_temp_dir_behind():
    """SIGINT, SIGTERM or SIGKILL to a driver with an embedded Ray: within 20 s every
    process of its cluster is gone and its temp dir removed (the reaper does it)."""
    import json
    import signal
    import subprocess
    import sys

    from helpers.ray_heads import _descendants, _ours

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    drivers = {
        sig: subprocess.Popen(
            [sys.executable, "-c", _DRIVER], stdout=subprocess.PIPE, text=True, env=env
        )
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
    }
    try:
        started = {sig: json.loads(p.stdout.readline())["temp_dir"] for sig, p in drivers.items()}
        for sig, proc in drivers.items():
            temp_dir = started[sig]
            ours = _descendants(_ours(temp_dir)) - {proc.pid}
            assert len(ours) >= 3, ours  # GCS, raylet, the host worker at least
            proc.send_signal(sig)
            proc.wait(timeout=60)
            assert gone(list(ours), timeout=20.0), (sig, [p for p in ours if alive(p)])
            deadline = time.monotonic() + 10
            while os.path.exists(temp_dir) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not os.path.exists(temp_dir), sig
    finally:
        for proc in drivers.values():
            proc.kill()
