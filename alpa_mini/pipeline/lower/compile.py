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
cotangent with 1/B; the loss value and aux outputs are averaged the same way. Last, each
stretch of one mesh's instructions between transfers becomes one program (``fuse.py``).
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
from .apply_grad import apply_updates, donate_inputs, entry_axes, state_sharding
from .fuse import fuse_stream
from .partials import GroupSplit, PartialsPlan, eval_with_partials, partial_sharding, plan_partials

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
    # Per stage, its gradient accumulators in ``bwd{s}``'s order: (loss leaf, whether it
    # holds per-group partial sums with a leading groups axis).
    accumulators: list[tuple[tuple[int, bool], ...]] = field(default_factory=list)
    # Donated step arguments (``arg{k}``) and the layout key each is consumed in.
    donation: dict[str, str] = field(default_factory=dict)
    # Fused programs (``fuse_stream``) and the programs each runs, in order.
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)


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
    donated: Sequence[int] = (),
    shard_state: bool = False,
    fuse: bool = True,
) -> CompiledPipeline:
    """Build programs and the instruction stream of one pipelined step.

    ``donated``: step argument leaves the apply programs may consume (``donate_argnums``).
    ``shard_state``: keep optimiser state and gradients in ZeRO layouts over each stage's
    devices (``apply_grad.state_sharding``), as the planner prices every layout but "data".
    ``fuse``: run each stretch of one mesh's instructions between transfers as one program
    (``fuse.fuse_stream``); False keeps one program per task, sync and apply.
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
    rows = _micro_batch_rows(fj, capture)
    grads = [_stage_grads(st, loss_in, capture, rows) for st in sts]
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
    dp_axes = [gr.split.axes if gr.split is not None else () for gr in grads]

    def zero_layout(s: int, lay: NamedSharding, shape: tuple[int, ...]) -> NamedSharding:
        return state_sharding(lay, shape, dp_axes[s])

    # The layout each gradient is handed to its owner in: the parameter's, or ZeRO's.
    grad_layout: dict[int, NamedSharding] = {}
    for j, o in owner.items():
        v = _var_of(sts[o], loss_in, j)
        lay = sts[o].in_sharding[v]
        grad_layout[j] = zero_layout(o, lay, v.aval.shape) if shard_state else lay
    for st, gr in zip(sts, grads, strict=True):
        s = st.index
        fwd, bwd, bwd_first = _stage_programs(st, consts, gr, loss_in)
        programs[f"fwd{s}"], programs[f"bwd{s}"], programs[f"bwd{s}.0"] = fwd, bwd, bwd_first
        if gr.needs_sync:
            targets = tuple(
                grad_layout[loss_in[p]] if owner[loss_in[p]] == s else st.in_sharding[p]
                for p in gr.params
            )
            programs[f"sync{s}"] = _sync_program(gr, targets)

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

    first_bwd: dict[int, int] = {}
    last_bwd: dict[int, int] = {}
    for task in schedule.order():
        if task.kind != "fwd":
            first_bwd.setdefault(task.stage, task.micro_batch)
            last_bwd[task.stage] = task.micro_batch
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
            continue
        gr = grads[s]
        accs = tuple(f"acc{s}.{i}" for i in range(len(gr.accs)))
        first = m == first_bwd[s]
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
        acts = [v for v in st.diff_in if v not in loss_in]
        act_out = tuple(f"d{name(v)}.{s}.mb{m}" for v in acts)
        kept_in = [in_buffer(st, v, m) for v in st.diff_in + st.nondiff_in if v in loss_in]
        program, acc_in = (f"bwd{s}.0", ()) if first else (f"bwd{s}", accs)
        stream.append(
            Run(program, (f"res{s}.mb{m}", *kept_in, *cts, *acc_in), (*act_out, *accs), s)
        )
        dead = [f"res{s}.mb{m}", *cts]
        dead += [in_buffer(st, v, m) for v in st.diff_in + st.nondiff_in if v not in loss_in]
        dead += [
            f"{name(v)}.mb{m}@{s}"
            for v in st.diff_out + st.nondiff_out
            if v not in (value_var, *aux_vars) and s == producer[v] and not consumers.get(v)
        ]
        # Cotangents of activations go back to the stage that made them.
        for v, d in zip(acts, act_out, strict=True):
            p = producer[v]
            moved = f"{d}@{p}"
            stream.append(Put(d, moved, p, layout_key(sts[p].out_sharding[v], p)))
            stream.append(accumulate(moved, f"ct{name(v)}.mb{m}@{p}", p))
            dead += [d, moved]
        stream.append(Free(tuple(dict.fromkeys(dead)), s))
        if m == last_bwd[s]:
            _sync_stage(st, gr, accs, loss_in, owner, grad_layout, stream, accumulate, layout_key)

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
    grad_param = {
        ov: arg_of[j]
        for j, ov in zip(diff_leaves, geqn.outvars[1 + capture.num_aux :], strict=True)
        if j in owner
    }
    out_names, out_literals = apply_updates(
        step,
        g,
        gout,
        param_home,
        sts,
        arg_names,
        programs,
        stream,
        layout_key,
        grad_param,
        zero_layout if shard_state else None,
    )
    fused: dict[str, tuple[str, ...]] = {}
    if fuse:
        stream, fused = fuse_stream(programs, stream, out_names)
    donation = donate_inputs(programs, stream, {arg_names[k] for k in donated}, out_names)
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
        [tuple((loss_in[p], partial) for p, partial in gr.accs) for gr in grads],
        donation,
        fused,
    )


def _var_of(st: _Stage, loss_in: dict[Any, int], j: int) -> Any:
    for v in st.diff_in + st.nondiff_in:
        if loss_in.get(v) == j:
            return v
    raise KeyError(j)


def _stage_programs(
    st: _Stage, consts: dict[Any, Any], gr: _StageGrads, loss_in: dict[Any, int]
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """``fwd{s}`` (outputs and the residuals), ``bwd{s}`` (activation cotangents, and the
    stage's gradient accumulators with this micro-batch added) and ``bwd{s}.0``, the
    stage's first backward, which starts the accumulators."""
    diff_in, nondiff_in = list(st.diff_in), list(st.nondiff_in)
    diff_out, nondiff_out = list(st.diff_out), list(st.nondiff_out)
    eqns = st.sl.eqns
    used_consts = {v: c for v, c in consts.items() if v in set(st.sl.invars)}
    partial_params = [p for p, partial in gr.accs if partial]
    partial_sh = {p: sh for (p, partial), sh in zip(gr.accs, gr.shardings, strict=True) if partial}
    # Runs of equations between the pinned ones, so that the common case stays one call.
    cuts = sorted(st.pinned)

    def run(lo: int, hi: int, env: dict[Any, Any], partials: dict[Any, Any]) -> None:
        if gr.plan is None or gr.split is None:
            eval_eqns(eqns[lo:hi], env)
        else:
            eval_with_partials(eqns[lo:hi], env, gr.plan, partials, gr.split, partial_sh, lo)

    def f_env(env: dict[Any, Any], partials: dict[Any, Any]) -> None:
        done = 0
        for e in cuts:
            run(done, e + 1, env, partials)
            for o, sharding in st.pinned[e]:
                v = eqns[e].outvars[o]
                env[v] = jax.lax.with_sharding_constraint(env[v], sharding)
            done = e + 1
        run(done, len(eqns), env, partials)

    # Residuals that are the stage's step inputs themselves (parameters, batch slices) are
    # not returned by the forward: an output may not alias an input, so each would be
    # copied once per micro-batch. The backward reads those input buffers instead.
    ins_all = diff_in + nondiff_in
    kept = [k for k, v in enumerate(ins_all) if v in loss_in]
    residual_slots: dict[str, Any] = {}  # set when the forward is traced

    def fwd(*args: Any) -> tuple[Any, ...]:
        d, nd = args[: len(diff_in)], args[len(diff_in) :]
        groups = gr.split.groups if gr.split is not None else 1  # partials imply a split
        zs = [
            jax.lax.with_sharding_constraint(
                jnp.zeros((groups, *p.aval.shape), p.aval.dtype), partial_sh[p]
            )
            for p in partial_params
        ]

        def f(dvals: list[Any], zvals: list[Any]) -> tuple[list[Any], list[Any]]:
            env: dict[Any, Any] = dict(used_consts)
            env.update(zip(diff_in, dvals, strict=True))
            env.update(zip(nondiff_in, nd, strict=True))
            f_env(env, dict(zip(partial_params, zvals, strict=True)))
            return [env[v] for v in diff_out], [env[v] for v in nondiff_out]

        outs_d, vjp_fn, outs_nd = jax.vjp(f, list(d), zs, has_aux=True)
        leaves, treedef = jax.tree.flatten(vjp_fn)
        position = {id(args[k]): j for j, k in enumerate(kept)}
        slots, res = [], []
        for leaf in leaves:
            j = position.get(id(leaf))
            slots.append(("res", len(res)) if j is None else ("in", j))
            if j is None:
                res.append(leaf)
        residual_slots.update(treedef=treedef, slots=slots)
        return (*outs_d, *outs_nd, tuple(res))

    acts = [v for v in diff_in if v not in loss_in]
    n_ct, n_kept = len(diff_out), len(kept)

    def bwd(res: Any, *rest: Any) -> tuple[Any, ...]:
        """Activation cotangents, and the accumulators with this micro-batch added (the
        stage's first backward gets none and starts them)."""
        inputs, cts, accs = rest[:n_kept], rest[n_kept : n_kept + n_ct], rest[n_kept + n_ct :]
        leaves = [res[i] if kind == "res" else inputs[i] for kind, i in residual_slots["slots"]]
        vjp_fn = jax.tree.unflatten(residual_slots["treedef"], leaves)
        d_list, z_list = vjp_fn(list(cts))
        plain = dict(zip(diff_in, d_list, strict=True))
        partial = dict(zip(partial_params, z_list, strict=True))
        new = [partial[p] if is_partial else plain[p] for p, is_partial in gr.accs]
        if accs:
            new = [acc + g for acc, g in zip(accs, new, strict=True)]
        return (*(plain[v] for v in acts), *new)

    in_sh = tuple(st.in_sharding[v] for v in diff_in + nondiff_in)
    out_sh = (*(st.out_sharding[v] for v in diff_out + nondiff_out), None)
    bwd_sh = (*(st.in_sharding[v] for v in acts), *gr.shardings)
    fwd_j = jax.jit(fwd, in_shardings=in_sh, out_shardings=out_sh)
    # The accumulators are donated: each backward adds in place. (Before the runtime bounded
    # the programs in flight on the CPU client, this deadlocked an 8-device collective.)
    first_acc = 1 + n_kept + n_ct
    donate = tuple(range(first_acc, first_acc + len(gr.accs)))
    bwd_j = jax.jit(bwd, out_shardings=bwd_sh, donate_argnums=donate)
    return fwd_j, bwd_j, jax.jit(bwd, out_shardings=bwd_sh)


@dataclass(frozen=True)
class _StageGrads:
    """A stage's gradient accumulators: ``params`` (its differentiated loss inputs), one
    accumulator per ``(param, partial)`` in ``accs`` laid out as ``shardings`` (a partial one
    holds per-group sums, ``partials.py``), and how rows split into groups."""

    params: tuple[Any, ...]
    accs: tuple[tuple[Any, bool], ...]
    shardings: tuple[NamedSharding, ...]
    split: GroupSplit | None = None
    plan: PartialsPlan | None = None

    @property
    def needs_sync(self) -> bool:
        """Whether partial sums need the once-per-step reduction (``sync{s}``)."""
        return any(partial for _, partial in self.accs)


def _micro_batch_rows(forward: Jaxpr, capture: GradCapture) -> int | None:
    """Rows of one micro-batch: the leading size of the loss's batch inputs."""
    for j, v in enumerate(forward.invars):
        if capture.batch[j] and v.aval.shape:
            return int(v.aval.shape[0])
    return None


def _group_split(
    st: _Stage, loss_in: dict[Any, int], capture: GradCapture, rows: int | None
) -> GroupSplit | None:
    """The stage's data-parallel groups: the mesh axes that split the rows of its batch
    inputs (the step's batch first, then activations), if any."""
    if rows is None:
        return None
    ins = st.diff_in + st.nondiff_in
    batch = [v for v in ins if v in loss_in and capture.batch[loss_in[v]]]
    for v in batch + [v for v in ins if v not in loss_in]:
        shape = getattr(v.aval, "shape", ())
        if not shape or shape[0] != rows:
            continue
        spec = st.in_sharding[v].spec
        first = spec[0] if len(spec) else None
        axes = first if isinstance(first, tuple) else (first,) if first is not None else ()
        groups = math.prod(st.mesh.shape[a] for a in axes)
        if groups > 1 and rows % groups == 0:
            return GroupSplit(rows, groups, tuple(axes))
    return None


def _stage_grads(
    st: _Stage,
    loss_in: dict[Any, int],
    capture: GradCapture,
    rows: int | None,
) -> _StageGrads:
    params = tuple(v for v in st.diff_in if v in loss_in)
    split = _group_split(st, loss_in, capture, rows) if params else None
    plan = None
    if split:
        local = {p: _split_dims(st.in_sharding[p], split) for p in params}
        plan = plan_partials(st.sl.eqns, params, st.sl.outvars, split, local)
    grouped = plan.grouped if plan is not None else frozenset()
    plain = (set(params) - grouped) | (set(plan.plain) if plan is not None else set())
    accs = tuple(
        [(p, False) for p in params if p in plain] + [(p, True) for p in params if p in grouped]
    )
    shardings = tuple(
        partial_sharding(st.in_sharding[p], split) if partial and split else st.in_sharding[p]
        for p, partial in accs
    )
    return _StageGrads(params, accs, shardings, split, plan)


def _split_dims(sharding: NamedSharding, split: GroupSplit) -> frozenset[int]:
    """The dimensions a parameter's layout splits over the data-parallel axes."""
    out = set()
    for d, entry in enumerate(sharding.spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if any(n in split.axes for n in names if n is not None):
            out.add(d)
    return frozenset(out)


def _sync_program(gr: _StageGrads, targets: tuple[NamedSharding, ...]) -> Callable[..., Any]:
    """``sync{s}``: the once-per-step reduction of the stage's partial sums into each
    gradient's layout (``targets``, one per parameter): an all-reduce, or a reduce-scatter
    where the layout shards it over the data-parallel axes (ZeRO-2/3). The all-reduces go
    out as one collective over all of them (as ``pmean`` of a gradient pytree does): on
    8 CPU devices each separate collective cost about 1 ms of rendezvous."""
    split = gr.split
    assert split is not None
    target = dict(zip(gr.params, targets, strict=True))
    names = split.axes if len(split.axes) > 1 else split.axes[0]

    def sync(*accs: Any) -> tuple[Any, ...]:
        reduced: dict[int, Any] = {}
        summed: list[tuple[int, PartitionSpec, PartitionSpec]] = []  # one psum for these
        for k, (acc, (p, partial), sh) in enumerate(zip(accs, gr.accs, gr.shardings, strict=True)):
            if not partial:
                reduced[k] = acc
                continue
            how = _reduction(acc.ndim - 1, sh, target[p], split)
            if how is None:
                reduced[k] = jax.lax.with_sharding_constraint(jnp.sum(acc, axis=0), target[p])
            elif how[0] is None:
                summed.append((k, sh.spec, how[1]))
            else:
                reduced[k] = _scatter(acc, sh, target[p], names, *how)
        if summed:
            outs = jax.shard_map(
                lambda *xs: jax.lax.psum(tuple(x[0] for x in xs), names),
                mesh=_partial_mesh(gr),
                in_specs=tuple(spec for _, spec, _ in summed),
                out_specs=tuple(out for _, _, out in summed),
                check_vma=False,
            )(*(accs[k] for k, _, _ in summed))
            for (k, _, _), out in zip(summed, outs, strict=True):
                reduced[k] = jax.lax.with_sharding_constraint(out, target[gr.accs[k][0]])
        total: dict[Any, Any] = {}
        for k, (p, _) in enumerate(gr.accs):
            total[p] = reduced[k] if p not in total else total[p] + reduced[k]
        return tuple(total[p] for p in gr.params)

    return jax.jit(sync, out_shardings=targets)


def _partial_mesh(gr: _StageGrads) -> Mesh:
    """The mesh of a stage's partial-sum accumulators."""
    return next(sh.mesh for (_, partial), sh in zip(gr.accs, gr.shardings, strict=True) if partial)


def _reduction(
    ndim: int, partial: NamedSharding, target: NamedSharding, split: GroupSplit
) -> tuple[int | None, PartitionSpec] | None:
    """How ``acc.sum(0)`` becomes ``target`` in one collective over the group axes:
    ``(None, spec)`` a ``psum`` (``target`` does not use them), ``(d, spec)`` a tiled
    ``psum_scatter`` along dimension d (a dimension of ``target`` adds them, then possibly
    more axes, a local slice, after its own); None: left to the partitioner (which may
    all-reduce and slice). ``spec``: the collective's output layout."""
    rest = [entry_axes(e) for e in tuple(partial.spec)[1:]] + [()] * (ndim - len(partial.spec) + 1)
    want = [entry_axes(e) for e in tuple(target.spec)] + [()] * (ndim - len(target.spec))
    grown = [k for k in range(ndim) if want[k] != rest[k]]
    scatter: int | None = None
    if len(grown) == 1:
        d = grown[0]
        lead = rest[d] + split.axes
        if want[d][: len(lead)] == lead:
            scatter = d
    if grown and scatter is None:
        return None
    out_spec = list(target.spec) + [None] * (ndim - len(target.spec))
    if scatter is not None:
        lead = rest[scatter] + split.axes
        out_spec[scatter] = lead if len(lead) > 1 else lead[0]
    return scatter, PartitionSpec(*out_spec)


def _scatter(
    acc: Any, partial: NamedSharding, target: NamedSharding, names: Any, d: int, out: Any
) -> Any:
    """``acc.sum(0)`` reduce-scattered along dimension ``d`` over the group axes."""
    out = jax.shard_map(
        lambda x: jax.lax.psum_scatter(x[0], names, scatter_dimension=d, tiled=True),
        mesh=partial.mesh,
        in_specs=partial.spec,
        out_specs=out,
        check_vma=False,
    )(acc)
    return jax.lax.with_sharding_constraint(out, target)


def _sync_stage(
    st: _Stage,
    gr: _StageGrads,
    accs: tuple[str, ...],
    loss_in: dict[Any, int],
    owner: dict[int, int],
    grad_layout: dict[int, NamedSharding],
    stream: list[Instruction],
    accumulate: Callable[[str, str, int], Accumulate],
    layout_key: Callable[[NamedSharding, int], str],
) -> None:
    """After a stage's last backward: reduce its accumulators once and hand each gradient to
    the stage that owns the parameter (``grad{j}``)."""
    s = st.index
    if gr.needs_sync:
        outs = tuple(f"g{loss_in[p]}.{s}" for p in gr.params)
        stream.append(Run(f"sync{s}", accs, outs, s))
        stream.append(Free(accs, s))
        names = dict(zip(gr.params, outs, strict=True))
    else:
        names = {p: acc for (p, _), acc in zip(gr.accs, accs, strict=True)}
    for p in gr.params:
        j, d = loss_in[p], names[p]
        o = owner[j]
        if o != s:
            stream.append(Put(d, f"{d}@{o}", o, layout_key(grad_layout[j], o)))
            stream.append(Free((d,), s))
            d = f"{d}@{o}"
        stream.append(accumulate(d, f"grad{j}", o))
        stream.append(Free((d,), o))


def _splitter(count: int, sharding: NamedSharding) -> Callable[..., Any]:
    """``split{s}.{j}``: a batch input cut into ``count`` contiguous micro-batches, each laid
    out as ``sharding``. Viewed as ``(count, rows, ...)``, the input moves into
    ``(None, *spec)`` in one all-to-all, after which each micro-batch is a local slice
    (slicing the input directly costs a collective-permute per micro-batch and device)."""
    stacked = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))

    def split(x: Any) -> tuple[Any, ...]:
        size = x.shape[0] // count
        if count == 1:
            return (x,)
        y = x.reshape(count, size, *x.shape[1:])
        y = jax.lax.with_sharding_constraint(y, stacked)
        return tuple(y[m] for m in range(count))

    return jax.jit(split, out_shardings=tuple([sharding] * count))


def _seed(aval: Any, value: float, sharding: NamedSharding) -> Callable[..., Any]:
    return jax.jit(lambda: (jnp.full(aval.shape, value, aval.dtype),), out_shardings=(sharding,))


def _zeros(aval: Any, sharding: NamedSharding) -> Callable[..., Any]:
    return jax.jit(lambda: (jnp.zeros(aval.shape, aval.dtype),), out_shardings=(sharding,))


def _scale(factor: float) -> Callable[..., Any]:
    return jax.jit(lambda x: (x * jnp.asarray(factor, x.dtype),))
