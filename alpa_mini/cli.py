"""``alpa-mini`` command line: solve sharding problems (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .solvers.errors import InfeasibleError, SolverInputError, SolverTimeLimitError
from .solvers.ilp import ShardingSolution, solve_sharding
from .solvers.sharding_problem import ShardingProblem, load_iopddl

__all__ = ["main"]

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
        help="auto-shard a GPT train step on simulated CPU devices and check it against JAX",
        description="Plan a GPT train step with ShardParallel on N simulated CPU devices, run "
        "a few steps, and compare with serial JAX.",
    )
    demo.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    demo.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    demo.add_argument(
        "--mesh", default=None, help="logical mesh shape, e.g. 2,4 (default: searched)"
    )
    demo.add_argument("--scan", action="store_true", help="write the layers with lax.scan")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    if args.command == "solve":
        return _solve(args, console)
    if args.command == "demo":
        return _demo(args, console)
    return 2  # argparse rejects unknown commands before this


def _demo(args: argparse.Namespace, console: Console) -> int:
    from .demo import run_demo

    mesh = None
    if args.mesh:
        try:
            mesh = tuple(int(x) for x in args.mesh.split(","))
        except ValueError:
            console.print(f"[red]--mesh: {args.mesh!r} is not a shape like 8 or 2,4[/]")
            return 2
    try:
        result = run_demo(
            num_devices=args.devices,
            steps=args.steps,
            mesh_shape=mesh,
            scan_layers=args.scan,
            console=console,
        )
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


if __name__ == "__main__":
    sys.exit(main())
