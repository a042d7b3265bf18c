"""A watchdog that outlives the driver of an embedded Ray: when the driver process ends in
any way (``shutdown``, an exception, SIGINT, SIGTERM, SIGKILL), every process the embedded
cluster started is killed and its temp dir removed.

Run as a script by path (``start_reaper``), so that it imports only the standard library:
``python reaper.py DRIVER_PID TEMP_DIR``. Linux only (it reads ``/proc``); elsewhere
``start_reaper`` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["start_reaper", "stop_reaper"]

#: Seconds between the watchdog's looks at the driver and the cluster's processes.
POLL = 0.5


def start_reaper(temp_dir: str) -> subprocess.Popen[bytes] | None:
    """Start the watchdog for this process and ``temp_dir``; None where there is no
    ``/proc``. ``stop_reaper`` ends it after a clean shutdown."""
    if not Path("/proc/self/stat").exists():
        return None
    return subprocess.Popen(
        [sys.executable, "-I", "-S", __file__, str(os.getpid()), temp_dir],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the driver's terminal must not stop it first
    )


def stop_reaper(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of ``pid`` from /proc, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def _processes() -> dict[int, tuple[int, int]]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            found[int(entry)] = st
    return found


def _names(pid: int, temp_dir: str) -> bool:
    try:
        return temp_dir.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _ours(temp_dir: str, procs: dict[int, tuple[int, int]]) -> set[int]:
    """The processes naming ``temp_dir`` on their command line (every process the
    embedded Ray starts does) and everything below them."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found = {p for p in procs if _names(p, temp_dir)}
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def watch(driver: int, temp_dir: str) -> None:
    """Record the embedded cluster's processes until the driver is gone; then kill those
    still running (the same processes: start times are compared, so a reused pid is
    spared) and remove ``temp_dir``. The driver's other children are not ours to stop."""
    me = os.getpid()
    seen: dict[int, int] = {}  # pid -> start time

    def record() -> None:
        procs = _processes()
        for pid in _ours(temp_dir, procs) - {me}:
            seen.setdefault(pid, procs[pid][1])

    while os.getppid() == driver and _stat(driver) is not None:
        record()
        if not Path(temp_dir).exists():
            return  # a clean shutdown removed it
        time.sleep(POLL)
    record()
    for pid, started in seen.items():
        st = _stat(pid)
        if st is not None and st[1] == started:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]), sys.argv[2])
