"""Cost-model calibration on CPU: micro-benchmarks -> a profile database -> predicted versus
measured stage times of the test models on 8 simulated CPU devices.

    alpa-mini bench calibration                      # BENCHMARKS.md section, CSV, profile JSON
    alpa-mini bench calibration --models gpt-small --no-write

1. ``alpa_mini.cluster.profile_devices`` measures matmul and elementwise throughput per number of
   busy devices and fits alpha-beta per collective kind and group size; the database is
   saved to ``benchmarks/results/cpu-profile.json``.
2. For each test model and stage layout (one stage on 1, 2, 4 or 8 devices with 1-D or 2-D
   logical meshes; 2 and 4 uniform stages), the step is planned twice, on ``cpu-1x8`` with
   its nominal figures and with the profile attached, and each plan is run on the CPU
   devices with every instruction timed back to back (``PipeshardExecutable.profile``).
3. Per stage: predicted = the plan's stage latency (the ILP's compute + communication +
   resharding for one micro-batch's forward and backward); measured = the median forward
   plus the median backward program time. The error is |predicted - measured| / measured.

Every model runs in a fresh process (its own 8 CPU devices, no warm caches).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks._report import RESULTS, run_child, update_section

__all__ = ["LAYOUTS", "MODELS", "error_summary", "main", "to_markdown"]

PROG = "alpa-mini bench calibration"
MODELS = ("mlp-small", "gpt-tiny", "gpt-small", "moe-small", "wresnet-small")
Layout = tuple[int, tuple[int, int], tuple[int, ...]]
#: (stages, submesh (hosts, devices), logical mesh) per measured layout.
LAYOUTS: tuple[Layout, ...] = (
    (1, (1, 1), (1,)),
    (1, (1, 2), (2,)),
    (1, (1, 4), (4,)),
    (1, (1, 4), (2, 2)),
    (1, (1, 8), (8,)),
    (1, (1, 8), (2, 4)),
    (2, (1, 4), (4,)),
    (4, (1, 2), (2,)),
)
MICRO_BATCHES = 2
STEPS = 3  # profiled steps per plan (after 2 warm-up steps)
TARGET = 0.15  # median absolute relative error
PROFILE_JSON = "cpu-profile.json"
CSV_FIELDS = [
    "model",
    "layout",
    "stage",
    "cluster",
    "predicted_ms",
    "measured_ms",
    "error",
]


def _concrete(abstract: Any, seed: int) -> Any:
    """Arrays for ``abstract`` leaves: small normals for floats, zeros (valid token and label
    ids) for integers. Timings do not depend on the values."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)

    def leaf(a: Any) -> Any:
        if jnp.issubdtype(a.dtype, jnp.integer):
            return jnp.zeros(a.shape, a.dtype)
        return jnp.asarray(rng.normal(0.0, 0.02, a.shape), a.dtype)

    return jax.tree.map(leaf, abstract)


def profile_child(
    repeats: int, *, cluster: str = "cpu-1x8", num_cpu_devices: int | None = 8
) -> dict[str, Any]:
    """Profile the devices ``alpa_mini.init(cluster, num_cpu_devices=...)`` sets up;
    ``cluster="local"`` profiles the live devices (one GPU, say)."""
    import alpa_mini

    alpa_mini.init(cluster=cluster, num_cpu_devices=num_cpu_devices)
    t0 = time.perf_counter()
    db = alpa_mini.cluster.profile_devices(repeats=repeats)
    return {"profile": db.to_dict(), "seconds": time.perf_counter() - t0}


def measure_child(
    name: str,
    profile: dict[str, Any],
    *,
    cluster: str = "cpu-1x8",
    num_cpu_devices: int | None = 8,
    layouts: Sequence[Layout] = LAYOUTS,
) -> list[dict[str, Any]]:
    """Every layout of ``name``: per stage, predicted and measured seconds under both the
    nominal and the profiled cluster.

    The nominal cluster is what ``alpa_mini.init(cluster, num_cpu_devices=...)`` returns:
    ``cpu-1x8`` by default; ``cluster="local"`` describes the live devices
    (``ClusterSpec.detect()``: one H100, say, priced with ``dgx-h100``'s figures). Every
    layout must fit in that cluster's devices."""
    import dataclasses

    import alpa_mini

    nominal = alpa_mini.init(cluster=cluster, num_cpu_devices=num_cpu_devices)
    too_big = [lay for lay in layouts if lay[1][0] * lay[1][1] * lay[0] > nominal.num_devices]
    if too_big:
        raise ValueError(
            f"layouts: {too_big[0]!r} needs more than the {nominal.num_devices} devices of "
            f"cluster {nominal.name!r}"
        )
    import jax

    from alpa_mini.cluster.profile_db import ProfileDB
    from alpa_mini.models import adam, make_train_step
    from alpa_mini.models.specs import ModelSpec
    from alpa_mini.runtime.instructions import Run

    clusters = {"nominal": nominal, "profiled": nominal.with_profile(ProfileDB.from_dict(profile))}
    spec = ModelSpec.named(name)
    marked = hasattr(spec.config, "pipeline_marks")  # else an MLP: balanced layers
    if marked:
        config = dataclasses.replace(spec.config, pipeline_marks=True)
        spec = dataclasses.replace(spec, config=config)
    opt = adam(1e-4)
    params = _concrete(spec.abstract_params(), 0)
    state = opt.init(params)
    batch = _concrete(spec.abstract_batch(), 1)
    train_step = make_train_step(spec.loss_fn(), opt, alpa_mini.value_and_grad)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, state, batch)
    )
    points = []
    for stages, submesh, logical in layouts:
        if not marked and stages > spec.config.num_layers:
            continue
        layers: Any = (
            alpa_mini.ManualLayerOption()  # the model's own layer boundaries
            if marked
            else alpa_mini.AutoLayerOption(stages, eps=2.0)
        )
        label = f"{stages}x{submesh[1]}dev ({'x'.join(map(str, logical))})"
        for which, cluster in clusters.items():
            method = alpa_mini.PipeshardParallel(
                num_micro_batches=MICRO_BATCHES,
                layer_option=layers,
                stage_option=alpa_mini.UniformStageOption(stages, submesh, logical),
                fuse_programs=False,  # a program per forward and backward, timed apart
            )
            plan = alpa_mini.plan(train_step, *abstract, method=method, cluster=cluster)
            step = alpa_mini.parallelize(train_step, method=dataclasses.replace(method, plan=plan))
            ex = step.get_executable(params, state, batch)
            p, s = params, state
            for _ in range(2):  # compile and warm up
                p, s, out = ex(p, s, batch)
                jax.block_until_ready((p, s, out))
            runs: dict[str, list[float]] = {}
            for _ in range(STEPS):
                (p, s, out), timeline = ex.profile(p, s, batch)
                for t in timeline:
                    if isinstance(t.instruction, Run):
                        runs.setdefault(t.instruction.program, []).append(t.seconds)
            for k, st in enumerate(plan.stages):
                measured = statistics.median(runs[f"fwd{k}"]) + statistics.median(runs[f"bwd{k}"])
                points.append(
                    {
                        "model": name,
                        "layout": label,
                        "stage": k,
                        "cluster": which,
                        "predicted": st.latency,
                        "measured": measured,
                    }
                )
    return points


def error_summary(points: list[dict[str, Any]], cluster: str) -> dict[str, float]:
    """Median, mean and largest |predicted - measured| / measured over ``cluster``'s points."""
    errors = [
        abs(p["predicted"] - p["measured"]) / p["measured"]
        for p in points
        if p["cluster"] == cluster
    ]
    if not errors:
        return {"median": math.nan, "mean": math.nan, "max": math.nan, "count": 0}
    return {
        "median": statistics.median(errors),
        "mean": statistics.fmean(errors),
        "max": max(errors),
        "count": len(errors),
    }


def to_markdown(
    points: list[dict[str, Any]], profile: dict[str, Any], command: str, wall: float
) -> str:
    cal, nom = error_summary(points, "profiled"), error_summary(points, "nominal")
    met = "met" if cal["median"] <= TARGET else "**missed**"
    lines = [
        "## Cost-model calibration on CPU",
        "",
        f"Command: `{command}` ({datetime.date.today().isoformat()}; {wall:.0f} s). "
        f"Micro-benchmarks on 8 simulated CPU devices (`alpa_mini.cluster.profile_devices`, "
        f"{profile['machine']}) give the profile database "
        f"`benchmarks/results/{PROFILE_JSON}`; each test model is planned on `cpu-1x8` with "
        "the nominal figures and with the profile attached (`ClusterSpec.with_profile`), "
        f"with uniform stages and {MICRO_BATCHES} micro-batches, and run with every "
        "instruction timed back to back. Per stage: predicted = the plan's stage latency "
        "(forward + backward of one micro-batch); measured = median forward + median "
        "backward program time. Error = |predicted - measured| / measured.",
        "",
        f"**Median absolute error with the profile: {cal['median']:.1%}** over {cal['count']} "
        f"stages (mean {cal['mean']:.1%}, worst {cal['max']:.1%}); target ≤ {TARGET:.0%}: "
        f"{met}. With the nominal figures: median {nom['median']:.1%} (worst "
        f"{nom['max']:.1%}).",
        "",
        "Profile (per device, with *n* devices busy together):",
        "",
        "| busy devices | matmul GFLOP/s | elementwise GB/s |",
        "|---:|---:|---:|",
    ]
    for c in profile["compute"]:
        lines.append(
            f"| {c['busy_devices']} | {c['matmul_flops'] / 1e9:.1f} | "
            f"{c['memory_bandwidth'] / 1e9:.2f} |"
        )
    lines += ["", "| collective | group | alpha µs | beta ns/B |", "|---|---:|---:|---:|"]
    for c in profile["collectives"]:
        lines.append(
            f"| {c['kind']} | {c['group_size']} | {c['alpha'] * 1e6:.1f} | {c['beta'] * 1e9:.3f} |"
        )
    lines += [
        "",
        "| model | layout | stage | predicted ms (profiled) | measured ms | error | "
        "predicted ms (nominal) | measured ms | error |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key: dict[tuple[str, str, int], dict[str, dict[str, Any]]] = {}
    for p in points:
        by_key.setdefault((p["model"], p["layout"], p["stage"]), {})[p["cluster"]] = p
    for (model, layout, stage), pair in by_key.items():
        cells = []
        for which in ("profiled", "nominal"):
            p = pair.get(which)
            if p is None:
                cells.append("– | – | –")
                continue
            err = abs(p["predicted"] - p["measured"]) / p["measured"]
            cells.append(f"{p['predicted'] * 1e3:.2f} | {p['measured'] * 1e3:.2f} | {err:.0%}")
        lines.append(f"| {model} | {layout} | {stage} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per micro-benchmark")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child == "profile":
        print("RESULT " + json.dumps(profile_child(opts.repeats)), flush=True)
        return 0
    if opts.child:
        profile = json.loads(opts.profile)
        print("RESULT " + json.dumps(measure_child(opts.child, profile)), flush=True)
        return 0
    models = [m for m in opts.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models: {unknown[0]!r} is not one of {', '.join(MODELS)}")
    command = (PROG + " " + " ".join(sys.argv[1:] if argv is None else argv)).strip()
    t0 = time.perf_counter()
    prof = run_child(
        "benchmarks.calibration", ["--child", "profile", "--repeats", str(opts.repeats)], 1800
    )
    profile = prof["profile"]
    print(f"profiled in {prof['seconds']:.0f} s", flush=True)
    points: list[dict[str, Any]] = []
    for name in models:
        print(f"{name} ...", flush=True)
        args = ["--child", name, "--profile", json.dumps(profile)]
        points += run_child("benchmarks.calibration", args, 3600)
        for which in ("profiled", "nominal"):
            print(f"  {which}: {error_summary(points, which)}", flush=True)
    markdown = to_markdown(points, profile, command, time.perf_counter() - t0)
    print(markdown)
    if not opts.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / PROFILE_JSON).write_text(json.dumps(profile, indent=1) + "\n")
        with (RESULTS / "calibration.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            writer.writeheader()
            for p in points:
                writer.writerow(
                    {
                        "model": p["model"],
                        "layout": p["layout"],
                        "stage": p["stage"],
                        "cluster": p["cluster"],
                        "predicted_ms": p["predicted"] * 1e3,
                        "measured_ms": p["measured"] * 1e3,
                        "error": abs(p["predicted"] - p["measured"]) / p["measured"],
                    }
                )
        update_section("calibration", markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
