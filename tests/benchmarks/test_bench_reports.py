"""The evaluation benchmarks' arithmetic: growth exponents, ratios against targets, and the
``alpa-mini bench`` entry point (the benchmarks themselves run outside the test suite)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from alpa_mini.cli.main import main as cli_main
from benchmarks.calibration import error_summary
from benchmarks.calibration import to_markdown as calibration_markdown
from benchmarks.plan_quality import micro_batch_counts, to_csv_rows, to_markdown
from benchmarks.planning_time import fit_exponents


def test_growth_exponents_recover_a_power_law():
    points = [
        {"layers": n, "devices": d, "seconds": 0.3 * n**1.5 * d**0.25}
        for n in (24, 48, 96)
        for d in (8, 64, 512)
    ]
    a, b, r2 = fit_exponents(points)
    assert a == pytest.approx(1.5) and b == pytest.approx(0.25) and r2 == pytest.approx(1.0)


def _result(model, family, ours, baselines):
    return {
        "model": model,
        "family": family,
        "gpus": 8,
        "baselines": [
            {"name": n, "time": t, "config": c, "reason": r, "seconds": 1.0}
            for n, t, c, r in baselines
        ],
        "best_baseline": min(baselines, key=lambda b: b[1])[0],
        "ours": {
            "time": ours,
            "stages": [[0, 3, [1, 8], [2, 4]]] if math.isfinite(ours) else [],
            "micro_batches": 16,
            "reasons": [] if math.isfinite(ours) else ["B=16: memory_budget: too big"],
        },
        "planning_s": 2.0,
    }


def test_ratios_are_against_the_best_baseline_and_the_family_target():
    cfg = {"dp": 2, "tp": 4, "pp": 1, "micro_batches": 16}
    rows = to_csv_rows(
        [
            _result(
                "gpt-x", "gpt", 9.5, [("data-parallel", 12.0, cfg, ""), ("megatron", 10.0, cfg, "")]
            ),
            _result("moe-x", "moe", 9.5, [("megatron", 10.0, cfg, "")]),
            _result("wresnet-x", "wresnet", math.inf, [("zero-3", 4.0, cfg, "")]),
        ]
    )
    gpt, moe, wrn = rows
    # Rows written before the rename say "megatron": read as the strong grid.
    assert (gpt["baseline"], gpt["ratio"], gpt["target"], gpt["met"]) == (
        "strong-grid",
        0.95,
        1.0,
        True,
    )
    # One target against the best baseline for every family (the family targets stand
    # against the faithful baselines).
    assert (moe["ratio"], moe["target"], moe["met"]) == (0.95, 1.0, True)
    assert math.isinf(wrn["ratio"]) and not wrn["met"] and "memory_budget" in wrn["note"]
    text = to_markdown(rows, "alpa-mini bench plan-quality", 1.0)
    assert "| moe-x | 8 | strong-grid | dp2 tp4 pp1 B16 |" in text
    # A row without a plan of ours misses it.
    wrn_row = "| wresnet-x | 8 | zero-3 | dp2 tp4 pp1 B16 | 4.000 | *tuned* – | inf | inf |"
    assert f"{wrn_row} ≤ 1.00 | **no** |" in text
    assert "0-3@1x8(2x4)" in text
    assert text.count("| per micro-batch | – |") == 3  # rows measured before issue 20


def test_rows_rerun_with_once_per_step_sync_show_their_earlier_figures():
    cfg = {"dp": 2, "tp": 4, "pp": 1, "micro_batches": 16}
    old = _result("gpt-x", "gpt", 12.0, [("megatron", 10.0, cfg, "")])
    new = dict(_result("gpt-x", "gpt", 9.0, [("megatron", 10.0, cfg, "")]), grad_sync="per-step")
    (row,) = to_csv_rows([new], before={"gpt-x": old})
    assert (row["ratio"], row["grad_sync"], row["before"]) == (
        0.9,
        "per step",
        "10.000, 12.000 (1.200)",
    )
    assert row["met"]
    (unsynced,) = to_csv_rows([old], before={"gpt-x": old})
    assert (unsynced["grad_sync"], unsynced["before"]) == ("per micro-batch", "–")
    text = to_markdown([row], "alpa-mini bench plan-quality", 1.0)
    row = "| 0.900 | ≤ 1.00 | yes | megatron-lm – | – | 0.900 | 2.0 | exhaustive | per step |"
    assert row + " 10.000, 12.000 (1.200) |" in text


def test_rows_compare_ours_with_the_faithful_baseline_and_the_strong_grid():
    """Each family's faithful baseline (Megatron-LM, DeepSpeed-MoE, PP-DP) and the strong grid
    get their own ratio; the faithful target tightens on 16+ GPUs (0.95 / 0.5 / 0.8), and a
    faithful baseline that fits nowhere counts as beaten."""
    cfg = {"dp": 2, "tp": 4, "pp": 1, "micro_batches": 16}
    ep = {"dp": 8, "ep": 4, "pp": 1, "micro_batches": 16}
    gpt = _result(
        "gpt-x", "gpt", 9.0, [("strong-grid", 9.5, cfg, ""), ("megatron-lm", 10.0, cfg, "")]
    )
    moe = _result(
        "moe-x", "moe", 4.0, [("deepspeed-moe", 10.0, ep, ""), ("strong-grid", 5.0, cfg, "")]
    )
    wrn = _result(
        "wresnet-x", "wresnet", 9.0, [("pp-dp", math.inf, {}, "OOM"), ("zero-3", 9.9, cfg, "")]
    )
    for r in (gpt, moe, wrn):
        r["gpus"] = 16
    g, m, w = to_csv_rows([gpt, moe, wrn])
    assert (g["faithful"], g["faithful_s"], g["ratio_faithful"]) == ("megatron-lm", 10.0, 0.9)
    assert (g["faithful_target"], g["faithful_met"]) == (0.95, True)
    assert g["ratio_strong_grid"] == pytest.approx(9.0 / 9.5)
    assert (m["ratio_faithful"], m["faithful_target"], m["faithful_met"]) == (0.4, 0.5, True)
    assert m["ratio_strong_grid"] == 0.8 and m["baseline"] == "strong-grid"
    assert math.isinf(w["faithful_s"]) and w["faithful_met"]  # PP-DP fits nowhere
    assert math.isnan(w["ratio_strong_grid"])  # not run in that row
    text = to_markdown([g, m, w], "alpa-mini bench plan-quality", 1.0)
    assert "| megatron-lm 10.000 | 0.900 ≤ 0.95 yes | 0.947 |" in text
    assert "| deepspeed-moe 10.000 | 0.400 ≤ 0.50 yes | 0.800 |" in text
    assert "dp8 ep4 pp1 B16" not in text  # the best baseline is the strong grid
    assert "| pp-dp no fit | – ≤ 0.80 yes | – |" in text
    gpt["gpus"] = 8  # below 16 GPUs the faithful target is 1.00
    (small,) = to_csv_rows([gpt])
    assert small["faithful_target"] == 1.0


def test_rows_whose_batch_the_default_counts_do_not_divide_use_the_nearest_divisors():
    """WResNet-13B's batch of 1520 = 2^4 * 5 * 19 has none of 32 ... 256 as a divisor; each
    count becomes the divisor nearest by ratio (38 = 32 * 1.19 beats 20 = 32 / 1.6), and the
    row says so. A batch the defaults divide keeps them."""
    assert micro_batch_counts(1536, (32, 64, 128, 256)) == (32, 64, 128, 256)
    assert micro_batch_counts(1520, (32, 64, 128, 256)) == (38, 76, 152, 304)
    assert micro_batch_counts(12, (4, 5, 6)) == (4, 6)  # 5 -> 6 (6/5 < 5/4), counted once
    row = _result("wresnet-y", "wresnet", 9.0, [("megatron", 10.0, {}, "")])
    row.update(batch_size=1520, micro_batch_counts=[38, 76, 152, 304])
    (csv_row,) = to_csv_rows([row])
    assert "micro-batch counts 38, 76, 152, 304 for both sides" in csv_row["note"]


def test_bench_names_its_benchmarks(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "nonsense"])
    assert "plan-quality" in capsys.readouterr().err


#: One Megatron-table row as ``megatron_compare.row`` returns it (a run before the sync fields).
MEGATRON_ROW = {
    "model": "megatron-x",
    "gpus": 32,
    "published": {"dp": 32, "tp": 1, "pp": 1},
    "theirs": 10.0,
    "their_B": 8,
    "their_reasons": [],
    "ours": 8.0,
    "our_choice": {"dp": 4, "tp": 8, "pp": 1, "B": 16},
    "our_reasons": [],
    "planning_s": 3.0,
}


def test_megatron_rows_kept_ours_and_the_memory_model_they_were_priced_with():
    from benchmarks.megatron_compare import keep_ours
    from benchmarks.megatron_compare import to_markdown as megatron_markdown

    earlier = dict(MEGATRON_ROW, date="2026-11-26")
    # Megatron's sides re-priced (slower now), ours carried over with its date.
    theirs = {k: v for k, v in earlier.items() if k not in ("ours", "our_choice", "date")}
    measured = dict(theirs, theirs=12.0, memory_model="accumulators")
    row = keep_ours(measured, earlier)
    assert (row["ours"], row["theirs"], row["ours_date"]) == (8.0, 12.0, "2026-11-26")
    assert row["our_choice"] == earlier["our_choice"] and row["planning_s"] == 3.0
    assert keep_ours(measured, row)["ours_date"] == "2026-11-26"  # kept twice: still its own
    text = megatron_markdown([row, earlier], "alpa-mini bench megatron", 1.0)
    assert "| 8.00 | 0.667 |" in text  # ours / Megatron over the re-priced side
    assert "- Megatron's sides priced with an earlier memory model: megatron-x (11-28), " in text
    assert (
        "- Ours priced with an earlier memory model: megatron-x (11-26), megatron-x (11-26)\n"
        in text
    )
    assert "- Ours kept from an earlier run (`--ours kept`): megatron-x (2026-11-26)" in text
    # Megatron's side re-priced on other stage graphs than our kept plan: not compared.
    regraphed = keep_ours(dict(measured, graph_model="dead code dropped"), earlier)
    text = megatron_markdown([regraphed], "alpa-mini bench megatron", 1.0)
    assert "| 8.00 | – (other pricing) |" in text
    assert "- – (other pricing): our tuned plan was priced on stage graphs with dead code" in text
    with pytest.raises(SystemExit, match="megatron-x has no earlier row"):
        keep_ours(measured, None)


def test_megatron_rows_report_both_layouts_and_the_ratio():
    from benchmarks.megatron_compare import _micro_batch_counts
    from benchmarks.megatron_compare import to_markdown as megatron_markdown

    # 512 sequences over dp 32: 1, 2, 4 or 8 per rank and micro-batch
    assert _micro_batch_counts(512, 32) == [16, 8, 4, 2]
    assert _micro_batch_counts(24, 16) == []  # 24 does not split over 16 ranks
    result = dict(MEGATRON_ROW)
    text = megatron_markdown([result], "alpa-mini bench megatron", 1.0)
    # A row measured before gradients were synchronised once per step says so.
    row = (
        "| megatron-x | 32 | stored | per micro-batch | 32/1/1 (B8) | 10.00 | 4/8/1 (B16) "
        "| 8.00 | 0.800 | – | – | 3 | – |"
    )
    assert row in text
    # Rows with Megatron-LM's own layouts priced too show them and ours / them.
    lm = dict(result, megatron_lm=12.5, megatron_lm_B=8, megatron_lm_reasons=[])
    text = megatron_markdown([lm], "alpa-mini bench megatron", 1.0)
    assert "| 8.00 | 0.800 | 12.50 | 0.640 | 3 | – |" in text
    unfit_lm = dict(lm, megatron_lm=math.inf, megatron_lm_reasons=["B=8: 90 GiB"])
    text = megatron_markdown([unfit_lm], "alpa-mini bench megatron", 1.0)
    assert "| 0.800 | no plan fits | – | 3 |" in text
    assert "- megatron-x, Megatron-LM layouts: B=8: 90 GiB" in text
    per_step = {"grad_sync": "per-step", "grad_sync_ilp": "per-step"}
    text = megatron_markdown(
        [dict(result, recomputed=True, **per_step)], "alpa-mini bench megatron", 1.0
    )
    assert "| megatron-x | 32 | recomputed | per step | 32/1/1 (B8) |" in text
    # A re-run row shows its per-micro-batch figures beside (benchmarks/results snapshot).
    again = dict(result, model="megatron-1.7b", **per_step)
    text = megatron_markdown([again], "alpa-mini bench megatron", 1.0)
    assert "| 8.04, 8/4/1 (B8) 6.74 |\n" in text, text
    # A row whose stage ILPs still priced the gradient's move per micro-batch is marked.
    stale = dict(result, grad_sync="per-step")
    text = megatron_markdown([stale], "alpa-mini bench megatron", 1.0)
    assert "| megatron-x | 32 | stored | per step\\* |" in text
    assert "- megatron-x (*per step\\**): measured before" in text
    # A published plan that fits at no micro-batch count: no ratio, and the reason shown.
    unfit = dict(result, theirs=math.inf, their_B=None, their_reasons=["whole: B=8: 90 GiB"])
    text = megatron_markdown([unfit], "alpa-mini bench megatron", 1.0)
    row = "| megatron-x | 32 | stored | per micro-batch | 32/1/1 | no plan fits | 4/8/1 (B16) |"
    assert row in text
    assert "- megatron-x, Megatron: whole: B=8: 90 GiB" in text


def _point(model, stage, cluster, predicted, measured):
    return {
        "model": model,
        "layout": "1x4dev (4)",
        "stage": stage,
        "cluster": cluster,
        "predicted": predicted,
        "measured": measured,
    }


def test_calibration_error_is_the_median_relative_error_per_cluster():
    points = [
        _point("a", 0, "profiled", 1.1, 1.0),  # 10%
        _point("a", 1, "profiled", 0.7, 1.0),  # 30%
        _point("b", 0, "profiled", 2.1, 2.0),  # 5%
        _point("a", 0, "nominal", 3.0, 1.0),  # 200%
    ]
    profiled = error_summary(points, "profiled")
    assert profiled["median"] == pytest.approx(0.10)
    assert profiled["max"] == pytest.approx(0.30) and profiled["count"] == 3
    assert error_summary(points, "nominal")["median"] == pytest.approx(2.0)
    profile = {"machine": "m", "compute": [], "collectives": []}
    text = calibration_markdown(points, profile, "alpa-mini bench calibration", 1.0)
    assert "Median absolute error with the profile: 10.0%** over 3 stages" in text
    assert "target ≤ 15%: met" in text
    assert "| a | 1x4dev (4) | 1 | 700.00 | 1000.00 | 30% | – | – | – |" in text
    worse = [dict(p, predicted=p["predicted"] * 2) for p in points]
    assert "**missed**" in calibration_markdown(worse, profile, "cmd", 1.0)


def test_benchmark_children_report_progress_results_and_failures(capsys):
    """``run_child`` echoes a child's progress lines as they come, returns its RESULT, and
    names the child and its own stderr when it fails, runs past its timeout or is killed."""
    from benchmarks._report import run_child

    assert run_child("tests.helpers.bench_child_probe", ["ok"], timeout=120) == {"rows": 2}
    shown = capsys.readouterr().out.splitlines()
    assert shown == ["  row 1 of 2", "  row 2 of 2"]
    with pytest.raises(
        RuntimeError, match=r"(?s)bench_child_probe fail failed \(exit status 3\).*own reason"
    ):
        run_child("tests.helpers.bench_child_probe", ["fail"], timeout=120)
    with pytest.raises(RuntimeError, match=r"bench_child_probe hang killed after its 2 s timeout"):
        run_child("tests.helpers.bench_child_probe", ["hang"], timeout=2)
    # A SIGKILL from outside (the out-of-memory killer) is not called a timeout.
    with pytest.raises(RuntimeError, match=r"killed \(SIGKILL, most likely out of memory\)"):
        run_child("tests.helpers.bench_child_probe", ["killed"], timeout=120)


#: A defaults-table row as `benchmarks.default_plans.row` writes it (the report tests vary it).
DEFAULTS_ROW = {
    "model": "gpt-x",
    "gpus": 8,
    "micro_batches": 64,
    "stages": 1,
    "predicted_s": 10.0,
    "planning_s": 4.0,
    "peak_rss_gib": 0.5,
    "rss": "VmHWM",
    "tried": [[64, 10.0]],
    "sync": "ilp",
}


def test_default_plans_rows_say_which_memory_model_they_were_planned_with():
    from benchmarks._report import MEMORY_MODEL
    from benchmarks.default_plans import to_markdown as defaults_markdown

    base = dict(DEFAULTS_ROW, tried=[[32, None], [64, 10.0]])
    rows = [base, dict(base, memory_model="accumulators"), dict(base, memory_model=MEMORY_MODEL)]
    text = defaults_markdown(rows, "2026-11-29")
    for when in ("11-26", "11-28", "11-29"):
        assert f"| 32: no fit, 64: 10.00 | ilp | {when} | alone |" in text
    header = next(line for line in text.splitlines() if line.startswith("| model"))
    rule = next(line for line in text.splitlines() if line.startswith("|---"))
    assert header.count("|") == rule.count("|")  # the new column in both


def test_default_plans_show_solver_peaks_only_where_each_solver_read_its_own():
    """RUSAGE_CHILDREN's peak of a solver process is the planner's RSS when it was started
    (Linux carries a process's peak over exec), so only rows whose solvers read their own
    VmHWM show a solver figure: the sum of the solvers' peaks."""
    from benchmarks.default_plans import to_markdown as defaults_markdown

    base = DEFAULTS_ROW
    forked = dict(base, solver_rss_gib=0.5)  # read from RUSAGE_CHILDREN: not shown
    own = dict(base, solver_rss_gib=0.05, solvers_rss_gib=0.09, solver_rss="own VmHWM")
    rows = [line for line in defaults_markdown([forked, own], "x").splitlines() if "gpt-x" in line]
    assert "| 4.0 | 0.50 | 64: 10.00 |" in rows[0]
    assert "| 4.0 | 0.50 (+0.09 solvers) | 64: 10.00 |" in rows[1]


def test_default_plans_compare_with_the_fastest_other_setting_on_the_same_graphs(
    tmp_path, monkeypatch
):
    """*Best other s* is the fastest plan any other setting found on the row's own stage
    graphs (baselines, tuned runs, Megatron's published configurations), never the defaults'
    own plan-quality row; a row with only plans on other graphs says so."""
    import json

    from benchmarks import default_plans

    quality = [
        {
            "model": "gpt-x",
            "graph_model": "new",
            "our_space": "defaults",
            "ours": {"time": 9.0},  # the defaults themselves: not another setting
            "baselines": [
                {"name": "zero-2", "time": 12.5},
                {"name": "strong-grid", "time": 10.4},
                {"name": "data-parallel", "time": float("inf")},  # did not fit
            ],
        },
        {"model": "gpt-y", "graph_model": "old", "baselines": [{"name": "pp-dp", "time": 5.0}]},
    ]
    megatron = [
        {"model": "gpt-x", "graph_model": "new", "theirs": 10.2, "megatron_lm": 11.0,
         "ours": 9.5, "ours_graph_model": "old", "published": {"dp": 1, "tp": 8, "pp": 1}},
    ]  # fmt: skip
    paths = {}
    for name, rows in (("QUALITY", quality), ("TUNED", []), ("MEGATRON", megatron)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(rows))
        monkeypatch.setattr(default_plans, name, paths[name])
    x = dict(DEFAULTS_ROW, graph_model="new", simulated_s=10.2 * 0.98)
    y = dict(DEFAULTS_ROW, model="gpt-y", graph_model="new", simulated_s=10.0)
    z = dict(DEFAULTS_ROW, model="gpt-z", graph_model="new")  # run before it was simulated
    quality.append(dict(quality[0], model="gpt-z"))
    paths["QUALITY"].write_text(json.dumps(quality))
    lines = default_plans.to_markdown([x, y, z], "x").splitlines()
    row: dict[str, str] = {}  # (the defaults table's line, not the Megatron table's after it)
    for ln in lines:
        if ln.startswith("| gpt-"):
            row.setdefault(ln.split(" | ")[0][2:], ln)
    # Both sides as the simulator times them (the planner's own 10.00 s left out).
    # (our tuned 9.5 s was priced on the old graphs)
    mp = "10.20 (megatron published; left out: 1 priced otherwise)"
    assert f"| 10.00 | 10.00 | {mp} | 0.980 |" in row["gpt-x"]
    assert "| 10.00 | 10.00 | – | – (other pricing) |" in row["gpt-y"]
    assert "| 10.00 | – | 10.40 (strong-grid) | – (not simulated) |" in row["gpt-z"]
    assert "1 rows not compared with another setting" in "\n".join(lines)


def test_the_defaults_benchmark_child_reads_each_solvers_own_peak(tmp_path):
    """The benchmark's child script, run on a stand-in planner that starts a solver pool of
    two while holding 200 MiB: each solver's peak is its own (well under 200 MiB), where
    RUSAGE_CHILDREN would have read the planner's."""
    import subprocess
    import sys

    from benchmarks.default_plans import CHILD

    stand_in = (
        "import importlib, sys\n"
        "cli = importlib.import_module('alpa_mini.cli.main')\n"
        "def main(argv):\n"
        "    from alpa_mini.shard.solve_pool import SolvePool\n"
        "    held = bytearray(200 * 2**20)\n"
        "    held[::4096] = b'x' * len(held[::4096])\n"
        "    pool = SolvePool(2)\n"
        "    for child in pool._children:  # each imported the solvers and is ready\n"
        "        assert child._receive(120.0, 'start') == 'ready'\n"
        "    pool.close()\n"
        "    return 0\n"
        "cli.main = main\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", stand_in + CHILD],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("SOLVER_RSS_KIB"))
    largest, together = (int(k) for k in line.split()[1:3])
    planner = int(next(ln for ln in out.stdout.splitlines() if "PEAK_RSS_KIB" in ln).split()[1])
    assert planner > 200 * 1024
    assert 0 < largest < 150 * 1024 and largest <= together < 2 * largest + 1


def test_seconds_of_several_stages_compare_only_under_the_same_transfer_model(
    tmp_path, monkeypatch
):
    """A plan of several stages priced with the transfers over one link (rows without
    ``transfer_model``) is not compared with one priced host-parallel; a plan of one stage
    hands nothing on and compares with either."""
    import json

    from benchmarks import default_plans
    from benchmarks._report import TRANSFER_MODEL, comparable, pricing
    from benchmarks.plan_quality import one_link

    old = {"graph_model": "g"}  # before the transfer model was recorded
    new = {"graph_model": "g", "transfer_model": TRANSFER_MODEL}
    assert pricing(old, 4) == ("g", "one link") and pricing(new, 1) == ("g", None)
    assert not comparable(pricing(old, 4), pricing(new, 2))
    assert comparable(pricing(old, 1), pricing(new, 2))
    assert not comparable(pricing(old, 1), pricing({"graph_model": "h"}, 1))
    quality = [
        {
            "model": "gpt-x",
            **old,
            "baselines": [
                {"name": "pp-dp", "time": 9.0, "config": {"pp": 4}},  # one link: left out
                {"name": "zero-2", "time": 11.0, "config": {"pp": 1}},
                {"name": "strong-grid", "time": 10.5, "config": {"pp": 2}, **new},  # re-run
                {"name": "zero-3", "time": float("inf"), "reason": "no fit"},  # no seconds
            ],
        }
    ]
    megatron = [
        {"model": "gpt-x", **old, "theirs": 10.0, "megatron_lm": 10.8,
         "published": {"dp": 1, "tp": 8, "pp": 4}},
    ]  # fmt: skip
    for name, rows in (("QUALITY", quality), ("TUNED", []), ("MEGATRON", megatron)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rows))
        monkeypatch.setattr(default_plans, name, path)
    x = dict(DEFAULTS_ROW, stages=4, simulated_s=10.0, **new)
    text = default_plans.to_markdown([x], "x")
    best = "10.50 (strong-grid; left out: 3 priced otherwise) | 0.952 |"
    assert best in text
    assert "| 1/8/4 | 10.00 | 10.00 | – (other pricing) |" in text
    # Megatron's side re-priced host-parallel: compared
    megatron[0].update(new)
    default_plans.MEGATRON.write_text(json.dumps(megatron))
    assert "| 1/8/4 | 10.00 | 10.00 | 1.000 |" in default_plans.to_markdown([x], "x")
    # the plan-quality row names its sides of several stages still priced over one link
    assert one_link({**quality[0], "ours": {"stages": [[0, 1], [1, 2]]}}) == ["pp-dp", "ours"]
    assert one_link({**quality[0], "ours": {"stages": [[0, 2]]}}) == ["pp-dp"]


def test_transfers_price_alike_where_every_boundary_has_a_side_inside_one_host(
    tmp_path, monkeypatch
):
    """Host-parallel transfers split a hop over min(hosts of its two meshes) links: one link,
    as before, wherever a side sits inside one host. So a plan whose every boundary has such
    a side compares under either model; one with two multi-host neighbours does not."""
    import json

    from benchmarks import default_plans
    from benchmarks._report import TRANSFER_MODEL, even_hosts, plan_hosts, pricing
    from benchmarks.plan_quality import one_link

    old = {"graph_model": "g"}
    assert pricing(old, 4, hosts=[1, 1, 1, 1]) == ("g", None)
    assert pricing(old, 3, hosts=[2, 1, 4]) == ("g", None)
    assert pricing(old, 2, hosts=[2, 4]) == ("g", "one link")
    assert even_hosts(64, 2) == [4, 4] and even_hosts(16, 4) == [1] * 4
    assert even_hosts(None, 2) is None and even_hosts(64, None) is None
    assert plan_hosts([[0, 3, [2, 8], [16]], [4, 7, [1, 4], [4]]]) == [2, 1]
    assert plan_hosts([[0, 1], [2, 3]]) is None and plan_hosts(None) is None
    quality = [
        {"model": "gpt-x", "gpus": 32, **old, "baselines": [
            {"name": "pp-dp", "time": 9.0, "config": {"pp": 4}},  # 1 host a stage: alike
            {"name": "strong-grid", "time": 8.0, "config": {"pp": 2}},  # 2 hosts each: not
        ]},
    ]  # fmt: skip
    for name, rows in (("QUALITY", quality), ("TUNED", []), ("MEGATRON", [])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rows))
        monkeypatch.setattr(default_plans, name, path)
    x = dict(DEFAULTS_ROW, stages=2, simulated_s=9.9, transfer_model=TRANSFER_MODEL, **old)
    text = default_plans.to_markdown([x], "x")
    assert "9.00 (pp-dp; left out: 1 priced otherwise) | 1.100 |" in text
    assert one_link({**quality[0], "ours": {"stages": [[0, 3, [2, 8], [16]]] * 2}}) == [
        "strong-grid", "ours"
    ]  # fmt: skip
    assert one_link({**quality[0], "ours": {"stages": [[0, 3, [1, 8], [8]]] * 2}}) == [
        "strong-grid"
    ]


def test_the_defaults_table_reads_planning_beside_the_published_times():
    from benchmarks import default_plans

    rows = [
        dict(DEFAULTS_ROW, model="gpt-1.3b", planning_s=6.84, peak_rss_gib=0.264),
        dict(DEFAULTS_ROW, model="gpt-39b", error="timed out"),
        dict(DEFAULTS_ROW, model="gpt-2.6b", planning_s=15.0, peak_rss_gib=0.36),
    ]
    assert default_plans.planning_lines(rows) == [
        "",
        "Published planning times beside the defaults': gpt-1.3b: defaults 6.8 s and 0.26 GiB "
        "against Alpa 4092 s (profiling), Aceso 99 s.",
    ]
    assert default_plans.planning_lines(rows[1:]) == []


def test_compute_floors_say_which_targets_no_plan_can_reach():
    from benchmarks.compute_floor import to_markdown as floor_markdown

    quality = {
        "moe-10b": {"family": "moe", "gpus": 16, "ours": {"time": 5.0},
                    "baselines": [{"name": "deepspeed-moe", "time": 8.0}]},
        "gpt-6.7b": {"family": "gpt", "gpus": 16, "ours": 21.0,
                     "baselines": [{"name": "megatron-lm", "time": 22.0}]},
        "wresnet-1b": {"family": "wresnet", "gpus": 4, "ours": None, "baselines": []},
    }  # fmt: skip
    floors = [{"model": m, "floor_s": f} for m, f in (("moe-10b", 4.4), ("gpt-6.7b", 20.0),
                                                       ("wresnet-1b", 3.0))]  # fmt: skip
    rows = {ln.split(" | ")[0][2:]: ln.split(" | ") for ln in floor_markdown(floors, quality)
            .splitlines() if ln.startswith("| ") and not ln.startswith("| row")}  # fmt: skip
    # 4.4 / 8 = 0.55 is above MoE's 0.5: no plan reaches it; 20 / 22 = 0.909 is below 0.95.
    assert rows["moe-10b"][3:] == ["5.000", "1.136", "deepspeed-moe", "8.000", "0.550",
                                   "0.50", "**no** |"]  # fmt: skip
    assert rows["gpt-6.7b"][7:] == ["0.909", "0.95", "yes |"]
    assert rows["wresnet-1b"][3:] == ["–", "–", "pp-dp", "–", "–", "1.00", "– |"]
