"""The step after the gradient: optimiser updates and other results, run where they belong.

In: the step's jaxpr, the captured gradient's outputs and where each parameter lives. Out:
one ``apply{s}`` program per stage that owns results (jitted with the parameters' layouts as
output shardings, so updated parameters stay in place) and the PUT/RUN instructions that
feed and run them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Literal
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ...graph.jaxpr_walk import eval_eqns
from ...runtime.instructions import Instruction, Put, Run

__all__ = ["apply_updates", "donate_inputs"]


class _Unjitted:
    """An apply program before ``donate_inputs`` jits it."""

    def __init__(self, fn: Callable[..., Any], out_shardings: tuple[Any, ...]) -> None:
        self.fn, self.out_shardings = fn, out_shardings


def donate_inputs(
    programs: dict[str, Any],
    stream: list[Instruction],
    donated_args: set[str],
    out_names: list[str | None],
) -> dict[str, str]:
    """Jit each apply program, donating the inputs that hold a donated step argument
    (``donated_args``: buffer names such as ``arg3``) where no later instruction and no
    step output reads that argument under any name (``Put`` copies and places it under new
    names, which may be the same array). Returns, per donated argument, the layout key it is
    donated in: an argument in another layout is copied there first, and the copy donated."""
    root: dict[str, str] = {}
    layout_of: dict[str, str] = {}
    for ins in stream:
        if isinstance(ins, Put):
            root[ins.dst] = root.get(ins.src, ins.src)
            layout_of[ins.dst] = ins.layout
    kept = {root.get(n, n) for n in out_names if n is not None}
    where: dict[str, str] = {}
    last_read: dict[str, int] = {}
    for i, ins in enumerate(stream):
        for n in _reads(ins):
            last_read[root.get(n, n)] = i
    for i, ins in enumerate(stream):
        if not isinstance(ins, Run) or not isinstance(programs.get(ins.program), _Unjitted):
            continue
        donate = tuple(
            k
            for k, n in enumerate(ins.inputs)
            if (r := root.get(n, n)) in donated_args
            and r not in kept
            and last_read[r] == i
            and ins.inputs.count(n) == 1
        )
        un = programs[ins.program]
        programs[ins.program] = jax.jit(
            un.fn, out_shardings=un.out_shardings, donate_argnums=donate
        )
        for k in donate:
            n = ins.inputs[k]
            if n in layout_of:
                where[root[n]] = layout_of[n]
    return where


def _reads(ins: Instruction) -> tuple[str, ...]:
    if isinstance(ins, Run):
        return ins.inputs
    if isinstance(ins, Put):
        return (ins.src,)
    src = getattr(ins, "src", None)
    return (src,) if src is not None else ()


def apply_updates(
    step: ClosedJaxpr,
    g: int,
    gout: dict[Any, tuple[str, int]],
    param_home: dict[int, tuple[int, NamedSharding]],
    sts: Sequence[Any],
    arg_names: list[str],
    programs: dict[str, Callable[..., Any]],
    stream: list[Instruction],
    layout_key: Callable[[NamedSharding, int], str],
) -> tuple[list[str | None], dict[int, Any]]:
    """Split the equations after the gradient (equation ``g``) by where their results should
    live; add each stage's apply program and instructions. Returns the step's output buffer
    names (None for a literal) and its literal outputs."""
    sj = step.jaxpr
    eqns = [e for i, e in enumerate(sj.eqns) if i != g]
    step_in = {v: k for k, v in enumerate(sj.invars)}
    made_by = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    # Home stage of a value: step args that are parameters live with their owner, gradient
    # outputs with theirs.
    roots = {v: param_home[k][0] for v, k in step_in.items() if k in param_home}
    roots.update({v: p for v, (_, p) in gout.items()})
    out_names: list[str | None] = []
    out_literals: dict[int, Any] = {}
    per_stage: dict[int, list[tuple[int, Any]]] = {}
    for o, v in enumerate(sj.outvars):
        if isinstance(v, Literal):
            out_literals[o] = v.val
            out_names.append(None)
        elif v in step_in:
            out_names.append(arg_names[step_in[v]])
        elif v in gout:
            out_names.append(gout[v][0])
        else:
            k = _home(v, eqns, made_by, roots)
            per_stage.setdefault(k, []).append((o, v))
            out_names.append(f"out{o}")
    consts = dict(zip(sj.constvars, step.consts, strict=True))
    for s, outs in sorted(per_stage.items()):
        sub, needed = _backward_slice(eqns, [v for _, v in outs])
        inputs = [w for w in needed if w not in consts]
        where = _Where(step_in, gout, param_home, arg_names)
        names_in = _feed(inputs, s, sts[s].mesh, where, stream, layout_key)
        out_sh = []
        for o, _v in outs:
            k = _alias_param(step, o, param_home)
            out_sh.append(param_home[k][1] if k is not None and param_home[k][0] == s else None)
        program = _apply_program(sub, inputs, [v for _, v in outs], consts)
        # Jitted by ``donate_inputs`` once the stream is complete (which inputs die here).
        programs[f"apply{s}"] = _Unjitted(program, tuple(out_sh))
        stream.append(Run(f"apply{s}", tuple(names_in), tuple(f"out{o}" for o, _ in outs), s))
    return out_names, out_literals


def _home(v: Any, eqns: list[Any], made_by: dict[Any, int], roots: dict[Any, int]) -> int:
    """The stage a result goes to: the home of its nearest root ancestor of the same shape
    (an optimiser update lives with its parameter), else of its nearest one at all, else 0."""
    best_any, best_same = None, None
    seen = {v}
    queue = deque([v])
    while queue:
        u = queue.popleft()
        if u in roots:
            if best_any is None:
                best_any = roots[u]
            if best_same is None and u.aval.shape == v.aval.shape:
                best_same = roots[u]
                break
        if u in made_by:
            for w in eqns[made_by[u]].invars:
                if not isinstance(w, Literal) and w not in seen:
                    seen.add(w)
                    queue.append(w)
    for cand in (best_same, best_any):
        if cand is not None:
            return cand
    return 0


def _backward_slice(eqns: list[Any], results: list[Any]) -> tuple[list[Any], list[Any]]:
    """The equations ``results`` depend on, in order, and the values they read from outside
    (``results`` defined outside included), in first-read order."""
    live = set(results)
    chosen: list[int] = []
    for i in range(len(eqns) - 1, -1, -1):
        if any(v in live for v in eqns[i].outvars):
            chosen.append(i)
            live.update(w for w in eqns[i].invars if not isinstance(w, Literal))
    chosen.reverse()
    sub = [eqns[i] for i in chosen]
    defined = {v for e in sub for v in e.outvars}
    needed: list[Any] = []
    for e in sub:
        for w in e.invars:
            if not isinstance(w, Literal) and w not in defined and w not in needed:
                needed.append(w)
    for v in results:
        if v not in defined and v not in needed:
            needed.append(v)
    return sub, needed


class _Where:
    """Where the apply programs' inputs come from: step arguments or gradient buffers."""

    def __init__(self, step_in, gout, param_home, arg_names) -> None:
        self.step_in, self.gout = step_in, gout
        self.param_home, self.arg_names = param_home, arg_names


def _feed(
    inputs: list[Any],
    s: int,
    mesh: Mesh,
    where: _Where,
    stream: list[Instruction],
    layout_key: Callable[[NamedSharding, int], str],
) -> list[str]:
    """Buffer names of stage ``s``'s apply inputs, PUT there first unless already in place
    (a parameter this stage owns keeps its layout; others arrive replicated)."""
    names_in = []
    for w in inputs:
        if w in where.step_in:
            k = where.step_in[w]
            src = where.arg_names[k]
            home = where.param_home.get(k)
            lay = home[1] if home is not None and home[0] == s else None
            dst = f"{src}@apply{s}"
        else:
            src, owner = where.gout[w]
            lay = None
            dst = src if owner == s else f"{src}@apply{s}"
        lay = lay or NamedSharding(mesh, PartitionSpec())
        if dst != src:
            stream.append(Put(src, dst, s, layout_key(lay, s)))
        names_in.append(dst)
    return names_in


def _apply_program(
    sub: list[Any], inputs: list[Any], results: list[Any], consts: dict[Any, Any]
) -> Callable[..., tuple[Any, ...]]:
    """The equations ``sub`` as a function of ``inputs`` returning ``results``."""

    def apply_fn(*args: Any) -> tuple[Any, ...]:
        env: dict[Any, Any] = dict(consts)
        env.update(zip(inputs, args, strict=True))
        eval_eqns(sub, env)
        return tuple(env[v] for v in results)

    return apply_fn


def _alias_param(step: ClosedJaxpr, o: int, param_home: dict[int, Any]) -> int | None:
    """The parameter argument leaf an output updates, when shapes pair them one to one."""
    v = step.jaxpr.outvars[o]
    for k in param_home:
        w = step.jaxpr.invars[k]
        if w.aval.shape == v.aval.shape and w.aval.dtype == v.aval.dtype and o == k:
            return k
    return None
