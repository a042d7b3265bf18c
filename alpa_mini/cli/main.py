"""``alpa-mini`` command line: solve sharding problems (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..graph.planning_stats import PlanningStats
from ..options.pipeshard import LOGICAL_SHAPE_SPACES
from ..solvers.errors import InfeasibleError, SolverInputError, SolverTimeLimitError
from ..solvers.sharding.problem import ShardingProblem, load_iopddl
from ..solvers.sharding.solve import ShardingSolution, solve_sharding

__all__ = ["main", "model_floor"]

EXAMPLE = "example_problem.json"


def _example_path() -> Path:
    return Path(str(resources.files("alpa_mini") / "data" / EXAMPLE))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alpa-mini", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    solve = sub.add_parser(
        "solve",
        help="solve a sharding problem file (IOPDDL JSON, .json or .json.gz)",
        description="Solve a sharding problem and print the choice, its cost and the status.",
    )
    solve.add_argument("problem", nargs="?", help=f"problem file (default: the bundled {EXAMPLE})")
    solve.add_argument("--backend", default="auto", choices=["auto", "highs", "cbc"])
    solve.add_argument("--time-limit", type=float, default=None, help="seconds (default: none)")
    solve.add_argument("--usage-limit", type=float, default=None, help="override the memory limit")
    solve.add_argument("--no-limit", action="store_true", help="ignore the file's usage limit")
    solve.add_argument(
        "--no-simplify", action="store_true", help="solve without graph simplification"
    )
    solve.add_argument(
        "--show", type=int, default=30, help="nodes listed in the table (default 30)"
    )
    solve.add_argument("--json", type=Path, default=None, help="also write the solution as JSON")
    demo = sub.add_parser(
        "demo",
        help="plan and train a GPT on simulated CPU devices and check it against JAX",
        description="Plan a GPT train step on N simulated CPU devices (PipeshardParallel with "
        "auto layers and stages, or ShardParallel with --method shard), run a few steps, "
        "and compare with serial JAX.",
    )
    demo.add_argument("--method", default="pipeshard", choices=["pipeshard", "shard"])
    demo.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    demo.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    demo.add_argument("--micro-batches", type=int, default=4, help="pipeshard: B (default 4)")
    demo.add_argument("--layers", type=int, default=4, help="pipeshard: auto layers (default 4)")
    demo.add_argument(
        "--cluster", default="cpu-2x4", help="pipeshard: cluster name or YAML (default cpu-2x4)"
    )
    demo.add_argument(
        "--mesh", default=None, help="shard: logical mesh shape, e.g. 2,4 (default: searched)"
    )
    demo.add_argument("--scan", action="store_true", help="shard: layers with lax.scan")
    _add_plan_parser(sub)
    books = sub.add_parser(
        "notebooks",
        help="run the checkout's notebooks top to bottom (as CI does), optionally saving figures",
        description="Execute notebooks/*.ipynb with nbclient on the CPU test mode; a failing "
        "cell fails the command. The notebooks in git stay output-free.",
    )
    books.add_argument("only", nargs="*", help="name prefixes to run, e.g. 01 03 (default: all)")
    books.add_argument(
        "--figures", type=Path, default=None, help="folder the notebooks save their figures in"
    )
    bench = sub.add_parser(
        "bench",
        help="run an evaluation benchmark (from a source checkout) and update BENCHMARKS.md",
        description="Evaluation benchmarks; arguments after the name go to the benchmark "
        "(try `alpa-mini bench plan-quality --help`).",
    )
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    return parser


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    """``alpa-mini plan``: its flags are the options a user would set; the rest are searched."""
    plan = sub.add_parser(
        "plan",
        help="plan a model with PipeshardParallel from abstract shapes and print the plan",
        description="Two-level planning (stage DP + per-stage ILPs) of a benchmark model's Adam "
        "train step on a cluster description; no parameters are allocated.",
    )
    plan.add_argument("--model", default="gpt-tiny", help="configs/models name or YAML path")
    plan.add_argument("--cluster", default="cpu-1x8", help="configs/clusters name or YAML path")
    plan.add_argument("--hosts", type=int, default=None, help="override the cluster's host count")
    plan.add_argument("--devices-per-host", type=int, default=None, help="override devices/host")
    plan.add_argument(
        "--micro-batches",
        type=_micro_batches,
        default="auto",
        help="B, or auto (default): searched over the batch's divisors nearest each power of two",
    )
    plan.add_argument("--batch-size", type=int, default=None, help="global batch (default: YAML)")
    plan.add_argument(
        "--profiling",
        default="individual",
        choices=["individual", "whole"],
        help="stage costs from per-layer ILPs (fast) or one ILP per layer range",
    )
    plan.add_argument(
        "--logical-shapes",
        default="model_parallel_in_host",
        choices=list(LOGICAL_SHAPE_SPACES),
        help="logical meshes per submesh (default model_parallel_in_host: every (dp, tp), tp in "
        "a host)",
    )
    plan.add_argument(
        "--memory-lean",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also offer the DP ZeRO-3-sharded layers, for when speed-chosen layers do not fit "
        "(default on)",
    )
    plan.add_argument(
        "--marks",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cut layers at the model's own pipeline markers (default); --no-marks plans it "
        "as an unmarked loop over its blocks, cut where its blocks repeat",
    )
    plan.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    plan.add_argument(
        "--activations",
        default="auto",
        choices=["auto", "stored", "recomputed"],
        help="keep each block's activations for its backward, or recompute the block there "
        "(auto, the default: stored, recomputed when no plan fits stored)",
    )
    plan.add_argument("--json", type=Path, default=None, help="write the plan as JSON")
    plan.add_argument(
        "--floor",
        action="store_true",
        help="also print the compute floor: the seconds per iteration no plan beats on this "
        "cluster under the cost model (one more trace of the step)",
    )


#: ``alpa-mini bench NAME`` -> module of the checkout's ``benchmarks`` package.
BENCHMARKS = {
    "calibration": "calibration",
    "compute-floor": "compute_floor",
    "default-plans": "default_plans",
    "megatron": "megatron_compare",
    "plan-quality": "plan_quality",
    "planning-time": "planning_time",
    "sync-pricing": "sync_pricing",
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    if args.command == "solve":
        return _solve(args, console)
    if args.command == "demo":
        return _demo(args, console)
    if args.command == "plan":
        return _plan(args, console)
    if args.command == "bench":
        return _bench(args, console)
    if args.command == "notebooks":
        return _notebooks(args, console)
    return 2  # argparse rejects unknown commands before this


def _notebooks(args: argparse.Namespace, console: Console) -> int:
    """Execute the notebooks; report each one's time, or the cell that failed."""
    from .notebooks import find_notebooks, run_notebook

    try:
        books = find_notebooks(args.only)
    except FileNotFoundError as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    import time

    for book in books:
        t0 = time.perf_counter()
        try:
            run_notebook(book, figures=args.figures)
        except Exception as err:  # nbclient's CellExecutionError carries the cell and traceback
            console.print(f"[red]{book.name} failed:[/]")
            console.print(str(err), markup=False, highlight=False)
            return 1
        console.print(f"{book.name}: ran in {time.perf_counter() - t0:.1f} s")
    if args.figures is not None:
        console.print(f"figures in {args.figures}")
    return 0


def _bench(args: argparse.Namespace, console: Console) -> int:
    """Run ``benchmarks/<name>.py`` of the source checkout this package was installed from."""
    import importlib

    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "__init__.py").is_file():
        console.print(
            f"[red]error:[/] alpa-mini bench {args.name} runs from a source checkout (it needs "
            f"the benchmarks/ folder beside alpa_mini/, not found under {root}); clone the "
            "repository and `pip install -e .` there"
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module(f"benchmarks.{BENCHMARKS[args.name]}")
    return int(module.main(list(args.rest)) or 0)


def _micro_batches(text: str) -> int | str:
    """``--micro-batches``: "auto" or a positive count."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; expected auto or a count >= 1")
    return value


def _plan(args: argparse.Namespace, console: Console) -> int:
    """Plan from abstract shapes; prints the plan, optionally writes its JSON."""
    import dataclasses
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from ..cluster.spec import ClusterSpec
    from ..errors import ConfigError, MemoryBudgetError
    from ..models.specs import ModelSpec
    from ..options.pipeshard import AutoStageOption, ManualLayerOption, PipeshardParallel

    try:
        spec = ModelSpec.load_any(args.model)
        cluster = (
            ClusterSpec.load(args.cluster)
            if Path(args.cluster).is_file()
            else ClusterSpec.named(args.cluster)
        )
        if args.hosts is not None:
            cluster = cluster.with_hosts(args.hosts)
        if args.devices_per_host is not None:
            cluster = dataclasses.replace(cluster, devices_per_host=args.devices_per_host)
        config = spec.config
        if hasattr(config, "pipeline_marks"):  # layers end at the model's own boundaries
            config = dataclasses.replace(config, pipeline_marks=args.marks)
            spec = dataclasses.replace(spec, config=config)
        if args.activations != "stored" and not hasattr(spec.config, "remat"):
            if args.activations == "recomputed":
                raise ConfigError(
                    f"--activations: {spec.name} has no recomputation option; use stored or auto"
                )
            args.activations = "stored"
        method = PipeshardParallel(
            num_micro_batches=None if args.micro_batches == "auto" else args.micro_batches,
            layer_option=ManualLayerOption(),
            stage_option=AutoStageOption(
                profiling=args.profiling,
                logical_shapes=args.logical_shapes,
                memory_lean=args.memory_lean,
            ),
            pipeline_schedule=args.schedule,
        )
        try:
            planned = _plan_model(spec, method, cluster, args, args.activations == "recomputed")
        except MemoryBudgetError as err:
            if args.activations != "auto":
                raise
            console.print(f"no plan fits with activations stored ({str(err)[:200]}...); "
                          "planning again with every block recomputed in its backward")  # fmt: skip
            planned = _plan_model(spec, method, cluster, args, True)
            args.activations = "recomputed"
    except (ConfigError, ValueError) as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    console.print(planned.summary())
    if args.activations == "recomputed":
        console.print("activations: every block recomputed in its backward pass")
    p = planned.planning or PlanningStats()
    if p.micro_batches_tried:
        tried = ", ".join(
            f"B={b}: " + ("does not fit" if t is None else f"{t * 1e3:.1f} ms")
            for b, t in sorted(p.micro_batches_tried)
        )
        for b, t in sorted(p.micro_batches_dominated):
            tried += f", B={b}: over {t * 1e3:.1f} ms (stopped at its bound)"
        console.print(f"micro-batch counts planned: {tried}")
    console.print(
        f"planned in {p.total_seconds:.2f} s; ILPs solved {p.ilps_solved}"
        + (f" ({p.ilps_bounded} left at their LP bound)" if p.ilps_bounded else "")
        + f", cost-table entries {p.cost_entries} ({p.cache_hits} from the cache)"
    )
    if args.floor:
        recompute = args.activations == "recomputed"
        floor = model_floor(spec, method, cluster, args.batch_size, recompute)
        console.print(
            f"compute floor {floor * 1e3:.4g} ms/iter (the whole batch's work over all "
            f"{cluster.num_devices} devices, no communication): this plan is "
            f"{planned.predicted_time / floor:.3f}x it"
        )
    if args.json is not None:
        args.json.write_text(planned.to_json())
        console.print(f"plan written to {args.json}")
    return 0


def _model_step(spec, batch_size: int | None, recompute: bool):
    """The bundled model's Adam step and its abstract (params, state, batch); ``recompute``:
    every block under ``jax.checkpoint`` (the model config's ``remat``)."""
    import dataclasses

    import jax

    from ..graph.micro_batch import value_and_grad
    from ..models import adam, make_train_step

    if recompute:
        spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, remat=True))
    opt = adam(1e-4)
    params = spec.abstract_params()
    state = jax.eval_shape(opt.init, params)
    batch = spec.abstract_batch(batch_size)
    return make_train_step(spec.loss_fn(), opt, value_and_grad), (params, state, batch)


def _plan_model(spec, method, cluster, args: argparse.Namespace, recompute: bool):
    """``alpa_mini.plan`` of the bundled model's Adam step from abstract shapes."""
    from ..api import plan

    step, step_args = _model_step(spec, args.batch_size, recompute)
    with Console(stderr=True).status("planning") as status:
        return plan(step, *step_args, method=method, cluster=cluster, progress=status.update)


def model_floor(
    spec, method, cluster, batch_size: int | None = None, recompute: bool = False
) -> float:
    """``executable.traced_floor`` of a bundled model's Adam step (``alpa-mini plan``'s, also
    read by ``benchmarks/compute_floor.py``): the seconds per iteration no plan beats on
    ``cluster`` under the cost model."""
    from ..api import parallelize
    from ..pipeline.executable import StepFun, traced_floor

    step, step_args = _model_step(spec, batch_size, recompute)
    call = parallelize(step, method=method)._prepare(step_args)
    return traced_floor(StepFun(step, (), call.in_tree), call.avals, call.roles, method, cluster)


def _demo(args: argparse.Namespace, console: Console) -> int:
    from .demo import run_demo, run_pipeshard_demo

    if args.method == "pipeshard":
        if args.mesh or args.scan:
            console.print("[red]--mesh and --scan belong to --method shard[/]")
            return 2
        if args.devices != 8 and args.cluster != "local":
            console.print("[red]--devices needs --cluster local (a named cluster fixes it)[/]")
            return 2

        def run() -> dict:
            return run_pipeshard_demo(
                num_devices=args.devices,
                steps=args.steps,
                num_micro_batches=args.micro_batches,
                num_layers=args.layers,
                cluster_name=args.cluster,
                console=console,
            )
    else:
        mesh = None
        if args.mesh:
            try:
                mesh = tuple(int(x) for x in args.mesh.split(","))
            except ValueError:
                console.print(f"[red]--mesh: {args.mesh!r} is not a shape like 8 or 2,4[/]")
                return 2

        def run() -> dict:
            return run_demo(
                num_devices=args.devices,
                steps=args.steps,
                mesh_shape=mesh,
                scan_layers=args.scan,
                console=console,
            )

    try:
        result = run()
    except (ValueError, RuntimeError) as err:
        console.print(f"[red]error:[/] {err}")
        return 2
    return 0 if result["ok"] else 1


def _solve(args: argparse.Namespace, console: Console) -> int:
    path = Path(args.problem) if args.problem else _example_path()
    try:
        problem = load_iopddl(path)
    except (SolverInputError, OSError) as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    if args.no_limit:
        problem = problem.with_usage_limit(None)
    elif args.usage_limit is not None:
        problem = problem.with_usage_limit(args.usage_limit)
    info = problem.summary()
    console.print(
        f"[bold]{info['name'] or path.name}[/bold]: {info['nodes']} nodes, {info['edges']} edges, "
        f"{info['strategies']} strategies, usage limit {info['usage_limit']}"
    )
    try:
        sol = solve_sharding(
            problem,
            backend=args.backend,
            time_limit=args.time_limit,
            simplify_graph=not args.no_simplify,
        )
    except (InfeasibleError, SolverTimeLimitError, SolverInputError) as err:
        console.print(f"[red]{type(err).__name__}:[/red] {err}")
        return 1
    console.print(_choice_table(problem, sol, args.show))
    console.print(_status_table(sol))
    if args.json:
        args.json.write_text(sol.to_json())
        console.print(f"solution written to {args.json}")
    return 0


def _choice_table(problem: ShardingProblem, sol: ShardingSolution, show: int) -> Table:
    table = Table(title="chosen strategy per node", show_lines=False)
    for col in ("node", "strategy", "node cost", "usage", "live"):
        table.add_column(col, justify="right" if col not in ("node", "strategy") else "left")
    for v in range(min(problem.num_nodes, show)):
        i = sol.choice[v]
        start, end = problem.intervals[v]
        table.add_row(
            problem.node_label(v),
            problem.strategy_label(v, i),
            f"{problem.costs_of(v)[i]:,.6g}",
            f"{problem.usages_of(v)[i]:,.6g}",
            f"[{start}, {end})",
        )
    if problem.num_nodes > show:
        table.caption = f"first {show} of {problem.num_nodes} nodes (--show N for more)"
    return table


def _status_table(sol: ShardingSolution) -> Table:
    table = Table(title="solution", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    for label, value in sol.rows():
        table.add_row(label, value)
    return table
