"""Planning time as layers and devices grow: GPT (hidden 2048, 32 heads, seq 1024, vocab
51200, fp16, global batch 1024, 128 micro-batches) with 24 ... 128 layers on 8 ... 1024 A100s
(``dgx-a100`` hosts of 8), planned from abstract shapes, each point in a fresh process. The
memory budget is lifted (1 PB per device) so that every point ends in a plan: the deep
models do not fit the small clusters, and this measures the search, not a refusal.

    alpa-mini bench planning-time            # the grid; BENCHMARKS.md, CSV and PNG
    alpa-mini bench planning-time --layers 24,48 --devices 8,64 --no-write

Reports the seconds per point, the growth exponents of a least-squares fit
``t ~ layers^a * devices^b``, and a log-log plot (one line per device count).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import sys
import time
from typing import Any

import numpy as np

from benchmarks._report import RESULTS, run_child, update_section

__all__ = ["fit_exponents", "main", "point"]

LAYERS = (24, 48, 96, 128)
DEVICES = (8, 64, 256, 1024)
MICRO_BATCHES = 128
PROG = "alpa-mini bench planning-time"


def point(layers: int, devices: int) -> dict[str, Any]:
    """Plan one GPT of ``layers`` layers on ``devices`` A100s; seconds and what was solved."""
    import dataclasses

    import jax

    import alpa_mini
    from alpa_mini import ClusterSpec
    from alpa_mini.models import adam, make_train_step
    from alpa_mini.models.specs import ModelSpec

    spec = ModelSpec.named("gpt-1.3b")
    config = dataclasses.replace(spec.config, num_layers=layers, pipeline_marks=True)
    spec = dataclasses.replace(spec, config=config)
    cluster = ClusterSpec.named("dgx-a100").with_hosts(devices // 8)
    opt = adam(1e-4)
    params = spec.abstract_params()
    args = (params, jax.eval_shape(opt.init, params), spec.abstract_batch())
    step = make_train_step(spec.loss_fn(), opt, alpa_mini.value_and_grad)
    method = alpa_mini.PipeshardParallel(
        num_micro_batches=MICRO_BATCHES,
        layer_option=alpa_mini.ManualLayerOption(),
        stage_option=alpa_mini.AutoStageOption(),
        memory_budget=1e15,
    )
    t0 = time.perf_counter()
    plan = alpa_mini.plan(step, *args, method=method, cluster=cluster)
    seconds = time.perf_counter() - t0
    p = plan.planning
    return {
        "layers": layers,
        "devices": devices,
        "seconds": seconds,
        "stages": plan.num_stages,
        "ilps": p.ilps_solved,
        "entries": p.cost_entries,
    }


def fit_exponents(points: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Least squares of log t = c + a log layers + b log devices: (a, b, r^2)."""
    x = np.array([[1.0, math.log(p["layers"]), math.log(p["devices"])] for p in points])
    y = np.array([math.log(p["seconds"]) for p in points])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return float(coef[1]), float(coef[2]), 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def _plot(points: list[dict[str, Any]], path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in sorted({p["devices"] for p in points}):
        row = sorted((p for p in points if p["devices"] == d), key=lambda p: p["layers"])
        ax.plot(
            [p["layers"] for p in row], [p["seconds"] for p in row], marker="o", label=f"{d} GPUs"
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPT layers")
    ax.set_ylabel("planning time (s)")
    ax.set_title("alpa_mini planning time (abstract shapes, 2 CPU cores)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _child(layers: int, devices: int) -> dict[str, Any]:
    args = ["--child", f"{layers},{devices}"]
    return run_child("benchmarks.planning_time", args, timeout=3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default=",".join(map(str, LAYERS)))
    parser.add_argument("--devices", default=",".join(map(str, DEVICES)))
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        layers, devices = (int(x) for x in opts.child.split(","))
        print("RESULT " + json.dumps(point(layers, devices)), flush=True)
        return 0
    layers = [int(x) for x in opts.layers.split(",")]
    devices = [int(x) for x in opts.devices.split(",")]
    bad = [d for d in devices if d < 8 or d % 8]
    if bad:
        parser.error(f"--devices: {bad[0]} is invalid; expected multiples of 8 (whole hosts)")
    command = "alpa-mini bench planning-time " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    points = []
    for d in devices:
        for n in layers:
            points.append(_child(n, d))
            print(json.dumps(points[-1]), flush=True)
    a, b, r2 = fit_exponents(points)
    header = "| layers | " + " | ".join(f"{d} GPUs" for d in devices) + " |"
    lines = [
        "## Planning time as layers and devices grow",
        "",
        f"Command: `{command.strip()}` ({datetime.date.today().isoformat()}; "
        f"{time.perf_counter() - t0:.0f} s). GPT with hidden 2048 and 24 to 128 layers, "
        f"{MICRO_BATCHES} micro-batches, `PipeshardParallel(memory_budget=1e15)` (individual "
        "profiling, power-of-two submeshes; the budget lifted so that every point ends in a "
        "plan) on `dgx-a100` clusters, each point a fresh process on this "
        "machine's 2 shared CPU cores. Seconds of `alpa_mini.plan` (tracing, per-layer ILPs, "
        "stage DP); in brackets the ILPs solved and the plan's stage count.",
        "",
        header,
        "|---:|" + "---:|" * len(devices),
    ]
    for n in layers:
        cells = []
        for d in devices:
            p = next(q for q in points if q["layers"] == n and q["devices"] == d)
            cells.append(f"{p['seconds']:.1f} ({p['ilps']} ILPs, {p['stages']} st.)")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Fit `t ~ layers^a * devices^b`: **a = {a:.2f}**, **b = {b:.2f}** (r² = {r2:.2f}). "
        "Plot: `benchmarks/results/planning-time.png`.",
        "",
        "![planning time](benchmarks/results/planning-time.png)",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.no_write:
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    _plot(points, RESULTS / "planning-time.png")
    with (RESULTS / "planning-time.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(points[0]))
        writer.writeheader()
        writer.writerows(points)
    update_section("planning-time", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
