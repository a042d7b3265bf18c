"""The activations handed between pipeline stages, which the stage DP's objective leaves out.

The DP prices a slicing as sum(t) + (B - 1) max(t) over the stages' latencies. Under 1F1B a
stage's backward of a micro-batch waits for the round trip through every later stage, so
each boundary's transfer (forward activations, then their cotangents back) lengthens that
loop; it costs time where the stages around it have no slack to hide it. So the planner
weighs a few slicings by the pipeline simulator (``simulate``), transfers included: the
DP's, and the DP's with each stage charged a hop per edge it hands values across
(``transfer_charges``, once per guess of the links they cross), which is about right for
balanced stages and too dear where they have slack.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.extend.core import Jaxpr, Literal

from ..cluster.spec import ClusterSpec, Link
from ..solvers.stages import StageProblem, StageSolution, stage_objective
from .placement import assign_devices
from .schedules import make_schedule
from .simulate import chain_timings, simulate

__all__ = ["CutBytes", "simulated_seconds", "transfer_charges", "uncharged"]


@dataclass(frozen=True, eq=False)
class CutBytes:
    """Each value an equation of the flat forward defines: where (``define``), the last
    equation that reads it (``last_read``; ``num_equations`` for a loss output, -1 for
    none) and its bytes per micro-batch."""

    define: np.ndarray
    last_read: np.ndarray
    nbytes: np.ndarray
    num_equations: int

    @classmethod
    def of(cls, jaxpr: Jaxpr) -> CutBytes:
        """The values of ``jaxpr``'s equations (dropped outputs left out)."""
        n = len(jaxpr.eqns)
        index: dict[object, int] = {}
        define, nbytes = [], []
        for e, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                if type(v).__name__ == "DropVar":
                    continue
                index[v] = len(define)
                define.append(e)
                aval = v.aval
                nbytes.append(float(math.prod(aval.shape) * aval.dtype.itemsize))
        last = np.full(len(define), -1, dtype=np.int64)
        for e, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if not isinstance(v, Literal) and (k := index.get(v)) is not None:
                    last[k] = e
        for v in jaxpr.outvars:
            if not isinstance(v, Literal) and (k := index.get(v)) is not None:
                last[k] = n
        return cls(np.asarray(define, dtype=np.int64), last, np.asarray(nbytes), n)

    def crossing(self, eqns: Sequence[int]) -> np.ndarray:
        """Bytes of the values defined before each equation index of ``eqns`` and read at or
        after it: what a stage starting there receives from all earlier ones."""
        delta = np.zeros(self.num_equations + 2)
        np.add.at(delta, self.define + 1, self.nbytes)
        np.add.at(delta, np.maximum(self.last_read, self.define) + 1, -self.nbytes)
        return np.cumsum(delta)[np.asarray(eqns, dtype=np.int64)]

    def sent(self, start: int, end: int) -> float:
        """Bytes a stage of equations ``[start, end)`` sends on: the values it defines that a
        later equation or the loss reads (none from the last stage), as ``slice_stage``."""
        if end >= self.num_equations:
            return 0.0
        keep = (self.define >= start) & (self.define < end) & (self.last_read >= end)
        return float(self.nbytes[keep].sum())


def transfer_charges(
    cut: CutBytes,
    starts: Sequence[int],
    ends: Sequence[int],
    problem: StageProblem,
    cluster: ClusterSpec,
) -> list[np.ndarray]:
    """Seconds to add to each (first layer, last layer, submesh) cell of the DP's table: each
    boundary's round trip (its values forward, their cotangents back) split between the two
    stages beside it, one hop each. Under 1F1B the round trips lengthen the loop every
    micro-batch makes through the stages, so where the stages are balanced the iteration
    grows by about a hop per boundary per micro-batch on each stage; the split keeps the sum
    right and favours neither end. Which links a boundary crosses depends on the whole
    slicing (``assign_devices``), so two guesses, a charge each: the inter-host links beside
    a submesh of whole hosts and the intra-host one beside a smaller submesh; and the
    inter-host links everywhere (on a cluster of several hosts). Either way a submesh of h
    hosts is guessed to send and receive over h links at once, as beside a neighbour of its
    own size. The simulator that weighs the slicings they give knows which was right."""
    into = cut.crossing(starts)
    into[0] = 0.0
    out = cut.crossing(ends)
    out[-1] = 0.0  # (the loss outputs stay on the last stage)

    def hop(link: Link, nbytes: np.ndarray, lanes: int) -> np.ndarray:
        return np.where(nbytes > 0, link.alpha + nbytes / lanes * link.beta, 0.0)

    def hops(link: Link, lanes: int = 1) -> np.ndarray:
        """One hop in and one hop out of each (first, last layer) range, the bytes split
        over ``lanes`` hosts sending at once (the simulator's model)."""
        return hop(link, into, lanes)[:, None] + hop(link, out, lanes)[None, :]

    intra = hops(cluster.intra_host)
    # the neighbour's host count is unknown here: guess this submesh's own
    inter = {h: hops(cluster.inter_host, h) for h in {h for h, _ in problem.submesh_shapes}}
    per = cluster.devices_per_host
    by_shape = np.stack(
        [inter[h] if h > 1 or d == per else intra for h, d in problem.submesh_shapes], axis=2
    )
    everywhere = np.stack([inter[h] for h, _ in problem.submesh_shapes], axis=2)
    if cluster.num_hosts > 1 and not np.array_equal(by_shape, everywhere):
        return [by_shape, everywhere]
    return [by_shape]


def uncharged(problem: StageProblem, solution: StageSolution) -> StageSolution:
    """``solution``'s slicing with its stages' latencies (and objective) read from
    ``problem``'s cells."""
    stages = tuple(
        dataclasses.replace(
            st,
            latency=float(
                problem.cost[st.layer_start, st.layer_end, st.submesh_index, st.config_index]
            ),
        )
        for st in solution.stages
    )
    lat = [st.latency for st in stages]
    return dataclasses.replace(
        solution,
        stages=stages,
        objective=stage_objective(lat, solution.num_micro_batches),
        sum_latency=sum(lat),
        max_latency=max(lat),
    )


def simulated_seconds(
    solution: StageSolution,
    cut: CutBytes,
    starts: Sequence[int],
    ends: Sequence[int],
    cluster: ClusterSpec,
    schedule: str,
) -> float:
    """The simulated iteration time of ``solution``'s slicing under ``schedule``, its stages
    placed as the planner places them (``assign_devices``), transfers included."""
    subs = [st.submesh_shape for st in solution.stages]
    per = cluster.devices_per_host
    hosts = [frozenset(d // per for d in devs) for devs in assign_devices(subs, cluster)]
    timings = chain_timings(
        [st.latency for st in solution.stages],
        [cut.sent(starts[st.layer_start], ends[st.layer_end]) for st in solution.stages],
        hosts,
        cluster,
    )
    plan = make_schedule(schedule, len(subs), solution.num_micro_batches)
    return simulate(timings, plan).iteration_time
