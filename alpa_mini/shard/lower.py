"""ShardingPlan -> a jitted function: re-evaluate the jaxpr and pin every planned layout.

The interpreter walks the same equations the tracer walked, in the same order and with the
same paths, so each variable finds its tensor in ``OpGraph.var_tensors``. After every
operator it applies ``with_sharding_constraint`` with the planned result layout; before an
operator whose strategy reads an operand in another layout it constrains a copy of that
operand, so XLA's partitioner inserts the resharding the plan priced. Inputs and outputs
get ``NamedSharding``s through ``jax.jit``. Call-like equations are inlined (remat
boundaries are therefore not kept); ``scan`` is re-emitted as ``lax.scan`` over the
re-interpreted body. In a scan that accumulates (the micro-batch loop), reductions that feed
the accumulators linearly wait until after the loop (``deferred.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.sharding import Mesh, NamedSharding

from ..graph.accumulation import accumulating_carries, loop_deferrable
from ..graph.jaxpr_walk import INLINED_PRIMITIVES, bind_equation, call_jaxpr_of
from ..graph.markers import MARKER_NAME
from ..graph.op_graph import OpGraph
from .deferred import Grouped, apply_linear, grouped_sharding, into_groups, source
from .plan import ShardingPlan
from .spec import ShardingSpec

__all__ = ["build_sharded_function", "named_sharding"]


def named_sharding(mesh: Mesh, spec: ShardingSpec | None, ndim: int) -> NamedSharding:
    spec = spec or ShardingSpec.replicated(ndim)
    return NamedSharding(mesh, spec.to_partition_spec(mesh.axis_names))


class _Interpreter:
    def __init__(self, graph: OpGraph, plan: ShardingPlan, mesh: Mesh) -> None:
        self.graph, self.plan, self.mesh = graph, plan, mesh
        self.node_at: dict[tuple[int, ...], int] = {}
        # (path, var) of the values an accumulation loop may keep as per-group partials.
        self.deferrable: set[tuple[tuple[int, ...], Any]] = set()
        self.boundary: dict[tuple[tuple[int, ...], str, int], int] = {}
        for node in graph.nodes:
            if node.kind in ("op", "opaque"):
                self.node_at[node.path] = node.id
            elif "operand" in node.params:
                self.boundary[(node.path, "in", node.params["operand"])] = node.id
            else:
                self.boundary[(node.path, "out", node.params["result"])] = node.id

    # ------------------------------------------------------------------ constraints
    def spec_of(self, path: tuple[int, ...], var: Any) -> ShardingSpec | None:
        t = self.graph.var_tensors.get((path, var))
        return None if t is None else self.plan.tensors[t].spec

    def pin(self, x: Any, spec: ShardingSpec | None) -> Any:
        if spec is None or not getattr(x, "ndim", 0):
            return x
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, spec.to_partition_spec(self.mesh.axis_names))
        )

    def partition_spec(self, spec: ShardingSpec | None) -> Any:
        return None if spec is None else spec.to_partition_spec(self.mesh.axis_names)

    def pin_grouped(self, g: Grouped, spec: ShardingSpec | None) -> Grouped:
        sharding = grouped_sharding(self.mesh, self.partition_spec(spec), g.axes, g.value.ndim - 1)
        return Grouped(jax.lax.with_sharding_constraint(g.value, sharding), g.axes)

    def reduced(self, x: Any, path: tuple[int, ...], var: Any) -> Any:
        """A value for an ordinary reader: partials reduced into their planned layout."""
        if not isinstance(x, Grouped):
            return x
        return self.pin(x.reduced(), self.spec_of(path, var))

    def deferred(self, eqn: Any, invals: list[Any], path: tuple[int, ...], here: tuple[int, ...]):
        """The equation's result kept as partials, when it feeds an accumulator linearly and
        either reads partials linearly or contracts a split dimension; else None."""
        if len(eqn.outvars) != 1 or (path, eqn.outvars[0]) not in self.deferrable:
            return None
        node_id = self.node_at.get(here)
        if node_id is None:
            return None
        if any(isinstance(x, Grouped) for x in invals):
            g = apply_linear(eqn, invals, self.mesh)
        else:
            invals = [self.operand(x, node_id, k) for k, x in enumerate(invals)]
            specs = [self.partition_spec(s) for s in self.plan.nodes[node_id].in_specs]
            g = source(eqn, invals, specs, self.mesh)
        return None if g is None else [self.pin_grouped(g, self.spec_of(path, eqn.outvars[0]))]

    def operand(self, x: Any, node_id: int, k: int) -> Any:
        """Constrain an operand copy when the node's strategy reads another layout."""
        t = self.graph.nodes[node_id].inputs[k]
        if t is None or self.graph.tensors[t].role == "const":
            return x
        want = self.plan.nodes[node_id].in_specs[k]
        have = self.plan.tensors[t].spec
        return x if want is None or want == have else self.pin(x, want)

    # ------------------------------------------------------------------ evaluation
    def run(
        self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any], path: tuple[int, ...]
    ) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for i, eqn in enumerate(jaxpr.eqns):
            here = (*path, i)
            invals = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name in INLINED_PRIMITIVES:
                sub, sub_consts = call_jaxpr_of(eqn)
                outs = self.run(sub, sub_consts, invals, here)
            elif name == MARKER_NAME:
                outs = invals
            elif (outs := self.deferred(eqn, invals, path, here)) is not None:
                pass
            elif name == "scan":
                invals = [self.reduced(x, path, v) for x, v in zip(invals, eqn.invars, strict=True)]
                outs = self.scan(eqn, invals, path, here)
            else:
                invals = [self.reduced(x, path, v) for x, v in zip(invals, eqn.invars, strict=True)]
                node_id = self.node_at[here]
                invals = [self.operand(x, node_id, k) for k, x in enumerate(invals)]
                outs = bind_equation(eqn, invals)
                outs = [
                    self.pin(x, self.spec_of(path, v))
                    for x, v in zip(outs, eqn.outvars, strict=True)
                ]
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    def scan(
        self, eqn: Any, invals: list[Any], path: tuple[int, ...], here: tuple[int, ...]
    ) -> list[Any]:
        """The scan re-emitted over the re-interpreted body; an accumulating carry holds
        per-group partials (``deferred.py``), reduced after the loop."""
        p = eqn.params
        body: ClosedJaxpr = p["jaxpr"]
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        invals = [self.operand(x, self.boundary[(here, "in", k)], 0) for k, x in enumerate(invals)]
        consts, init, xs = (
            invals[:n_consts],
            invals[n_consts : n_consts + n_carry],
            invals[n_consts + n_carry :],
        )
        body_in_specs = [self.spec_of(here, v) for v in body.jaxpr.invars]
        carry_specs = body_in_specs[n_consts : n_consts + n_carry]
        acc = accumulating_carries(body.jaxpr, n_consts, n_carry)
        self.deferrable |= loop_deferrable(body.jaxpr, n_consts, n_carry, here)
        # Which accumulators receive partials, over which axes: one abstract pass finds out.
        groups: dict[int, tuple[str, ...]] = {}
        stacked: dict[int, tuple[str, ...]] = {}

        def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            args = [*consts, *carry, *x]
            for k, (a, s) in enumerate(zip(args, body_in_specs, strict=True)):
                c = k - n_consts
                if c in groups:
                    args[k] = self.pin_grouped(Grouped(a, groups[c]), s)
                else:
                    args[k] = self.pin(a, s)
            outs = self.run(body.jaxpr, body.consts, args, here)
            new_carry = []
            for c, (o, s) in enumerate(zip(outs[:n_carry], carry_specs, strict=True)):
                if c in groups:
                    new_carry.append(self.carry_partials(o, groups[c], s))
                else:
                    if isinstance(o, Grouped) and c in acc:
                        groups.setdefault(c, o.axes)  # recorded by the abstract pass
                    new_carry.append(self.pin(self.reduced(o, here, body.jaxpr.outvars[c]), s))
            ys = []
            for k, (o, v) in enumerate(
                zip(outs[n_carry:], body.jaxpr.outvars[n_carry:], strict=True)
            ):
                if isinstance(o, Grouped) and (path, eqn.outvars[n_carry + k]) in self.deferrable:
                    stacked[k] = o.axes
                    ys.append(o.value)
                else:
                    ys.append(self.reduced(o, here, v))
            return new_carry, ys

        if acc:
            jax.eval_shape(lambda: step(list(init), [x[0] for x in xs]))
            stacked.clear()
        init = [
            into_groups(x, self.mesh, groups[c]) if c in groups else x for c, x in enumerate(init)
        ]
        carry, ys = jax.lax.scan(
            step, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
        )
        return self.scan_results(eqn, path, carry, ys, groups, stacked)

    def scan_results(
        self,
        eqn: Any,
        path: tuple[int, ...],
        carry: list[Any],
        ys: list[Any],
        groups: dict[int, tuple[str, ...]],
        stacked: dict[int, tuple[str, ...]],
    ) -> list[Any]:
        """A scan's results in their planned layouts, or still partial where the enclosing
        loop accumulates them (a stacked partial ``(L, D, ...)`` becomes ``(D, L, ...)``)."""
        outs: list[Any] = [
            Grouped(x, groups[c]) if c in groups else x for c, x in enumerate(carry)
        ] + [
            Grouped(jnp.moveaxis(y, 1, 0), stacked[k]) if k in stacked else y
            for k, y in enumerate(ys)
        ]
        result = []
        for x, v in zip(outs, eqn.outvars, strict=True):
            if isinstance(x, Grouped) and (path, v) in self.deferrable:
                result.append(self.pin_grouped(x, self.spec_of(path, v)))
            else:
                result.append(self.pin(self.reduced(x, path, v), self.spec_of(path, v)))
        return result

    def carry_partials(self, o: Any, axes: tuple[str, ...], spec: ShardingSpec | None) -> Any:
        """An accumulator's new partials (a value that came out reduced goes to group 0)."""
        if not isinstance(o, Grouped) or o.axes != axes:
            o = Grouped(
                into_groups(o.reduced() if isinstance(o, Grouped) else o, self.mesh, axes), axes
            )
        return self.pin_grouped(o, spec).value


def build_sharded_function(
    closed: ClosedJaxpr,
    graph: OpGraph,
    plan: ShardingPlan,
    mesh: Mesh,
    *,
    donate_argnums: Sequence[int] = (),
) -> Callable[..., Any]:
    """A jitted function of the flat inputs that runs ``closed`` laid out as ``plan`` says."""
    interp = _Interpreter(graph, plan, mesh)

    def flat_fun(*flat_args: Any) -> tuple[Any, ...]:
        outs = interp.run(closed.jaxpr, closed.consts, flat_args, ())
        return tuple(
            interp.reduced(x, (), v) for x, v in zip(outs, closed.jaxpr.outvars, strict=True)
        )

    in_shardings = tuple(
        named_sharding(mesh, plan.tensors[t].spec, len(plan.tensors[t].shape)) for t in plan.inputs
    )
    out_shardings = tuple(
        named_sharding(mesh, spec, len(plan.tensors[t].shape))
        for t, spec in zip(plan.outputs, plan.output_specs, strict=True)
    )
    return jax.jit(
        flat_fun,
        in_shardings=in_shardings,
        out_shardings=out_shardings,
        donate_argnums=tuple(donate_argnums),
    )
