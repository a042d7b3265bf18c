"""Write one benchmark's markdown into its own marked section of BENCHMARKS.md."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "BENCHMARKS.md"
RESULTS = ROOT / "benchmarks" / "results"


def update_section(name: str, markdown: str) -> None:
    """Replace the text between ``<!-- begin:name -->`` and ``<!-- end:name -->``.

    The section is appended when the markers are missing; everything else in the file
    (hand-written notes) stays as it is. The markdown is also kept in results/NAME.md.
    """
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(markdown.rstrip() + "\n")
    begin, end = f"<!-- begin:{name} -->", f"<!-- end:{name} -->"
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    text = REPORT.read_text() if REPORT.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    REPORT.write_text(text)


#: The memory models rows are priced with, oldest first, recorded per row (``memory_model``)
#: and shown by the date they took effect (a row without the field predates issue 23).
#: "accumulators" (2026-11-28): the planner counts the gradient accumulators the runtime
#: keeps from a stage's first backward to the step's end (``alpa_mini/shard/accumulators.py``).
#: "parameters held once" (2026-11-29): a stage's residuals leave out the parameters its
#: backward reads, which the runtime holds once, not once per micro-batch in flight
#: (``stage_cost._StageModel._graph``); earlier models counted them with each micro-batch.
MEMORY_MODELS: dict[str | None, str] = {
    None: "11-26",
    "accumulators": "11-28",
    "parameters held once": "11-29",
}
MEMORY_MODEL = "parameters held once"


#: The stage graphs a row is priced on, recorded per row (``graph_model``): since 2026-11-28,
#: evening, the planner drops dead code from each stage's traced forward + backward
#: (``alpa_mini/pipeline/stage_trace.py``), 2-6% of a GPT or MoE stage's cost. Rows without
#: the field were priced on graphs that still held it, so their seconds compare only among
#: themselves.
GRAPH_MODEL = "dead code dropped"


#: How the simulator prices the activations handed between stages, recorded per row
#: (``transfer_model``): since 2026-11-29, afternoon, a boundary's bytes share the inter-host
#: links of the smaller mesh's hosts, which send their shards at once ("host-parallel":
#: ``alpa_mini/pipeline/simulate.py: chain_timings``); rows without the field sent them over
#: one link, 18-24% dearer on gpt3-175b's and megatron-145.6b's plans. A plan of one stage
#: hands nothing on, and one whose every boundary has a side inside one host sends each hop
#: over one link under either (min(hosts) = 1), so their seconds are the same under both.
TRANSFER_MODEL = "host-parallel"

#: Planning times published for rows of these tables (as issue 4 quotes them), to read
#: beside ours.
PUBLISHED_PLANNING = {
    "gpt-1.3b": "Alpa 4092 s (profiling), Aceso 99 s",
    "gpt-39b": "Alpa ~2400 s",
}

#: GPUs per host of the benchmarks' clusters (``dgx-a100``; fewer GPUs make one host).
HOST_GPUS = 8

#: What a plan's seconds were priced with: (stage graphs, transfer model or None).
Pricing = tuple[str | None, str | None]

#: A cell left out because its two sides were priced differently (``comparable``).
OTHER_PRICING = "other pricing"


def pricing(
    row: dict[str, Any], stages: int | None, prefix: str = "", hosts: list[int] | None = None
) -> Pricing:
    """What a plan's simulated seconds in ``row`` depend on besides the plan: the stage graphs
    (``GRAPH_MODEL``) and, for a plan of several stages (``stages``; None: unknown), the
    transfer model (``TRANSFER_MODEL``), unless ``hosts`` (each stage's host count, where
    known) shows every boundary has a side inside one host, where both models price a hop
    alike. ``prefix`` picks a side's fields (``"ours_"``), falling back to the row's own."""
    graphs = row.get(prefix + "graph_model", row.get("graph_model"))
    transfers = row.get(prefix + "transfer_model", row.get("transfer_model", "one link"))
    alike = hosts is not None and all(min(a, b) <= 1 for a, b in itertools.pairwise(hosts))
    return graphs, None if stages == 1 or alike else transfers


def even_hosts(gpus: int | None, pp: int | None) -> list[int] | None:
    """The hosts each of ``pp`` equal stages spans on ``gpus`` GPUs (1 inside one host), or
    None where either is unknown."""
    return None if not pp or not gpus else [max(1, gpus // pp // HOST_GPUS)] * pp


def plan_hosts(stages: list | None) -> list[int] | None:
    """The hosts each stage of a recorded plan spans (``[first, last, [hosts, devices],
    mesh]`` per stage), or None where they were not recorded."""
    if not stages or any(len(s) < 3 for s in stages):
        return None
    return [int(s[2][0]) for s in stages]


def even_pricing(row: dict[str, Any], pp: int | None, prefix: str = "") -> Pricing:
    """``pricing`` of a plan of ``pp`` equal stages over ``row``'s GPUs (a baseline's grid
    point, Megatron-LM's published configuration)."""
    return pricing(row, pp, prefix, even_hosts(row.get("gpus"), pp))


def plan_pricing(row: dict[str, Any], stages: list | None, prefix: str = "") -> Pricing:
    """``pricing`` of a recorded plan's ``stages`` (``plan_hosts``; None: not recorded)."""
    return pricing(row, len(stages) if stages else None, prefix, plan_hosts(stages))


def comparable(a: Pricing, b: Pricing) -> bool:
    """Whether seconds priced as ``a`` and ``b`` (``pricing``) compare: the same stage graphs,
    and the same transfer model unless one plan has no transfers."""
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


def memory_label(row: dict[str, Any], field: str = "memory_model") -> str:
    """The date of the memory model ``row`` was priced with (``MEMORY_MODELS``)."""
    return MEMORY_MODELS.get(row.get(field), "?")


#: A child's stdout line with this prefix is echoed by the parent as it arrives.
PROGRESS = "PROGRESS "


def earlier_rows(filename: str) -> list[dict[str, Any]]:
    """The rows a benchmark saved in ``results/<filename>`` (none if it never ran)."""
    path = RESULTS / filename
    return json.loads(path.read_text()) if path.exists() else []


def not_rerun(earlier: list[dict[str, Any]], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier rows whose model this run has not re-run yet: a run stopped part-way keeps
    them, and each is replaced once its model is re-run."""
    done = {r["model"] for r in results}
    return [r for r in earlier if r["model"] not in done]


def progress(message: str) -> None:
    """From a child: one line the parent shows at once (long rows take many minutes)."""
    print(PROGRESS + message, flush=True)


def run_child(module: str, args: list[str], timeout: float) -> Any:
    """Run ``python -m module args`` from the repository root in a fresh process (its own
    JAX, no warm caches) and return the JSON it prints on a ``RESULT `` line; its
    ``progress`` lines are echoed (indented) while it runs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    started = time.perf_counter()
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        # stderr drains on a thread, so a chatty child cannot block on a full pipe.
        err: list[str] = []
        drain = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
        drain.start()
        out = []
        for line in proc.stdout:
            out.append(line)
            if line.startswith(PROGRESS):
                print("  " + line[len(PROGRESS) :].rstrip(), flush=True)
        proc.wait()
        drain.join()
    finally:
        timer.cancel()
    result = next((ln for ln in out if ln.startswith("RESULT ")), None)
    if result is None:
        took = time.perf_counter() - started
        if timed_out.is_set():
            why = f"killed after its {timeout:.0f} s timeout"
        elif proc.returncode == -signal.SIGKILL:
            # Not ours: on these machines that is the kernel's out-of-memory killer.
            why = f"was killed (SIGKILL, most likely out of memory) after {took:.0f} s"
        elif proc.returncode < 0:
            why = f"died of signal {-proc.returncode} after {took:.0f} s"
        else:
            why = f"failed (exit status {proc.returncode}) after {took:.0f} s"
        raise RuntimeError(
            f"{module} {' '.join(args)} {why}:\n{''.join(out)[-2000:]}{''.join(err)[-3000:]}"
        )
    return json.loads(result[len("RESULT ") :])
