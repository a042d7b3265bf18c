"""The README's "Bring your own model" and checkpoint examples run as they are."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _section_code(title: str) -> str:
    text = README.read_text()
    start = text.index(f"### {title}\n")
    end = text.index("\n### ", start + 1)
    return "\n".join(re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S))


@pytest.mark.slow  # 8 s
def test_bring_your_own_model_and_checkpoint_examples_run() -> None:
    code = _section_code("Bring your own model")
    assert "alpa_mini.gather" in code and "nnx.split" in code
    resume = _section_code("Checkpoints and saved plans")
    assert "restore_checkpoint" in resume
    code += "\n" + resume
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split()
    assert "(64, 8)" in proc.stdout, proc.stdout
    assert all(float(v) == float(v) for v in lines[:2])  # finite-looking losses
    assert lines[-1] == "4", proc.stdout  # restored at step 3, then one more step
