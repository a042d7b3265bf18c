"""The sharding ILP on the six public IOPDDL contest instances, under the contest's limits.

    python -m benchmarks.iopddl                 # all six, contest time limits (~16 min)
    python -m benchmarks.iopddl --only B,G      # a subset
    python -m benchmarks.iopddl --time-scale 0.1 --no-write   # a quick look

Every reported cost is re-checked with ``evaluate`` on the original problem.
"""

from __future__ import annotations

import argparse
import csv
import platform
import time
from pathlib import Path

from alpa_mini.solvers.sharding.problem import evaluate, load_iopddl
from alpa_mini.solvers.sharding.solve import solve_sharding

from ._report import RESULTS, update_section

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "iopddl"
#: Contest time limits (seconds) and best known costs (B and G are proven optimal).
CONTEST = {
    "A": (60, 6_548_641_531),
    "B": (60, 532_843),
    "G": (120, 217_039),
    "K": (180, 2_274_276_676),
    "P": (240, 662_197_407_330),
    "V": (300, 1_632_051),
}


def run(only: list[str], time_scale: float, backend: str) -> list[dict[str, object]]:
    rows = []
    for name in only:
        limit, best = CONTEST[name]
        t0 = time.perf_counter()
        problem = load_iopddl(DATA / f"asplos-2025-iopddl-{name}.json.gz")
        load_s = time.perf_counter() - t0
        budget = limit * time_scale
        t1 = time.perf_counter()
        sol = solve_sharding(problem, backend=backend, time_limit=budget)
        wall = time.perf_counter() - t1
        ev = evaluate(problem, sol.choice)
        red = sol.reduction
        row = {
            "instance": name,
            "nodes": f"{red['nodes'][0]} → {red['nodes'][1]}",
            "edges": f"{red['edges'][0]} → {red['edges'][1]}",
            "strategies": f"{red['strategies'][0]} → {red['strategies'][1]}",
            "objective": int(ev.cost) if ev.cost.is_integer() else ev.cost,
            "ratio": ev.cost / best,
            "feasible": ev.feasible and not ev.forbidden_nodes and not ev.forbidden_edges,
            "status": sol.status,
            "gap": sol.gap,
            "found by": sol.source,
            "wall_s": wall,
            "limit_s": budget,
            "load_s": load_s,
            "simplify_s": sol.timings.get("simplify", 0.0),
        }
        rows.append(row)
        print(
            f"{name}: {row['objective']:,} ratio {row['ratio']:.6f} {sol.status} "
            f"gap {sol.gap if sol.gap is None else f'{sol.gap:.2e}'} {wall:.1f}s/{budget:.0f}s "
            f"feasible={row['feasible']} by {sol.source}",
            flush=True,
        )
    return rows


def to_markdown(rows: list[dict[str, object]], command: str, backend: str) -> str:
    lines = [
        "## Sharding ILP on the IOPDDL contest instances",
        "",
        f"Command: `{command}` (backend {backend}; {platform.processor() or platform.machine()}, "
        "2 cores). Cost ratio is ours / the contest's best known (B and G are proven optimal; "
        "below 1 means we beat the contest's best). Wall time is `solve_sharding` (simplify + "
        "heuristic + MIP + mapping back), loading the file excluded. Feasible = `evaluate` on "
        "the original problem: within memory, no forbidden (1e18) choice.",
        "",
        "| inst | nodes (before → after) | edges | strategies | objective | ratio to best "
        "| feasible | status | gap | found by | wall s | limit s |",
        "|---|---|---|---|---:|---:|---|---|---:|---|---:|---:|",
    ]
    for r in rows:
        gap = "—" if r["gap"] is None else f"{100 * float(r['gap']):.3f}%"
        lines.append(
            f"| {r['instance']} | {r['nodes']} | {r['edges']} | {r['strategies']} | "
            f"{r['objective']:,} | {float(r['ratio']):.6f} | {'yes' if r['feasible'] else 'NO'} | "
            f"{r['status']} | {gap} | {r['found by']} | {float(r['wall_s']):.1f} | "
            f"{float(r['limit_s']):.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--only", default=",".join(CONTEST), help="instances, e.g. B,G")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply contest limits")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md")
    args = parser.parse_args(argv)
    only = [x.strip().upper() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in only if x not in CONTEST]
    if unknown:
        parser.error(f"--only: unknown instances {unknown}; valid: {', '.join(CONTEST)}")
    rows = run(only, args.time_scale, args.backend)
    if args.no_write:
        return
    command = "python -m benchmarks.iopddl"
    if args.only != ",".join(CONTEST):
        command += f" --only {args.only}"
    if args.time_scale != 1.0:
        command += f" --time-scale {args.time_scale}"
    update_section("iopddl", to_markdown(rows, command, args.backend))
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "iopddl.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
