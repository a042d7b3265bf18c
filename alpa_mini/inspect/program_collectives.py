"""The collectives of a pipeshard step, program by program, from the compiled HLO.

A pipeshard step is many programs (per stage: forward, backward, the once-per-step gradient
sync, the optimiser's apply), each run some number of times per step. ``step_collectives``
parses each program's HLO and weighs it by how often the instruction stream runs it, so
``per_step()`` answers "how many bytes of gradient all-reduce does one step move" (a
collective inside a program's micro-batch loop, ``lower/roll.py``, counts once per iteration).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from .hlo_collectives import KINDS, CollectiveSummary, parse_collectives, summarize

__all__ = ["ProgramCollectives", "StepCollectives", "program_role", "step_collectives"]

Role = Literal["forward", "backward", "sync", "apply", "split", "fused", "other"]
_ROLES: dict[str, Role] = {
    "fwd": "forward",
    "bwd": "backward",
    "sync": "sync",
    "apply": "apply",
    "split": "split",
}


def program_role(program: str) -> tuple[Role, int | None]:
    """``("backward", 1)`` for ``bwd1``: a program's role and stage, from its name; a fused
    program (``fwd1+bwd1``, ``lower/fuse.py``) is ``"fused"``, on its first part's stage."""
    if "+" in program or "*" in program:
        first = program.split("+")[0].split("*")[0]
        return "fused", program_role(first)[1]
    m = re.fullmatch(r"([a-z]+)(\d+)(?:\.\d+)?", program)
    if m is None:
        return "other", None
    return _ROLES.get(m.group(1), "other"), int(m.group(2))


@dataclass(frozen=True)
class ProgramCollectives:
    """One program: its stage and role, runs per step, and its collectives per run."""

    program: str
    stage: int | None
    role: Role
    runs_per_step: int
    collectives: dict[str, CollectiveSummary]

    def per_step(self) -> dict[str, tuple[int, int]]:
        """``{kind: (count, bytes)}`` over one step (per run times runs), kinds present."""
        n = self.runs_per_step
        return {k: (s.count * n, s.bytes * n) for k, s in self.collectives.items() if s.count}


@dataclass(frozen=True)
class StepCollectives:
    """Every program of a pipeshard step with its collectives."""

    programs: tuple[ProgramCollectives, ...]

    def per_step(self, role: Role | None = None) -> dict[str, tuple[int, int]]:
        """``{kind: (count, bytes)}`` summed over one step (bytes per device, as in
        ``Collective.bytes``); only programs of ``role`` if given."""
        total: dict[str, list[int]] = {}
        for p in self.programs:
            if role is not None and p.role != role:
                continue
            for kind, (count, nbytes) in p.per_step().items():
                t = total.setdefault(kind, [0, 0])
                t[0] += count
                t[1] += nbytes
        return {k: (c, b) for k, (c, b) in total.items()}

    def __getitem__(self, program: str) -> ProgramCollectives:
        for p in self.programs:
            if p.program == program:
                return p
        raise KeyError(f"no program {program!r}; programs: {[p.program for p in self.programs]}")

    def __str__(self) -> str:
        head = f"{'program':<14}{'role':<10}{'runs':>5}  {'kind':<20}{'count':>7}{'bytes/run':>14}"
        lines = [head]
        for p in self.programs:
            for kind in KINDS:
                s = p.collectives.get(kind)
                if s is not None and s.count:
                    lines.append(
                        f"{p.program:<14}{p.role:<10}{p.runs_per_step:>5}  {kind:<20}"
                        f"{s.count:>7}{s.bytes:>14}"
                    )
        if len(lines) == 1:
            lines.append("(no collectives)")
        return "\n".join(lines)


def step_collectives(
    runs: Iterable[tuple[str, int]], hlo_text: Callable[[str], str]
) -> StepCollectives:
    """``runs``: (program, runs per step); ``hlo_text(program)``: its compiled HLO."""
    out = []
    for program, n in runs:
        role, stage = program_role(program)
        hlo = summarize(parse_collectives(hlo_text(program)), per_run=True)
        out.append(ProgramCollectives(program, stage, role, n, hlo))
    return StepCollectives(tuple(out))
