"""The sharding ILP as numpy arrays, ready for any MIP backend.

Formulation over a simplified ``CoreProblem`` (see ``simplify``):

* s[x, i] binary, one-hot per variable: the strategy of x.
* e[ab, i, j] in [0, 1] for every *finite* entry of edge (a, b)'s matrix (strategies with
  equal rows or columns there merged into one class, see ``_edge_rows``), tied to the node
  choices by marginals: Σ_j e[i, j] = s[a, i] for every i and Σ_i e[i, j] = s[b, j] for
  every j but the last (it is implied by the one-hot rows). With s integral these force
  e = s_a s_bᵀ exactly, so e may stay continuous; forbidden pairs simply have no e, which
  forbids them. This is the tight (marginal) linearisation, not the weak e >= s_a + s_b - 1.
* Memory, telescoped: on the sorted grid of term start/end times, a continuous m[k] equals
  m[k-1] + (usage of terms starting at grid point k) - (usage of terms ending there), and
  m[k] <= limit - (largest constant usage while the segment lasts). Each term appears in two
  rows, so the model is linear in the input size; the usual row-per-time-point form has
  O(time x live nodes) nonzeros and did not even build for the contest's instance M.

Costs are scaled so the largest coefficient is about 1e6 and usages are divided by the
limit, which keeps HiGHS's tolerances meaningful for costs up to 1e13.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InfeasibleError
from .problem import interval_peak
from .simplify import CoreProblem

__all__ = ["MipModel", "build_mip"]

COST_TARGET = 1e6


@dataclass(frozen=True, eq=False)
class MipModel:
    """min c·x subject to row_lower <= A x <= row_upper, col bounds, some columns binary.

    ``A`` is stored row-wise (CSR: ``start``, ``index``, ``value``). ``cost_scale`` maps the
    objective back: original cost = cost_scale * (c·x) + ``offset``.
    """

    c: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    integer: np.ndarray
    start: np.ndarray
    index: np.ndarray
    value: np.ndarray
    row_lower: np.ndarray
    row_upper: np.ndarray
    cost_scale: float
    offset: float
    s_offsets: np.ndarray  # s[x, i] is column s_offsets[x] + i
    # Per edge: (first column, row class, column class of each pair column, then each
    # strategy's row class and column class); see ``_edge_rows``.
    edge_cols: tuple[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]
    mem_first_col: int
    mem_usage_scale: float
    mem_const: np.ndarray  # largest constant usage per memory segment, scaled like usages
    peak_col: int  # -1 unless the objective is the peak usage

    @property
    def num_cols(self) -> int:
        return len(self.c)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    @property
    def num_nonzeros(self) -> int:
        return len(self.value)

    def size(self) -> dict[str, int]:
        return {
            "columns": self.num_cols,
            "binaries": int(self.integer.sum()),
            "rows": self.num_rows,
            "nonzeros": self.num_nonzeros,
        }

    def strategies_from(self, x_values: np.ndarray) -> np.ndarray:
        """One strategy per core variable from a (possibly fractional) column vector."""
        offs = self.s_offsets
        return np.array(
            [int(np.argmax(x_values[offs[v] : offs[v + 1]])) for v in range(len(offs) - 1)],
            dtype=np.int64,
        )

    def columns_from(self, core: CoreProblem, choice: np.ndarray) -> np.ndarray:
        """The full column vector of a core assignment (for warm starts)."""
        choice = np.asarray(choice, dtype=np.int64)
        x = np.zeros(self.num_cols)
        x[self.s_offsets[:-1] + choice] = 1.0
        for (first, ii, jj, rc, cc), (a, b) in zip(self.edge_cols, core.edges, strict=True):
            if not len(ii):
                continue
            hit = np.flatnonzero((ii == rc[choice[a]]) & (jj == cc[choice[b]]))
            if hit.size:
                x[first + hit[0]] = 1.0
        if self.mem_first_col >= 0:
            grid, deltas = _term_deltas(core, choice)
            levels = np.cumsum(deltas) / self.mem_usage_scale
            x[self.mem_first_col : self.mem_first_col + len(grid)] = levels
        if self.peak_col >= 0:
            levels = x[self.mem_first_col : self.mem_first_col + len(self.mem_const)]
            x[self.peak_col] = max(
                float(np.max(levels + self.mem_const, initial=0.0)), self.col_lower[self.peak_col]
            )
        return x


def _term_deltas(core: CoreProblem, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Grid of term start/end times and the change of term usage at each grid point."""
    grid = _grid(core)
    use = core.term_usage_of(choice)
    deltas = np.zeros(len(grid))
    np.add.at(deltas, np.searchsorted(grid, core.term_intervals[:, 0]), use)
    np.add.at(deltas, np.searchsorted(grid, core.term_intervals[:, 1]), -use)
    return grid, deltas


def _grid(core: CoreProblem) -> np.ndarray:
    iv = core.term_intervals
    return np.unique(iv.reshape(-1)) if len(iv) else np.zeros(0, dtype=np.int64)


def _segment_const_max(core: CoreProblem, grid: np.ndarray) -> np.ndarray:
    """Largest constant usage on each segment [grid[k], grid[k+1]) (the last is open-ended)."""
    ci, cu = core.const_intervals, core.const_usages
    live = ci[:, 0] < ci[:, 1] if len(ci) else np.zeros(0, dtype=bool)
    points = np.unique(np.concatenate([grid, ci[live].reshape(-1)]))
    delta = np.zeros(len(points) + 1)
    np.add.at(delta, np.searchsorted(points, ci[live, 0]), cu[live])
    np.add.at(delta, np.searchsorted(points, ci[live, 1]), -cu[live])
    level = np.cumsum(delta)[:-1]  # constant usage on [points[p], points[p+1])
    first = np.searchsorted(points, grid)
    return np.maximum.reduceat(level, first) if len(grid) else np.zeros(0)


def build_mip(core: CoreProblem, *, objective: str = "cost") -> MipModel:
    """Assemble the ILP of ``core``. ``objective="peak"`` minimises peak memory instead.

    The peak model keeps only the edges that forbid something (the rest cannot restrict a
    choice) and bounds every memory level by a free column P, which it minimises.
    """
    if objective not in ("cost", "peak"):
        raise ValueError(f"objective: {objective!r} is not 'cost' or 'peak'")
    peak_mode = objective == "peak"
    ks = np.array([len(c) for c in core.costs], dtype=np.int64)
    s_off = np.zeros(len(ks) + 1, dtype=np.int64)
    np.cumsum(ks, out=s_off[1:])
    n_s = int(s_off[-1])
    node_c = np.concatenate(core.costs) if len(ks) else np.zeros(0)
    col_upper_s = np.ones(n_s)
    forbidden = ~np.isfinite(node_c)
    col_upper_s[forbidden] = 0.0  # only reachable when simplification was switched off
    node_c = np.where(forbidden, 0.0, node_c)
    cost_scale = 1.0 if peak_mode else _cost_scale(core, node_c)

    m = _Rows(n_cols=n_s)
    m.cols_c.append(np.zeros(n_s) if peak_mode else node_c / cost_scale)
    # One-hot rows.
    m.add(
        [np.repeat(np.arange(len(ks)), ks)], [np.arange(n_s)], [np.ones(n_s)],
        np.ones(len(ks)), np.ones(len(ks)), len(ks),
    )  # fmt: skip
    edge_cols = _edge_rows(m, core, s_off, cost_scale, peak_mode)
    memory = _memory_rows(m, core, s_off, peak_mode)
    peak_col = _peak_rows(m, memory) if peak_mode else -1
    mem_first, usage_scale, const_part = memory

    col_lower = np.zeros(m.n_cols)
    col_upper = np.ones(m.n_cols)
    col_upper[:n_s] = col_upper_s
    integer = np.zeros(m.n_cols, dtype=bool)
    integer[:n_s] = True
    if mem_first >= 0:
        g = len(const_part)
        col_upper[mem_first : mem_first + g] = (
            np.inf if peak_mode else (core.usage_limit / usage_scale - const_part)
        )
    if peak_col >= 0:
        col_upper[peak_col] = np.inf
        const_peak, _ = interval_peak(
            core.const_intervals[:, 0], core.const_intervals[:, 1], core.const_usages
        )
        col_lower[peak_col] = const_peak / usage_scale
    start, index, value = m.csr()
    return MipModel(
        c=np.concatenate(m.cols_c),
        col_lower=col_lower,
        col_upper=col_upper,
        integer=integer,
        start=start,
        index=index,
        value=value,
        row_lower=np.concatenate(m.row_lo),
        row_upper=np.concatenate(m.row_hi),
        cost_scale=cost_scale,
        offset=0.0 if peak_mode else core.const_cost,
        s_offsets=s_off,
        edge_cols=tuple(edge_cols),
        mem_first_col=mem_first,
        mem_usage_scale=usage_scale,
        mem_const=const_part,
        peak_col=peak_col,
    )


def _cost_scale(core: CoreProblem, node_c: np.ndarray) -> float:
    """Divide costs by this so that the largest is about ``COST_TARGET``."""
    finite_edge_max = max(
        (float(m[np.isfinite(m)].max(initial=0.0)) for m in core.edge_costs), default=0.0
    )
    biggest = max(float(node_c.max(initial=0.0)), finite_edge_max)
    return biggest / COST_TARGET if biggest > COST_TARGET else 1.0


class _Rows:
    """The model under construction: column costs and the constraint matrix as COO pieces,
    appended in order (the order fixes the CSR layout the solver sees)."""

    def __init__(self, n_cols: int) -> None:
        self.cols_c: list[np.ndarray] = []
        self.rows_r: list[np.ndarray] = []
        self.rows_c: list[np.ndarray] = []
        self.rows_v: list[np.ndarray] = []
        self.row_lo: list[np.ndarray] = []
        self.row_hi: list[np.ndarray] = []
        self.n_rows = 0
        self.n_cols = n_cols

    def add(self, rows, cols, vals, lo: np.ndarray, hi: np.ndarray, count: int) -> None:
        """``count`` new rows with bounds ``lo``/``hi``; ``rows`` hold absolute row ids."""
        self.rows_r += rows
        self.rows_c += cols
        self.rows_v += vals
        self.row_lo.append(lo)
        self.row_hi.append(hi)
        self.n_rows += count

    def csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rr = np.concatenate(self.rows_r).astype(np.int64)
        cc = np.concatenate(self.rows_c).astype(np.int64)
        vv = np.concatenate(self.rows_v).astype(np.float64)
        return _to_csr(rr, cc, vv, self.n_rows)


def _edge_rows(
    m: _Rows, core: CoreProblem, s_off: np.ndarray, cost_scale: float, peak_mode: bool
) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """One column per allowed pair of every edge, tied to both endpoints' one-hot columns by
    the marginal rows (the tight linearisation); returns each edge's columns.

    Strategies whose rows (columns) of the edge's matrix are equal are one class: the pair
    columns are per (row class, column class), and a class's marginal row sums its
    strategies' one-hot columns. Every feasible point of the per-strategy form maps to one of
    equal cost here and back (split a class's share in proportion to its strategies'), so the
    relaxation is exactly as tight, with far fewer columns: many strategies of an operator
    differ only in what they reduce, not in the layouts an edge prices."""
    edge_cols = []
    for (a, b), mat in zip(core.edges, core.edge_costs, strict=True):
        fin = np.isfinite(mat)
        if peak_mode and fin.all():
            empty = np.zeros(0, np.int64)
            edge_cols.append((m.n_cols, empty, empty, empty, empty))
            continue
        small, row_class, col_class = _classes(mat)
        ii, jj = np.nonzero(np.isfinite(small))
        ne = len(ii)
        first = m.n_cols
        edge_cols.append((first, ii, jj, row_class, col_class))
        ecol = first + np.arange(ne)
        m.cols_c.append(np.zeros(ne) if peak_mode else small[ii, jj] / cost_scale)
        m.n_cols += ne
        ka, kb = small.shape
        n = m.n_rows
        keep = jj < kb - 1
        sb = np.flatnonzero(col_class < kb - 1)
        m.add(
            # Σ_c e[r, c] - Σ_{i in r} s[a, i] = 0 for every row class r; then
            # Σ_r e[r, c] - Σ_{j in c} s[b, j] = 0 for every column class c but the last.
            [n + ii, n + row_class, n + ka + jj[keep], n + ka + col_class[sb]],
            [ecol, s_off[a] + np.arange(len(row_class)), ecol[keep], s_off[b] + sb],
            [np.ones(ne), -np.ones(len(row_class)), np.ones(int(keep.sum())), -np.ones(len(sb))],
            np.zeros(ka + kb - 1),
            np.zeros(ka + kb - 1),
            ka + kb - 1,
        )
    return edge_cols


#: Merge an edge's equal rows and columns only when that leaves at most this share of its
#: pair columns: a mild merge saves little, and it changed the dual simplex's path enough to
#: cost more than it saved on a scanned GPT-2 1.3B layer (2.4 -> 2.7 s) while a 2.4x merge
#: of the tied unrolled model's MIP saved 6.7 -> 5.1 s.
MERGE_MAX_SHARE = 0.5


def _classes(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The edge matrix over classes of equal rows and columns, and each strategy's row and
    column class (identity classes when merging would not pay)."""
    rows, _, row_class = _unique_rows(mat)
    _, col_at, col_class = _unique_rows(rows.T)
    small = rows[:, col_at]
    if small.size > MERGE_MAX_SHARE * mat.size:
        return mat, np.arange(mat.shape[0]), np.arange(mat.shape[1])
    return small, row_class, col_class


def _unique_rows(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``np.unique(mat, axis=0, return_index=True, return_inverse=True)`` (rows sorted
    lexicographically, each class's first row), about 5x faster on the small matrices
    edges have: no structured-dtype sort."""
    n = mat.shape[0]
    order = np.lexsort(mat.T[::-1]) if mat.shape[1] else np.arange(n)
    s = mat[order]
    new = np.ones(n, dtype=bool)
    if n > 1:
        new[1:] = (s[1:] != s[:-1]).any(axis=1)
    inverse = np.empty(n, dtype=np.intp)
    inverse[order] = np.cumsum(new) - 1
    return s[new], order[new], inverse


def _memory_rows(
    m: _Rows, core: CoreProblem, s_off: np.ndarray, peak_mode: bool
) -> tuple[int, float, np.ndarray]:
    """The telescoping memory levels (one column per time point of the grid) and their rows;
    returns (first level column or -1, usage scale, the usage no choice can change)."""
    limit = core.usage_limit
    if limit is None or not len(core.term_var):
        return -1, 1.0, np.zeros(0)
    grid = _grid(core)
    const_max = _segment_const_max(core, grid)
    usage_scale = limit if limit > 0 else 1.0
    if peak_mode:
        biggest_use = max(
            [float(u.max()) for u in core.term_usages] + [float(core.const_usages.sum())] + [1.0]
        )
        usage_scale = max(usage_scale, biggest_use)
    else:
        worst = np.flatnonzero(const_max > limit * (1 + 1e-12))
        if worst.size:
            k = int(worst[0])
            raise InfeasibleError(
                f"usage_limit {limit:.6g} is below the usage that no choice can avoid "
                f"({const_max[k]:.6g} at time {int(grid[k])})",
                min_peak=float(const_max.max()),
                proven=True,
            )
    g = len(grid)
    mem_first = m.n_cols
    mcols = mem_first + np.arange(g)
    m.n_cols += g
    m.cols_c.append(np.zeros(g))
    # Row k: m[k] - m[k-1] - Σ_starting use·s + Σ_ending use·s = 0.
    r0 = m.n_rows
    rows, cols = [r0 + np.arange(g), r0 + np.arange(1, g)], [mcols, mcols[:-1]]
    vals = [np.ones(g), -np.ones(g - 1)]
    for var, (s, t), use in zip(core.term_var, core.term_intervals, core.term_usages, strict=True):
        nz = np.flatnonzero(use)
        cs = s_off[var] + nz
        scaled = use[nz] / usage_scale
        rows += [
            np.full(len(nz), r0 + np.searchsorted(grid, s)),
            np.full(len(nz), r0 + np.searchsorted(grid, t)),
        ]
        cols += [cs, cs]
        vals += [-scaled, scaled]
    m.add(rows, cols, vals, np.zeros(g), np.zeros(g), g)
    return mem_first, usage_scale, const_max / usage_scale


def _peak_rows(m: _Rows, memory: tuple[int, float, np.ndarray]) -> int:
    """P >= every memory level: m[k] + const[k] <= P, i.e. m[k] - P <= -const[k]; and P is at
    least the peak of the usage no choice can change. Minimise P; returns its column."""
    mem_first, _, const_part = memory
    peak_col = m.n_cols
    m.n_cols += 1
    m.cols_c.append(np.ones(1))
    g = len(const_part)
    if g:
        n = m.n_rows
        m.add(
            [n + np.arange(g), n + np.arange(g)],
            [mem_first + np.arange(g), np.full(g, peak_col)],
            [np.ones(g), -np.ones(g)],
            np.full(g, -np.inf),
            -const_part,
            g,
        )
    return peak_col


def _to_csr(
    rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, n_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """COO -> CSR with duplicate (row, col) entries summed and zeros dropped."""
    order = np.lexsort((cols, rows))
    rows, cols, vals = rows[order], cols[order], vals[order]
    if len(rows):
        new = np.ones(len(rows), dtype=bool)
        new[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1])
        first = np.flatnonzero(new)
        vals = np.add.reduceat(vals, first)
        rows, cols = rows[first], cols[first]
        keep = vals != 0
        rows, cols, vals = rows[keep], cols[keep], vals[keep]
    start = np.zeros(n_rows + 1, dtype=np.int64)
    np.add.at(start, rows + 1, 1)
    return np.cumsum(start), cols, vals
