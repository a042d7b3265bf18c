"""Stage costs composed from per-layer ILPs (individual profiling): running sums of layer
latencies and the resharding between layers inside a range, with a memory bound; and the
configs worth re-planning whole.
"""

from __future__ import annotations

import dataclasses
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..shard.spec import ShardingSpec
from .stage_cost import StageCost, plan_held_bytes
from .stage_slice import is_float


@dataclass
class _LayerTable:
    """Per-layer ILP results on one (submesh, logical mesh), and the resharding time between
    the layout a layer hands a value on in and the layout a later layer reads it in."""

    costs: list[StageCost | None]
    reshard_into: list[list[tuple[int, float]]]  # layer b -> [(producer layer a, seconds)]
    held: list[float] = dataclasses.field(default_factory=list)  # ``_held_bytes`` per layer
    # (a, b, table): the same table with layer a or b re-planned to read the parameters the
    # two share in the other's layouts, for ranges holding both where that beats resharding.
    aligned: list[tuple[int, int, _LayerTable]] = dataclasses.field(default_factory=list)
    pinned: set[tuple[int, int, int]] = dataclasses.field(default_factory=set)  # (a, b, layer)
    # (a, b, table): lower bounds of the aligned compositions of pairs not aligned yet
    # (``bound_alignments``), so that the stage DP ranks ranges holding both readers as
    # aligning them could; a range the DP picks from one is aligned and re-composed.
    optimistic: list[tuple[int, int, _LayerTable]] = dataclasses.field(default_factory=list)
    lower_bound: bool = False  # an optimistic table: its rows are bounds, not compositions

    def __post_init__(self) -> None:
        if not self.held:  # every composed row reads each layer's: worked out once
            self.held = [0.0 if c is None else _held_bytes(c) for c in self.costs]


def _layer_table(model, starts, ends, sub, logical, layout: str = "auto") -> _LayerTable:
    costs = [model.cost(starts[k], ends[k], sub, logical, layout) for k in range(len(starts))]
    return _table_of(model, starts, ends, sub, logical, costs)


def align_shared(model, table: _LayerTable, starts, ends, sub, config, i: int, j: int) -> None:
    """Add to ``table`` the aligned tables of the layers ``i..j`` that share parameters: each
    reader re-planned to read them as the other does (two layer ILPs per pair, solved at
    once), which a stage holding both may take instead of resharding them. Done for the
    chosen stages only: the stage DP ranked slicings with the resharding priced."""
    logical, layout = config
    todo = [
        (a, b, k, pins)
        for a, b, k, pins in shared_pins(model, starts, ends, table.costs)
        if i <= a and b <= j and (a, b, k) not in table.pinned
    ]
    if not todo:
        return
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        found = list(
            pool.map(
                lambda t: model.cost_pinned(starts[t[2]], ends[t[2]], sub, logical, layout, t[3]),
                todo,
            )
        )
    for (a, b, k, _), pinned in zip(todo, found, strict=True):
        table.pinned.add((a, b, k))
        if pinned is not None:
            other = [pinned if n == k else c for n, c in enumerate(table.costs)]
            table.aligned.append((a, b, _table_of(model, starts, ends, sub, logical, other)))


def bound_alignments(model, table: _LayerTable, starts, ends, sub, config) -> None:
    """Give ``table`` lower bounds of the aligned compositions ``align_shared`` would make for
    each pair of readers of a shared parameter not aligned yet: per reader it would re-plan,
    that reader freed. Its ILP only gains a constraint, so its objective is at least the free
    one's (a gradient sync priced outside the ILP, ``gradient_sync="after"``, is left out;
    its kernels' launches stay the same); what it hands to or takes from its neighbours
    costs at least nothing to reshard, less the most host load it could have been charged
    (``_table_of``'s ``free``); and it holds at least its memory floor. The other reader and
    every other layer keep their plans."""
    logical, layout = config
    aligned = {(a, b) for a, b, _ in table.pinned}
    for a, b, x, _ in shared_pins(model, starts, ends, table.costs):
        if (a, b) in aligned:
            continue
        c = table.costs[x]
        held = model.memory_floor(starts[x], ends[x], sub, logical, layout)[0]
        if c.plan is None:
            ilp = 0.0
        elif model.ties_gradients:  # the sync is in the ILP's objective
            ilp = c.latency
        else:
            ilp = c.plan.predicted_time
        costs = list(table.costs)
        costs[x] = dataclasses.replace(
            c, latency=ilp, peak_memory=0.0, plan=None, bound=True, held_bytes=held
        )
        lb = _table_of(model, starts, ends, sub, logical, costs, free=frozenset((x,)))
        table.optimistic.append((a, b, dataclasses.replace(lb, lower_bound=True)))


def shared_pins(model, starts, ends, costs) -> list[tuple[int, int, int, dict[int, Any]]]:
    """Parameters read by several layers (a tied embedding): per first and next reader
    (a, b), each of the two re-planned to read them in the other's layouts, as (a, b, the
    layer re-planned, {position among its ILP inputs: layout})."""
    readers: dict[Any, list[tuple[int, int]]] = {}
    for b, cb in enumerate(costs):
        for k, v in enumerate(model.slice(starts[b], ends[b]).invars):
            if cb is not None and not cb.bound and model.role(v) == "param":
                readers.setdefault(v, []).append((b, k))
    pins: dict[tuple[int, int, int], dict[int, Any]] = {}
    for v, found in readers.items():
        if len(found) < 2:
            continue
        for (x, _), (y, ky) in (found[:2], found[1::-1]):  # x re-planned to read v as y does
            spec, inputs = costs[y].in_specs[ky], model.ilp_inputs(starts[x], ends[x])
            if spec is not None and (v, False) in inputs:
                a, b = sorted((x, y))
                pins.setdefault((a, b, x), {})[inputs.index((v, False))] = spec
    return [(a, b, x, p) for (a, b, x), p in pins.items()]


def _table_of(
    model, starts, ends, sub, logical, costs: list[StageCost | None], free=frozenset()
) -> _LayerTable:
    """The layer table of these per-layer costs: what values handed between layers cost.
    Layers in ``free`` may still change layouts: what they hand or take is priced at its
    least (no resharding, the largest host-load credit), for ``bound_alignments``."""
    L = len(starts)
    cm = model.cost_model(sub, logical)
    producer: dict[Any, tuple[int, int]] = {}
    for a in range(L):
        for o, v in enumerate(model.slice(starts[a], ends[a]).outvars):
            producer[v] = (a, o)
    into: list[list[tuple[int, float]]] = [[] for _ in range(L)]
    load = 1.0 / cm.cluster.intra_host.bandwidth
    # Per layer, where each input (value, is its cotangent) sits among its ILP's inputs.
    ilp_in = [
        {key: n for n, key in enumerate(model.ilp_inputs(starts[k], ends[k]))} for k in range(L)
    ]
    credited: set[Any] = set()  # values whose cotangent's load is already credited
    for b in range(L):
        cb = costs[b]
        if cb is None:
            continue
        for k, v in enumerate(model.slice(starts[b], ends[b]).invars):
            a, o = producer.get(v, (None, 0))
            ca = None if a is None else costs[a]
            if ca is None:
                continue
            # Handed over inside a stage, v (and its cotangent, back) never crosses from the
            # host, though each layer's ILP priced it so (shard.problem._input_strategies).
            t = -_host_load(cb, ilp_in[b].get((v, False)), v, load, b in free)
            if (v, True) in ilp_in[a] and v not in credited:
                credited.add(v)
                t -= _host_load(ca, ilp_in[a][(v, True)], v, load, a in free)
            # (A freed layer may take or hand it in any layout: no resharding.)
            fixed = a not in free and b not in free
            if fixed and ca.out_specs[o] is not None and cb.in_specs[k] is not None:
                src, dst = ca.out_specs[o], cb.in_specs[k]
                shape, size = tuple(v.aval.shape), v.aval.dtype.itemsize
                t += cm.reshard(shape, size, src, dst)
                if is_float(v.aval):  # its cotangent travels back the other way
                    t += cm.reshard(shape, size, dst, src)
            if t != 0:
                into[b].append((a, t))
    _shared_params(model, starts, ends, costs, cm, into, free)
    return _LayerTable(costs, into)


def _shared_params(
    model, starts, ends, costs, cm, into: list[list[tuple[int, float]]], free=frozenset()
) -> None:
    """A parameter read by several layers (a tied embedding) enters a stage once, in one
    layout: each layer after the first that reads it inside the range takes it from the
    previous reader's layout, and hands its gradient contribution back to be added there
    (priced at nothing where either reader is ``free``)."""
    last: dict[Any, tuple[int, ShardingSpec]] = {}
    for b in range(len(starts)):
        cb = costs[b]
        if cb is None:
            continue
        for k, v in enumerate(model.slice(starts[b], ends[b]).invars):
            if model.role(v) != "param" or cb.in_specs[k] is None:
                continue
            prev, last[v] = last.get(v), (b, cb.in_specs[k])
            if prev is None:
                continue
            a, src = prev
            if a in free or b in free:
                continue
            dst = cb.in_specs[k]
            shape, size = tuple(v.aval.shape), v.aval.dtype.itemsize
            n = math.prod(shape)
            add = cm.compute(n, 3 * n * size, str(v.aval.dtype), src.num_shards(cm.mesh.shape))
            there_and_back = cm.reshard(shape, size, src, dst) + cm.reshard(shape, size, dst, src)
            into[b].append((a, there_and_back + add))


def _host_load(cost: StageCost, k: int | None, v: Any, load: float, most: bool = False) -> float:
    """Seconds a layer ILP charged its input ``k`` (the value ``v``, or its cotangent) for
    arriving from the host: its bytes per device at ``load`` s/byte. An LP bound's cell
    charged none (its bound leaves such inputs' load out: ``StageCost.bound``). ``most``: the
    most any layout could be charged (``v`` unsharded)."""
    if k is None:
        return 0.0
    if most:
        return math.prod(v.aval.shape) * v.aval.dtype.itemsize * load
    if cost.plan is None:
        return 0.0
    spec = cost.plan.tensors[cost.plan.inputs[k]].spec
    shards = 1 if spec is None else spec.num_shards(cost.plan.mesh_shape)
    return math.prod(v.aval.shape) * v.aval.dtype.itemsize / shards * load


def _composed_row(table: _LayerTable, i: int) -> list[StageCost | None]:
    """``_row`` of the table, each range that holds an aligned pair (a, b) taken from that
    pair's aligned table where it is faster."""
    return _best_row(table, i)[0]


def _best_row(table: _LayerTable, i: int) -> tuple[list[StageCost | None], list[_LayerTable]]:
    """``_composed_row`` and, per range, the table its composition comes from (an
    optimistic one's rows are bounds: ``needs_alignment``). A pair not aligned yet offers
    the least latency and the least memory of its bounds, which is below whichever aligned
    composition ``align_shared`` then keeps."""
    row, source = _row(table, i), [table] * (len(table.costs) - i)
    aligned = {(a, b) for a, b, _ in table.pinned}
    bounds: dict[tuple[int, int], list[_LayerTable]] = {}
    for a, b, lb in table.optimistic:
        if (a, b) not in aligned and a >= i:
            bounds.setdefault((a, b), []).append(lb)
    offers = [(a, b, other, _row(other, i)) for a, b, other in table.aligned if a >= i]
    for (a, b), lbs in bounds.items():
        least = [_least(cells) for cells in zip(*(_row(lb, i) for lb in lbs), strict=True)]
        offers.append((a, b, lbs[0], least))
    for _, b, other, offered in offers:
        for j, sc in enumerate(offered[b - i :], start=b - i):
            if sc is not None and (row[j] is None or sc.latency < row[j].latency):
                row[j], source[j] = sc, other
    return row, source


def _least(cells: tuple[StageCost | None, ...]) -> StageCost | None:
    """The least latency and the least peak memory of these bounds of one range."""
    if any(c is None for c in cells):
        return None
    fastest = min(cells, key=lambda c: c.latency)  # type: ignore[union-attr]
    return dataclasses.replace(fastest, peak_memory=min(c.peak_memory for c in cells))  # type: ignore[union-attr]


def needs_alignment(table: _LayerTable, i: int, j: int) -> bool:
    """Whether the cost of layers ``i..j`` in ``table`` is an aligned composition's lower
    bound (``bound_alignments``), which ``align_shared`` turns into the composition."""
    return _best_row(table, i)[1][j - i].lower_bound


def _row(table: _LayerTable, i: int) -> list[StageCost | None]:
    """Individual-mode costs of layers ``i..j`` for every ``j >= i``, by running sums:
    per-layer latencies plus the resharding between layers inside the range.

    Memory: while layer k runs inside the stage, every other layer j holds at most H_j (its
    parameters, their gradients and its residuals; ``_held_bytes``), and layer k itself at
    most its own peak. So the stage peaks at sum(H) + max_k(peak_k - H_k): the transients
    count once, not once per layer as a plain sum of per-layer peaks would. A layer whose
    cost is only a bound (``StageCost.bound``) makes the row a bound too: with lower bounds
    of H_k and peak_k, sum(H) + peak_k - H_k = peak_k + (the others' H) is still one."""
    out: list[StageCost | None] = []
    lat = held = res = state = 0.0
    transient = -math.inf
    bound = False
    for j in range(i, len(table.costs)):
        p = table.costs[j]
        if p is None:
            out.extend([None] * (len(table.costs) - j))
            break
        lat += p.latency + sum(t for a, t in table.reshard_into[j] if a >= i)
        h = table.held[j]
        held, transient = held + h, max(transient, p.peak_memory - h)
        res, state = res + p.residual_bytes, state + p.state_bytes
        bound = bound or p.bound
        # The credits for values handed between layers take back what the layers' own
        # latencies charged, so only round-off can take the sum below 0.
        out.append(StageCost(max(lat, 0.0), held + transient, res, state, bound=bound))
    return out


def _held_bytes(sc: StageCost) -> float:
    """Bytes per device one layer holds while the other layers of its stage run: its
    parameters and their gradients in the layouts its ILP chose, and its residuals. Without
    its plan, its whole peak (the plain sum, as before), or a bound's own lower bound."""
    if sc.held_bytes is not None:
        return sc.held_bytes
    if sc.plan is None:
        return sc.peak_memory
    return plan_held_bytes(sc.plan, sc.residual_bytes)


def _refine_configs(model, tables, starts, ends, stage, configs, within: float | None):
    """The configs of a chosen stage's submesh that ``refine`` re-plans whole: all of them,
    or (``within``) those whose composed estimate is within that fraction of the chosen
    config's, the chosen one first."""
    cfgs = configs[stage.submesh_index]
    if within is None:
        return list(cfgs)
    i, j = stage.layer_start, stage.layer_end

    def estimate(ci: int) -> float:
        table = tables.get((stage.submesh_index, ci))
        est = None if table is None else _composed_stage(model, table, starts, ends, i, j)
        return math.inf if est is None else est.latency

    limit = estimate(stage.config_index) * (1.0 + within)
    others = [c for ci, c in enumerate(cfgs) if ci != stage.config_index and estimate(ci) <= limit]
    return [cfgs[stage.config_index], *others]


def _composed_stage(model, table: _LayerTable, starts, ends, i: int, j: int) -> StageCost | None:
    """The composed cost of layers ``i..j`` plus the layouts at the stage's edges: each value
    the stage reads takes the layout of the first layer that reads it; each value it hands on,
    its producer's."""
    row, source = _best_row(table, i)
    sc, table = row[j - i], source[j - i]
    if sc is None:
        return None
    stage = model.slice(starts[i], ends[j])
    read_as: dict[Any, ShardingSpec | None] = {}
    made_as: dict[Any, ShardingSpec | None] = {}
    read_later: set[Any] = set()
    for k in range(i, j + 1):
        sl, layer = model.slice(starts[k], ends[k]), table.costs[k]
        for v, spec in zip(sl.invars, layer.in_specs, strict=True):
            read_as.setdefault(v, spec)
            if k > i:
                read_later.add(v)
        made_as.update(zip(sl.outvars, layer.out_specs, strict=True))
    # Values handed from one layer to a later one inside the stage keep their producer's
    # layout, as the composed cost assumed (the consumer's reshard is priced from it).
    site = model.result_sites()
    inner = tuple(
        sorted(
            (*site[v], spec)
            for v, spec in made_as.items()
            if spec is not None and v in read_later and v in site
        )
    )
    return dataclasses.replace(
        sc,
        in_specs=tuple(read_as.get(v) for v in stage.invars),
        out_specs=tuple(made_as.get(v) for v in stage.outvars),
        inner_specs=inner,
    )
