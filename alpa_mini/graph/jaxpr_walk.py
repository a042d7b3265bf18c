"""Walking jaxprs: which call primitives are inlined, their sub-jaxprs, flop counts, and the
one equation evaluator every interpreter in alpa_mini uses.

Tracing (jaxpr -> ``OpGraph``), lowering (re-evaluating a jaxpr with sharding constraints)
and the pipeline (splicing nested calls into one flat forward, evaluating stage slices) all
read these, so they agree on what a call is and evaluate equations the same way.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal, Var

__all__ = [
    "CALL_PRIMITIVES",
    "INLINED_PRIMITIVES",
    "bind_equation",
    "call_jaxpr_of",
    "equation_context",
    "equation_flops",
    "eval_eqns",
    "flatten_calls",
    "jaxpr_flops",
    "subjaxprs",
    "without_dead_code",
]

#: Equations whose sub-jaxpr is inlined when tracing and lowering (param name of the body).
INLINED_PRIMITIVES = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "checkpoint": "jaxpr",
    "remat2": "jaxpr",
    "remat": "jaxpr",
}
#: The plain calls among them, which ``flatten_calls`` splices into a pipeline's flat
#: forward; the others carry meaning the pipeline keeps (custom derivatives, recomputation).
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})


def call_jaxpr_of(eqn: Any) -> tuple[Jaxpr, Sequence[Any]]:
    """The inlined sub-jaxpr of a call-like equation and its closed-over constants."""
    sub = eqn.params[INLINED_PRIMITIVES[eqn.primitive.name]]
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, sub.consts
    return sub, ()


def subjaxprs(eqn: Any) -> list[Jaxpr]:
    """Every jaxpr an equation's parameters carry (call bodies, scan/while/cond branches)."""
    found = []
    for value in eqn.params.values():
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if isinstance(v, ClosedJaxpr):
                found.append(v.jaxpr)
            elif isinstance(v, Jaxpr):
                found.append(v)
    return found


def jaxpr_flops(jaxpr: Jaxpr) -> float:
    """Flops of a whole (sub-)jaxpr; a scan body counts once per iteration."""
    return sum(eqn_total_flops(eqn) for eqn in jaxpr.eqns)


def eqn_total_flops(eqn: Any) -> float:
    """Flops of one equation, its sub-jaxprs included."""
    subs = subjaxprs(eqn)
    if subs:
        scale = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        return scale * sum(jaxpr_flops(s) for s in subs)
    return equation_flops(eqn)


def equation_flops(eqn: Any) -> float:
    """Floating-point operations of one leaf equation (a multiply-add counts 2)."""
    name = eqn.primitive.name
    outs = [v.aval for v in eqn.outvars if hasattr(v.aval, "shape")]
    ins = [v.aval for v in eqn.invars if hasattr(v.aval, "shape")]
    out_size = sum(math.prod(a.shape) for a in outs)
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = ins[0].shape
        return 2.0 * out_size * math.prod(lhs[d] for d in lc)
    if name == "conv_general_dilated":
        rhs = ins[1].shape
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        per_output = math.prod(rhs) / rhs[out_feature_dim]
        return 2.0 * out_size * per_output
    in_size = max((math.prod(a.shape) for a in ins), default=0)
    return float(max(out_size, in_size))


def equation_context(eqn: Any) -> contextlib.ExitStack:
    """The equation's own context (source location, name stack), as ``jax.core.eval_jaxpr``
    uses it, so the compiled HLO's metadata still points at the user's code."""
    from jax._src import source_info_util

    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    stack = contextlib.ExitStack()
    stack.enter_context(
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)
    )
    stack.enter_context(eqn.ctx.manager)
    return stack


def bind_equation(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Apply one equation's primitive to ``invals`` in the equation's context."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with equation_context(eqn):
        ans = eqn.primitive.bind(*invals, **params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def eval_eqns(eqns: Sequence[Any], env: dict[Any, Any]) -> None:
    """Evaluate equations in order, reading and writing ``env`` (var -> value)."""
    for eqn in eqns:
        invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
        env.update(zip(eqn.outvars, bind_equation(eqn, invals), strict=True))


def flatten_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same function with nested plain calls (``CALL_PRIMITIVES``) spliced in.

    Spliced structurally: every other equation is kept as it is (its primitive, parameters
    and source context), under fresh variables, since one callee's jaxpr may be spliced at
    many call sites. Re-tracing the function instead binds every equation again, which took
    about a second per micro-batch count on GPT-3 175B's loss."""
    if not any(e.primitive.name in CALL_PRIMITIVES for e in closed.jaxpr.eqns):
        return closed
    constvars: list[Var] = []
    consts: list[Any] = []
    eqns: list[Any] = []

    def splice(jaxpr: Jaxpr, values: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        for v, c in zip(jaxpr.constvars, values, strict=True):
            env[v] = Var(v.aval)
            constvars.append(env[v])
            consts.append(c)
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> Any:
            return v if isinstance(v, Literal) else env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive.name in CALL_PRIMITIVES:
                env.update(zip(eqn.outvars, splice(*call_jaxpr_of(eqn), ins), strict=True))
                continue
            outs = [v if isinstance(v, DropVar) else Var(v.aval) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outs, strict=True))
            eqns.append(eqn.replace(invars=ins, outvars=outs))
        return [read(v) for v in jaxpr.outvars]

    top = closed.jaxpr
    invars = [Var(v.aval) for v in top.invars]
    outvars = splice(top, closed.consts, invars)
    jaxpr = Jaxpr(constvars, invars, outvars, eqns, top.effects, top.debug_info)
    return ClosedJaxpr(jaxpr, consts)


def without_dead_code(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` less the equations none of its outputs depends on (nested jaxprs too);
    inputs, constants and effectful equations are kept. XLA drops such code, so neither an
    ILP nor a lowering should carry it."""
    # jax has no public dead-code pass (jit lowering runs this one).
    from jax._src.interpreters import partial_eval as pe

    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    return ClosedJaxpr(jaxpr, closed.consts)
