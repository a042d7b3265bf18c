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

__all__ = ["Unjitted", "apply_updates", "donate_inputs", "state_sharding"]


def state_sharding(
    param: NamedSharding, shape: tuple[int, ...], first: tuple[str, ...] = ()
) -> NamedSharding:
    """ZeRO's layout for a parameter's optimiser state and gradient: the parameter's, with
    the mesh axes it leaves unused added (minor) to the first dimension they divide, the
    data-parallel axes ``first`` major among them so that a reduce-scatter over those axes
    lands in place. The parameter's own layout when no dimension fits."""
    spec = list(param.spec) + [None] * (len(shape) - len(param.spec))
    used = {a for e in spec for a in entry_axes(e)}
    names = param.mesh.axis_names
    unused = [a for a in first if a not in used] + [
        a for a in names if a not in used and a not in first
    ]
    if not unused:
        return param
    extra = 1
    for a in unused:
        extra *= param.mesh.shape[a]
    for d, size in enumerate(shape):
        have = 1
        for a in entry_axes(spec[d]):
            have *= param.mesh.shape[a]
        if size % (have * extra) == 0:
            axes = (*entry_axes(spec[d]), *unused)
            spec[d] = axes if len(axes) > 1 else axes[0]
            return NamedSharding(param.mesh, PartitionSpec(*spec))
    return param


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (None, a name or a tuple of names)."""
    return tuple(entry) if isinstance(entry, tuple) else () if entry is None else (entry,)


class Unjitted:
    """A program before ``donate_inputs`` jits it (an apply or a fused program):
    ``out_shardings`` None leaves the result layouts to the programs inside; ``donate``:
    inputs it always consumes, besides the step arguments ``donate_inputs`` adds."""

    def __init__(
        self,
        fn: Callable[..., Any],
        out_shardings: tuple[Any, ...] | None,
        donate: tuple[int, ...] = (),
    ) -> None:
        self.fn, self.out_shardings, self.donate = fn, out_shardings, donate


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
    # A program run several times consumes an argument only where every run may.
    per_program: dict[str, set[int]] = {}
    runs: dict[str, list[Run]] = {}
    for i, ins in enumerate(stream):
        if not isinstance(ins, Run) or not isinstance(programs.get(ins.program), Unjitted):
            continue
        donate = {
            k
            for k, n in enumerate(ins.inputs)
            if (r := root.get(n, n)) in donated_args
            and r not in kept
            and last_read[r] == i
            and sum(root.get(m, m) == r for m in ins.inputs) == 1
        }
        if ins.program in per_program:
            per_program[ins.program] &= donate
        else:
            per_program[ins.program] = donate
        runs.setdefault(ins.program, []).append(ins)
    for program, args in per_program.items():
        un = programs[program]
        shardings = {} if un.out_shardings is None else {"out_shardings": un.out_shardings}
        both = tuple(sorted(args | set(un.donate)))
        programs[program] = jax.jit(un.fn, donate_argnums=both, **shardings)
        for ins in runs[program]:
            for k in args:
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
    grad_param: dict[Any, int] | None = None,
    shard_state: Callable[[int, NamedSharding, tuple[int, ...]], NamedSharding] | None = None,
) -> tuple[list[str | None], dict[int, Any]]:
    """Split the equations after the gradient (equation ``g``) by where their results should
    live; add each stage's apply program and instructions. Returns the step's output buffer
    names (None for a literal) and its literal outputs.

    With ``shard_state`` (stage, parameter layout, shape -> layout), optimiser state is kept
    in that layout (ZeRO): fed so, and returned so; ``grad_param`` names the parameter
    argument of each gradient output."""
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
    state: dict[int, tuple[int, NamedSharding]] = {}
    if shard_state is not None:
        layout_of_root = {sj.invars[k]: home for k, home in param_home.items()}
        layout_of_root.update({v: param_home[k] for v, k in (grad_param or {}).items()})
        state = _state_layouts(sj, eqns, made_by, layout_of_root, shard_state, set(param_home))
    for s, outs in sorted(per_stage.items()):
        sub, needed = _backward_slice(eqns, [v for _, v in outs])
        inputs = [w for w in needed if w not in consts]
        where = _Where(step_in, gout, {**param_home, **state}, arg_names)
        names_in = _feed(inputs, s, sts[s].mesh, where, stream, layout_key)
        out_sh = []
        for o, _v in outs:
            k = _alias_param(step, o, param_home)
            if k is None and o in state:
                k, home = o, state[o]
            else:
                home = param_home.get(k) if k is not None else None
            out_sh.append(home[1] if home is not None and home[0] == s else None)
        program = _apply_program(sub, inputs, [v for _, v in outs], consts)
        # Jitted by ``donate_inputs`` once the stream is complete (which inputs die here).
        programs[f"apply{s}"] = Unjitted(program, tuple(out_sh))
        stream.append(Run(f"apply{s}", tuple(names_in), tuple(f"out{o}" for o, _ in outs), s))
    return out_names, out_literals


def _ancestors(v: Any, eqns: list[Any], made_by: dict[Any, int]) -> Any:
    """``v`` and the values it is computed from, nearest first (breadth first)."""
    seen = {v}
    queue = deque([v])
    while queue:
        u = queue.popleft()
        yield u
        if u in made_by:
            for w in eqns[made_by[u]].invars:
                if not isinstance(w, Literal) and w not in seen:
                    seen.add(w)
                    queue.append(w)


def _nearest_root(
    v: Any, eqns: list[Any], made_by: dict[Any, int], roots: dict[Any, Any], same_shape: bool
) -> Any | None:
    for u in _ancestors(v, eqns, made_by):
        if u in roots and (not same_shape or u.aval.shape == v.aval.shape):
            return u
    return None


def _home(v: Any, eqns: list[Any], made_by: dict[Any, int], roots: dict[Any, int]) -> int:
    """The stage a result goes to: the home of its nearest root ancestor of the same shape
    (an optimiser update lives with its parameter), else of its nearest one at all, else 0."""
    for same in (True, False):
        u = _nearest_root(v, eqns, made_by, roots, same)
        if u is not None:
            return roots[u]
    return 0


def _state_layouts(
    sj: Any,
    eqns: list[Any],
    made_by: dict[Any, int],
    layout_of_root: dict[Any, tuple[int, NamedSharding]],
    shard: Callable[[int, NamedSharding, tuple[int, ...]], NamedSharding],
    skip: set[int],
) -> dict[int, tuple[int, NamedSharding]]:
    """Step argument leaf -> (stage, ZeRO layout) for optimiser state: a leaf the step
    returns updated at the same position, whose update derives from a parameter or its
    gradient of the same shape, is laid out as ``shard`` says for that parameter."""
    found = {}
    for k, w in enumerate(sj.invars):
        if k in skip or k >= len(sj.outvars) or not getattr(w.aval, "shape", ()):
            continue
        o = sj.outvars[k]
        if isinstance(o, Literal) or o.aval.shape != w.aval.shape or o.aval.dtype != w.aval.dtype:
            continue
        root = _nearest_root(o, eqns, made_by, layout_of_root, True)
        if root is not None:
            s, lay = layout_of_root[root]
            found[k] = (s, shard(s, lay, tuple(w.aval.shape)))
    return found


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
    (a parameter this stage owns keeps its layout, its optimiser state takes its ZeRO
    layout when sharded; others arrive replicated)."""
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
