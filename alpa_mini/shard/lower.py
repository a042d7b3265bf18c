"""ShardingPlan -> a jitted function: re-evaluate the jaxpr and pin every planned layout.

The interpreter walks the same equations the tracer walked, in the same order and with the
same paths, so each variable finds its tensor in ``OpGraph.var_tensors``. After every
operator it applies ``with_sharding_constraint`` with the planned result layout; before an
operator whose strategy reads an operand in another layout it constrains a copy of that
operand, so XLA's partitioner inserts the resharding the plan priced. Inputs and outputs
get ``NamedSharding``s through ``jax.jit``. Call-like equations are inlined (remat
boundaries are therefore not kept); ``scan`` is re-emitted as ``lax.scan`` over the
re-interpreted body.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal
from jax.sharding import Mesh, NamedSharding

from ..graph.jaxpr_walk import INLINED_PRIMITIVES, bind_equation, call_jaxpr_of
from ..graph.markers import MARKER_NAME
from ..graph.op_graph import OpGraph
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
            elif name == "scan":
                outs = self.scan(eqn, invals, path, here)
            else:
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

        def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            args = [*consts, *carry, *x]
            args = [self.pin(a, s) for a, s in zip(args, body_in_specs, strict=True)]
            outs = self.run(body.jaxpr, body.consts, args, here)
            new_carry = [self.pin(c, s) for c, s in zip(outs[:n_carry], carry_specs, strict=True)]
            return new_carry, outs[n_carry:]

        carry, ys = jax.lax.scan(
            step, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
        )
        outs = [*carry, *ys]
        return [self.pin(x, self.spec_of(path, v)) for x, v in zip(outs, eqn.outvars, strict=True)]


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
        return tuple(interp.run(closed.jaxpr, closed.consts, flat_args, ()))

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
