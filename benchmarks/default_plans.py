"""Plans with the defaults: ``alpa-mini plan --model M --cluster dgx-a100 --hosts H`` and no
other flag, per Alpa-suite and Megatron row and GPT-3 175B, each in a fresh process: its
planning seconds, the planner's peak RSS, the micro-batch count chosen and every count
planned, whether blocks are recomputed, and the predicted iteration time beside the best
plan this project found for the row with hand-picked settings (``plan-quality.json`` and
``megatron.json``, from their own runs).

Run alone (ILP time limits are wall-clock): ``python -m benchmarks.default_plans
[--models gpt-1.3b,gpt-39b]``. Rows run one after another; each writes its result to
``benchmarks/results/default_plans.json`` as it finishes, and the table in BENCHMARKS.md
shows every row recorded there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._report import (
    GRAPH_MODEL,
    MEMORY_MODEL,
    OTHER_PRICING,
    PUBLISHED_PLANNING,
    TRANSFER_MODEL,
    Pricing,
    comparable,
    even_pricing,
    memory_label,
    plan_pricing,
    pricing,
    update_section,
)
from .megatron_compare import ROWS as MEGATRON_ROWS
from .plan_quality import SUITES, cluster_for

RESULTS = Path(__file__).resolve().parent / "results" / "default_plans.json"
#: The other settings' runs: the plan-quality table (its baselines; `alpa-mini bench
#: plan-quality --ours defaults` rewrites its "ours" with the defaults), that table as its
#: tuned settings last made it, and the Megatron table.
QUALITY = RESULTS.parent / "plan-quality.json"
TUNED = RESULTS.parent / "plan-quality-tuned.json"
MEGATRON = RESULTS.parent / "megatron.json"
#: Rows beyond the Alpa suites and Megatron's table (with a planning-time target), and the
#: GPUs each is planned on (their YAML names none).
EXTRA_ROWS = {"gpt3-175b": 128 * 8}
#: Planning-time targets of issue 23 (seconds on 2 cores); 4 GiB of planner RSS everywhere.
TARGETS = {"gpt-1.3b": 5.0, "gpt-39b": 60.0, "gpt3-175b": 120.0, "megatron-1t": 300.0}
#: The most seconds one row may plan before it is recorded as timed out.
ROW_LIMIT = 3600
# The child's own peak (VmHWM): ru_maxrss would also count the parent's RSS at fork, which
# Linux carries over exec. For the same reason RUSAGE_CHILDREN cannot measure its solver
# processes (``shard.solve_pool``; a solver started when the planner held 2 GiB would read
# 2 GiB): each reads its own VmHWM, taken just before the pool stops it.
CHILD = """
import re, sys
from alpa_mini.shard import solve_pool

def hwm_kib(pid):
    try:
        found = re.search(r"VmHWM:\\s+(\\d+)", open(f"/proc/{pid}/status").read())
    except OSError:
        return -1
    return int(found.group(1)) if found else -1

solvers = []
stop = solve_pool._Child.stop

def stop_and_measure(child, *args, **kwargs):
    solvers.append(hwm_kib(child.proc.pid))
    stop(child, *args, **kwargs)

solve_pool._Child.stop = stop_and_measure
from alpa_mini.cli.main import main
code = main(sys.argv[1:])
print("PEAK_RSS_KIB", hwm_kib("self"), flush=True)
print("SOLVER_RSS_KIB", max(solvers, default=-1), sum(k for k in solvers if k > 0), flush=True)
sys.exit(code)
"""


def row(model: str) -> dict[str, Any]:
    """Plan ``model`` on its row's GPUs with the defaults, in a fresh process."""
    from alpa_mini.graph.planning_stats import PlanningStats
    from alpa_mini.models.specs import ModelSpec
    from alpa_mini.pipeline.plan import PipeshardPlan
    from benchmarks.baselines import evaluate_plan

    spec = ModelSpec.load_any(model)
    spec = dataclasses.replace(spec, gpus=spec.gpus or EXTRA_ROWS[model])
    cluster = cluster_for(spec.gpus)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        args = ["plan", "--model", model, "--cluster", "dgx-a100",
                "--hosts", str(cluster.num_hosts),
                "--devices-per-host", str(cluster.devices_per_host),
                "--json", str(out)]  # fmt: skip
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", CHILD, *args],
                capture_output=True, text=True, timeout=ROW_LIMIT,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"model": model, "gpus": spec.gpus, "error": f"timed out after {ROW_LIMIT} s"}
        wall = time.perf_counter() - t0
        rss = [int(ln.split()[1]) for ln in proc.stdout.splitlines() if "PEAK_RSS_KIB" in ln]
        rss = [k for k in rss if k > 0]
        solver = next(
            ([int(k) for k in ln.split()[1:3]] for ln in proc.stdout.splitlines()
             if ln.startswith("SOLVER_RSS_KIB")),
            None,
        )  # fmt: skip
        result: dict[str, Any] = {
            "model": model,
            "gpus": spec.gpus,
            "wall_s": wall,
            "peak_rss_gib": rss[0] / 2**20 if rss else None,
            "rss": "VmHWM",
            "solver_rss_gib": solver[0] / 2**20 if solver and solver[0] > 0 else None,
            "solvers_rss_gib": solver[1] / 2**20 if solver and solver[0] > 0 else None,
            "solver_rss": "own VmHWM",
        }
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            return {**result, "error": " ".join(tail)[:400]}
        plan = PipeshardPlan.from_json(out.read_text())
    planning = plan.planning or PlanningStats()
    simulated, _, overflow = evaluate_plan(plan, cluster)
    return {
        **result,
        "micro_batches": plan.num_micro_batches,
        "stages": plan.num_stages,
        # (which decides whether its transfers price alike under every model: _report.pricing)
        "stage_hosts": [st.submesh[0] for st in plan.stages],
        "predicted_s": plan.predicted_time,
        # As the plan-quality and Megatron tables time every plan (transfers between stages
        # on the links); inf where the schedule's micro-batches in flight overflow a device.
        "simulated_s": simulated,
        "simulated_overflow": overflow,
        "planning_s": planning.total_seconds,
        "tried": [list(t) for t in planning.micro_batches_tried],
        "dominated": [list(t) for t in planning.micro_batches_dominated],
        "recomputed": "every block recomputed" in " ".join(proc.stdout.split()),
    }


def other_settings() -> dict[str, list[tuple[float, str, Pricing]]]:
    """Per row, every plan another setting found for it in this project's benchmark runs,
    as (simulated s/iter, what found it, what its seconds were priced with:
    ``_report.pricing``): the plan-quality table's baselines (data parallel, ZeRO, PP-DP,
    the strong grid, the family's faithful baseline), our tuned runs (refine, (dp, tp)
    meshes, ZeRO-3 layers, 20 s ILPs, a few micro-batch counts), and the Megatron table's
    published configurations, with the ILP free inside each stage and with Megatron-LM's
    own layouts. Plans that did not fit are left out."""
    found: dict[str, list[tuple[float, str, Pricing]]] = {}

    def add(model: str, seconds: Any, label: str, priced: Pricing) -> None:
        if isinstance(seconds, int | float) and math.isfinite(seconds):
            found.setdefault(model, []).append((float(seconds), label, priced))

    for r in _load(QUALITY):
        for b in r.get("baselines") or []:
            pp = (b.get("config") or {}).get("pp")
            # a baseline kept from an earlier run carries its own transfer model
            add(r["model"], b.get("time"), b["name"], even_pricing({**r, **b}, pp))
    for path in (TUNED, QUALITY):
        for r in _load(path):
            if r.get("our_space") == "defaults":  # the defaults themselves
                continue
            ours = r.get("ours")
            t = ours.get("time") if isinstance(ours, dict) else ours
            stages = ours.get("stages") if isinstance(ours, dict) else None
            add(r["model"], t, "tuned", plan_pricing(r, stages, "ours_"))
    for r in _load(MEGATRON):
        pp = r["published"]["pp"]
        add(r["model"], r.get("theirs"), "megatron published", even_pricing(r, pp))
        add(r["model"], r.get("megatron_lm"), "megatron-lm", even_pricing(r, pp))
        mine = (r.get("our_choice") or {}).get("stages")
        add(r["model"], r.get("ours"), "tuned", plan_pricing(r, mine, "ours_"))
    return found


def _own_pricing(row: dict[str, Any]) -> Pricing:
    """``_report.pricing`` of a defaults row's own plan (its stages' hosts, where recorded)."""
    return pricing(row, row.get("stages"), hosts=row.get("stage_hosts"))


def best_other(row: dict[str, Any], found: list[tuple[float, str, Pricing]]) -> str:
    """The table's *best other* and *ratio* cells of a defaults row: the fastest plan another
    setting found and priced as the row's own (``_report.pricing``), and defaults / that
    (target 1.02), both timed by the pipeline simulator (rows run before it was read say so).
    Plans priced otherwise are left out; the cell counts them."""
    mine = _own_pricing(row)
    same = [f for f in found if comparable(f[2], mine)]
    if not same:
        return f"– | – ({OTHER_PRICING})" if found else "– | –"
    seconds, label, _ = min(same)
    ours = row.get("simulated_s")
    if ours is None:
        ratio = "– (not simulated)"
    else:
        ratio = f"{ours / seconds:.3f}" if math.isfinite(ours) else "– (over memory)"
    left = len(found) - len(same)
    label += f"; left out: {left} priced otherwise" if left else ""
    return f"{seconds:.2f} ({label}) | {ratio}"


def _load(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text()) if path.exists() else []


def published_lines(results: list[dict[str, Any]]) -> list[str]:
    """The Megatron rows against Megatron-LM's published (dp, tp, pp), as the Megatron
    table priced it (``megatron.json``: equal stages, each the better of a whole-stage ILP
    and a composition), and their geometric mean."""
    theirs = {r["model"]: r for r in _load(MEGATRON)}
    rows = [r for r in results if r["model"] in theirs and "error" not in r]
    if not rows:
        return []
    lines = [
        "",
        "Megatron-LM's published configurations against the defaults (*Megatron s*: the "
        "published (dp, tp, pp) as `alpa-mini bench megatron` priced it, its best micro-batch "
        "count, the ILP free inside each stage, so stronger than Megatron-LM's own layouts; "
        "target ≤ 1.00):",
        "",
        "| model | GPUs | Megatron dp/tp/pp | Megatron s | defaults simulated s "
        "| defaults / Megatron "
        "| memory model (Megatron, defaults) |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    ratios = []
    for r in rows:
        t = theirs[r["model"]]
        pub = t["published"]
        ours = r.get("simulated_s")
        if not comparable(_own_pricing(r), even_pricing(t, pub["pp"])):
            said = f"– ({OTHER_PRICING})"
        elif ours is None:
            said = "– (not simulated)"
        else:
            ratios.append(ours / t["theirs"])
            said = f"{ratios[-1]:.3f}"
        lines.append(
            f"| {r['model']} | {r['gpus']} | {pub['dp']}/{pub['tp']}/{pub['pp']} | "
            f"{t['theirs']:.2f} | {'–' if ours is None else f'{ours:.2f}'} | {said} | "
            f"{memory_label(t)}, {memory_label(r)} |"
        )
    if len(ratios) < len(rows):
        lines += ["", f"{len(rows) - len(ratios)} rows not compared: {PRICING_NOTE} {SIM_NOTE}"]
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines += ["", f"Geometric mean {geo:.3f} over {len(ratios)} rows; worst {max(ratios):.3f}."]
    return lines


#: Why a ratio is left out: the defaults' plan was not timed by the simulator.
SIM_NOTE = (
    "Rows run before 2026-11-29 (the nineteenth sitting) kept only the planner's own "
    "predicted time, which leaves out the transfers between stages the simulator times on "
    "every other setting's plan."
)

#: Why a ratio is left out: the two sides were priced differently.
PRICING_NOTE = (
    "one side was priced on stage graphs with dead code (before 2026-11-28, evening, 2-6% "
    "more per GPT or MoE stage: `_report.GRAPH_MODEL`), or, for a plan of several stages "
    "two neighbours of which both span several hosts, with the transfers between stages "
    "over one link (before 2026-11-29, afternoon: `_report.TRANSFER_MODEL`; where a side of "
    "every boundary sits in one host, both models send each hop over one link), the other "
    "not; such seconds are not compared until that side is re-run."
)


def _simulated(r: dict[str, Any]) -> str:
    """A row's simulated seconds, "over memory" where its in-flight micro-batches overflow."""
    seconds = r.get("simulated_s")
    if seconds is None:
        return "–"
    return "over memory" if math.isinf(seconds) else f"{seconds:.2f}"


def to_markdown(results: list[dict[str, Any]], when: str) -> str:
    others = other_settings()
    lines = [
        "## Plans with the defaults",
        "",
        f"Command: `python -m benchmarks.default_plans [--models ...]` ({when}), 2 cores, alone "
        "unless the *run beside* column names what ran beside the row (planning seconds are "
        "then inflated and not comparable with the targets). *Sync*: the gradient-sync pricing "
        "the defaults had when the row ran (`after` before the default became `ilp`). *Memory*: "
        "the date of the memory model the row was planned with (11-28: the gradient "
        "accumulators the runtime keeps counted; 11-29: also the parameters a stage's backward "
        "reads held once, where earlier models counted them again with each micro-batch in "
        "flight; 11-26: neither). Each row is "
        "`alpa-mini plan --model M --cluster dgx-a100 --hosts H` with no other flag, in a fresh "
        "process: the micro-batch count searched (the batch's divisors nearest each power of "
        "two, by bisection), every (dp, tp) with tp in a host, ZeRO-3 layers offered, blocks "
        "recomputed only where nothing fits stored, a one-stage plan on one host refined "
        "whole (from 2026-11-28, evening). *B planned*: each count planned and its "
        "predicted s/iter (composed, before any refinement); >x: its planning stopped once a "
        "lower bound x exceeded a faster "
        "count's (from 2026-11-27, evening). Planning s: the planner's own total; peak "
        "RSS: the planning process's own peak (≤: an upper bound, read as ru_maxrss, which on "
        "Linux also counts the benchmark runner's RSS at fork), and in brackets the peaks of "
        "its ILP solver processes (one per core) added up, each its own VmHWM read just before "
        "the pool stops it (from 2026-11-28, afternoon; rows before read RUSAGE_CHILDREN, "
        "which counted the planner's RSS when each solver was started, and are not shown). "
        "*Predicted s/iter*: the planner's own (its stage DP's objective); *simulated s*: the "
        "plan timed by the pipeline simulator, with the transfers between stages on the links, "
        "as every other setting's plan is timed (from 2026-11-29, the nineteenth sitting). "
        "*Best other s*: the fastest plan any other setting found for the row on the same "
        "stage graphs, and which: the plan-quality table's baselines (data parallel, ZeRO-2/3, "
        "PP-DP, the strong grid, the family's faithful baseline), our tuned runs (refine, "
        "20 s ILPs) and the Megatron table's published configurations (`benchmarks/results`; "
        "run apart from this table, on the same cost model and simulator); *ratio*: simulated "
        "defaults / best other "
        "(target 1.02). Planning targets (issue 23): "
        + ", ".join(f"{m} {t:.0f} s" for m, t in TARGETS.items())
        + ", 4 GiB of RSS everywhere.",
        "",
        "| model | GPUs | B | stages | act. | predicted s/iter | simulated s | best other s "
        "| ratio | planning s | peak RSS GiB | B planned | sync | memory | run beside |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|---|",
    ]
    unlike = unsimulated = 0
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['gpus']} |" + " – |" * 12 + f" {r['error']} |")
            continue
        said = {b: "no fit" if t is None else f"{t:.2f}" for b, t in r["tried"]}
        said |= {b: f">{t:.2f}" for b, t in r.get("dominated", [])}
        tried = ", ".join(f"{b}: {said[b]}" for b in sorted(said))
        bound = "" if r.get("rss") == "VmHWM" else "≤"
        rss = "–" if r["peak_rss_gib"] is None else f"{bound}{r['peak_rss_gib']:.2f}"
        if r.get("solver_rss") == "own VmHWM" and r.get("solvers_rss_gib"):
            rss += f" (+{r['solvers_rss_gib']:.2f} solvers)"
        best = best_other(r, others.get(r["model"], []))
        unlike += best.endswith(f"({OTHER_PRICING})")
        unsimulated += best.endswith("(not simulated)")
        act = "recomp." if r.get("recomputed") else "stored"
        lines.append(
            f"| {r['model']} | {r['gpus']} | {r['micro_batches']} | {r['stages']} | {act} | "
            f"{r['predicted_s']:.2f} | {_simulated(r)} | {best} | "
            f"{r['planning_s']:.1f} | {rss} | {tried} | {r.get('sync', 'after')} | "
            f"{memory_label(r)} | {r.get('beside') or 'alone'} |"
        )
    if unlike:
        lines += ["", f"{unlike} rows not compared with another setting: {PRICING_NOTE}"]
    if unsimulated:
        lines += ["", f"{unsimulated} rows not compared with another setting: {SIM_NOTE}"]
    return "\n".join(lines + planning_lines(results) + published_lines(results))


def planning_lines(results: list[dict[str, Any]]) -> list[str]:
    """The rows' planning seconds and peak RSS beside the planning times published for the
    same rows (``_report.PUBLISHED_PLANNING``)."""
    said = [
        f"{r['model']}: defaults {r['planning_s']:.1f} s and {r['peak_rss_gib']:.2f} GiB "
        f"against {PUBLISHED_PLANNING[r['model']]}"
        for r in results
        if r["model"] in PUBLISHED_PLANNING and "error" not in r and r.get("peak_rss_gib")
    ]
    if not said:
        return []
    return ["", "Published planning times beside the defaults': " + "; ".join(said) + "."]


def _default_sync() -> str:
    """The gradient-sync pricing ``PipeshardParallel()`` uses (the rows' planner default)."""
    from alpa_mini import PipeshardParallel

    return PipeshardParallel().gradient_sync


def _rows() -> list[str]:
    """Every row, in table order."""
    return [m for names in SUITES.values() for m in names] + [*MEGATRON_ROWS, *EXTRA_ROWS]


def render() -> None:
    """Rewrite the BENCHMARKS.md section from the saved rows."""
    every = _rows()
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    kept.sort(key=lambda r: every.index(r["model"]) if r["model"] in every else len(every))
    dates = sorted({r["date"] for r in kept if "date" in r}) or [datetime.date.today().isoformat()]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    update_section("default-plans", to_markdown(kept, when))


def main(argv: list[str] | None = None) -> int:
    every = _rows()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.default_plans")
    parser.add_argument("--models", default=",".join(every), help="comma-separated rows")
    parser.add_argument(
        "--beside",
        default="",
        help="what ran on the machine beside this run, recorded per row (planning times and "
        "wall-clock ILP limits move with load); empty: alone",
    )
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in every]
    if unknown:
        parser.error(f"--models: {unknown[0]!r} is not a row; rows: {', '.join(every)}")
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for model in models:
        print(f"{model} ...", flush=True)
        today = datetime.date.today().isoformat()
        result = {
            **row(model),
            "sync": _default_sync(),
            "memory_model": MEMORY_MODEL,
            "graph_model": GRAPH_MODEL,
            "transfer_model": TRANSFER_MODEL,
            "beside": args.beside,
            "date": today,
        }
        print(json.dumps(result), flush=True)
        kept = [r for r in kept if r["model"] != model] + [result]
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(kept, indent=1) + "\n")
    render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
