"""Inter-operator stage DP (DESIGN 5.2): slice layers into pipeline stages on submeshes.

Layers ``0..L-1`` run on a cluster of ``N`` hosts x ``M`` devices. A *stage* is a contiguous
layer range ``i..j`` (inclusive) placed on one submesh ``s`` of :func:`submesh_shapes` with one
logical-mesh config ``c``; ``cost[i, j, s, c]`` is its latency (``inf``: does not fit) and
``max_succ[i, j, s, c]`` the number of later stages it tolerates under 1F1B memory. A slicing
covers every layer, its submesh device counts sum to exactly ``N * M`` and it minimises

    T = sum_stages t + (B - 1) * max_stages t          (B = number of micro-batches).

:func:`solve_stages` is exact and fast; ``brute_force.solve_stages_reference`` is Alpa's
plain scheme (every distinct ``t_max``, one full inner DP each) kept for tests and
benchmarks.

How :func:`solve_stages` stays exact (details in the comments next to each step):

* ``g(t)``, the least latency sum over slicings whose stages are all ``<= t``, is
  nonincreasing in ``t`` and ``T* = min_t g(t) + (B - 1) t``. Instead of one inner DP per
  distinct cost, a best-first search probes few ``t``: an unexplored run of candidates
  ``[t_a, t_b]`` whose nearest probe to the right has ``g >= g_r`` holds no ``T`` below
  ``g_r + (B - 1) t_a``; runs that cannot beat the incumbent are dropped, and a probe whose
  optimum peaks at ``t' <= t`` settles every candidate in ``[t', t]``.
* Relaxations bound where to look: the fewest-devices slicing must fit the cluster (a lower
  bound on the optimal max stage), and a Lagrangian price on devices gives a lower bound on
  ``g`` (hence an upper bound on the useful ``t``).
* Most probes are a cheap *relaxed* DP (memory limits ignored, cheapest config per range and
  submesh): a lower bound on ``g(t)``, and exact whenever its slicing meets every memory
  limit. Otherwise the memory-aware DP runs, restricted to the states whose relaxed
  prefix + suffix sum can still matter for the search (it then either returns ``g(t)`` or
  proves ``g(t)`` above the cut).
* Inside both DPs: configs dominated within one (range, submesh) are dropped (cheaper *and*
  tolerating as many later stages), after capping ``max_succ`` at what could ever be asked of
  it; device counts are kept in units of the gcd of the usable submesh sizes and only within
  the window a full-cluster slicing can reach; rows are whole numpy vectors over devices; the
  memory-aware DP keeps "at most ``r`` stages from layer ``k`` on" only for the ``r`` that can
  differ from "unlimited" (below the stage count of the unlimited optimum).
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..errors import InfeasibleError
from .bounds import (
    _bottleneck_lower_bound,
    _lagrangian_sum_bound,
    _relaxed_dp,
    _relaxed_prefix,
    _RelaxedTables,
)
from .dp import _infeasible_reason, _memory_dp
from .problem import _INF, StageProblem, StageSolution, _make_solution
from .tables import _CHOICE_FIELDS, _Choices, _device_windows, _prepare, _Prepared, _Probe, _useful

__all__ = ["solve_stages"]


class _Search:
    """The ``t_max`` search of :func:`solve_stages`, with its probes and incumbent.

    Two kinds of probe at a threshold ``t``: the *relaxed* DP ignores memory limits and keeps
    one cheapest config per (range, submesh); it is several times cheaper, its sum is a lower
    bound on ``g(t)``, and when its slicing happens to meet every memory limit it *is* an
    exact optimum at ``t``. Only otherwise does the memory-aware DP run, and then only over
    the states whose relaxed prefix + suffix can still matter (a sum cut, see
    :func:`_memory_dp`).
    """

    def __init__(self, prep: _Prepared, problem: StageProblem) -> None:
        self.prep = prep
        self.problem = problem
        self.b1 = problem.num_micro_batches - 1
        self.exact_choices = prep.exact
        self.relaxed_choices = prep.relaxed
        self.relaxed_by_end = np.argsort(prep.relaxed.end, kind="stable")
        self.relaxed_at: dict[float, _Probe] = {}
        self.tables_at: dict[float, _RelaxedTables] = {}
        self.exact_at: dict[float, _Probe] = {}
        self.found: dict[float, float] = {}  # t -> T of the slicing found there (inf: none)
        self.bounds: list[tuple[float, float]] = []  # (t, lower bound on g(t') for t' <= t)
        self.failed_below = -_INF  # every t <= this is infeasible
        self.t_lb = 0.0  # every feasible slicing peaks at >= this
        self.best: _Probe | None = None

    def best_value(self) -> float:
        """``T`` of the incumbent (``inf`` if none)."""
        return self.best.g + self.b1 * self.best.t_actual if self.best else _INF

    def restrict(self, t_hi: float) -> None:
        """Forget every choice that no probe at ``t <= t_hi`` can use: cheaper probes.

        That is every choice above ``t_hi``, and every choice that cannot join two window
        states at ``t_hi``: windows only shrink as ``t`` decreases (fewer submeshes qualify).
        """
        lo, hi, _, _ = _device_windows(self.prep, self.problem, t_hi)
        for name in ("exact_choices", "relaxed_choices"):
            ch = getattr(self, name).below(t_hi)
            keep = np.flatnonzero(_useful(ch.start, ch.end + 1, ch.size, lo, hi))
            setattr(self, name, _Choices(*(getattr(ch, f)[keep] for f in _CHOICE_FIELDS)))
        self.relaxed_by_end = np.argsort(self.relaxed_choices.end, kind="stable")

    def _offer(self, res: _Probe) -> None:
        if res.feasible and res.memory_ok and res.g + self.b1 * res.t_actual < self.best_value():
            self.best = res

    def _record_exact(self, res: _Probe) -> _Probe:
        self._offer(res)
        if res.feasible or not math.isfinite(res.lower):
            value = res.g + self.b1 * res.t_actual if res.feasible else _INF
            self.found[res.t] = min(value, self.found.get(res.t, _INF))
        if res.feasible and not math.isfinite(res.lower):
            self.exact_at[res.t] = res
            self.bounds.append((res.t, res.g))
        elif math.isfinite(res.lower):
            self.bounds.append((res.t, res.lower))
        else:
            self.exact_at[res.t] = res
            self.failed_below = max(self.failed_below, res.t)
        return res

    def relaxed(self, t: float) -> _Probe:
        """Relaxed probe at ``t``; recorded as exact when its slicing meets memory limits."""
        if t in self.relaxed_at:
            return self.relaxed_at[t]
        res, tables = _relaxed_dp(self.prep, self.relaxed_choices, self.problem, t)
        self.relaxed_at[t] = res
        if not res.feasible or res.memory_ok:  # relaxed infeasible => exact infeasible
            self._record_exact(res)
        else:
            assert tables is not None
            self.tables_at = {t: tables}  # only the latest is ever reused
            self.bounds.append((t, res.g))
        return res

    def exact(self, t: float, cut: float = _INF) -> _Probe:
        """Exact optimum at ``t`` if it sums to ``<= cut`` (else only ``g(t) > cut``)."""
        if t in self.exact_at:
            return self.exact_at[t]
        res = self.relaxed(t)
        if t in self.exact_at:
            return res
        bound = None
        if math.isfinite(cut):
            tables = self.tables_at.get(t)
            if tables is None:  # evicted by a later relaxed probe: rebuild it
                tables = _relaxed_dp(self.prep, self.relaxed_choices, self.problem, t)[1]
                assert tables is not None
            tables.prefix = _relaxed_prefix(
                self.relaxed_choices, self.relaxed_by_end, tables, t, self.problem.num_layers
            )
            bound = (tables, cut)
        res = _memory_dp(self.prep, self.exact_choices, self.problem, t, bound)
        return self._record_exact(res)

    def trace(self) -> list[tuple[float, float]]:
        """``(t, T of the slicing found there)`` of every memory-aware probe (``inf``: none
        exists at ``t``)."""
        return list(self.found.items())

    # ---- the phases
    def first_incumbent(self, t_lb: float, top: float) -> None:
        """Gallop up from the bottleneck bound until some slicing is feasible."""
        t = t_lb
        step = max(t_lb * 2.0**-10, (top - t_lb) * 2.0**-30, 1e-300)
        while not self.exact(t).feasible:
            if t >= top:
                return
            t = min(top, t + step)
            step *= 2.0

    def explore(self, lo: float, sum_lb: float) -> None:
        """Find a strong incumbent early (a heuristic: exactness comes from :meth:`certify`).

        Relaxed probes on a ladder ``lo + (hi - lo) * (2**i - 1) / 1024`` up to the current ``t_hi``
        (cheap, tight thresholds first), then a golden-section search of ``g(t) + (B - 1) t``
        around the best rung, and one exact probe at the best point found.
        """
        b1 = self.b1

        def t_hi() -> float:
            return (self.best_value() - sum_lb) / b1

        def value(t: float) -> float:
            res = self.relaxed(t)
            return res.g + b1 * res.t_actual if res.feasible else _INF

        hi = t_hi()
        if not hi > lo:
            return
        rungs, values = [lo], [value(lo)]
        # t_hi shrinks as the incumbent improves. The ladder passes hi by rung 11; the
        # scaling by 2**-10 comes last so that a subnormal span (hi - lo) cannot underflow
        # to a zero step, and the rung cap bounds the loop whatever the floats do.
        while rungs[-1] < t_hi() and len(rungs) < 64:
            rung = lo + (hi - lo) * (2.0 ** len(rungs) - 1.0) * 2.0**-10
            rungs.append(min(rung, t_hi()))
            values.append(value(rungs[-1]))
        i = int(np.argmin(values))
        a, b = rungs[max(i - 1, 0)], rungs[min(i + 1, len(rungs) - 1)]
        inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
        c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
        fc, fd = value(c), value(d)
        for _ in range(10):
            if (b - a) * b1 <= 1e-4 * self.best_value():
                break
            if fc <= fd:
                b, d, fd = d, c, fc
                c = b - inv_phi * (b - a)
                fc = value(c)
            else:
                a, c, fc = c, d, fd
                d = a + inv_phi * (b - a)
                fd = value(d)
        candidates = [*zip(values, rungs, strict=True), (fc, c), (fd, d)]
        t = min(candidates)[1]
        # it can only improve the incumbent if g(t) < best - (B - 1) * (least feasible t)
        self.exact(t, self.best_value() - b1 * max(self.failed_below, self.t_lb))

    def certify(self, sum_lb: float) -> None:
        """Probe candidates until none can beat the incumbent (exact; see solve_stages)."""
        b1 = self.b1
        t_hi = (self.best_value() - sum_lb) / b1
        costs = self.exact_choices.cost
        cand = np.unique(costs[(costs > self.failed_below) & (costs <= t_hi)])
        done = np.zeros(cand.size, dtype=bool)
        settled = 0
        while True:
            # settle what the exact probes so far decide: an optimum at t peaking at t' <= t
            # makes g constant on [t', t] (nothing there beats it); infeasible t: all below
            for p in list(self.exact_at.values())[settled:]:
                if p.feasible:
                    done[(cand >= p.t_actual) & (cand <= p.t)] = True
            settled = len(self.exact_at)
            done[cand <= self.failed_below] = True
            open_idx = np.flatnonzero(~done)
            if open_idx.size == 0:
                return
            breaks = np.flatnonzero(np.diff(open_idx) > 1)
            run_lo = open_idx[np.r_[0, breaks + 1]]
            run_hi = open_idx[np.r_[breaks, open_idx.size - 1]]
            # g is nonincreasing: a probe (exact, relaxed or cut) at t bounds g on t' <= t
            pts = sorted(self.bounds)
            pt = np.array([x[0] for x in pts])
            pg = np.maximum.accumulate(np.array([x[1] for x in pts])[::-1])[::-1]
            right = np.searchsorted(pt, cand[run_hi], side="left")
            g_right = np.where(right < pt.size, pg[np.minimum(right, pt.size - 1)], sum_lb)
            g_right = np.maximum(g_right, sum_lb)
            best = self.best_value()
            # candidates t with g_right + (B - 1) t >= best cannot beat the incumbent
            limit = np.searchsorted(cand, (best - g_right) / b1, side="left") - 1
            for lo, hi, lim in zip(run_lo.tolist(), run_hi.tolist(), limit.tolist(), strict=True):
                if lim < hi:
                    done[max(lo, lim + 1) : hi + 1] = True
            live = limit >= run_lo
            if not live.any():
                return
            # the run whose best case is lowest, probed at its highest useful candidate; an
            # exact probe there only matters if g(t) < best - (B - 1) * (run's lowest t)
            i = int(np.argmin(np.where(live, g_right + b1 * cand[run_lo], np.inf)))
            top = min(run_hi[i], limit[i])
            t = float(cand[top])
            if t not in self.relaxed_at:
                self.relaxed(t)
                continue
            res = self.exact(t, best - b1 * float(cand[run_lo[i]]))
            if math.isfinite(res.lower):
                # g(t') >= g(t) > best - (B - 1) * t_lo for every t' <= t: the run is done
                done[run_lo[i] : top + 1] = True


def solve_stages(problem: StageProblem) -> StageSolution:
    """Exact optimal slicing of all layers into stages (see the module docstring).

    Raises :class:`InfeasibleError` when no slicing uses all devices with finite costs and
    satisfied memory limits; the message says which constraint binds.
    """
    t0 = time.perf_counter()
    prep = _prepare(problem)
    search = _Search(prep, problem)
    t_lb, min_devices = _bottleneck_lower_bound(prep, problem)
    if not math.isfinite(t_lb):
        raise InfeasibleError(
            _infeasible_reason(prep, problem, min_devices), min_devices=min_devices
        )
    search.t_lb = t_lb
    top = float(prep.exact.cost.max())
    if search.b1 == 0:
        search.exact(top)  # B = 1: T is the plain latency sum, least with every stage allowed
    else:
        search.first_incumbent(t_lb, top)
    if search.best is None:
        raise InfeasibleError(_infeasible_reason(prep, problem, min_devices))
    if search.b1 > 0:
        # g(t) >= sum_lb for every t, so no t above t_hi can beat the incumbent
        sum_lb = _lagrangian_sum_bound(prep, problem)
        search.restrict((search.best_value() - sum_lb) / search.b1)
        search.explore(max(search.failed_below, t_lb), sum_lb)
        search.certify(sum_lb)
    assert search.best is not None
    return _make_solution(problem, search.best.choices, search.trace(), t0, "stage_dp")
