"""Stage DP: the exact fast solver against Alpa's reference scheme on synthetic cost tables.

    python -m benchmarks.stage_dp              # full grid (reference cut at 120 s; ~1 h)
    python -m benchmarks.stage_dp --quick      # a small subset (smoke check, ~1 min)
    python benchmarks/stage_dp.py --layers 32 --clusters 64x8 --batches 64

Instances come from ``random_stage_problem(L, N, M, num_configs=4, num_micro_batches=B,
seed)``; generating them is not timed. The reference runs in a child process killed at the
limit ("> 120 s"). Wherever both finish, their objectives must agree (rel. 1e-9): the table
says so and the run fails otherwise. The table is printed and written to
``benchmarks/results/stage_dp.md`` (unless ``--no-write``).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alpa_mini.solvers.brute_force import random_stage_problem, solve_stages_reference
from alpa_mini.solvers.stages import solve_stages
from benchmarks._report import update_section

FULL = {"layers": [16, 32, 48, 96], "clusters": ["1x8", "8x8", "64x8", "128x8"], "batches": [8, 64]}
QUICK = {"layers": [16], "clusters": ["1x8", "8x8"], "batches": [8, 64]}


def _cluster(text: str) -> tuple[int, int]:
    hosts, per_host = text.lower().split("x")
    return int(hosts), int(per_host)


def _reference_child(args: tuple[int, int, int, int, int], queue: mp.Queue) -> None:
    """Child process: rebuild the instance, run the reference, report (T, seconds, #t_max)."""
    layers, hosts, per_host, batches, seed = args
    problem = random_stage_problem(layers, hosts, per_host, num_micro_batches=batches, seed=seed)
    t0 = time.perf_counter()
    try:
        sol = solve_stages_reference(problem)
        queue.put((sol.objective, time.perf_counter() - t0, len(sol.tmax_trace)))
    except Exception as exc:  # reported in the table, e.g. InfeasibleError
        queue.put((f"{type(exc).__name__}", time.perf_counter() - t0, 0))


def run_reference(
    args: tuple[int, int, int, int, int], limit_s: float
) -> tuple[float | str | None, float | None, int]:
    """Reference objective, wall seconds and #t_max tried; ``(None, None, 0)`` if cut."""
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    queue: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_reference_child, args=(args, queue), daemon=True)
    proc.start()
    proc.join(limit_s)
    if proc.is_alive():
        proc.terminate()
        proc.join()
        return None, None, 0
    return queue.get(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small subset, 30 s reference limit")
    parser.add_argument("--layers", help="comma list, e.g. 16,32")
    parser.add_argument("--clusters", help="comma list, e.g. 1x8,8x8")
    parser.add_argument("--batches", help="micro-batch counts, e.g. 8,64")
    parser.add_argument("--limit", type=float, help="reference time limit in s (default 120)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="do not write results/*.md")
    opts = parser.parse_args(argv)
    grid = QUICK if opts.quick else FULL
    layers = [int(x) for x in opts.layers.split(",")] if opts.layers else grid["layers"]
    clusters = opts.clusters.split(",") if opts.clusters else grid["clusters"]
    batches = [int(x) for x in opts.batches.split(",")] if opts.batches else grid["batches"]
    limit = opts.limit if opts.limit is not None else (30.0 if opts.quick else 120.0)

    header = (
        "| L | cluster | B | ours (s) | reference (s) | speedup | T ours | T reference | match "
        "| stages | t_max: ours / ref |\n"
        "|---:|:---|---:|---:|---:|---:|---:|---:|:---:|---:|---:|"
    )
    print(header, flush=True)
    lines, mismatches = [header], 0
    for num_layers in layers:
        for cluster in clusters:
            hosts, per_host = _cluster(cluster)
            for b in batches:
                problem = random_stage_problem(
                    num_layers, hosts, per_host, num_micro_batches=b, seed=opts.seed
                )
                t0 = time.perf_counter()
                ours = solve_stages(problem)
                ours_s = time.perf_counter() - t0
                ref_t, ref_s, ref_n = run_reference(
                    (num_layers, hosts, per_host, b, opts.seed), limit
                )
                if isinstance(ref_t, float):
                    ok = math.isclose(ours.objective, ref_t, rel_tol=1e-9)
                    mismatches += not ok
                    match = "yes" if ok else "**NO**"
                    ref_col, ref_val = f"{ref_s:.3f}", f"{ref_t:.6g}"
                    speed = f"{ref_s / ours_s:.0f}x"
                else:
                    match, speed = "-", f"> {limit / ours_s:.0f}x" if ref_t is None else "-"
                    ref_col = f"> {limit:.0f}" if ref_t is None else f"{ref_t}"
                    ref_val = "-"
                row = (
                    f"| {num_layers} | {cluster} | {b} | {ours_s:.3f} | {ref_col} | {speed} "
                    f"| {ours.objective:.6g} | {ref_val} | {match} | {ours.num_stages} "
                    f"| {len(ours.tmax_trace)} / {ref_n if ref_n else '-'} |"
                )
                print(row, flush=True)
                lines.append(row)

    notes = (
        "## Stage DP: `solve_stages` vs Alpa's reference scheme\n\n"
        f"`random_stage_problem(L, N, M, num_configs=4, num_micro_batches=B, seed={opts.seed})`; "
        f"reference in a child process, cut at {limit:.0f} s. "
        "t_max: exact inner-DP evaluations of ours / t_max values the reference solved. "
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}.\n\n"
    )
    text = notes + "\n".join(lines) + "\n"
    if not opts.no_write:
        update_section("stage_dp", text)
    if mismatches:
        print(f"{mismatches} objective mismatch(es) between solve_stages and the reference")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
