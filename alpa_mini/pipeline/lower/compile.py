"""Lower a staged step to programs and one instruction stream (DESIGN 6).

Inputs: the step's jaxpr with one captured ``alpa_mini.grad`` equation, the flat forward
loss, and the stage decisions (equation range, devices, logical mesh and the layouts of the
values crossing the stage's edges). Per stage it builds

- ``fwd{s}``: the slice under ``jax.vjp``; returns the outputs and the vjp closure, whose
  leaves are the residuals, so they stay on the stage's devices until ``bwd{s}``;
- ``bwd{s}``: the closure applied to the outputs' cotangents: parameter gradients and the
  cotangents of activations that came from earlier stages;
- ``apply{s}``: the step's equations after the gradient whose results live on this stage.

The schedule's task order becomes a stream of ``Put``/``Run``/``Accumulate``/``Free`` for
``runtime.local`` (or Ray). Gradients are averaged over micro-batches by seeding the loss
cotangent with 1/B; the loss value and aux outputs are averaged the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ...graph.grad_capture import GRAD_NAME, GradCapture
from ...graph.jaxpr_walk import eval_eqns
from ...runtime.instructions import Accumulate, Free, Instruction, Put, Run
from ...shard.spec import ShardingSpec
from ..schedules import Schedule
from ..stage_slice import StageSlice, slice_stage
from .apply_grad import apply_updates

__all__ = ["CompiledPipeline", "StageLowering", "compile_pipeline", "grad_equation"]


@dataclass(frozen=True)
class StageLowering:
    """What lowering needs to know about one stage.

    ``in_specs``/``out_specs`` give the layout of each of the slice's invars/outvars on the
    stage's logical mesh (None: the default rule, batch-like values split along their leading
    dimension over every axis, everything else replicated); ``inner_specs`` pin values inside
    the stage (by the forward equation and result that define them) with a sharding
    constraint, which the backward mirrors on their cotangents.
    """

    start: int
    end: int
    devices: tuple[Any, ...]
    logical_shape: tuple[int, ...]
    in_specs: tuple[ShardingSpec | None, ...] | None = None
    out_specs: tuple[ShardingSpec | None, ...] | None = None
    inner_specs: tuple[tuple[int, int, ShardingSpec], ...] = ()  # (equation, result, spec)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return ("x", "y", "z")[: len(self.logical_shape)]


def grad_equation(step: Jaxpr) -> int:
    """Index of the single captured ``alpa_mini.grad`` equation of a step."""
    found = [i for i, e in enumerate(step.eqns) if e.primitive.name == GRAD_NAME]
    if len(found) != 1:
        raise ValueError(
            "PipeshardParallel: the step must call alpa_mini.grad or alpa_mini.value_and_grad "
            f"exactly once (found {len(found)}); jax.grad is not visible to the pipeline planner"
        )
    return found[0]


@dataclass
class _Stage:
    index: int
    sl: StageSlice
    mesh: Mesh
    diff_in: list[Any] = field(default_factory=list)
    nondiff_in: list[Any] = field(default_factory=list)
    diff_out: list[Any] = field(default_factory=list)
    nondiff_out: list[Any] = field(default_factory=list)
    in_sharding: dict[Any, NamedSharding] = field(default_factory=dict)
    out_sharding: dict[Any, NamedSharding] = field(default_factory=dict)
    pinned: dict[int, list[tuple[int, NamedSharding]]] = field(default_factory=dict)


@dataclass
class CompiledPipeline:
    """Programs, layouts and the stream of one step; ``num_args``/``num_outs`` flat leaves."""

    programs: dict[str, Callable[..., Any]]
    layouts: dict[str, NamedSharding]
    stream: list[Instruction]
    arg_names: list[str]
    out_names: list[str | None]
    out_literals: dict[int, Any]
    meshes: list[Mesh]
    stage_param_leaves: list[list[int]]


def _default_spec(aval: Any, mesh: Mesh, batch_like: bool) -> PartitionSpec:
    n = math.prod(mesh.devices.shape)
    if batch_like and aval.shape and n > 1 and aval.shape[0] % n == 0:
        return PartitionSpec(mesh.axis_names)
    return PartitionSpec()


def compile_pipeline(
    step: ClosedJaxpr,
    capture: GradCapture,
    forward: ClosedJaxpr,
    stages: Sequence[StageLowering],
    schedule: Schedule,
) -> CompiledPipeline:
    """Build programs and the instruction stream of one pipelined step.

    Long because it is one walk: stages and their layouts, the per-stage programs, then the
    schedule's ticks emitted in order, sharing buffer-naming and freeing state that the
    instruction stream's correctness depends on (every buffer freed exactly once after its
    last reader). Splitting it is tracked with the gradient-sync rework of this module.
    """
    g = grad_equation(step.jaxpr)
    geqn = step.jaxpr.eqns[g]
    fj = forward.jaxpr
    B = capture.num_micro_batches
    consts = dict(zip(fj.constvars, forward.consts, strict=True))
    loss_in = {v: j for j, v in enumerate(fj.invars)}
    step_in = {v: k for k, v in enumerate(step.jaxpr.invars)}
    # Loss leaf j is step argument leaf arg_of[j].
    arg_of: list[int] = []
    for j, v in enumerate(geqn.invars):
        if isinstance(v, Literal) or v not in step_in:
            raise ValueError(
                "PipeshardParallel: alpa_mini.grad must be applied to the step's own arguments "
                f"(operand {j} of the loss is computed inside the step); compute it inside the "
                "loss function instead"
            )
        arg_of.append(step_in[v])
    value_var = fj.outvars[0]
    aux_vars = list(fj.outvars[1:])

    sts: list[_Stage] = []
    producer: dict[Any, int] = {}
    for s, lo in enumerate(stages):
        devs = np.array(lo.devices).reshape(lo.logical_shape)
        mesh = Mesh(devs, lo.axis_names)
        sl = slice_stage(fj, lo.start, lo.end, capture.diff)
        st = _Stage(s, sl, mesh)
        for e, o, spec in lo.inner_specs:
            if not lo.start <= e < lo.end:
                raise ValueError(
                    f"inner_specs: equation {e} is outside stage {s} (equations "
                    f"{lo.start}..{lo.end - 1})"
                )
            ps = spec.to_partition_spec(lo.axis_names)
            st.pinned.setdefault(e - lo.start, []).append((o, NamedSharding(mesh, ps)))
        st.diff_in, st.nondiff_in = list(sl.diff_in), list(sl.nondiff_in)
        st.diff_out, st.nondiff_out = list(sl.diff_out), list(sl.nondiff_out)
        sts.append(st)
        for v in sl.outvars:
            producer.setdefault(v, s)
    consumers: dict[Any, list[int]] = {}
    for st in sts:
        for v in st.diff_in + st.nondiff_in:
            if v not in loss_in:
                consumers.setdefault(v, []).append(st.index)
    for v in [value_var, *aux_vars]:
        if not isinstance(v, Literal) and v not in producer:
            raise ValueError("PipeshardParallel: the loss returns one of its inputs unchanged")

    # ------------------------------------------------------------------ layouts
    layouts: dict[str, NamedSharding] = {}

    def layout_key(sh: NamedSharding, s: int) -> str:
        key = f"s{s}:{sh.spec}"
        layouts.setdefault(key, sh)
        return key

    for st, lo in zip(sts, stages, strict=True):
        for k, v in enumerate(st.sl.invars):
            spec = lo.in_specs[k] if lo.in_specs is not None else None
            batch_like = not (v in loss_in and not capture.batch[loss_in[v]])
            ps = (
                spec.to_partition_spec(st.mesh.axis_names)
                if spec is not None
                else _default_spec(v.aval, st.mesh, batch_like)
            )
            st.in_sharding[v] = NamedSharding(st.mesh, ps)
        for k, v in enumerate(st.sl.outvars):
            spec = lo.out_specs[k] if lo.out_specs is not None else None
            ps = (
                spec.to_partition_spec(st.mesh.axis_names)
                if spec is not None
                else _default_spec(v.aval, st.mesh, True)
            )
            st.out_sharding[v] = NamedSharding(st.mesh, ps)

    # ------------------------------------------------------------------ programs
    programs: dict[str, Callable[..., Any]] = {}
    for st in sts:
        programs[f"fwd{st.index}"], programs[f"bwd{st.index}"] = _stage_programs(st, consts)
    vid: dict[Any, int] = {}

    def name(v: Any) -> str:
        return f"v{vid.setdefault(v, len(vid))}"

    # Which stages read each loss leaf; the first one owns its gradient.
    users: dict[int, list[int]] = {}
    for st in sts:
        for v in st.diff_in + st.nondiff_in:
            if v in loss_in:
                users.setdefault(loss_in[v], []).append(st.index)
    owner = {j: us[0] for j, us in users.items()}

    stream: list[Instruction] = []
    arg_names = [f"arg{k}" for k in range(len(step.jaxpr.invars))]
    # Step inputs the forward reads: put them on each stage that reads them.
    for st in sts:
        for v in st.diff_in + st.nondiff_in:
            if v not in loss_in:
                continue
            j = loss_in[v]
            src = arg_names[arg_of[j]]
            if capture.batch[j]:
                full = NamedSharding(st.mesh, st.in_sharding[v].spec)
                stream.append(Put(src, f"{src}@{st.index}", st.index, layout_key(full, st.index)))
                prog = f"split{st.index}.{j}"
                programs[prog] = _splitter(B, st.in_sharding[v])
                stream.append(
                    Run(
                        prog,
                        (f"{src}@{st.index}",),
                        tuple(f"{src}.mb{m}@{st.index}" for m in range(B)),
                        st.index,
                    )
                )
                stream.append(Free((f"{src}@{st.index}",), st.index))
            else:
                stream.append(
                    Put(src, f"{src}@{st.index}", st.index, layout_key(st.in_sharding[v], st.index))
                )

    def in_buffer(st: _Stage, v: Any, m: int) -> str:
        if v in loss_in:
            j = loss_in[v]
            src = arg_names[arg_of[j]]
            return f"{src}.mb{m}@{st.index}" if capture.batch[j] else f"{src}@{st.index}"
        return f"{name(v)}.mb{m}@{st.index}"

    seed_made: set[int] = set()
    started: set[str] = set()  # accumulators that already hold a value

    def accumulate(src: str, dst: str, mesh: int) -> Accumulate:
        first = dst not in started
        started.add(dst)
        return Accumulate(src, dst, mesh, first)

    pending_free: dict[tuple[Any, int], int] = {}
    for task in schedule.order():
        st = sts[task.stage]
        s, m = st.index, task.micro_batch
        if task.kind == "fwd":
            for v in st.diff_in + st.nondiff_in:
                if v in loss_in:
                    continue
                p = producer[v]
                src = f"{name(v)}.mb{m}@{p}"
                stream.append(Put(src, in_buffer(st, v, m), s, layout_key(st.in_sharding[v], s)))
                key = (v, m)
                pending_free[key] = pending_free.get(key, len(consumers[v])) - 1
                if pending_free[key] == 0 and v not in (value_var, *aux_vars):
                    stream.append(Free((src,), p))
            ins = tuple(in_buffer(st, v, m) for v in st.diff_in + st.nondiff_in)
            outs = tuple(f"{name(v)}.mb{m}@{s}" for v in st.diff_out + st.nondiff_out)
            stream.append(Run(f"fwd{s}", ins, (*outs, f"res{s}.mb{m}"), s))
            for v in [value_var, *aux_vars]:
                if not isinstance(v, Literal) and producer[v] == s:
                    stream.append(accumulate(f"{name(v)}.mb{m}@{s}", f"{name(v)}.sum", s))
        else:
            cts = []
            for v in st.diff_out:
                ct = f"ct{name(v)}.mb{m}@{s}"
                if v is value_var:
                    if s not in seed_made:
                        programs[f"seed{s}"] = _seed(v.aval, 1.0 / B, st.out_sharding[v])
                        stream.append(Run(f"seed{s}", (), (f"seed@{s}",), s))
                        seed_made.add(s)
                    stream.append(accumulate(f"seed@{s}", ct, s))
                cts.append(ct)
            stream.append(
                Run(
                    f"bwd{s}",
                    (f"res{s}.mb{m}", *cts),
                    tuple(f"d{k}.{s}.mb{m}" for k in range(len(st.diff_in))),
                    s,
                )
            )
            dead = [f"res{s}.mb{m}", *cts]
            dead += [in_buffer(st, v, m) for v in st.diff_in + st.nondiff_in if v not in loss_in]
            dead += [
                f"{name(v)}.mb{m}@{s}"
                for v in st.diff_out + st.nondiff_out
                if v not in (value_var, *aux_vars) and s == producer[v] and not consumers.get(v)
            ]
            # Gradients this stage owns are summed by one fused program per micro-batch (one
            # dispatch instead of one per parameter); the first micro-batch only renames.
            fused: list[tuple[str, str]] = []
            for k, v in enumerate(st.diff_in):
                d = f"d{k}.{s}.mb{m}"
                if v in loss_in and owner[loss_in[v]] == s and f"grad{loss_in[v]}" in started:
                    fused.append((f"grad{loss_in[v]}", d))
                    dead.append(d)
                    continue
                if v in loss_in:
                    j = loss_in[v]
                    o = owner[j]
                    dst = f"grad{j}"
                    if o != s:
                        moved = f"{d}@{o}"
                        lay = sts[o].in_sharding[_var_of(sts[o], loss_in, j)]
                        stream.append(Put(d, moved, o, layout_key(lay, o)))
                        dead.append(d)
                        d = moved
                    stream.append(accumulate(d, dst, o))
                    dead.append(d)
                else:
                    p = producer[v]
                    ct = f"ct{name(v)}.mb{m}@{p}"
                    moved = f"{d}@{p}"
                    stream.append(Put(d, moved, p, layout_key(sts[p].out_sharding[v], p)))
                    stream.append(accumulate(moved, ct, p))
                    dead += [d, moved]
            if fused:
                acc = f"accumulate{s}.{len(fused)}"
                programs.setdefault(acc, _add_pairs(len(fused)))
                sums = tuple(a for a, _ in fused)
                stream.append(Run(acc, (*sums, *(b for _, b in fused)), sums, s))
            stream.append(Free(tuple(dict.fromkeys(dead)), s))

    # ------------------------------------------------------------------ gradient outputs
    # Buffers standing for the captured equation's outputs: value, aux..., grads of diff leaves.
    gout: dict[Any, tuple[str, int]] = {}
    for v, ov in zip([value_var, *aux_vars], geqn.outvars[: 1 + capture.num_aux], strict=True):
        if isinstance(v, Literal):
            continue
        p = producer[v]
        programs[f"mean{p}"] = _scale(1.0 / B)
        stream.append(Run(f"mean{p}", (f"{name(v)}.sum",), (f"{name(v)}.mean",), p))
        gout[ov] = (f"{name(v)}.mean", p)
    diff_leaves = [j for j, d in enumerate(capture.diff) if d]
    for j, ov in zip(diff_leaves, geqn.outvars[1 + capture.num_aux :], strict=True):
        if j in owner:
            gout[ov] = (f"grad{j}", owner[j])
        else:  # never read by the loss: its gradient is zero
            programs[f"zeros{j}"] = _zeros(ov.aval, NamedSharding(sts[0].mesh, PartitionSpec()))
            stream.append(Run(f"zeros{j}", (), (f"grad{j}",), 0))
            gout[ov] = (f"grad{j}", 0)

    # ------------------------------------------------------------------ apply gradient
    param_home: dict[int, tuple[int, NamedSharding]] = {}
    for j, o in owner.items():
        v = _var_of(sts[o], loss_in, j)
        if capture.diff[j]:
            param_home[arg_of[j]] = (o, sts[o].in_sharding[v])
    out_names, out_literals = apply_updates(
        step, g, gout, param_home, sts, arg_names, programs, stream, layout_key
    )
    stage_params = [sorted({arg_of[loss_in[v]] for v in st.diff_in if v in loss_in}) for st in sts]
    return CompiledPipeline(
        programs,
        layouts,
        stream,
        arg_names,
        out_names,
        out_literals,
        [st.mesh for st in sts],
        stage_params,
    )


def _var_of(st: _Stage, loss_in: dict[Any, int], j: int) -> Any:
    for v in st.diff_in + st.nondiff_in:
        if loss_in.get(v) == j:
            return v
    raise KeyError(j)


def _stage_programs(
    st: _Stage, consts: dict[Any, Any]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    diff_in, nondiff_in = list(st.diff_in), list(st.nondiff_in)
    diff_out, nondiff_out = list(st.diff_out), list(st.nondiff_out)
    eqns = st.sl.eqns
    used_consts = {v: c for v, c in consts.items() if v in set(st.sl.invars)}
    # Runs of equations between the pinned ones, so that the common case stays one call.
    cuts = sorted(st.pinned)

    def f_env(env: dict[Any, Any]) -> None:
        done = 0
        for e in cuts:
            eval_eqns(eqns[done : e + 1], env)
            for o, sharding in st.pinned[e]:
                v = eqns[e].outvars[o]
                env[v] = jax.lax.with_sharding_constraint(env[v], sharding)
            done = e + 1
        eval_eqns(eqns[done:], env)

    def fwd(*args: Any) -> tuple[Any, ...]:
        d, nd = args[: len(diff_in)], args[len(diff_in) :]

        def f(*dvals: Any) -> tuple[list[Any], list[Any]]:
            env: dict[Any, Any] = dict(used_consts)
            env.update(zip(diff_in, dvals, strict=True))
            env.update(zip(nondiff_in, nd, strict=True))
            f_env(env)
            return [env[v] for v in diff_out], [env[v] for v in nondiff_out]

        outs_d, vjp_fn, outs_nd = jax.vjp(f, *d, has_aux=True)
        return (*outs_d, *outs_nd, vjp_fn)

    def bwd(vjp_fn: Any, *cts: Any) -> tuple[Any, ...]:
        return tuple(vjp_fn(list(cts)))

    in_sh = tuple(st.in_sharding[v] for v in diff_in + nondiff_in)
    out_sh = (*(st.out_sharding[v] for v in diff_out + nondiff_out), None)
    grads_sh = tuple(st.in_sharding[v] for v in diff_in)
    fwd_j = jax.jit(fwd, in_shardings=in_sh, out_shardings=out_sh)
    bwd_j = jax.jit(bwd, out_shardings=grads_sh)
    return fwd_j, bwd_j


def _splitter(count: int, sharding: NamedSharding) -> Callable[..., Any]:
    def split(x: Any) -> tuple[Any, ...]:
        size = x.shape[0] // count
        return tuple(jax.lax.slice_in_dim(x, m * size, (m + 1) * size) for m in range(count))

    return jax.jit(split, out_shardings=tuple([sharding] * count))


def _seed(aval: Any, value: float, sharding: NamedSharding) -> Callable[..., Any]:
    return jax.jit(lambda: (jnp.full(aval.shape, value, aval.dtype),), out_shardings=(sharding,))


def _zeros(aval: Any, sharding: NamedSharding) -> Callable[..., Any]:
    return jax.jit(lambda: (jnp.zeros(aval.shape, aval.dtype),), out_shardings=(sharding,))


def _add_pairs(n: int) -> Callable[..., Any]:
    """``(a_1..a_n, b_1..b_n) -> (a_1 + b_1, ..., a_n + b_n)`` as one program."""
    return jax.jit(lambda *xs: tuple(a + b for a, b in zip(xs[:n], xs[n:], strict=True)))


def _scale(factor: float) -> Callable[..., Any]:
    return jax.jit(lambda x: (x * jnp.asarray(factor, x.dtype),))
