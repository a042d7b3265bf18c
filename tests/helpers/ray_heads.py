"""A Ray head of a test's own (``ray start --head`` on loopback, a temp dir it owns),
stopped by pid afterwards: only the processes it started, never anyone else's Ray."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import alpa_mini


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone(pids: list[int], timeout: float = 20.0) -> bool:
    """Whether every process in ``pids`` has exited within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.2)
    return False


def listening_outside_loopback() -> list[tuple[str, int, str]]:
    """(address, port, process) of every listening socket of this process and the processes
    it started (the embedded Ray's gcs, raylet, agents and workers) that is not loopback."""
    import ipaddress

    import psutil

    me = psutil.Process()
    ours = {me.pid} | {c.pid for c in me.children(recursive=True)}
    time.sleep(1.0)  # agents open their ports a moment after init returns
    found = []
    for c in psutil.net_connections(kind="inet"):
        if c.status != psutil.CONN_LISTEN or c.pid not in ours:
            continue
        ip = ipaddress.ip_address(c.laddr.ip)
        mapped = getattr(ip, "ipv4_mapped", None)
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            found.append((c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name()))
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(roots: set[int]) -> set[int]:
    """``roots`` and every process below them (from ``ps``)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        pid, ppid = (int(x) for x in line.split())
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        p = todo.pop()
        if p not in found:
            found.add(p)
            todo.extend(children.get(p, []))
    return found


def _ours(temp_dir: str) -> set[int]:
    """Processes of the head started with ``temp_dir`` (their command lines name it)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {int(line.split(None, 1)[0]) for line in out.splitlines() if temp_dir in line}


@pytest.fixture
def ray_head(monkeypatch):
    """Yields (GCS address, dashboard/job-server URL, the head's pids). The dashboard and
    job server listen on 127.0.0.1."""
    temp_dir = tempfile.mkdtemp(prefix="alpa-mini-head-")
    port, dashboard = _free_port(), _free_port()
    # The agents' ports too: their defaults are fixed (the dashboard agent's 52365), so a
    # second Ray on this machine (the other pytest worker's) would leave this head without
    # a job agent ("No available agent to submit job").
    agents = [
        f"--{flag}={_free_port()}"
        for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                     "runtime-env-agent-port", "metrics-export-port")
    ]  # fmt: skip
    ray_cli = str(Path(sys.executable).with_name("ray"))
    subprocess.run(
        [ray_cli, "start", "--head", f"--port={port}", "--num-cpus=4", f"--temp-dir={temp_dir}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", "--disable-usage-stats", *agents],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    # `ray start` heads use token authentication in Ray 2.60; the driver must say so.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    pids = _descendants(_ours(temp_dir))
    assert pids, "could not find the head's processes by their temp dir"
    try:
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard}", pids
    finally:
        alpa_mini.shutdown()
        pids = _descendants(pids | _ours(temp_dir))
        for p in sorted(pids, reverse=True):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        assert gone(list(pids))
        shutil.rmtree(temp_dir, ignore_errors=True)
