"""How the planner prices gradient sync: ``gradient_sync="after"`` against ``"ilp"``.

    alpa-mini bench sync-pricing                        # both rows, B = 32 and 256
    alpa-mini bench sync-pricing --models gpt-6.7b --micro-batches 32 --no-write

Per model (at its suite GPU count, ``dgx-a100`` hosts of 8), micro-batch count and pricing:
planning seconds, the simulated iteration time, the chosen (dp, tp, pp), ILPs solved, free
stage MIPs that stopped unproven and how often a restricted plan (ZeRO-3's or Megatron's
layouts, ``StageCostModel._restricted``) replaced one. Since issue 20 a stage reduces its
gradients once per step, so a micro-batch pays 1/B of the sync under both pricings; "ilp"
also lets each stage's ILP pick layouts that avoid it. Every plan runs in a fresh process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from typing import Any

from benchmarks._report import progress, run_child, update_section
from benchmarks.plan_quality import OUR_LOGICAL_SHAPES, SUITES, suite_step

__all__ = ["main", "plan_once", "to_markdown"]

ROWS = ("gpt-6.7b", "gpt-39b")
MICRO_BATCHES = (32, 256)
PRICINGS = ("after", "ilp")
PROG = "alpa-mini bench sync-pricing"
#: Seconds per stage ILP, as in the plan-quality table.
ILP_TIME_LIMIT = 20.0


def plan_once(name: str, micro_batches: int, pricing: str, time_limit: float) -> dict[str, Any]:
    """Plan one model at one micro-batch count with one gradient-sync pricing."""
    import alpa_mini
    from alpa_mini.errors import MemoryBudgetError
    from benchmarks.baselines import evaluate_plan
    from benchmarks.megatron_compare import plan_summary

    spec, cluster, step, args = suite_step(name)
    method = alpa_mini.PipeshardParallel(
        num_micro_batches=micro_batches,
        layer_option=alpa_mini.ManualLayerOption(),
        stage_option=alpa_mini.AutoStageOption(logical_shapes=OUR_LOGICAL_SHAPES, memory_lean=True),
        default_auto_sharding_option=alpa_mini.ShardParallel(time_limit=time_limit),
        gradient_sync=pricing,  # type: ignore[arg-type]
    )
    out = {"model": name, "gpus": spec.gpus, "B": micro_batches, "pricing": pricing}
    try:
        plan = alpa_mini.plan(step, *args, method=method, cluster=cluster)
    except MemoryBudgetError as err:
        return {**out, "time": math.inf, "reason": str(err)[:200]}
    seconds, _, reason = evaluate_plan(plan, cluster)
    stats = plan.planning
    progress(f"{name} B={micro_batches} {pricing}: {seconds:.3f} s ({stats.total_seconds:.0f} s)")
    return {
        **out,
        "time": seconds,
        "reason": reason,
        "planning_s": stats.total_seconds,
        "ilps_solved": stats.ilps_solved,
        "ilps_unproven": stats.ilps_unproven,
        "restricted_wins": stats.restricted_wins,
        "choice": plan_summary(plan),
    }


def to_markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "## Gradient-sync pricing in the planner: after the solve or inside the ILP",
        "",
        f"Command: `{command}` ({datetime.date.today().isoformat()}). Each model at its "
        "plan-quality GPU count (`dgx-a100` hosts), planned with the plan-quality table's "
        "settings but without `refine` (logical meshes "
        f"`{OUR_LOGICAL_SHAPES}`, `memory_lean=True`, "
        f"{ILP_TIME_LIMIT:.0f} s ILPs), one plan per process, nothing else running. *after*: "
        "each stage's ILP is solved alone and the once-per-step gradient sync (1/B per "
        "micro-batch) priced afterwards; *ilp*: the sync is inside the ILP at the same "
        "1/B weight, so layouts that avoid it can win. *Unproven*: free stage MIPs that hit "
        "the time limit; *restricted*: how often ZeRO-3's or Megatron's restricted layouts "
        "then gave the faster stage plan.",
        "",
        "| model | GPUs | B | pricing | planning s | simulated s/iter | dp/tp/pp | ILPs | "
        "unproven | restricted |",
        "|---|---:|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if not math.isfinite(r["time"]):
            lines.append(
                f"| {r['model']} | {r['gpus']} | {r['B']} | {r['pricing']} | – | no plan fits "
                "| – | – | – | – |"
            )
            continue
        c = r["choice"]
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['B']} | {r['pricing']} | "
            f"{r['planning_s']:.1f} | {r['time']:.3f} | {c['dp']}/{c['tp']}/{c['pp']} | "
            f"{r['ilps_solved']} | {r['ilps_unproven']} | {r['restricted_wins']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ROWS))
    parser.add_argument("--micro-batches", default=",".join(map(str, MICRO_BATCHES)))
    parser.add_argument("--time-limit", type=float, default=ILP_TIME_LIMIT)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        name, b, pricing = opts.child.split(":")
        result = plan_once(name, int(b), pricing, opts.time_limit)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    models = [m for m in opts.models.split(",") if m]
    every = [m for names in SUITES.values() for m in names]
    unknown = [m for m in models if m not in every]
    if unknown:
        parser.error(f"--models: {unknown[0]!r} is not a suite row; rows: {', '.join(every)}")
    try:
        counts = [int(b) for b in opts.micro_batches.split(",") if b]
    except ValueError:
        parser.error(f"--micro-batches: {opts.micro_batches!r} is not comma-separated integers")
    rows = []
    for name in models:
        for b in counts:
            for pricing in PRICINGS:
                print(f"{name} B={b} {pricing} ...", flush=True)
                args = ["--child", f"{name}:{b}:{pricing}", "--time-limit", str(opts.time_limit)]
                rows.append(run_child("benchmarks.sync_pricing", args, timeout=3600))
    command = f"{PROG} " + " ".join(sys.argv[1:] if argv is None else argv)
    text = to_markdown(rows, command.strip())
    print(text)
    if not opts.no_write:
        update_section("sync-pricing", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
