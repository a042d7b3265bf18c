"""Compute floors: per plan-quality row, the seconds per iteration that no plan on its GPUs
beats under the cost model (``alpa_mini.pipeline.latency_floors.step_floor``: the whole
batch's roofline work split over every device, with no communication, bubble or optimiser
update), beside our plan and the family's faithful baseline from ``plan-quality.json``.

floor / baseline is the best ratio any plan could reach against that baseline, so where it
exceeds issue 23's target (0.95 against Megatron-LM, 0.5 against DeepSpeed-MoE, 0.8 against
PP-DP, on 16 or more GPUs) no plan reaches the target under this cost model; ours / floor is
how far our plan is from it.

    alpa-mini bench compute-floor                        # every 16+ GPU row with a target
    alpa-mini bench compute-floor --models moe-10b,gpt-6.7b

Each row traces its Adam step once with the whole batch as one micro-batch (no ILP is solved)
and is written to ``benchmarks/results/compute-floor.json`` as it finishes; the table in
BENCHMARKS.md shows every row recorded there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import time
from typing import Any

from benchmarks._report import RESULTS, earlier_rows, update_section
from benchmarks.baseline_names import FAITHFUL, faithful_target

__all__ = ["main", "row_floor", "to_markdown"]

PROG = "alpa-mini bench compute-floor"
OUT = RESULTS / "compute-floor.json"
QUALITY = RESULTS / "plan-quality.json"


def row_floor(model: str) -> float:
    """``alpa_mini.cli.main.model_floor`` of ``model``'s Adam step on its plan-quality row's
    GPUs, cut into layers at the model's own boundaries (as ``alpa-mini plan`` cuts it)."""
    from alpa_mini.cli.main import model_floor
    from alpa_mini.models.specs import ModelSpec
    from alpa_mini.options.pipeshard import ManualLayerOption, PipeshardParallel
    from benchmarks.plan_quality import cluster_for

    spec = ModelSpec.load_any(model)
    if hasattr(spec.config, "pipeline_marks"):
        spec = dataclasses.replace(
            spec, config=dataclasses.replace(spec.config, pipeline_marks=True)
        )
    method = PipeshardParallel(layer_option=ManualLayerOption())
    return model_floor(spec, method, cluster_for(spec.gpus))


def _quality_rows() -> dict[str, dict[str, Any]]:
    return {r["model"]: r for r in earlier_rows(QUALITY.name)}


def _time(side: Any) -> float | None:
    t = side.get("time") if isinstance(side, dict) else side
    return float(t) if isinstance(t, int | float) and math.isfinite(t) else None


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def _targeted(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The rows with a faithful-baseline target below 1.00 (16 or more GPUs)."""
    return [m for m, r in rows.items() if faithful_target(r["family"], r["gpus"]) < 1.0]


def to_markdown(floors: list[dict[str, Any]], quality: dict[str, dict[str, Any]]) -> str:
    """The table: per row its floor, ours and the faithful baseline against it."""
    lines = [
        "## Compute floors: what no plan beats under the cost model",
        "",
        f"`{PROG}` (the command regenerates this table). *floor*: the whole batch's roofline "
        "work over all the row's GPUs (`latency_floors.step_floor`; no plan of any stages, "
        "meshes, layouts or micro-batch count is faster). *best possible*: floor / the "
        "family's faithful baseline, the lowest ratio any plan could reach against it; where "
        "it is above the target, no plan reaches the target under this cost model. Ours and "
        "the baseline are the plan-quality table's.",
        "",
        "| row | GPUs | floor s | ours s | ours / floor | baseline | baseline s "
        "| best possible | target | reachable |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for f in floors:
        r = quality.get(f["model"], {})
        name = FAITHFUL.get(r.get("family", ""), "")
        base = next((_time(b) for b in r.get("baselines") or [] if b["name"] == name), None)
        ours, floor = _time(r.get("ours")), f["floor_s"]
        target = faithful_target(r.get("family", ""), int(r.get("gpus", 0)))
        best = None if base is None else floor / base
        reachable = "–" if best is None else "yes" if best <= target else "**no**"
        cells = [
            f["model"], r.get("gpus", "–"), _fmt(floor), _fmt(ours),
            _fmt(None if ours is None else ours / floor), name or "–", _fmt(base), _fmt(best),
            f"{target:.2f}", reachable,
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    quality = _quality_rows()
    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument(
        "--models",
        default=",".join(_targeted(quality)),
        help="comma-separated plan-quality rows (default: those with a target below 1.00)",
    )
    parser.add_argument("--no-write", action="store_true", help="leave the results alone")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in quality]
    if unknown:
        rows = ", ".join(quality)
        parser.error(f"--models: {unknown[0]!r} has no plan-quality row; rows: {rows}")
    kept = [] if args.no_write else earlier_rows(OUT.name)
    for model in models:
        t0 = time.perf_counter()
        result = {
            "model": model,
            "floor_s": row_floor(model),
            "seconds": time.perf_counter() - t0,
            "date": datetime.date.today().isoformat(),
        }
        print(json.dumps(result), flush=True)
        kept = [r for r in kept if r["model"] != model] + [result]
        if not args.no_write:
            OUT.write_text(json.dumps(kept, indent=1) + "\n")
    order = list(quality)
    kept.sort(key=lambda r: order.index(r["model"]) if r["model"] in order else len(order))
    table = to_markdown(kept, quality)
    print(table)
    if not args.no_write:
        update_section("compute-floor", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
