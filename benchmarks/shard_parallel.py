"""ShardParallel: planning time of GPT-2 1.3B, step time against plain ``jax.jit``, and the
plan's predicted collectives against the compiled HLO's.

    python -m benchmarks.shard_parallel            # everything (unrolled 1.3B capped, ~12 min)
    python -m benchmarks.shard_parallel --quick    # smoke check, prints only (< 3 min)
    python -m benchmarks.shard_parallel --sections planning --layouts "" --profile unrolled

Three tables, written to the ``shard-parallel`` section of BENCHMARKS.md (unless
``--no-write``). ``--quick`` plans only the scanned 1.3B and only on mesh (8,), times the
steps on mesh (8,), checks collectives on (8,) and (2, 4), and prints instead of writing
(``--write`` forces it): the ILP on 2-D/3-D meshes alone takes minutes (see the tables).

1. **Planning**: GPT-2 1.3B (24 layers, hidden 2048, seq 1024, vocab 51200) with Adam,
   planned by ``ShardParallel()`` (its own mesh search) from
   ``jax.ShapeDtypeStruct`` leaves only, for 8 devices of ``--cluster`` (default
   ``dgx-a100``: the local CPU devices' 2 GiB each cannot hold 1.3B parameters with Adam).
   Each layout (``scan_layers`` True/False) runs in its own process, cut at ``--cap`` s.
   Per mesh shape (``ShardingPlan.mesh_search``): ILP status, ILP-core nodes, seconds,
   prediction; the total is ``ShardingPlan.planning.total_seconds`` of ``alpa_mini.plan``
   (trace + OpGraph + every mesh shape). Afterwards every 1-D/2-D/3-D factorisation of 8
   that the search did not plan is planned alone (fixed ``mesh_shape``; not part of the
   total), so every shape has a figure.
   ``--profile`` reruns one layout under cProfile and tabulates the top functions.
2. **Step time**: the planned executable (``Executable.jitted`` on placed inputs) against
   ``jax.jit(train_step, in_shardings=..., out_shardings=...)`` with the same input and
   output shardings and no intermediate constraints; runs alternate; medians of ``--steps``
   and the median of the per-round ratios.
3. **Communication fidelity**: ``Executable.collectives()`` for every test model on (8,),
   (2,4) and (2,2,2): predicted vs HLO-parsed tensor counts per kind, and bytes.

Per-mesh-shape timings come from the plan itself (``ShardingPlan.mesh_search``, one
``MeshTrial`` per mesh) and phase timings from ``ShardingPlan.planning``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import datetime
import io
import json
import math
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._report import ROOT, update_section

SECTION = "shard-parallel"
NUM_DEVICES = 8
FIDELITY_MESHES: tuple[tuple[int, ...], ...] = ((8,), (2, 4), (2, 2, 2))
TARGET_PLANNING_S = 10.0
TARGET_STEP_RATIO = 1.05
KIND_ABBREV = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}

Record = dict[str, Any]


# ================================================================ 1. planning GPT-2 1.3B
def _gpt13b_step(scan: bool, batch_size: int) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The Adam train step of GPT-2 1.3B and its abstract (params, opt_state, batch)."""
    import jax

    from alpa_mini.models import (
        GPT2_1_3B,
        adam,
        gpt_abstract_batch,
        gpt_abstract_params,
        gpt_loss,
        make_train_step,
    )

    config = dataclasses.replace(GPT2_1_3B, scan_layers=scan)
    opt = adam(1e-4)
    params = gpt_abstract_params(config)
    state = jax.eval_shape(opt.init, params)
    batch = gpt_abstract_batch(config, batch_size)
    return make_train_step(gpt_loss, opt), (params, state, batch)


def mesh_factorisations(n: int) -> list[tuple[int, ...]]:
    """Every 1-D, 2-D and 3-D mesh of ``n`` devices whose axes all exceed 1."""
    shapes: list[tuple[int, ...]] = [(n,)]
    shapes += [(a, n // a) for a in range(2, n) if n % a == 0]
    shapes += [
        (a, b, n // (a * b))
        for a in range(2, n)
        for b in range(2, n)
        if n % (a * b) == 0 and n // (a * b) > 1
    ]
    return shapes


def _top_functions(prof: cProfile.Profile, key: str, limit: int) -> list[Record]:
    """The ``limit`` costliest functions by ``key`` (tottime/cumtime), paths shortened."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:limit]:  # type: ignore[attr-defined]
        _cc, nc, tt, ct, _ = stats.stats[func]  # type: ignore[attr-defined]
        filename, line, name = func
        short = filename
        for marker in (str(ROOT) + "/", "site-packages/"):
            if marker in short:
                short = short.split(marker, 1)[1]
        rows.append({"func": f"{short}:{line}({name})", "ncalls": nc, "tottime": tt, "cumtime": ct})
    return rows


def plan_child(
    variant: str,
    cluster: str,
    batch_size: int,
    out: Path,
    profile: bool,
    mesh: tuple[int, ...] | None,
) -> None:
    """Child process: plan GPT-2 1.3B (mesh search unless ``mesh``), appending JSON records
    to ``out``: one per mesh tried (from the plan's ``mesh_search``), the phases (from its
    ``planning``), and each progress line as it comes (what is left if the child is cut)."""
    import alpa_mini

    alpa_mini.init(cluster=cluster, num_cpu_devices=NUM_DEVICES)

    def emit(record: Record) -> None:
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")

    t0 = time.perf_counter()
    fun, args = _gpt13b_step(variant == "scan", batch_size)
    emit({"kind": "abstract", "wall": time.perf_counter() - t0})

    def plan_on(shape: tuple[int, ...] | None, phase: str) -> Any:
        def heard(line: str) -> None:
            emit({"kind": "progress", "phase": phase, "line": line})

        method = alpa_mini.ShardParallel(mesh_shape=shape)
        plan = alpa_mini.plan(fun, *args, method=method, progress=heard)
        for trial in plan.mesh_search:
            emit({"kind": "shape", "phase": phase, **_trial_record(trial)})
        return plan

    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    total: Record = {"kind": "total"}
    try:
        if prof is not None:
            prof.enable()
        plan = plan_on(mesh, "search")
    except Exception as err:
        total.update(wall=time.perf_counter() - t0, error=f"{type(err).__name__}: {err}")
    else:
        stats = plan.planning
        total.update(
            wall=time.perf_counter() - t0,
            planning_time=stats.total_seconds,
            trace_time=stats.trace_seconds,
            graph_time=stats.graph_seconds,
            graph_nodes=len(plan.nodes),
            mesh=list(plan.mesh_shape),
            predicted=plan.predicted_time,
        )
    finally:
        if prof is not None:
            prof.disable()
    emit(total)
    if prof is not None:
        emit(
            {
                "kind": "profile",
                "tottime": _top_functions(prof, "tottime", 25),
                "cumtime": _top_functions(prof, "cumulative", 40),
            }
        )
        return
    if mesh is None:  # every factorisation the search skipped or never reached, one by one
        records = [json.loads(line) for line in out.read_text().splitlines()]
        tried = {tuple(r["mesh"]) for r in records if r["kind"] == "shape"}
        for shape in mesh_factorisations(NUM_DEVICES):
            if shape in tried:
                continue
            try:
                plan_on(shape, "alone")
            except Exception as err:  # nothing fits on this mesh alone: say so
                emit({"kind": "shape", "phase": "alone", "mesh": list(shape), "wall": None,
                      "status": type(err).__name__})  # fmt: skip


def _trial_record(trial: Any) -> Record:
    return {
        "mesh": list(trial.shape),
        "status": trial.outcome,
        "core_nodes": trial.core_nodes,
        "wall": trial.seconds,
        "predicted": trial.predicted_time,
        "peak": trial.peak_memory,
    }


def run_plan_child(
    variant: str,
    cluster: str,
    batch_size: int,
    cap: float,
    profile: bool,
    mesh: tuple[int, ...] | None = None,
) -> tuple[list[Record], bool, float]:
    """Run ``plan_child`` in a fresh process cut at ``cap`` s: (records, finished, seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.jsonl"
        cmd = [
            sys.executable, "-m", "benchmarks.shard_parallel", "--child", variant,
            "--child-out", str(out), "--cluster", cluster, "--batch", str(batch_size),
        ]  # fmt: skip
        if profile:
            cmd.append("--child-profile")
        if mesh is not None:
            cmd += ["--child-mesh", ",".join(map(str, mesh))]
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=cap, capture_output=True)
            finished = True
            if proc.returncode:
                print(proc.stderr.decode()[-3000:], file=sys.stderr)
        except subprocess.TimeoutExpired:
            finished = False
        seconds = time.perf_counter() - t0
        text = out.read_text() if out.exists() else ""
    return [json.loads(line) for line in text.splitlines()], finished, seconds


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _seconds(t: float | None) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.3f} s"


def planning_tables(results: dict[str, tuple[list[Record], bool, float]], cap: float) -> str:
    """Markdown: a per-mesh-shape table and a per-layout summary."""
    shape_rows = [
        "| layout | mesh | phase | ILP status | ILP nodes after simplification "
        "| shape total s | predicted step | peak / device |",
        "|:---|:---|:---|:---|---:|---:|---:|---:|",
    ]
    summary = [
        "| layout | abstract args s | trace s | OpGraph s | mesh shapes s | total planning s "
        f"| ≤ {TARGET_PLANNING_S:.0f} s | chosen mesh | predicted step |",
        "|:---|---:|---:|---:|---:|---:|:---:|:---|---:|",
    ]
    for variant, (records, finished, _) in results.items():
        layout = "scan_layers=True" if variant == "scan" else "unrolled"
        shapes = [r for r in records if r["kind"] == "shape"]
        for r in shapes:
            peak = "-" if r.get("peak") is None else f"{r['peak'] / 2**30:.1f} GiB"
            shape_rows.append(
                f"| {layout} | {tuple(r['mesh'])} | {r['phase']} | {r['status']} "
                f"| {r.get('core_nodes') or '-'} | {_fmt(r['wall'])} "
                f"| {_seconds(r.get('predicted'))} | {peak} |"
            )
        if not finished:
            heard = sum(1 for r in records if r["kind"] == "progress")
            shape_rows.append(
                f"| {layout} | (cut) | | did not finish in {cap:.0f} s ({heard} meshes done) "
                "| | | | |"
            )
        total = next((r for r in records if r["kind"] == "total"), None)
        abstract = next((r["wall"] for r in records if r["kind"] == "abstract"), None)
        graph = None if total is None else total.get("graph_time")
        search_s = sum(r["wall"] for r in shapes if r["phase"] == "search")
        if total is None:
            plan_s, met, chosen, pred = f"did not finish in {cap:.0f} s", "no", "-", "-"
            trace = "-"
        elif "error" in total:
            plan_s = f"failed after {total['wall']:.1f} s ({total['error'].split(':')[0]})"
            met, chosen, pred, trace = "no", "none", "-", "-"
        else:
            plan_s = f"{total['planning_time']:.1f}"
            met = "yes" if total["planning_time"] <= TARGET_PLANNING_S else "no"
            chosen, pred = str(tuple(total["mesh"])), _seconds(total["predicted"])
            trace = _fmt(total["trace_time"])
        summary.append(
            f"| {layout} | {_fmt(abstract)} | {trace} | {_fmt(graph)} | {_fmt(search_s)} "
            f"| {plan_s} | {met} | {chosen} | {pred} |"
        )
    return "\n".join(summary) + "\n\n" + "\n".join(shape_rows)


def profile_table(records: list[Record], limit: int = 15) -> str:
    """Markdown: the profiled run's top functions by own time."""
    prof = next((r for r in records if r["kind"] == "profile"), None)
    if prof is None:
        return "(the profiled run did not finish)"
    lines = ["| function | calls | own s | cumulative s |", "|:---|---:|---:|---:|"]
    for row in prof["tottime"][:limit]:
        lines.append(
            f"| `{row['func']}` | {row['ncalls']} | {row['tottime']:.2f} | {row['cumtime']:.2f} |"
        )
    return "\n".join(lines)


def print_profile(records: list[Record]) -> None:
    prof = next((r for r in records if r["kind"] == "profile"), None)
    if prof is None:
        print("profile: the profiled run did not finish")
        return
    for key in ("tottime", "cumtime"):
        print(f"\n-- top functions by {key}")
        for row in prof[key]:
            print(f"{row['tottime']:9.2f} {row['cumtime']:9.2f} {row['ncalls']:>9} {row['func']}")


# ================================================================ shared model zoo
@dataclasses.dataclass(frozen=True)
class Workload:
    """A train step and its (params, opt_state, batch) as abstract or concrete arrays."""

    name: str
    step: Callable[..., Any]
    make_args: Callable[[bool], tuple[Any, ...]]  # concrete? -> (params, opt_state, batch)


def _workload(name: str, init: Any, batch: Any, loss: Any, config: Any, bs: int) -> Workload:
    import jax

    from alpa_mini.models import adam, make_train_step

    opt = adam(1e-3)

    def make_args(concrete: bool) -> tuple[Any, ...]:
        def build() -> tuple[Any, ...]:
            params = init(config, jax.random.key(0))
            return params, opt.init(params), batch(config, jax.random.key(1), bs)

        if concrete:
            return jax.jit(build)()
        return jax.eval_shape(build)

    return Workload(name, make_train_step(lambda p, b: loss(p, b), opt), make_args)


def fidelity_workloads() -> list[Workload]:
    """The test models: MLP, GPT_TINY (unrolled and scanned), MoE, Wide-ResNet."""
    from alpa_mini import models as m

    gpt_scan = dataclasses.replace(m.GPT_TINY, scan_layers=True)
    return [
        _workload(
            "MLP", m.init_mlp, m.make_mlp_batch, m.mlp_loss,
            m.MLPConfig(in_dim=128, hidden=512, out_dim=128, num_layers=3), 64,
        ),
        _workload("GPT_TINY", m.init_gpt, m.make_gpt_batch, m.gpt_loss, m.GPT_TINY, 16),
        _workload("GPT_TINY scan", m.init_gpt, m.make_gpt_batch, m.gpt_loss, gpt_scan, 16),
        _workload(
            "MoE", m.init_moe, m.make_moe_batch, m.moe_loss,
            m.MoEConfig(hidden=64, ffn=256, num_experts=8, seq_len=32), 16,
        ),
        _workload(
            "Wide-ResNet", m.init_wide_resnet, m.make_wide_resnet_batch, m.wide_resnet_loss,
            m.WideResNetConfig(image_size=16, in_channels=3, width=32, num_blocks=2,
                               num_classes=10), 16,
        ),
    ]  # fmt: skip


def step_workloads() -> list[Workload]:
    """Models big enough that a CPU step takes ~0.1-1 s, so dispatch noise does not dominate."""
    from alpa_mini import models as m

    return [
        _workload("GPT_SMALL", m.init_gpt, m.make_gpt_batch, m.gpt_loss, m.GPT_SMALL, 8),
        _workload(
            "MLP", m.init_mlp, m.make_mlp_batch, m.mlp_loss,
            m.MLPConfig(in_dim=512, hidden=2048, out_dim=512, num_layers=4), 256,
        ),
    ]  # fmt: skip


# ================================================================ 2. step time
def step_time_table(
    workloads: list[Workload], steps: int, warmup: int, mesh: tuple[int, ...] | None
) -> str:
    """Markdown: ours vs hand-written ``jax.jit`` with the same in/out shardings."""
    import jax

    import alpa_mini
    from alpa_mini.shard.lower import named_sharding

    lines = [
        "| model | mesh | ours median s | jax.jit median s | paired ratio "
        f"| ≤ {TARGET_STEP_RATIO} | ratio of medians | ratio of minima | predicted step "
        "| loss diff | planning s | ILP status |",
        "|:---|:---|---:|---:|---:|:---:|---:|---:|---:|---:|---:|:---|",
    ]
    for w in workloads:
        args = w.make_args(True)
        step = alpa_mini.parallelize(w.step, method=alpa_mini.ShardParallel(mesh_shape=mesh))
        ex = step.get_executable(*args)
        placed = [
            jax.device_put(x, s)
            for x, s in zip(jax.tree.leaves(args), ex.input_shardings, strict=True)
        ]
        out_shardings = jax.tree.unflatten(
            ex.out_tree,
            [
                named_sharding(ex.mesh, spec, len(ex.plan.tensors[t].shape))
                for t, spec in zip(ex.plan.outputs, ex.plan.output_specs, strict=True)
            ],
        )
        baseline = jax.jit(
            w.step,
            in_shardings=tuple(jax.tree.unflatten(ex.in_tree, ex.input_shardings)),
            out_shardings=out_shardings,
        )
        base_args = jax.tree.unflatten(ex.in_tree, placed)

        def ours(placed: list[Any] = placed, ex: Any = ex) -> Any:
            return jax.block_until_ready(ex.jitted(*placed))

        def base(args: Any = base_args, fn: Any = baseline) -> Any:
            return jax.block_until_ready(fn(*args))

        loss_diff = abs(float(ours()[-1]) - float(base()[-1]))  # also the first warm-up step
        for _ in range(warmup - 1):
            ours()
            base()
        t_ours: list[float] = []
        t_base: list[float] = []
        for i in range(steps):  # alternate which side runs first, so load drifts hit both
            pair = ((ours, t_ours), (base, t_base))
            for fn, acc in pair if i % 2 == 0 else pair[::-1]:
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        mo, mb = statistics.median(t_ours), statistics.median(t_base)
        # Adjacent runs share the machine's load of the moment: their ratio cancels it.
        paired = statistics.median(a / b for a, b in zip(t_ours, t_base, strict=True))
        row = (
            f"| {w.name} | {ex.plan.mesh_shape} | {mo:.4f} | {mb:.4f} | {paired:.3f} "
            f"| {'yes' if paired <= TARGET_STEP_RATIO else 'no'} | {mo / mb:.3f} "
            f"| {min(t_ours) / min(t_base):.3f} | {_seconds(ex.plan.predicted_time)} "
            f"| {loss_diff:.1e} | {ex.planning_time:.1f} "
            f"| {ex.plan.solver.get('status')} |"
        )
        print(row, flush=True)
        print(f"   ours {[round(t, 4) for t in t_ours]}", flush=True)
        print(f"   base {[round(t, 4) for t in t_base]}", flush=True)
        lines.append(row)
    return "\n".join(lines)


# ================================================================ 3. communication fidelity
def _tensor_bytes(c: Any) -> list[int]:
    """Bytes of each logical tensor one parsed HLO collective moves (cost-model convention)."""
    if c.num_tensors == 1:
        return [c.bytes]
    return list(c.result_bytes if c.kind == "all-gather" else c.operand_bytes)


def _unmatched(plan: Any, hlo: list[Any]) -> str:
    """Collectives left over on each side after pairing equal (kind, bytes) ones."""
    from collections import Counter

    planned = Counter((c.kind, round(c.nbytes)) for c in plan.collectives)
    parsed = Counter((c.kind, b) for c in hlo for b in _tensor_bytes(c))
    extra, missing = parsed - planned, planned - parsed
    items = [(k, b, n, "+") for (k, b), n in extra.items()]
    items += [(k, b, n, "−") for (k, b), n in missing.items()]
    items.sort(key=lambda i: (i[0], i[3], -i[1]))
    return ", ".join(
        f"{KIND_ABBREV[k]} {sign}{_kib(b)}" + (f" ×{n}" if n > 1 else "") for k, b, n, sign in items
    )


def fidelity_table(
    workloads: list[Workload], meshes: tuple[tuple[int, ...], ...]
) -> tuple[str, list[Record]]:
    """Markdown: predicted vs HLO collectives per kind; and the raw rows for analysis."""
    import alpa_mini
    from alpa_mini.inspect.hlo_collectives import KINDS, parse_collectives

    head = " | ".join(f"{KIND_ABBREV[k]} plan/HLO" for k in KINDS)
    lines = [
        f"| model | mesh | {head} | plan bytes | HLO bytes (in loops) | plan/HLO bytes | match "
        "| unpaired tensors: HLO + / plan − |",
        "|:---|:---|" + "---:|" * len(KINDS) + "---:|---:|---:|:---:|:---|",
    ]
    raw = []
    for w in workloads:
        args = w.make_args(False)
        for shape in meshes:
            step = alpa_mini.parallelize(w.step, method=alpa_mini.ShardParallel(mesh_shape=shape))
            ex = step.get_executable(*args)
            rep = ex.collectives()
            cells, same = [], True
            for k in KINDS:
                pc = rep.predicted.get(k, (0, 0.0))[0]
                hc = rep.hlo[k].count if k in rep.hlo else 0
                same &= pc == hc
                cells.append(
                    "·" if pc == hc == 0 else f"{pc}/{hc}" if pc == hc else f"**{pc}/{hc}**"
                )
            pb = sum(b for _, b in rep.predicted.values())
            hb = sum(s.bytes for s in rep.hlo.values())
            lb = sum(s.loop_bytes for s in rep.hlo.values())
            ratio = rep.byte_ratio()
            same &= ratio is None or math.isclose(ratio, 1.0, rel_tol=0.01)
            unpaired = _unmatched(ex.plan, parse_collectives(ex.get_hlo_text()))
            row = (
                f"| {w.name} | {shape} | {' | '.join(cells)} | {_kib(pb)} | {_kib(hb)}"
                f"{f' ({_kib(lb)})' if lb else ''} | {'-' if ratio is None else f'{ratio:.3f}'} "
                f"| {'yes' if same else 'no'} | {unpaired or '-'} |"
            )
            print(row, flush=True)
            lines.append(row)
            raw.append({"model": w.name, "mesh": shape, "report": str(rep)})
    return "\n".join(lines), raw


def _kib(b: float) -> str:
    if not b:
        return "0"
    kib = b / 1024
    return f"{kib:,.0f} KiB" if kib == round(kib) else f"{kib:,.2f} KiB"


# ================================================================ driver
def _machine_note() -> str:
    import jax

    load = os.getloadavg()[0]
    return (
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs "
        f"(1-min load average {load:.1f} at the end of the run), {NUM_DEVICES} simulated JAX CPU "
        f"devices, JAX {jax.__version__}, Python {platform.python_version()}."
    )


def _mesh_arg(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke check: scan 1.3B on mesh (8,) only, fixed meshes, fewer steps; no write",
    )
    parser.add_argument(
        "--sections", default="planning,step,fidelity", help="comma list of the tables to run"
    )
    parser.add_argument("--layouts", help="1.3B layouts to time (default scan,unrolled)")
    parser.add_argument("--cluster", default="dgx-a100", help="cluster the 1.3B plan is for")
    parser.add_argument("--batch", type=int, default=8, help="1.3B global batch size")
    parser.add_argument("--cap", type=float, default=900.0, help="1.3B cut per layout, s")
    parser.add_argument(
        "--profile",
        choices=("scan", "unrolled", "both", "none"),
        help="cProfile 1.3B layouts (default: both; quick: none)",
    )
    parser.add_argument("--steps", type=int, help="timed steps per side (default 20; quick 6)")
    parser.add_argument("--write", action="store_true", help="write BENCHMARKS.md even if quick")
    parser.add_argument("--no-write", action="store_true", help="do not write BENCHMARKS.md")
    parser.add_argument("--child", choices=("scan", "unrolled"), help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-mesh", type=_mesh_arg, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        plan_child(
            opts.child, opts.cluster, opts.batch, opts.child_out, opts.child_profile,
            opts.child_mesh,
        )  # fmt: skip
        return 0

    quick = opts.quick
    sections = set(opts.sections.split(","))
    layouts = opts.layouts if opts.layouts is not None else "scan" if quick else "scan,unrolled"
    profile = opts.profile or ("none" if quick else "both")
    steps = opts.steps or (6 if quick else 20)
    plan_mesh = (NUM_DEVICES,) if quick else None
    step_mesh = (NUM_DEVICES,) if quick else None
    meshes = FIDELITY_MESHES[:2] if quick else FIDELITY_MESHES
    write = opts.write or not (quick or opts.no_write)
    command = " ".join(["python -m benchmarks.shard_parallel", *(argv or sys.argv[1:])])
    parts = [
        "## ShardParallel: planning time, step time, communication fidelity\n\n",
        f"Command: `{command}` ({datetime.date.today().isoformat()}). ",
    ]
    t_start = time.perf_counter()

    if "planning" in sections:
        results = {}
        for variant in filter(None, layouts.split(",")):
            print(f"planning GPT-2 1.3B ({variant}) in a child process ...", flush=True)
            results[variant] = run_plan_child(
                variant, opts.cluster, opts.batch, opts.cap, False, plan_mesh
            )
            for r in results[variant][0]:
                print("  ", json.dumps(r)[:300], flush=True)
        searched = sorted(
            {
                tuple(r["mesh"])
                for records, _, _ in results.values()
                for r in records
                if r["kind"] == "shape" and r["phase"] == "search"
            },
            key=lambda m: (len(m), m),
        )
        how = (
            f"mesh search over {', '.join(map(str, searched))}"
            if plan_mesh is None
            else "one mesh shape"
        )
        method = (
            "ShardParallel()" if plan_mesh is None else f"ShardParallel(mesh_shape={plan_mesh})"
        )
        parts.append(
            "\n### Planning GPT-2 1.3B (24 layers, hidden 2048, seq 1024, vocab 51200), Adam\n\n"
            f"`{method}` on 8 devices of cluster `{opts.cluster}` "
            f"({how}; ILP time limit 60 s per "
            f"shape), global batch {opts.batch}, from `jax.ShapeDtypeStruct` leaves only. Each "
            f"layout plans in its own process, cut at {opts.cap:.0f} s. Target: total ≤ "
            f"{TARGET_PLANNING_S:.0f} s. *Total planning* is `plan.planning.total_seconds` "
            "of `alpa_mini.plan` (trace + OpGraph + every mesh shape); *abstract args* "
            "(building the ShapeDtypeStruct pytrees) is not part of it. Rows marked *alone* "
            "are the other factorisations of 8 devices, planned afterwards one at a time with that "
            "`mesh_shape` fixed (not part of the total), so that every shape has a figure.\n\n"
        )
        if results:
            table = planning_tables(results, opts.cap)
            print(table, flush=True)
            parts.append(table + "\n")
        profiled = {"both": ("scan", "unrolled"), "none": ()}.get(profile, (profile,))
        for variant in profiled:
            print(f"profiling GPT-2 1.3B ({variant}) ...", flush=True)
            records, _, _ = run_plan_child(
                variant, opts.cluster, opts.batch, opts.cap, True, plan_mesh
            )
            print_profile(records)
            parts.append(
                f"\nWhere the time goes: cProfile of the mesh search of one more `{variant}` run "
                "(its overhead inflates Python-heavy code), top functions by own time.\n\n"
                + profile_table(records)
                + "\n"
            )

    if sections & {"step", "fidelity"}:
        import alpa_mini

        alpa_mini.init(cluster="local", num_cpu_devices=NUM_DEVICES)
    if "step" in sections:
        print("step time ...", flush=True)
        table = step_time_table(step_workloads(), steps, 2, step_mesh)
        how = "with mesh search" if step_mesh is None else f"on mesh {step_mesh}"
        parts.append(
            "\n### Step time: planned executable vs plain `jax.jit`\n\n"
            f"Cluster `local` (8 CPU devices), `ShardParallel()` {how}, Adam. Ours is "
            "`Executable.jitted` (every planned layout pinned); the baseline is `jax.jit(step, "
            "in_shardings=..., out_shardings=...)` with the plan's input and output shardings "
            f"and no constraint in between. Both run on the same placed arrays; {steps} timed "
            "steps each after 2 warm-up steps, alternating which side runs first. *Paired "
            "ratio* is the median over steps of ours / baseline of the same round (the two "
            "runs of a round share the shared machine's load of the moment, which swings "
            f"step times by up to 2x here); target: paired ratio ≤ {TARGET_STEP_RATIO}. "
            "*Predicted step* is the plan's cost model with the nominal "
            "(uncalibrated) CPU figures; *loss diff* is |loss ours − loss baseline| on the "
            "first step.\n\n" + table + "\n"
        )
    if "fidelity" in sections:
        print("communication fidelity ...", flush=True)
        table, _ = fidelity_table(fidelity_workloads(), meshes)
        parts.append(
            "\n### Communication fidelity: predicted vs compiled collectives\n\n"
            "`ShardParallel(mesh_shape=...)` on cluster `local`, Adam; "
            "`Executable.collectives()`. Cells are tensor counts, plan / HLO (AR all-reduce, AG "
            "all-gather, RS reduce-scatter, A2A all-to-all, CP collective-permute; · none either "
            "side; bold: they differ). Bytes are per device; a collective inside a `while` loop "
            "(scan) counts once on both sides. Match: equal counts and bytes within 1 %. The "
            "last column pairs equal (kind, bytes) tensors and lists what is left: + only in "
            "the HLO, − only in the plan.\n\n" + table + "\n"
        )

    wall = time.perf_counter() - t_start
    parts.insert(2, _machine_note() + f" Wall time of this run: {wall:.0f} s.\n")
    markdown = "".join(parts)
    if write:
        update_section(SECTION, markdown)
    else:
        print("\n" + markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
