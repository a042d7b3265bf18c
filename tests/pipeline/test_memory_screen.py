"""The memory screen (``pipeline.memory_screen``): a micro-batch count that no plan fits is
found before any layer ILP is solved, and a count some plan fits is never screened out."""

from __future__ import annotations

import numpy as np
import pytest

import alpa_mini
from alpa_mini import ClusterSpec, MemoryBudgetError, PipeshardParallel
from alpa_mini.models import make_train_step, sgd
from alpa_mini.pipeline import stage_cost
from alpa_mini.pipeline.compose import _composed_row, _LayerTable
from alpa_mini.pipeline.memory_screen import _even_slicing_fits, _floor_cells
from alpa_mini.pipeline.stage_cost import StageCost
from alpa_mini.pipeline.stage_search import LEAST_MEMORY, _fill_cells
from helpers.mlp import marked_mlp_args, marked_mlp_loss


def _tables(rng, L: int, exact: bool):
    """Per-layer floors (held, residual, state) and a layer table of plans that respect
    them: parameters at least evenly split, any peak, even one below the parameters and
    gradients it holds (``exact``: every layer at its floor, and a peak of 0)."""
    p, r, state = rng.uniform(1, 10, L), rng.uniform(1, 10, L), rng.uniform(0, 3, L)
    floors = np.stack([2 * p + r, r, state], axis=1)
    params = p if exact else p * rng.uniform(1, 2, L)
    peak = np.zeros(L) if exact else (2 * params + r) * rng.uniform(0, 1.5, L)
    costs = [
        StageCost(1.0, peak[k], r[k], state[k], held_bytes=2 * params[k] + r[k]) for k in range(L)
    ]
    return floors, _LayerTable(costs, [[] for _ in range(L)])


@pytest.mark.parametrize("exact", [False, True])
def test_the_floor_admits_every_composed_stage_that_fits_and_equals_it_at_the_floor(exact):
    rng = np.random.default_rng(7)
    for trial in range(200):
        L = int(rng.integers(1, 9))
        floors, table = _tables(rng, L, exact)
        budget = float(rng.uniform(10, 120))
        real_cost, real_succ = np.full((L, L), np.inf), np.zeros((L, L), dtype=np.int64)
        items = [
            ((i, j, 0, 0), sc)
            for i in range(L)
            for j, sc in enumerate(_composed_row(table, i), start=i)
        ]
        _fill_cells(real_cost[:, :, None, None], real_succ[:, :, None, None], items, budget)
        fits_floor, succ = _floor_cells(floors, budget)
        cost = np.where(fits_floor, 0.0, np.inf)
        fits = np.isfinite(real_cost)
        assert np.all(np.isfinite(cost[fits])), trial  # never screens out a stage that fits
        assert np.all(succ[fits] >= real_succ[fits]), trial
        if exact:  # at the floor, the floor is the composition itself
            assert np.array_equal(np.isfinite(cost), fits), trial
            assert np.array_equal(succ[fits], real_succ[fits]), trial


def _marked_mlp(budget: float, count: int):
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-2x4"))
    params, data = marked_mlp_args(4, 32, 64)
    opt = sgd(0.1)
    step = make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(count, memory_budget=budget)
    return alpa_mini.plan(step, params, opt.init(params), data, method=method)


def test_a_count_no_plan_fits_is_refused_before_any_layer_ilp(monkeypatch, devices8):
    solved = []
    real = stage_cost.plan_sharding

    def counted(*args, **kwargs):
        solved.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(stage_cost, "plan_sharding", counted)
    token = LEAST_MEMORY.set(False)  # as the micro-batch search asks for each count
    try:
        with pytest.raises(MemoryBudgetError, match="split evenly over its stage's devices"):
            _marked_mlp(1024.0, 4)
    finally:
        LEAST_MEMORY.reset(token)
    assert not solved
    # The least memory the full search finds fits, and the screen lets it through.
    with pytest.raises(MemoryBudgetError) as err:
        _marked_mlp(1024.0, 4)
    need = err.value.min_budget
    assert need is not None and need > 1024.0
    assert _marked_mlp(need * 1.0001, 4).num_micro_batches == 4
    assert solved


def test_an_even_slicing_is_found_exactly_when_one_fits():
    """``_even_slicing_fits`` against every way to cut L layers into S stages."""
    import itertools

    rng = np.random.default_rng(3)
    for trial in range(300):
        L = int(rng.integers(1, 7))
        S = int(rng.integers(1, L + 2))
        fits = np.triu(rng.random((L, L)) < 0.7)
        succ = np.where(fits, rng.integers(0, L, (L, L)), 0)
        want = any(
            all(
                fits[i, j - 1] and succ[i, j - 1] >= S - 1 - s
                for s, (i, j) in enumerate(zip((0, *cuts), (*cuts, L), strict=True))
            )
            for cuts in itertools.combinations(range(1, L), S - 1)
        )
        assert _even_slicing_fits(fits, succ, S) == want, trial
