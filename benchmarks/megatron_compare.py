"""Megatron-LM's published configurations beside ours: for each row of Megatron-LM's GPT
table (SC'21 Table 1, bundled as ``megatron-*`` configs), its (dp, tp, pp) and ours, with
the simulated iteration time of both on A100 hosts of 8.

    alpa-mini bench megatron                            # every row; BENCHMARKS.md + CSV
    alpa-mini bench megatron --models megatron-1.7b --no-write
    alpa-mini bench megatron --ours kept    # re-price Megatron's sides, keep our plans

Megatron's plan is priced at its published configuration: ``pp`` equal stages of
``dp x tp`` devices (tensor parallelism inside a host), the batch split on the dp axis, and
its layouts two ways: as the strong grid prices it (``baselines.py``'s ``strong-grid``:
every other layout the ILP's best on the (dp, tp) mesh, each stage solved whole and
composed from per-layer ILPs, the better kept; the "Megatron" columns), and with
Megatron-LM's own parameter layouts pinned (``megatron-lm``: column/row/vocabulary splits,
whole-stage ILPs; the "Megatron-LM layouts" column), each at the micro-batch count that fits
best (the paper's micro-batch size is not in the table). Activations are stored unless the
published plan fits no count that way; then every side is priced with every block
recomputed (``GPTConfig.remat``). Ours is the stage DP (``refine=True``, logical meshes
``model_parallel_in_host``) over the same micro-batch counts. Each row runs in a fresh
process; rows run before the Megatron-LM layouts column show "–" there. Rows record the
memory model they were priced with (``_report.MEMORY_MODEL``), and the table lists the sides
priced with an earlier one.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import sys
import time
from collections import Counter
from typing import Any, Literal

from benchmarks._report import (
    GRAPH_MODEL,
    MEMORY_MODEL,
    OTHER_PRICING,
    RESULTS,
    TRANSFER_MODEL,
    comparable,
    earlier_rows,
    even_pricing,
    memory_label,
    not_rerun,
    plan_pricing,
    progress,
    run_child,
    update_section,
)

__all__ = ["ROWS", "keep_ours", "main", "plan_summary", "row"]

PROG = "alpa-mini bench megatron"
ROWS = (
    "megatron-1.7b",
    "megatron-3.6b",
    "megatron-7.5b",
    "megatron-18.4b",
    "megatron-39.1b",
    "megatron-76.1b",
    "megatron-145.6b",
    "megatron-310.1b",
    "megatron-529.6b",
    "megatron-1t",
)
ILP_TIME_LIMIT = 20.0
#: How gradients are synchronised in the runtime the rows are priced for. Rows measured before
#: the once-per-step sync lack the field; their figures stay in ``BEFORE`` for one release.
GRAD_SYNC = "per-step"
#: Rows also record how the stage ILPs (``gradient_sync="ilp"``) price moving a gradient into
#: its parameter's layout. Rows of 2026-11-26 before commit 761eea5 lack it: their ILPs
#: charged that move once per micro-batch while the stage cost charged the rest once per step.
GRAD_SYNC_ILP = "per-step"
STALE = "per step\\*"  # a per-step row whose ILPs still charged the move per micro-batch
#: Our side of a row: planned now with the tuned settings, or kept from its earlier run.
Ours = Literal["tuned", "kept"]
BEFORE = "megatron-before-grad-sync.json"


def _micro_batch_counts(batch: int, dp: int) -> list[int]:
    """Micro-batch counts that leave each data-parallel rank 1, 2, 4 or 8 sequences."""
    out = []
    for per_rank in (1, 2, 4, 8):
        if batch % (dp * per_rank) == 0:
            out.append(batch // (dp * per_rank))
    return out


def row(name: str, time_limit: float, ours: Ours = "tuned") -> dict[str, Any]:
    """Megatron's published configuration and ours for one table row; with ``ours="kept"``
    only Megatron's sides (the caller keeps our plan from the row's earlier run)."""
    import jax

    import alpa_mini
    from alpa_mini import ClusterSpec
    from alpa_mini.errors import MemoryBudgetError
    from alpa_mini.models import adam, make_train_step
    from alpa_mini.models.specs import ModelSpec
    from benchmarks.baselines import evaluate_plan, megatron_splits

    spec = ModelSpec.named(name)
    pub = {"dp": spec.published.dp, "tp": spec.published.tp, "pp": spec.published.pp}
    cluster = ClusterSpec.named("dgx-a100").with_hosts(spec.gpus // 8)
    opt = adam(1e-4)
    ilp = alpa_mini.ShardParallel(time_limit=time_limit)
    per_stage = spec.gpus // pub["pp"]
    submesh = (per_stage // 8, 8) if per_stage >= 8 else (1, per_stage)
    counts = _micro_batch_counts(spec.batch_size, pub["dp"])

    def problem(recompute: bool) -> tuple[Any, tuple[Any, ...]]:
        """The train step and its abstract arguments; ``recompute``: every transformer
        block under ``jax.checkpoint``, so a stage keeps only block inputs per micro-batch
        in flight and recomputes the rest in its backward (the planner prices both)."""
        config = dataclasses.replace(spec.config, pipeline_marks=True, remat=recompute)
        model = dataclasses.replace(spec, config=config)
        params = model.abstract_params()
        args = (params, jax.eval_shape(opt.init, params), model.abstract_batch())
        return make_train_step(model.loss_fn(), opt, alpa_mini.value_and_grad), args

    def best_of(case, make_method, who: str) -> tuple[float, Any, list[str]]:
        step, args = case
        best, best_plan, reasons = math.inf, None, []
        for b in counts:
            tb = time.perf_counter()
            try:
                plan = alpa_mini.plan(step, *args, method=make_method(b), cluster=cluster)
            except MemoryBudgetError as err:
                reasons.append(f"B={b}: {str(err)[:140]}")
                progress(f"{name} {who} B={b}: no plan fits ({time.perf_counter() - tb:.0f} s)")
                continue
            seconds, _, reason = evaluate_plan(plan, cluster)
            took = time.perf_counter() - tb
            progress(f"{name} {who} B={b}: {seconds:.3f} s {reason} ({took:.0f} s)")
            if reason:
                reasons.append(f"B={b}: {reason}")
            elif seconds < best:
                best, best_plan = seconds, plan
        return best, best_plan, reasons

    t0 = time.perf_counter()
    theirs, their_plan, their_reasons = math.inf, None, []
    # Activations are stored, as in every other benchmark, unless the published plan fits
    # at no micro-batch count that way: then both sides are priced with every block
    # recomputed, as Megatron-LM ran these models (SC'21's FLOP count includes the
    # recomputed forward pass).
    stored = problem(False)
    for recompute in (False, True):
        current = problem(True) if recompute else stored
        activations = "recomputed" if recompute else "stored"
        # Each stage solved as one ILP ("whole") and composed from per-layer ILPs (as ours
        # starts from): a whole-stage MIP that stops at its time limit can be far worse
        # than the composition, and Megatron's plan is priced at its best.
        for profiling in ("whole", "individual"):
            seconds, plan, reasons = best_of(
                current,
                lambda b, profiling=profiling: alpa_mini.PipeshardParallel(
                    num_micro_batches=b,
                    layer_option=alpa_mini.ManualLayerOption(),
                    stage_option=alpa_mini.UniformStageOption(
                        pub["pp"], submesh, (pub["dp"], pub["tp"]), profiling=profiling
                    ),
                    default_auto_sharding_option=dataclasses.replace(ilp, batch_axis=0),
                    gradient_sync="ilp",
                ),
                f"Megatron ({profiling}, activations {activations})",
            )
            their_reasons += [f"{profiling}, activations {activations}: {r}" for r in reasons]
            if seconds < theirs:
                theirs, their_plan = seconds, plan
        if their_plan is not None:
            break
    if their_plan is None:  # nothing fits either way: ours as every other row
        recompute, current = False, stored
    their_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    splits = megatron_splits(current[1][0])
    lm_option = dataclasses.replace(ilp, layout="megatron", tensor_splits=splits)
    lm, lm_plan, lm_reasons = math.inf, None, splits.indivisible(pub["tp"])
    if not lm_reasons:  # tp divides the heads, the MLP width and the vocabulary
        lm, lm_plan, lm_reasons = best_of(
            current,
            lambda b: alpa_mini.PipeshardParallel(
                num_micro_batches=b,
                layer_option=alpa_mini.ManualLayerOption(),
                stage_option=alpa_mini.UniformStageOption(
                    pub["pp"], submesh, (pub["dp"], pub["tp"])
                ),
                default_auto_sharding_option=lm_option,
                gradient_sync="ilp",
            ),
            "Megatron-LM layouts",
        )
    lm_seconds = time.perf_counter() - t0
    megatron = {
        "model": name,
        "gpus": spec.gpus,
        "published": pub,
        "theirs": theirs,
        "their_B": None if their_plan is None else their_plan.num_micro_batches,
        "their_reasons": their_reasons,
        "recomputed": recompute,
        "their_seconds": their_seconds,
        "megatron_lm": lm,
        "megatron_lm_B": None if lm_plan is None else lm_plan.num_micro_batches,
        "megatron_lm_reasons": lm_reasons,
        "megatron_lm_seconds": lm_seconds,
    }
    if ours == "kept":
        return megatron
    t0 = time.perf_counter()
    mine, our_plan, our_reasons = best_of(
        current,
        lambda b: alpa_mini.PipeshardParallel(
            num_micro_batches=b,
            layer_option=alpa_mini.ManualLayerOption(),
            stage_option=alpa_mini.AutoStageOption(
                refine=True, logical_shapes="model_parallel_in_host", memory_lean=True
            ),
            default_auto_sharding_option=ilp,
            gradient_sync="ilp",
        ),
        "ours",
    )
    return {
        **megatron,
        "ours": mine,
        "our_choice": plan_summary(our_plan),
        "our_reasons": our_reasons,
        "planning_s": time.perf_counter() - t0,
    }


#: Our side's fields, which ``--ours kept`` carries over from the row's earlier run.
OUR_FIELDS = ("ours", "our_choice", "our_reasons", "planning_s")


def keep_ours(measured: dict[str, Any], earlier: dict[str, Any] | None) -> dict[str, Any]:
    """``measured`` (Megatron's sides only) with our side of the row's earlier run, dated
    (``ours_date``): the table then says which run priced which side."""
    if earlier is None:
        raise SystemExit(
            f"--ours kept: {measured['model']} has no earlier row in megatron.json to keep our "
            "plan from; run it with --ours tuned"
        )
    when = earlier.get("ours_date", earlier.get("date", ""))
    model = earlier.get("ours_memory_model", earlier.get("memory_model"))
    graphs = earlier.get("ours_graph_model", earlier.get("graph_model"))
    links = earlier.get("ours_transfer_model", earlier.get("transfer_model", "one link"))
    kept = {k: earlier[k] for k in OUR_FIELDS}
    return {
        **measured, **kept, "ours_date": when, "ours_memory_model": model,
        "ours_graph_model": graphs, "ours_transfer_model": links,
    }  # fmt: skip


def plan_summary(plan: Any) -> dict[str, Any] | None:
    """Our plan as (dp, tp, pp): pp stages; dp x tp the most common stage's logical mesh
    (1-D meshes read as tp = their size: the ILP decides what each axis splits)."""
    if plan is None:
        return None
    shapes = Counter(tuple(s.logical_shape) for s in plan.stages)
    shape = shapes.most_common(1)[0][0]
    dp, tp = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    return {
        "pp": plan.num_stages,
        "dp": dp,
        "tp": tp,
        "B": plan.num_micro_batches,
        "stage_shapes": {"x".join(map(str, k)): v for k, v in shapes.items()},
        # layers i..j @ submesh (logical mesh): whether the split is Megatron's even one
        "stages": [
            [s.layer_start, s.layer_end, list(s.submesh), list(s.logical_shape)]
            for s in plan.stages
        ],
    }


def _child(name: str, time_limit: float, ours: Ours) -> dict[str, Any]:
    args = ["--child", name, "--time-limit", str(time_limit), "--ours", ours]
    return run_child("benchmarks.megatron_compare", args, timeout=4 * 3600)


def to_markdown(results: list[dict[str, Any]], command: str, wall: float, earlier: str = "") -> str:
    lines = [
        "## Megatron-LM's published configurations beside ours",
        "",
        f"Command: `{command}` ({datetime.date.today().isoformat()}; {wall:.0f} s). {earlier}"
        "Rows of "
        "Megatron-LM's GPT table (SC'21 Table 1) on `dgx-a100` hosts; all plans priced by "
        "the same cost model and pipeline simulator. Megatron: its published (dp, tp, pp), "
        "equal stages, the batch split on the dp axis, each stage the better of one "
        "whole-stage ILP and a composition of per-layer ILPs (the strong grid's pricing), "
        "at the best micro-batch count that fits; *Megatron-LM layouts*: the same "
        "configuration with Megatron-LM's own parameter layouts pinned (column/row/vocabulary "
        "splits over tp; `megatron-lm` in `benchmarks/baselines.py`), whole-stage ILPs; – in "
        "rows run before that column. Activations are stored, unless the published plan "
        "fits no count that way: then every side recomputes every block in its backward "
        "pass, as Megatron-LM ran these models. Ours: the stage DP with "
        "`refine=True`, logical meshes `model_parallel_in_host` (every (dp, tp) with tp "
        "inside a host) and `memory_lean=True`, over the same counts. Our (dp, tp) is the "
        "most common stage mesh. *Sync*: whether the row is priced with gradients reduced once "
        "per step (this runtime since issue 20) or once per micro-batch (before: not re-run "
        "yet); *before* gives the per-micro-batch figures of the same row.",
        "",
        "| model | GPUs | activations | sync | Megatron dp/tp/pp | Megatron s | ours dp/tp/pp | "
        "ours s | ours / Megatron | Megatron-LM layouts s | ours / Megatron-LM | "
        "our planning s | before: Megatron s, ours (dp/tp/pp) s |",
        "|---|---:|---|---|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    notes: list[str] = []
    before = _before_rows()
    for r in results:
        p, o = r["published"], r["our_choice"]
        mine = "–" if o is None else f"{o['dp']}/{o['tp']}/{o['pp']} (B{o['B']})"
        theirs = f"{p['dp']}/{p['tp']}/{p['pp']}" + (
            "" if r["their_B"] is None else f" (B{r['their_B']})"
        )
        activations = "recomputed" if r.get("recomputed") else "stored"
        # Our plan kept from a run priced otherwise is not compared (``_report.pricing``).
        ours = plan_pricing(r, (o or {}).get("stages"), "ours_")
        same = comparable(ours, even_pricing(r, p["pp"]))
        both = math.isfinite(r["theirs"]) and math.isfinite(r["ours"])
        ratio = (f"{r['ours'] / r['theirs']:.3f}" if same else OTHER_CELL) if both else "–"
        sync = _sync_text(r)
        old = before.get(r["model"]) if r.get("grad_sync") == GRAD_SYNC else None
        old_text = "–" if old is None else _before_text(old)
        lm = r.get("megatron_lm")
        lm_text = "–" if lm is None else _seconds(lm)
        fits = lm is not None and math.isfinite(lm) and math.isfinite(r["ours"])
        lm_ratio = (f"{r['ours'] / lm:.3f}" if same else OTHER_CELL) if fits else "–"
        lines.append(
            f"| {r['model']} | {r['gpus']} | {activations} | {sync} | {theirs} "
            f"| {_seconds(r['theirs'])} | {mine} | "
            f"{_seconds(r['ours'])} | {ratio} | {lm_text} | {lm_ratio} | "
            f"{r['planning_s']:.0f} | {old_text} |"
        )
        if not math.isfinite(r["theirs"]):
            notes.append(f"- {r['model']}, Megatron: " + "; ".join(r["their_reasons"])[:300])
        if lm is not None and not math.isfinite(lm):
            why = "; ".join(r.get("megatron_lm_reasons", []))[:300]
            notes.append(f"- {r['model']}, Megatron-LM layouts: {why}")
        if not math.isfinite(r["ours"]):
            notes.append(f"- {r['model']}, ours: " + "; ".join(r["our_reasons"])[:300])
    notes += _memory_notes(results)
    if any(OTHER_CELL in line for line in lines):
        notes.append(
            f"- {OTHER_CELL}: our tuned plan was priced on stage graphs with dead code "
            "(before 2026-11-28, evening: `_report.GRAPH_MODEL`) or with the transfers between "
            "its stages over one link (before 2026-11-29, afternoon: "
            "`_report.TRANSFER_MODEL`), Megatron's side not, so their seconds are not "
            "compared; the defaults are, in *Plans with the defaults*"
        )
    stale = [r["model"] for r in results if _sync_text(r) == STALE]
    if stale:
        notes.append(
            f"- {', '.join(stale)} (*per step\\**): measured before the stage ILPs charged the "
            "move of a gradient into its parameter's layout once per step too (they charged it "
            "once per micro-batch, leaning against data parallelism); to be re-run"
        )
    return "\n".join([*lines, *([""] if notes else []), *notes]) + "\n"


#: A ratio left out: the two sides were priced differently (``_report.pricing``).
OTHER_CELL = f"– ({OTHER_PRICING})"


def _memory_notes(results: list[dict[str, Any]]) -> list[str]:
    """Which sides of which rows were priced with an earlier memory model, and which rows
    keep our plan from an earlier run (``--ours kept``)."""
    out = []
    for side, field in (("Megatron's sides", "memory_model"), ("Ours", "ours_memory_model")):
        earlier = [r for r in results if r.get(field) != MEMORY_MODEL]
        if earlier:
            named = ", ".join(f"{r['model']} ({memory_label(r, field)})" for r in earlier)
            out.append(f"- {side} priced with an earlier memory model: {named}")
    kept = [f"{r['model']} ({r['ours_date']})" for r in results if "ours_date" in r]
    if kept:
        out.append(f"- Ours kept from an earlier run (`--ours kept`): {', '.join(kept)}")
    return out


def _sync_text(r: dict[str, Any]) -> str:
    if r.get("grad_sync") != GRAD_SYNC:
        return "per micro-batch"
    return "per step" if r.get("grad_sync_ilp") == GRAD_SYNC_ILP else STALE


def _before_rows() -> dict[str, dict[str, Any]]:
    path = RESULTS / BEFORE
    return {r["model"]: r for r in json.loads(path.read_text())} if path.exists() else {}


def _before_text(r: dict[str, Any]) -> str:
    o = r["our_choice"]
    mine = "–" if o is None else f"{o['dp']}/{o['tp']}/{o['pp']} (B{o['B']})"
    return f"{_seconds(r['theirs'])}, {mine} {_seconds(r['ours'])}"


def _seconds(value: float) -> str:
    """A simulated iteration time, or why there is none (see the row's note)."""
    return f"{value:.2f}" if math.isfinite(value) else "no plan fits"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ROWS))
    parser.add_argument("--time-limit", type=float, default=ILP_TIME_LIMIT)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument(
        "--ours",
        choices=["tuned", "kept"],
        default="tuned",
        help="our plan: planned with the tuned settings, or kept from the row's earlier run "
        "(only Megatron's sides re-priced)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        print("RESULT " + json.dumps(row(opts.child, opts.time_limit, opts.ours)), flush=True)
        return 0
    models = [m for m in opts.models.split(",") if m]
    unknown = [m for m in models if m not in ROWS]
    if unknown:
        parser.error(f"--models: {unknown[0]!r} is not a table row; rows: {', '.join(ROWS)}")
    command = f"{PROG} " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    kept = [] if opts.no_write else earlier_rows("megatron.json")
    before = {r["model"]: r for r in (kept or earlier_rows("megatron.json"))}
    results = []
    for k, name in enumerate(models):
        print(f"{name} ...", flush=True)
        measured = _child(name, opts.time_limit, opts.ours)
        if opts.ours == "kept":
            measured = keep_ours(measured, before.get(name))
        today = datetime.date.today().isoformat()
        sync = {"grad_sync": GRAD_SYNC, "grad_sync_ilp": GRAD_SYNC_ILP}
        memory = {
            "memory_model": MEMORY_MODEL, "graph_model": GRAPH_MODEL,
            "transfer_model": TRANSFER_MODEL,
        }  # fmt: skip
        if opts.ours == "tuned":
            memory |= {
                "ours_memory_model": MEMORY_MODEL, "ours_graph_model": GRAPH_MODEL,
                "ours_transfer_model": TRANSFER_MODEL,
            }  # fmt: skip
        results.append({**sync, **measured, "date": today, **memory})
        print(json.dumps(results[-1]), flush=True)
        if not opts.no_write:  # after every row: a long run that stops keeps what it measured
            partial = "" if k == len(models) - 1 else f" (partial: {k + 1} of {len(models)} rows)"
            _write(
                not_rerun(kept, results),
                results,
                command.strip() + partial,
                time.perf_counter() - t0,
            )
    print(to_markdown(results, command.strip(), time.perf_counter() - t0))
    return 0


def _write(
    kept: list[dict[str, Any]], results: list[dict[str, Any]], command: str, wall: float
) -> None:
    merged = sorted(kept + results, key=lambda r: ROWS.index(r["model"]))
    earlier = ""
    if kept:
        dates = ", ".join(sorted({r.get("date", "") for r in kept}))
        earlier = f"{', '.join(r['model'] for r in kept)} are kept from earlier runs ({dates}). "
    text = to_markdown(merged, command, wall, earlier)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "megatron.csv").open("w", newline="") as f:
        fields = ["model", "gpus", "published", "theirs", "their_B", "ours", "our_choice"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(merged)
    (RESULTS / "megatron.json").write_text(json.dumps(merged, indent=1))
    update_section("megatron", text)


if __name__ == "__main__":
    raise SystemExit(main())
