"""Child processes that run ``solve_sharding`` beside the planner's threads.

Simplification and MIP assembly are Python and hold the GIL, so on two threads the
planner's layer ILPs ran no faster than on one (gpt-1.3b on 4 GPUs: 3.4 s of ILPs per
micro-batch count either way). Inside a ``solve_session`` the ILPs are solved in child
processes instead, while the planner's threads build the next ones.

Children are plain ``python -c`` processes that import only ``alpa_mini.solvers`` (never the
caller's ``__main__``, which multiprocessing's spawn would re-run), talk pickles over two
pipes, answer within the ILP's time limit plus a margin or are killed, and are stopped when
the outermost session ends. A child that fails is dropped and its ILP solved in-process: the
same function on the same problem, so the plan does not change.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from ..solvers import ShardingProblem, ShardingSolution, solve_sharding

__all__ = ["SolvePool", "active_pool", "session_pool", "solve_session", "usable_cpus"]

log = logging.getLogger("alpa_mini.shard.solve_pool")

#: Niceness a child adds to the planner's own. The planner's Python builds the
#: ILPs its children solve and traces the step while they start: on two cores it should not
#: yield its core to them (gpt-1.3b on 4 GPUs planned about 3% faster, paired runs).
CHILD_NICENESS = 5
#: Seconds a child may take to start (import numpy and the solvers) and say it is ready.
START_TIMEOUT = 120.0
#: Seconds a child may run past an ILP's own time limit before it is presumed stuck.
ANSWER_MARGIN = 120.0
#: The longest wait for an ILP without a time limit.
UNLIMITED_WAIT = 6 * 3600.0

_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from alpa_mini.shard.solve_pool import _serve; _serve(int(sys.argv[2]), int(sys.argv[3]))"
)


class _Child:
    """One worker process and the two pipe ends the parent holds."""

    def __init__(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        args = [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(to_child_r)]
        args.append(str(from_child_w))
        try:
            self.proc = subprocess.Popen(
                args,
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # solver logs must not mix into the caller's output
                close_fds=True,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        with contextlib.suppress(OSError, AttributeError):  # not permitted, or not POSIX
            mine = os.getpriority(os.PRIO_PROCESS, 0)
            os.setpriority(os.PRIO_PROCESS, self.proc.pid, min(mine + CHILD_NICENESS, 19))
        self.send_end = Connection(to_child_w, readable=False)
        self.recv_end = Connection(from_child_r, writable=False)
        self.ready = False

    def call(self, problem: ShardingProblem, kwargs: dict[str, Any], wait: float) -> Any:
        """Send one ILP and wait for ("ok", solution) or ("error", exception)."""
        if not self.ready:
            hello = self._receive(START_TIMEOUT, "start")
            if hello != "ready":
                raise ValueError(f"solver process {self.proc.pid} started with {hello!r}")
            self.ready = True
        self.send_end.send((problem, kwargs))
        return self._receive(wait, "answer")

    def _receive(self, wait: float, what: str) -> Any:
        if not self.recv_end.poll(wait):
            raise TimeoutError(f"solver process {self.proc.pid} did not {what} within {wait:.0f} s")
        return self.recv_end.recv()

    def stop(self, grace: float = 5.0) -> None:
        with contextlib.suppress(OSError):
            self.send_end.send(None)
        for end in (self.send_end, self.recv_end):
            with contextlib.suppress(OSError):
                end.close()
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=grace)


class SolvePool:
    """``size`` child processes; ``solve`` is ``solve_sharding`` and may be called from many
    threads at once (each call takes an idle child, or waits for one)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size: {size} solver processes; expected at least 1")
        self._idle: queue.Queue[_Child] = queue.Queue()
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        for _ in range(size):
            child = _Child()
            self._children.append(child)
            self._idle.put(child)

    @property
    def size(self) -> int:
        """Children still working (failed ones are dropped)."""
        return len(self._children)

    def solve(self, problem: ShardingProblem, **kwargs: Any) -> ShardingSolution:
        """``solve_sharding(problem, **kwargs)`` in a child; in-process when none is left."""
        limit = kwargs.get("time_limit")
        wait = UNLIMITED_WAIT if limit is None else float(limit) + ANSWER_MARGIN
        child = self._take(wait)
        if child is None:
            return solve_sharding(problem, **kwargs)
        try:
            kind, value = child.call(problem, kwargs, wait)
        except (OSError, EOFError, TimeoutError, ValueError) as err:  # died, stuck, or garbled
            self._drop(child, err)
            return solve_sharding(problem, **kwargs)
        self._idle.put(child)
        if kind == "error":
            raise value
        if kind != "ok":  # the child could not send its answer back (not picklable)
            return solve_sharding(problem, **kwargs)
        return value

    def _take(self, wait: float) -> _Child | None:
        while self.size:
            try:
                return self._idle.get(timeout=1.0)
            except queue.Empty:
                wait -= 1.0
                if wait <= 0:
                    return None
        return None

    def _drop(self, child: _Child, err: BaseException) -> None:
        log.warning("solver process %d failed (%s); solving in-process", child.proc.pid, err)
        with self._lock:
            if child in self._children:
                self._children.remove(child)
        child.proc.kill()
        child.stop(grace=5.0)

    def close(self) -> None:
        """Stop every child (each gets 5 s to exit, then is killed)."""
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.stop()


_state_lock = threading.Lock()
_pool: SolvePool | None = None
_depth = 0
_workers = 0


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def solve_session(workers: int | None = None) -> Iterator[None]:
    """A scope in which ``session_pool`` may start ``workers`` children (default: one per
    usable CPU); they are stopped when the outermost session ends (sessions nest)."""
    global _pool, _depth, _workers
    with _state_lock:
        if _depth == 0:
            _workers = usable_cpus() if workers is None else workers
        _depth += 1
    try:
        yield
    finally:
        with _state_lock:
            _depth -= 1
            pool = _pool if _depth == 0 else None
            if _depth == 0:
                _pool = None
        if pool is not None:
            pool.close()


def session_pool() -> SolvePool | None:
    """The open session's pool, started on first use; None outside a session, with fewer
    than two workers, or where no process can be started."""
    global _pool, _workers
    with _state_lock:
        if _pool is None and _depth and _workers >= 2:
            try:
                _pool = SolvePool(_workers)
            except OSError as err:  # no processes to be had: threads only, as before
                log.warning("no solver processes (%s); solving in threads", err)
                _workers = 0
        return _pool


def active_pool() -> SolvePool | None:
    """The open session's pool if it has been started (``session_pool``), else None."""
    return _pool


@atexit.register
def _close_at_exit() -> None:
    if _pool is not None:
        _pool.close()


def _serve(recv_fd: int, send_fd: int) -> None:
    """A child's loop: solve each problem received until told to stop (None) or the parent
    goes away (EOF)."""
    recv_end = Connection(recv_fd, writable=False)
    send_end = Connection(send_fd, readable=False)
    try:
        send_end.send("ready")
    except OSError:  # the pool closed while this child started (planning ended early)
        return
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the whole process group
        _answer(recv_end, send_end)


def _answer(recv_end: Connection, send_end: Connection) -> None:
    """Solve each job received and send back ("ok", solution) or ("error", exception)."""
    while True:
        try:
            job = recv_end.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        problem, kwargs = job
        try:
            answer: tuple[str, Any] = ("ok", solve_sharding(problem, **kwargs))
        except Exception as err:  # the parent re-raises it as if solved in-process
            answer = ("error", err.with_traceback(None))
        try:
            send_end.send(answer)
        except Exception:  # an answer that does not pickle: the parent re-solves
            send_end.send(("unsent", None))
