"""Fold what feeds a captured loss into the loss, so it reads only the step's inputs.

The record pass traces the step on one micro-batch. A grad call's inputs there may be the
step's inputs, values the step computed before the call (``x = batch["x"] / 255``, a dropout
key), or values the loss closed over. Each non-differentiated input is followed back through
the step's equations to step inputs; those equations run again inside the loss, once per
micro-batch. The folded loss reads a step input split into micro-batches exactly when that
input is a batch leaf, so whatever derives from the batch is split, however it reached the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from .grad_capture import GRAD_NAME, GradCapture, Recorded
from .jaxpr_walk import eval_eqns

__all__ = ["LossRecipe", "fold_loss"]


@dataclass(frozen=True, eq=False)
class LossRecipe:
    """How to trace one grad call's folded loss at another micro-batch count without tracing
    the step again (its optimiser update included): kept where the loss function closes over
    nothing traced and every non-differentiated argument leaf is a step input as it is, so
    the folded loss is the loss function itself over (differentiated leaves, step inputs)."""

    fun: Callable[..., Any]
    in_tree: Any
    has_aux: bool
    diff: tuple[bool, ...]
    leaf_step: tuple[int, ...]  # per argument leaf, its step input (-1: differentiated)
    step_ins: tuple[int, ...]  # the step inputs the loss reads, in the order it takes them
    diff_avals: tuple[Any, ...]
    sources: tuple[tuple[str, int], ...]
    aux_tree: Any

    def capture(self, micro: Sequence[Any], roles: Sequence[str], count: int) -> GradCapture:
        """The capture at ``count``, given the step's input avals on one micro-batch."""
        loss, _ = self.trace(micro)
        return _capture(loss, self.sources, roles, count, self.aux_tree)

    def trace(self, micro: Sequence[Any]) -> tuple[ClosedJaxpr, Any]:
        """The folded loss over (differentiated leaves, step inputs on one micro-batch) and
        its aux tree."""
        n_diff = len(self.diff_avals)
        aux_trees: list[Any] = []

        def folded(*values: Any) -> list[Any]:
            by_step = dict(zip(self.step_ins, values[n_diff:], strict=True))
            diff_vals = iter(values[:n_diff])
            flat = [
                next(diff_vals) if d else by_step[k]
                for d, k in zip(self.diff, self.leaf_step, strict=True)
            ]
            out = self.fun(*jax.tree.unflatten(self.in_tree, flat))
            value, aux = out if self.has_aux else (out, None)
            aux_leaves, tree = jax.tree.flatten(aux)
            aux_trees.append(tree)
            return [value, *aux_leaves]

        avals = [*self.diff_avals]
        avals += [jax.ShapeDtypeStruct(micro[k].shape, micro[k].dtype) for k in self.step_ins]
        return jax.make_jaxpr(folded)(*avals), aux_trees[-1]


def fold_loss(
    step: ClosedJaxpr, recorded: Sequence[Recorded], roles: Sequence[str], num_micro_batches: int
) -> list[tuple[GradCapture, LossRecipe | None]]:
    """One ``GradCapture`` per recorded grad call of ``step`` (traced on one micro-batch), in
    call order, each with its ``LossRecipe`` where it has one."""
    jaxpr = step.jaxpr
    found = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == GRAD_NAME]
    if len(found) != len(recorded):
        raise ValueError(
            f"alpa_mini.grad was called {len(recorded)} times but only {len(found)} calls are "
            "in the step itself; call it from the step, not inside a jax.jit, vmap or scan "
            "within the step"
        )
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    captures: list[tuple[GradCapture, LossRecipe | None]] = [None] * len(recorded)  # type: ignore
    for g in found:
        index = jaxpr.eqns[g].params["index"]
        captures[index] = _fold_one(step, g, recorded[index], producer, roles, num_micro_batches)
    return captures


def _fold_one(
    step: ClosedJaxpr,
    g: int,
    rec: Recorded,
    producer: dict[Any, int],
    roles: Sequence[str],
    count: int,
) -> tuple[GradCapture, LossRecipe | None]:
    jaxpr = step.jaxpr
    geqn = jaxpr.eqns[g]
    consts_in = list(geqn.invars[: rec.num_consts])
    leaves_in = list(geqn.invars[rec.num_consts :])
    fixed = consts_in + [v for v, d in zip(leaves_in, rec.diff, strict=True) if not d]
    eqns, step_ins, const_vars = _backward_slice(jaxpr, fixed, producer)
    for j, (v, d) in enumerate(zip(leaves_in, rec.diff, strict=True)):
        if d and _derives_from_batch(jaxpr, v, producer, roles):
            raise ValueError(
                f"{rec.name}: differentiated argument leaf {j} derives from the step's batch "
                "arguments; differentiate parameters, and pass or close over the batch"
            )
        if rec.named_batch[j] and not d and not _derives_from_batch(jaxpr, v, producer, roles):
            raise ValueError(
                f"batch_argnum: argument {rec.batch_arg} of {rec.name} (leaf {j}) does not "
                "derive from the step's batch arguments; name the step argument it comes "
                "from in parallelize(batch_argnums=...)"
            )
    step_index = {v: k for k, v in enumerate(jaxpr.invars)}
    sources = [("arg", j) for j, d in enumerate(rec.diff) if d]
    sources += [("step", step_index[v]) for v in step_ins]
    in_avals = [leaves_in[j].aval for _, j in sources[: sum(rec.diff)]]
    in_avals += [v.aval for v in step_ins]
    const_env = dict(zip(jaxpr.constvars, step.consts, strict=True))
    const_vals = {v: const_env[v] for v in const_vars}

    def folded(*values: Any) -> list[Any]:
        env: dict[Any, Any] = dict(const_vals)
        n_diff = sum(rec.diff)
        env.update(zip(step_ins, values[n_diff:], strict=True))
        eval_eqns([jaxpr.eqns[i] for i in eqns], env)

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        diff_vals = iter(values[:n_diff])
        loss_env: dict[Any, Any] = dict(
            zip(rec.loss.constvars, [read(v) for v in consts_in], strict=True)
        )
        for lv, v, d in zip(rec.loss.invars, leaves_in, rec.diff, strict=True):
            loss_env[lv] = next(diff_vals) if d else read(v)
        return _eval(rec.loss, loss_env)

    avals = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
        for a in in_avals
    ]
    loss = jax.make_jaxpr(folded)(*avals)
    capture = _capture(loss, tuple(sources), roles, count, rec.aux_tree)
    direct = rec.fun is not None and not rec.num_consts and not eqns and not const_vars
    direct = direct and all(  # every non-differentiated leaf is a step input as it is
        d or (not isinstance(v, Literal) and v in step_index)
        for v, d in zip(leaves_in, rec.diff, strict=True)
    )
    if not direct or any(a.weak_type for a in avals):  # weak types: fold as traced
        return capture, None
    recipe = LossRecipe(
        rec.fun,
        rec.in_tree,
        rec.has_aux,
        rec.diff,
        tuple(-1 if d else step_index[v] for v, d in zip(leaves_in, rec.diff, strict=True)),
        tuple(step_index[v] for v in step_ins),
        tuple(avals[: sum(rec.diff)]),
        tuple(sources),
        rec.aux_tree,
    )
    return capture, recipe


def _capture(
    loss: ClosedJaxpr,
    sources: tuple[tuple[str, int], ...],
    roles: Sequence[str],
    count: int,
    aux_tree: Any,
) -> GradCapture:
    """The ``GradCapture`` of a folded loss over ``sources``: an argument source is
    differentiated, a step source of a batch leaf is split into micro-batches."""
    diff = tuple(kind == "arg" for kind, _ in sources)
    batch = tuple(kind == "step" and roles[k] == "batch" for kind, k in sources)
    return GradCapture(loss, diff, batch, len(loss.out_avals) - 1, count, sources, aux_tree)


def _eval(jaxpr: Jaxpr, env: dict[Any, Any]) -> list[Any]:
    eval_eqns(jaxpr.eqns, env)
    return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]


def _backward_slice(
    jaxpr: Jaxpr, targets: Sequence[Any], producer: dict[Any, int]
) -> tuple[list[int], list[Any], list[Any]]:
    """Equations (in order) that compute ``targets`` from the step's inputs, the step inputs
    they read (in input order) and the step constants they read."""
    inputs, consts = set(jaxpr.invars), set(jaxpr.constvars)
    eqns: set[int] = set()
    used_in: set[Any] = set()
    used_consts: set[Any] = set()
    stack = [v for v in targets if not isinstance(v, Literal)]
    seen: set[Any] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in inputs:
            used_in.add(v)
        elif v in consts:
            used_consts.add(v)
        else:
            i = producer[v]
            if jaxpr.eqns[i].primitive.name == GRAD_NAME:
                raise ValueError(
                    "a loss reads the result of an earlier alpa_mini.grad call in the same step; "
                    "alpa_mini cannot micro-batch a gradient of a gradient"
                )
            if i not in eqns:
                eqns.add(i)
                stack.extend(u for u in jaxpr.eqns[i].invars if not isinstance(u, Literal))
    ordered_in = [v for v in jaxpr.invars if v in used_in]
    ordered_consts = [v for v in jaxpr.constvars if v in used_consts]
    return sorted(eqns), ordered_in, ordered_consts


def _derives_from_batch(
    jaxpr: Jaxpr, v: Any, producer: dict[Any, int], roles: Sequence[str]
) -> bool:
    if isinstance(v, Literal):
        return False
    _, step_ins, _ = _backward_slice(jaxpr, [v], producer)
    index = {u: k for k, u in enumerate(jaxpr.invars)}
    return any(roles[index[u]] == "batch" for u in step_ins)
