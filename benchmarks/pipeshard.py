"""PipeshardParallel benchmarks: two-level planning time, individual-vs-whole stage costs,
and the local runtime's overhead.

    python -m benchmarks.pipeshard                 # all three tables, BENCHMARKS.md updated
    python -m benchmarks.pipeshard --sections planning --no-write

*ray*: the same step on two Ray host workers against the local runtime.
*planning*: ``alpa-mini plan`` of Alpa's GPT suite (and GPT-3 175B) from abstract shapes on
A100 clusters, each in a fresh process (no warm caches), with ILPs solved versus cost-table
entries. *profiling*: on small models, every stage cost of the DP table from per-layer ILPs
("individual") against one ILP per layer range ("whole"), and what the cheaper table costs
the chosen plan. *runtime*: a 2-stage, 8-micro-batch GPT-small step on the local runtime
against the sum of its instructions run back to back.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._report import PUBLISHED_PLANNING, update_section

ROOT = Path(__file__).resolve().parents[1]

#: (model, hosts, devices per host, micro-batches, target seconds or None)
PLANNING_ROWS = [
    ("gpt-350m", 1, 1, 128, None),
    ("gpt-760m", 1, 2, 64, None),
    ("gpt-1.3b", 1, 4, 128, 3.0),
    ("gpt-2.6b", 1, 8, 128, None),
    ("gpt-6.7b", 2, 8, 128, None),
    ("gpt-15b", 4, 8, 128, None),
    ("gpt-39b", 8, 8, 128, 10.0),
    ("gpt3-175b", 128, 8, 128, 60.0),
]
#: Published planning times for the target rows (``_report.PUBLISHED_PLANNING``).
REFERENCE = {**PUBLISHED_PLANNING, "gpt3-175b": "—"}


def _python() -> str:
    return sys.executable


def planning_rows(cluster: str) -> list[dict[str, Any]]:
    """Plan every row in a fresh ``alpa-mini plan`` process; read its JSON."""
    rows = []
    for model, hosts, per_host, micro, target in PLANNING_ROWS:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "plan.json"
            cmd = [
                _python(), "-m", "alpa_mini.cli", "plan", "--model", model, "--cluster", cluster,
                "--hosts", str(hosts), "--devices-per-host", str(per_host),
                "--micro-batches", str(micro), "--json", str(out),
            ]  # fmt: skip
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                rows.append({"model": model, "error": proc.stdout[-400:] + proc.stderr[-400:]})
                continue
            plan = json.loads(out.read_text())
        p = plan["planning"]
        rows.append(
            {
                "model": model,
                "hosts": hosts,
                "per_host": per_host,
                "micro_batches": micro,
                "target": target,
                "seconds": p["total_seconds"],
                "process_wall": wall,
                "ilps": p["ilps_solved"],
                "entries": p["cost_entries"],
                "hits": p["cache_hits"],
                "stages": [
                    (tuple(s["layers"]), tuple(s["submesh"]), tuple(s["logical_shape"]))
                    for s in plan["stages"]
                ],
                "layers": len(plan["layer_starts"]),
                "predicted": _predicted(plan),
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "stages"}), flush=True)
    return rows


def _predicted(plan: dict[str, Any]) -> float:
    lat = [s["latency"] for s in plan["stages"]]
    return sum(lat) + (plan["num_micro_batches"] - 1) * max(lat)


def planning_table(rows: list[dict[str, Any]], cluster: str) -> str:
    lines = [
        "### Planning Alpa's GPT suite from abstract shapes\n",
        f"`alpa-mini plan --model M --cluster {cluster} --hosts H --devices-per-host D "
        "--micro-batches B` (auto layers at the model's pipeline marks: embedding, one per "
        "block; individual profiling; 1F1B; global batch 1024, fp16; analytic cost model; "
        "power-of-two submeshes). *Planning s* is `plan.planning.total_seconds` (trace + "
        "every ILP + stage DP), measured in a fresh process per row; *process s* adds "
        "Python and JAX start-up. *ILPs* are those really solved; *entries* the DP table's "
        "(layer range, submesh, logical mesh) cells; *hits* the per-layer lookups the "
        "structural-hash cache answered.\n",
        "| model | layers | devices | B | planning s | target | process s | ILPs | entries | "
        "hits | stages (layers @ submesh, logical) | predicted iter | published planning |",
        "|:---|---:|---:|---:|---:|:---|---:|---:|---:|---:|:---|---:|:---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | error: {r['error']!r} |" + " |" * 11)
            continue
        target = "—"
        if r["target"] is not None:
            ok = "yes" if r["seconds"] <= r["target"] else "**no**"
            target = f"≤ {r['target']:g} s: {ok}"
        stages = _stage_text(r["stages"])
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['hosts']}×{r['per_host']} | "
            f"{r['micro_batches']} | {r['seconds']:.2f} | {target} | {r['process_wall']:.1f} | "
            f"{r['ilps']} | {r['entries']} | {r['hits']} | {stages} | "
            f"{r['predicted']:.2f} s | {REFERENCE.get(r['model'], '')} |"
        )
    return "\n".join(lines) + "\n"


def _stage_text(stages: list[tuple[tuple[int, int], tuple[int, int], tuple[int, ...]]]) -> str:
    """Runs of equal (submesh, logical) stages folded: ``6 × 1x8 (2x4)``."""
    parts: list[list[Any]] = []
    for (a, b), sub, logical in stages:
        key = (sub, logical)
        if parts and parts[-1][0] == key:
            parts[-1][1] += 1
            parts[-1][2] = b
        else:
            parts.append([key, 1, b, a])
    out = []
    for (sub, logical), count, last, first in parts:
        mesh = f"{sub[0]}x{sub[1]} ({'x'.join(map(str, logical))})"
        out.append(
            f"{count} × {mesh} L{first}..{last}" if count > 1 else f"L{first}..{last} @ {mesh}"
        )
    return "; ".join(out)


# --------------------------------------------------------------------------- profiling


PROFILING_ROWS = [
    # (model, cluster, micro-batches)
    ("gpt-tiny", "cpu-2x4", 4),
    ("gpt-tiny", "cpu-1x8", 8),
    ("gpt-small", "cpu-2x4", 8),
    ("gpt-small", "dgx-a100:1x8", 8),
]


def profiling_rows() -> list[dict[str, Any]]:
    """Plan each row twice in this process (individual, whole); compare the two DP tables."""
    import dataclasses

    import jax
    import numpy as np

    import alpa_mini
    from alpa_mini.cluster.spec import ClusterSpec
    from alpa_mini.graph.micro_batch import value_and_grad
    from alpa_mini.models import adam, make_train_step
    from alpa_mini.models.specs import ModelSpec
    from alpa_mini.options.pipeshard import AutoStageOption, ManualLayerOption, PipeshardParallel
    from alpa_mini.solvers.stages import stage_objective

    rows = []
    for model, cluster_name, micro in PROFILING_ROWS:
        spec = ModelSpec.named(model)
        spec = dataclasses.replace(
            spec, config=dataclasses.replace(spec.config, pipeline_marks=True)
        )
        name, _, shape = cluster_name.partition(":")
        cluster = ClusterSpec.named(name)
        if shape:
            h, d = (int(x) for x in shape.split("x"))
            cluster = dataclasses.replace(cluster.with_hosts(h), devices_per_host=d)
        opt = adam(1e-4)
        params = spec.abstract_params()
        args = (params, jax.eval_shape(opt.init, params), spec.abstract_batch())
        step = make_train_step(spec.loss_fn(), opt, value_and_grad)
        plans = {}
        for mode in ("individual", "whole"):
            method = PipeshardParallel(
                num_micro_batches=micro,
                layer_option=ManualLayerOption(),
                stage_option=AutoStageOption(profiling=mode),
            )
            plans[mode] = alpa_mini.plan(step, *args, method=method, cluster=cluster)
        ind, whole = plans["individual"], plans["whole"]
        a, b = ind.stage_problem.cost, whole.stage_problem.cost
        both = np.isfinite(a) & np.isfinite(b)
        multi = (
            both
            & (np.arange(a.shape[0])[:, None] < np.arange(a.shape[1])[None, :])[:, :, None, None]
        )
        err = np.abs(a[multi] - b[multi]) / b[multi]
        signed = (a[multi] - b[multi]) / b[multi]
        # The individual plan's stages priced by the whole-range ILPs.
        chosen = [
            b[s.layer_start, s.layer_end, s.submesh_index, s.config_index]
            for s in ind.stage_solution.stages
        ]
        ind_by_whole = stage_objective(chosen, micro)
        rows.append(
            {
                "model": model,
                "cluster": cluster_name,
                "B": micro,
                "layers": ind.num_layers,
                "ranges": int(multi.sum()),
                "median_err": float(np.median(err)) if err.size else 0.0,
                "max_err": float(np.max(err)) if err.size else 0.0,
                "mean_signed": float(np.mean(signed)) if signed.size else 0.0,
                "single_equal": bool(
                    np.allclose(
                        np.diagonal(a, axis1=0, axis2=1),
                        np.diagonal(b, axis1=0, axis2=1),
                        rtol=1e-9,
                        equal_nan=True,
                    )
                ),
                "t_ind": ind.predicted_time,
                "t_whole": whole.predicted_time,
                "t_ind_by_whole": ind_by_whole,
                "s_ind": ind.planning.total_seconds,
                "s_whole": whole.planning.total_seconds,
                "ilps_ind": ind.planning.ilps_solved,
                "ilps_whole": whole.planning.ilps_solved,
                "same_slicing": [
                    (s.layer_start, s.layer_end, s.submesh, s.logical_shape) for s in ind.stages
                ]
                == [(s.layer_start, s.layer_end, s.submesh, s.logical_shape) for s in whole.stages],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def profiling_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "### Individual vs whole profiling of the stage cost table\n",
        "Each model is planned twice from abstract shapes: *individual* composes a layer "
        "range's latency from per-layer ILPs plus the resharding between them; *whole* solves "
        "one ILP per range. *Error* compares the two tables over every multi-layer range that "
        "both price (one-layer ranges are the same ILP; *1-layer equal* checks it). The last "
        "columns price the individual-mode plan's own stages with the whole-range ILPs: how "
        "much the cheap table costs the plan it picks.\n",
        "| model | cluster | B | layers | ranges | median error | max error | mean signed | "
        "1-layer equal | T whole | T individual (own table) | individual plan, whole costs | "
        "loss | same slicing | ILPs ind / whole | planning s ind / whole |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|:---|---:|---:|---:|---:|:---|---:|---:|",
    ]
    for r in rows:
        loss = r["t_ind_by_whole"] / r["t_whole"] - 1.0
        lines.append(
            f"| {r['model']} | {r['cluster']} | {r['B']} | {r['layers']} | {r['ranges']} | "
            f"{r['median_err']:.2%} | {r['max_err']:.2%} | {r['mean_signed']:+.2%} | "
            f"{'yes' if r['single_equal'] else 'no'} | {r['t_whole'] * 1e3:.3f} ms | "
            f"{r['t_ind'] * 1e3:.3f} ms | {r['t_ind_by_whole'] * 1e3:.3f} ms | {loss:+.2%} | "
            f"{'yes' if r['same_slicing'] else 'no'} | {r['ilps_ind']} / {r['ilps_whole']} | "
            f"{r['s_ind']:.1f} / {r['s_whole']:.1f} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- runtime


def _gpt_small_step(one_wide_stage: bool = False) -> tuple[Any, Any, Any, Any]:
    """The runtime benchmarks' case on the current cluster: GPT-small, Adam, two stages of
    one host's 4 devices each (or one stage over both hosts' 8), 8 micro-batches. Returns
    (executable, params, state, batch)."""
    import dataclasses

    import jax

    import alpa_mini
    from alpa_mini.models import adam, init_gpt, make_gpt_batch, make_train_step
    from alpa_mini.models.specs import ModelSpec

    spec = ModelSpec.named("gpt-small")
    config = dataclasses.replace(spec.config, pipeline_marks=True)
    spec = dataclasses.replace(spec, config=config)
    opt = adam(1e-4)
    params = init_gpt(config, jax.random.PRNGKey(0))
    state = opt.init(params)
    batch = make_gpt_batch(config, jax.random.PRNGKey(1), spec.batch_size)
    method = alpa_mini.PipeshardParallel(
        num_micro_batches=8,
        layer_option=alpa_mini.ManualLayerOption(),
        stage_option=alpa_mini.UniformStageOption(1, (2, 4))
        if one_wide_stage
        else alpa_mini.UniformStageOption(num_stages=2, submesh_shape=(1, 4)),
    )
    train_step = make_train_step(spec.loss_fn(), opt, alpa_mini.value_and_grad)
    step = alpa_mini.parallelize(train_step, method=method)
    return step.get_executable(params, state, batch), params, state, batch


def runtime_child(steps: int, one_wide_stage: bool = False) -> dict[str, Any]:
    """In a process with 8 CPU devices: the 2-stage, 8-micro-batch GPT-small step timed as
    the runtime runs it and with every instruction run back to back."""
    import alpa_mini

    alpa_mini.init(cluster="cpu-2x4", num_cpu_devices=8)
    import jax

    from alpa_mini.runtime.instructions import Put, Run

    ex, params, state, batch = _gpt_small_step(one_wide_stage)
    p, s = params, state
    for _ in range(2):  # compile and warm up
        p, s, out = ex(p, s, batch)
        jax.block_until_ready((p, s, out))
    pipelined, back_to_back, runs, stage_runs, puts, others = [], [], [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        p, s, out = ex(p, s, batch)
        jax.block_until_ready((p, s, out))
        pipelined.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        (p, s, out), timeline = ex.profile(p, s, batch)
        jax.block_until_ready((p, s, out))
        back_to_back.append(time.perf_counter() - t0)
        runs.append(sum(t.seconds for t in timeline if isinstance(t.instruction, Run)))
        stage_runs.append(
            sum(
                t.seconds
                for t in timeline
                if isinstance(t.instruction, Run) and t.instruction.program[:3] in ("fwd", "bwd")
            )
        )
        puts.append(sum(t.seconds for t in timeline if isinstance(t.instruction, Put)))
        others.append(sum(t.seconds for t in timeline if not isinstance(t.instruction, Run | Put)))
    n_runs = sum(isinstance(i, Run) for i in ex.compiled.stream)
    return {
        "stream": len(ex.compiled.stream),
        "runs": n_runs,
        "stages": [(s.layer_start, s.layer_end, s.submesh) for s in ex.plan.stages],
        "pipelined": pipelined,
        "back_to_back": back_to_back,
        "run_sum": runs,
        "stage_run_sum": stage_runs,
        "put_sum": puts,
        "other_sum": others,
    }


#: Ray runtime cases: (hosts form a jax.distributed group, one stage spanning both hosts).
RAY_CASES = {"hosts": (False, False), "group": (True, False), "spanning": (True, True)}


def ray_child(steps: int, case: str) -> dict[str, Any]:
    """The runtime benchmark's step on Ray, two host workers x 4 CPU devices: one stage per
    worker ("hosts"), the same with the workers in one jax.distributed group ("group"), or
    one stage over both ("spanning"); step wall time and the driver's dispatch per step."""

    import alpa_mini

    group, wide = RAY_CASES[case]
    alpa_mini.init(cluster="ray", num_hosts=2, num_cpu_devices=4, span_hosts=group)
    try:
        ex, params, state, batch = _gpt_small_step(wide)
        p, s = params, state
        for _ in range(2):  # compile and warm up
            p, s, _ = ex(p, s, batch)
        times, dispatch = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            p, s, _ = ex(p, s, batch)
            times.append(time.perf_counter() - t0)
            dispatch.append(ex.last_dispatch_seconds)
        return {"step": times, "dispatch": dispatch}
    finally:
        alpa_mini.shutdown()


def ray_table(rays: dict[str, dict[str, Any]], local: dict[str, Any], wide: dict[str, Any]) -> str:
    med = statistics.median
    rows = [
        ("hosts", "2 stages, one per worker", local, True),
        ("group", "the same, workers in one `jax.distributed` group", local, False),
        ("spanning", "1 stage over both workers' 8 devices", wide, False),
    ]
    lines = []
    for case, what, base, target in rows:
        r = rays[case]
        ratio = med(r["step"]) / med(base["pipelined"])
        ok = ("yes" if ratio <= 1.10 else "**no**") if target else "–"
        lines.append(
            f"| {what} | {med(r['step']) * 1e3:.1f} | {med(base['pipelined']) * 1e3:.1f} | "
            f"{ratio:.2f} | {ok} | {med(r['dispatch']) * 1e3:.2f} |"
        )
    return (
        "### Ray runtime vs the local runtime\n\n"
        "The same 8-micro-batch GPT-small step on two Ray host workers (embedded Ray, 4 CPU "
        "devices each; activations pass worker to worker through the object store) against "
        "the local runtime running the same plan in one process. *Step* includes sending the "
        "batch; parameters and optimiser state stay on their workers between steps (the "
        "outputs are handles, nothing is fetched). *Dispatch* is the driver issuing the "
        "step's calls. The target applies to the first row (the issue's case). In a "
        "`jax.distributed` group on CPU every collective, also one inside a host, runs over "
        "gloo between threads; the last row's stage mesh spans both workers, so its "
        "collectives cross processes. "
        f"Medians of {len(rays['hosts']['step'])} steps.\n\n"
        "| case | Ray step ms | local step ms | Ray / local | ≤ 1.10 | driver dispatch ms |\n"
        "|---|---:|---:|---:|:---|---:|\n" + "\n".join(lines) + "\n"
    )


def runtime_table(r: dict[str, Any]) -> str:
    med = statistics.median
    ratios = [a / b for a, b in zip(r["pipelined"], r["run_sum"], strict=True)]
    ratio_all = [
        a / (b + c) for a, b, c in zip(r["pipelined"], r["run_sum"], r["put_sum"], strict=True)
    ]
    ok = "yes" if med(ratios) <= 1.2 else "**no**"
    return (
        "\n".join(
            [
                "### Local runtime overhead\n",
                "GPT-small (4 blocks, hidden 256, seq 128, batch 16, fp32) with Adam, "
                f"`UniformStageOption(2, (1, 4))` on `cpu-2x4`, 8 micro-batches, 1F1B: "
                f"{r['stream']} instructions per step, {r['runs']} of them program runs. "
                "*Step* is one call of the executable (asynchronous dispatch, stages may overlap); "
                "*programs back to back* is the sum of the same step's `Run` instructions (stage "
                "forward/backward, fused gradient sums, apply-gradient), each timed to completion "
                "one after another (`PipeshardExecutable.profile`); *puts* are the cross-mesh "
                f"transfers. Medians of {len(ratios)} paired steps.\n",
                "| step ms | programs back to back ms | of which fwd/bwd ms | puts ms | "
                "accumulate/free ms | step / programs | ≤ 1.2 | step / (programs + puts) |",
                "|---:|---:|---:|---:|---:|---:|:---|---:|",
                f"| {med(r['pipelined']) * 1e3:.2f} | {med(r['run_sum']) * 1e3:.2f} | "
                f"{med(r['stage_run_sum']) * 1e3:.2f} | {med(r['put_sum']) * 1e3:.2f} | "
                f"{med(r['other_sum']) * 1e3:.2f} | {med(ratios):.3f} | {ok} | "
                f"{med(ratio_all):.3f} |",
            ]
        )
        + "\n"
    )


# --------------------------------------------------------------------------- main


def _child(flag: str, steps: int) -> dict[str, Any]:
    """Run this module with ``flag`` in a fresh process (its own JAX devices); its result."""
    proc = subprocess.run(
        [_python(), "-m", "benchmarks.pipeshard", flag, f"--steps={steps}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1800,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{flag} child failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT ") :])


def _machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    import jax

    return (
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs "
        f"(1-min load average {load:.1f} at the end), JAX {jax.__version__}, Python "
        f"{platform.python_version()}."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="planning,profiling,runtime,ray")
    parser.add_argument("--cluster", default="dgx-a100", help="cluster the GPT suite plans for")
    parser.add_argument("--steps", type=int, default=10, help="runtime: timed step pairs")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--runtime-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ray-child", choices=list(RAY_CASES), help=argparse.SUPPRESS)
    parser.add_argument("--wide-child", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.runtime_child or opts.wide_child:
        print("RESULT " + json.dumps(runtime_child(opts.steps, opts.wide_child)))
        return 0
    if opts.ray_child:
        print("RESULT " + json.dumps(ray_child(opts.steps, opts.ray_child)))
        return 0
    sections = set(opts.sections.split(","))
    command = " ".join(["python -m benchmarks.pipeshard", *(argv or sys.argv[1:])])
    t0 = time.perf_counter()
    parts = []
    if "planning" in sections:
        parts.append(planning_table(planning_rows(opts.cluster), opts.cluster))
    if "profiling" in sections:
        parts.append(profiling_table(profiling_rows()))
    ray_text = None
    if "runtime" in sections or "ray" in sections:
        local = _child("--runtime-child", opts.steps)
        if "runtime" in sections:
            parts.append(runtime_table(local))
        if "ray" in sections:
            ray_text = (
                "## Ray runtime: step time against the local runtime\n\n"
                f"Command: `{command}` ({datetime.date.today().isoformat()}). {_machine()}\n\n"
                + ray_table(
                    {case: _child(f"--ray-child={case}", opts.steps) for case in RAY_CASES},
                    local,
                    _child("--wide-child", opts.steps),
                ).split("\n", 2)[2]
            )
    header = (
        "## PipeshardParallel: planning time, individual vs whole profiling, runtime overhead\n\n"
        f"Command: `{command}` ({datetime.date.today().isoformat()}). {_machine()} "
        f"Wall time of this run: {time.perf_counter() - t0:.0f} s.\n"
    )
    text = header + "\n" + "\n".join(parts) if parts else ""
    print(text + "\n" + (ray_text or ""))
    if opts.no_write:
        return 0
    # Each section is replaced whole: write the pipeshard one only from a complete run.
    if {"planning", "profiling", "runtime"} <= sections:
        update_section("pipeshard", text)
    elif parts:
        print("(the pipeshard section needs planning,profiling,runtime together: not written)")
    if ray_text is not None:
        update_section("ray-runtime", ray_text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
