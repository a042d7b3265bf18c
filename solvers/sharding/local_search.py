"""Heuristic search for the simplified sharding problem (ILP warm start and fallback).

The ILP is exact but can time out on large or memory-tight graphs; this module finds good
feasible assignments of a :class:`~.simplify.CoreProblem` within a time limit, so the ILP
gets a warm start and the planner always has an answer. It also finds assignments of least
peak memory, which tell a user how far over budget a model is when nothing fits.

Building blocks (numpy per variable, Python over variables):

* **Memory model**: time is compressed to the segments between interval endpoints and the
  usage profile ``U`` (one float per segment) is kept up to date. A variable's memory terms
  are pre-summed into *blocks* (segment ranges on which its set of live terms is constant),
  giving a (strategies x blocks) matrix ``D``; the usage a move would leave on its blocks is
  ``blockmax(U) - D[cur] + D[s]``, one ``np.maximum.reduceat`` for all strategies at once.
* **Descent** (iterated conditional modes): a variable moves to its cheapest strategy given
  its neighbours (``cost[x] + Σ_e W_e[:, choice[nb]]``, one gather over its edge matrices
  laid side by side) among those that keep its blocks within the limit, so feasibility is
  kept; a work list re-visits neighbours of moved variables.
* **Repair**: while over the limit, lazy-greedy moves that remove excess memory at the
  least cost per unit removed, never raising an over-limit block nor pushing one over;
  if that gets stuck, moves at the peak segment that may trade memory between segments.
* **Priced rounds** (Lagrangian relaxation): multipliers on time segments price memory into
  the node costs, ``Σ_seg λ_seg usage_seg(s)``; sequential tree-reweighted message passing
  (TRW-S, Kolmogorov 2006) minimises the priced problem, whose solution is repaired and
  also decoded memory-safely from the messages; subgradient steps update the multipliers
  (two trajectories, bold and cautious steps, on small graphs). Without memory, TRW-S
  finds the exact optimum of contest instances A, B, P and V (checked against HiGHS), and
  the prices find memory trade-offs that single moves cannot.
* **Large-neighbourhood search**: exact tree DP over a random induced forest (about three
  quarters of the variables, the rest fixed) with memory priced by a random multiple of the
  multipliers, then repair and descent; ejection chains (a move that breaks the limit,
  repaired around); restarts from elite assignments or from random kicks when it stalls.

:func:`local_search` interleaves priced rounds and LNS moves (half the time each) from a
memory-aware greedy start. The loops check the clock, so ``time_limit`` holds to within
one step (about 0.2 s on the largest contest instance, K, with 5167 core variables) plus
the one-off setup (about a second on K).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .descent import _Descent
from .forest import _Forest
from .priced import _Priced
from .problem import check_choice
from .search_state import (
    _INF,
    ELITE_SIZE,
    LAGRANGIAN_SHARE,
    LNS_STALL,
    LNS_STALL_SHARE,
    SMALL_GRAPH,
    THETA0S,
)
from .simplify import CoreProblem

__all__ = [
    "HeuristicResult",
    "exact_peak",
    "greedy_assignment",
    "local_search",
    "min_peak_assignment",
]


@dataclass(frozen=True)
class HeuristicResult:
    """A heuristic assignment of a core problem and what it achieves.

    ``cost`` includes the core's ``const_cost`` (it is what ``CoreProblem.evaluate`` returns)
    and is ``inf`` when no assignment without a forbidden pair was found.
    """

    choice: np.ndarray
    cost: float
    peak_usage: float
    feasible: bool
    seconds: float
    iterations: int


class _Search(_Descent, _Priced, _Forest):
    """One assignment of a core problem and every move the heuristics make on it."""


class _Driver:
    """Runs the phases of :func:`local_search` and keeps the best feasible assignment."""

    def __init__(self, search: _Search) -> None:
        self.s = search
        self.best_cost = _INF
        self.best_choice: np.ndarray | None = None
        self.best_lam: np.ndarray | None = None
        self.lam = np.zeros(search.nseg)
        self.owner = ""  # which phase last set the search state
        self.init = np.zeros(search.n, dtype=np.int64)
        self.lam_mean: np.ndarray | None = None
        self.elite: list[tuple[float, np.ndarray, np.ndarray]] = []
        self.phase = "start"
        self.stall = int(LNS_STALL)
        self.stall_share = LNS_STALL_SHARE

    def consider(self) -> bool:
        """Record the current assignment if it is feasible and the cheapest so far."""
        s = self.s
        if not s.feasible_mem():
            return False
        cost = s.cost_of(s.choice)
        if self.phase == "lagrangian" and math.isfinite(cost):
            self._offer_elite(cost)
        if cost < self.best_cost - 1e-9 * abs(self.best_cost) or (
            self.best_choice is None and math.isfinite(cost)
        ):
            self.best_cost = cost
            self.best_choice = s.choice.copy()
            self.best_lam = self.lam.copy()
            return True
        return False

    def _offer_elite(self, cost: float) -> None:
        """Keep the cheapest distinct assignments seen, as restart points for the LNS."""
        if any(abs(cost - c) <= 1e-12 * abs(c) for c, _, _ in self.elite):
            return
        if len(self.elite) >= ELITE_SIZE and cost >= self.elite[-1][0]:
            return
        self.elite.append((cost, self.s.choice.copy(), self.lam.copy()))
        self.elite.sort(key=lambda item: item[0])
        del self.elite[ELITE_SIZE:]

    # ------------------------------------------------------------------ phases
    def start(self, initial: np.ndarray | None) -> None:
        """Feasible starting points: the caller's assignment, then a memory-aware greedy."""
        s = self.s
        self.init = s.min_usage_choice()
        if initial is not None:
            s.reset(np.asarray(initial, dtype=np.int64))
            if s.repair() is not None:
                s.descend()
                self.consider()
        s.greedy(memory=True, init=self.init)
        if s.repair() is not None:
            s.descend()
            self.consider()

    def _lagrangian_rounds(self, theta0: float) -> Iterator[None]:
        """Price memory per time segment and let TRW-S solve the priced problem (one round
        per step).

        Subgradient ascent on the multipliers (step ``theta * |UB - q| / |g|^2``, ``theta``
        starting at ``theta0``, shrinking when successive subgradients disagree, growing
        while they agree). Each round turns the priced solution into feasible candidates
        twice: by repair and by memory-safe decoding of the messages, each followed by
        descent on true costs. The multipliers and TRW-S messages are this generator's own,
        so several trajectories can run side by side.
        """
        s = self.s
        limit = float(s.limit) if s.limit is not None else _INF
        theta, gprev, rounds = theta0, None, 0
        # The step uses the best cost these rounds found themselves (not the LNS's), so the
        # multipliers follow the same path however the time is shared.
        upper = self.best_cost
        lam = np.zeros(s.nseg)
        lam_mean = np.zeros(s.nseg)
        messages = [np.zeros_like(m) for m in s.t_in]
        small = s.n <= SMALL_GRAPH
        while True:
            s.t_in = messages
            self.lam, self.lam_mean = lam, lam_mean  # what consider() and the LNS see
            unary = [c + p for c, p in zip(s.costs, s.prices(lam), strict=True)]
            labels = [s.trws_pass(True, unary), s.trws_pass(False, unary)]
            if not s.time_left():
                yield
                continue
            # Pick the better decoding by priced energy (skipped on big graphs: the
            # backward pass used the freshest messages and the profiles cost time).
            pick = int(np.argmin([self._priced(lab) for lab in labels])) if small else 1
            s.relaxed_descend(unary, labels[pick])
            profile = s.U.copy()
            q = s.cost_of(s.choice) + float(lam @ (profile - limit))
            if s.repair() is not None:
                s.descend()
                self.consider()
                upper = min(upper, s.cost_of(s.choice) if s.feasible_mem() else _INF)
            if s.time_left():
                s.decode_mem(unary, s.t_order, self.init)
                s.descend()
                self.consider()
                upper = min(upper, s.cost_of(s.choice) if s.feasible_mem() else _INF)
            g = profile - limit
            g = np.where((lam > 0) | (g > 0), g, 0.0)
            gg = float(g @ g)
            if gg > 0.0 and math.isfinite(q):
                if gprev is not None:
                    theta *= 0.7 if float(g @ gprev) < 0 else 1.1
                    theta = min(max(theta, 0.03), 1.0)
                gprev = g
                # Until something fits, aim the step at twice the priced value instead.
                gap = abs(upper - q) if math.isfinite(upper) else abs(q) + 1.0
                lam = np.maximum(lam + theta * gap / gg * g, 0.0)
                rounds += 1
                lam_mean += (lam - lam_mean) / rounds
            yield

    def _priced(self, label: np.ndarray) -> float:
        s = self.s
        cost = s.cost_of(label)
        if s.limit is None or not math.isfinite(cost):
            return cost
        return cost + float(self.lam @ (s.profile_of(label) - float(s.limit)))

    def _lns_steps(self) -> Iterator[None]:
        """Large-neighbourhood search, one move per step, with restarts when it stalls.

        Moves: exact DP over a random induced forest with memory priced by a random
        multiple of one of the multiplier vectors (those that found the start, the last
        ones, their running mean), then repair and local descent; and ejection chains on
        random variables. A move is kept if it is no worse. The search jumps to any new
        best the priced rounds find. After ``stall`` moves and a share of the time without
        gain it restarts: from an unused elite assignment of the priced rounds, or from the
        best with a region set to random strategies (iterated local search); the best is
        kept apart.
        """
        s = self.s
        assert self.best_choice is not None
        cur, choice, lam_start = self.best_cost, self.best_choice.copy(), self.best_lam
        seen_best = self.best_cost
        used: list[np.ndarray] = [choice]
        span = max(s.deadline - time.perf_counter(), 1e-9)
        since, t_gain = 0, time.perf_counter()
        while True:
            if self.best_cost < seen_best * (1 - 1e-12):
                seen_best = self.best_cost
                if self.best_cost < cur * (1 - 1e-12):
                    cur, choice, lam_start = self.best_cost, self.best_choice.copy(), self.best_lam
                    since, t_gain = 0, time.perf_counter()
                    self.owner = ""
            elif since >= self.stall and time.perf_counter() - t_gain > self.stall_share * span:
                fresh = [e for e in self.elite if not any(np.array_equal(e[1], u) for u in used)]
                if fresh and s.rng.random() < 0.5:
                    cur, choice, lam_start = fresh[0][0], fresh[0][1].copy(), fresh[0][2]
                    used.append(choice)
                    self.owner = ""
                else:
                    cur, choice, lam_start = self._kick(), s.choice.copy(), self.best_lam
                    self.owner = "lns"
                since, t_gain = 0, time.perf_counter()
            if self.owner != "lns":
                s.reset(choice)
                self.owner = "lns"
            lams = [v for v in (lam_start, self.lam, self.lam_mean) if v is not None and v.any()]
            cost = self._lns_move(lams, cur)
            if cost is not None:
                if cost < cur * (1 - 1e-12):
                    since, t_gain = 0, time.perf_counter()
                cur, choice = cost, s.choice.copy()
                self.consider()
            else:
                since += 1
            yield

    def _kick(self) -> float:
        """Set a random region of the best assignment to random strategies, repair, descend.

        Returns the cost of the resulting (feasible) state; if the repair fails, the state
        is the best assignment itself.
        """
        s = self.s
        assert self.best_choice is not None
        s.reset(self.best_choice)
        region = s.random_region(int(s.rng.integers(4, 32)))
        for x in region.tolist():
            s.set(x, int(s.rng.integers(s.k[x])))
        if s.repair() is not None:
            queue = np.unique(np.concatenate([region] + [s.nbrs[y] for y in region.tolist()]))
            s.descend(queue, sweeps=False)
            cost = s.cost_of(s.choice)
            if math.isfinite(cost) and s.feasible_mem():
                self.consider()
                return cost
        s.reset(self.best_choice)
        return self.best_cost

    def run(self) -> None:
        """Alternate priced rounds and LNS moves, each getting its share of the time.

        Interleaving (rather than phases) lets small graphs run many priced rounds, which
        find the memory trade-offs, while big graphs, where a round takes seconds, still
        get neighbourhood moves early; both feed one best assignment.
        """
        s = self.s
        # Two multiplier trajectories on small graphs, taking rounds in turn: bold steps find
        # the memory trade-offs of small graphs within a second, cautious ones give better
        # prices (and elites) for the LNS where the relaxation is weaker. On big graphs a
        # round takes seconds, and the cautious one alone does best.
        theta0s = THETA0S if s.n <= SMALL_GRAPH else THETA0S[-1:]
        lags = [self._lagrangian_rounds(theta0) for theta0 in theta0s]
        lns = None
        spent_lag = spent_lns = 0.0
        turn = 0
        while s.time_left():
            use_lag = self.best_choice is None or spent_lag <= LAGRANGIAN_SHARE * (
                spent_lag + spent_lns
            )
            t = time.perf_counter()
            if use_lag:
                self.phase, self.owner = "lagrangian", "lagrangian"
                next(lags[turn % len(lags)])
                turn += 1
                spent_lag += time.perf_counter() - t
            else:
                self.phase = "lns"
                if lns is None:
                    lns = self._lns_steps()
                next(lns)
                spent_lns += time.perf_counter() - t

    def _lns_move(self, lams: list[np.ndarray], cur: float) -> float | None:
        """One LNS move; its cost if feasible and no worse than ``cur``, else None (undone)."""
        s = self.s
        snap = s.snapshot()
        if s.rng.random() < 0.7:
            extra = None
            if lams:
                mu = float(np.exp(s.rng.uniform(np.log(0.1), np.log(10.0))))
                extra = s.prices(lams[int(s.rng.integers(len(lams)))] * mu)
            s.reset(s.forest_dp(s.random_forest(), extra=extra))
            if s.repair() is None:
                s.restore(snap)
                return None
            changed = np.flatnonzero(s.choice != snap[0])
            if len(changed):
                queue = np.unique(np.concatenate([changed] + [s.nbrs[y] for y in changed]))
                s.descend(queue, sweeps=False)
        else:
            for x in s.rng.choice(s.n, size=min(s.n, 16), replace=False).tolist():
                if not s.time_left():
                    break
                s.eject(x)
        cost = s.cost_of(s.choice)
        if s.feasible_mem() and cost <= cur:
            return cost
        s.restore(snap)
        return None


# --------------------------------------------------------------------------- public API
def greedy_assignment(core: CoreProblem, *, seed: int = 0) -> np.ndarray:
    """The cost-greedy start (memory ignored): BFS order, cheapest given fixed neighbours.

    Forbidden pairs with already fixed neighbours are avoided whenever some strategy can.
    """
    s = _Search(core, seed, _INF, track_memory=False)
    return s.greedy(memory=False)


def exact_peak(core: CoreProblem, choice: np.ndarray) -> float:
    """Peak usage of a core assignment by an event sweep (independent of the search state)."""
    tv = np.asarray(core.term_var, dtype=np.int64)
    sizes = np.array([len(u) for u in core.term_usages], dtype=np.int64)
    off = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    flat = np.concatenate(core.term_usages) if len(sizes) else np.zeros(0)
    use = flat[off[:-1] + np.asarray(choice, dtype=np.int64)[tv]] if len(tv) else np.zeros(0)
    iv = np.concatenate(
        [np.reshape(core.term_intervals, (-1, 2)), np.reshape(core.const_intervals, (-1, 2))]
    )
    val = np.concatenate([use, np.asarray(core.const_usages, dtype=np.float64)])
    live = iv[:, 0] < iv[:, 1]
    if not live.any():
        return 0.0
    times = np.concatenate([iv[live, 0], iv[live, 1]])
    deltas = np.concatenate([val[live], -val[live]])
    order = np.argsort(times, kind="stable")
    _, first = np.unique(times[order], return_index=True)
    # Usage from a distinct time to the next is the sum of all deltas at times up to it.
    return float(np.cumsum(np.add.reduceat(deltas[order], first)).max())


def _result(s: _Search, choice: np.ndarray, t0: float) -> HeuristicResult:
    """Evaluate ``choice`` from scratch (no incremental drift) and package it."""
    choice = np.asarray(choice, dtype=np.int64).copy()
    cost = s.cost_of(choice)
    peak = exact_peak(s.core, choice)
    limit = s.core.usage_limit
    feasible = math.isfinite(cost) and (limit is None or peak <= s.tlimit)
    if not feasible:
        cost = _INF
    return HeuristicResult(
        choice=choice,
        cost=cost,
        peak_usage=peak,
        feasible=feasible,
        seconds=time.perf_counter() - t0,
        iterations=s.iterations,
    )


def local_search(
    core: CoreProblem,
    *,
    time_limit: float = 10.0,
    seed: int = 0,
    initial: np.ndarray | None = None,
) -> HeuristicResult:
    """Find a cheap assignment of ``core`` within its memory limit, in ``time_limit`` seconds.

    ``initial`` (one strategy per core variable, e.g. a previous plan) is repaired and used
    as an extra start. The result is the best feasible assignment found; if none was found,
    ``feasible`` is False, ``cost`` is inf and ``choice`` is the least-peak assignment found
    (so a caller can still report how far over the limit the problem is).

    The search has no optimality proof, so it uses the whole ``time_limit`` (it returns
    early only when even the least usage of every term breaks the limit). Results depend
    on ``seed`` and, through the clock, slightly on machine speed.
    """
    t0 = time.perf_counter()
    deadline = t0 + max(float(time_limit), 0.0)
    s = _Search(core, seed, deadline)
    if initial is not None:
        initial = check_choice("initial", initial, s.k, owner="core variable")
    if s.n == 0:
        return _result(s, np.zeros(0, dtype=np.int64), t0)
    if s.nseg and float(s.base.max()) > s.tlimit:
        # Even the least usage of every term is over the limit somewhere: nothing fits.
        s.deadline = min(deadline, time.perf_counter() + 1.0)
        return _result(s, _min_peak(s), t0)
    d = _Driver(s)
    d.start(initial)
    s.trws_setup()
    if s.limit is not None and s.nseg:
        s.price_setup()
    d.run()
    if d.best_choice is None:
        # Nothing fits: report the least-peak assignment (with a short extra search).
        s.deadline = time.perf_counter() + min(1.0, max(float(time_limit), 0.0) * 0.1)
        return _result(s, _min_peak(s), t0)
    return _result(s, d.best_choice, t0)


def _min_peak(s: _Search, max_stale: int = 8) -> np.ndarray:
    """Least-peak assignment found by peak descent from greedy starts and random restarts.

    Descent moves a variable live at the peak segment to a strategy that lowers it, never
    raising any other segment to the peak, and never enters a forbidden pair (once out of
    them); cost is ignored. The peak of the starting point never increases. Restarts
    perturb the best assignment until the time is up, ``max_stale`` restarts bring no gain,
    or the peak meets its lower bound (every term at its least usage).
    """
    saved = s.tlimit
    bound = float(s.base.max()) if s.nseg else 0.0
    best: np.ndarray | None = None
    best_key = (True, _INF)  # (uses a forbidden pair, peak): conflict-free wins first

    def run(start: np.ndarray) -> None:
        nonlocal best, best_key
        s.reset(start)
        s.tlimit = _INF
        s.fix_conflicts()
        s.tlimit = 0.0  # every segment counts as "over": push the peak down as far as it goes
        s.repair_peak(ignore_cost=True)
        key = (not math.isfinite(s.cost_of(s.choice)), s.peak())
        if (
            best is None
            or key[0] < best_key[0]
            or (key[0] == best_key[0] and key[1] < best_key[1] * (1 - 1e-12))
        ):
            best, best_key = s.choice.copy(), key

    def at_bound() -> bool:
        return not best_key[0] and best_key[1] <= bound * (1 + 1e-12) + 1e-9

    run(s.min_usage_choice())
    greedy = s.greedy(memory=False)
    s.reset(greedy)
    if (not math.isfinite(s.cost_of(greedy)), s.peak()) < best_key:
        # The promise is a peak no higher than the cost-greedy start's; descend from it too.
        run(greedy)
    stale = 0
    while s.time_left() and stale < max_stale and not at_bound():
        assert best is not None
        start = best.copy()
        kick = s.rng.choice(s.n, size=max(1, min(s.n // 10, 50)), replace=False)
        start[kick] = s.rng.integers(0, s.k[kick])
        before = best_key
        run(start)
        stale = stale + 1 if best_key >= before else 0
    assert best is not None
    # One cheap descent pass on cost, never raising the peak that was reached.
    s.reset(best)
    s.tlimit = max(best_key[1], 0.0) * (1 + 1e-12) + 1e-9
    if not best_key[0]:
        s.descend(sweeps=False)
    s.tlimit = saved
    return s.choice.copy()


def min_peak_assignment(
    core: CoreProblem, *, time_limit: float = 10.0, seed: int = 0
) -> HeuristicResult:
    """Heuristically minimise the peak memory, ignoring cost except forbidden pairs.

    Used to tell a user how far over the limit the best assignment we can find is when no
    assignment fits. The peak never exceeds that of :func:`greedy_assignment` when the
    latter avoids forbidden pairs. ``cost`` is the assignment's true cost when it fits the
    limit and has no forbidden pair, else inf; among assignments of equal peak the descent
    also lowers cost.
    """
    t0 = time.perf_counter()
    s = _Search(core, seed, t0 + max(float(time_limit), 0.0), track_memory=True)
    if s.n == 0:
        return _result(s, np.zeros(0, dtype=np.int64), t0)
    return _result(s, _min_peak(s), t0)
