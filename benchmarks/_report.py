"""Write one benchmark's markdown into its own marked section of BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
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


def run_child(module: str, args: list[str], timeout: float) -> Any:
    """Run ``python -m module args`` from the repository root in a fresh process (its own
    JAX, no warm caches) and return the JSON it prints on a ``RESULT `` line."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        timeout=timeout,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(
            f"{module} {' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return json.loads(line[len("RESULT ") :])
