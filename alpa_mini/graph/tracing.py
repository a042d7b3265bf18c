"""Jaxpr -> OpGraph: one explicit loop over equations, recursing into sub-jaxprs.

Call-like equations (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``/``remat``,
``closed_call``) are inlined: their inner equations become nodes, so the planner sees the
real operators. A ``scan`` body is walked once with its costs multiplied by the trip count,
framed by boundary nodes (operands in, per-iteration slices, carries looping back, stacked
results out) so a layer stack written with ``lax.scan`` plans like the unrolled one.
``while`` and ``cond`` become one opaque node each whose flops summarise their bodies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from .accumulation import loop_deferrable
from .jaxpr_walk import (
    INLINED_PRIMITIVES,
    call_jaxpr_of,
    equation_flops,
    jaxpr_flops,
    subjaxprs,
)
from .markers import MARKER_NAME
from .op_graph import OpGraph, OpNode, Tensor

__all__ = ["OPAQUE_PRIMITIVES", "is_prng_key", "trace_jaxpr"]

#: Control flow kept as one node: its operands and results stay replicated.
OPAQUE_PRIMITIVES = ("while", "cond")


def is_prng_key(x: Any) -> bool:
    """Whether ``x`` (an array or abstract value) is a typed PRNG key (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _dtype(aval: Any) -> tuple[str, int]:
    try:
        dt = np.dtype(aval.dtype)
    except TypeError:  # extended dtypes such as PRNG keys
        return str(aval.dtype), int(getattr(aval.dtype, "itemsize", 8) or 8)
    return dt.name, dt.itemsize


class _Builder:
    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.nodes: list[OpNode] = []
        self.var_tensors: dict[tuple[tuple[int, ...], Any], int] = {}
        self.warnings: list[str] = []
        # (path, var) -> how often per step a value kept partial is reduced (its loop's exit).
        self.reduced_at: dict[tuple[tuple[int, ...], Any], float] = {}
        # id(eqn) -> (flops, source): an inlined jitted layer repeats its equation objects
        # once per call (the nodes keep them alive, so ids are not reused meanwhile).
        self._eqn_facts: dict[int, tuple[float, str]] = {}

    # ---------------------------------------------------------------- helpers
    def tensor(self, aval: Any, producer: int | None, role: str, name: str = "") -> int:
        dtype, itemsize = _dtype(aval)
        tid = len(self.tensors)
        self.tensors.append(
            Tensor(tid, tuple(int(s) for s in aval.shape), dtype, itemsize, producer, role, name)
        )
        return tid

    def node(self, **kw: Any) -> OpNode:
        node = OpNode(id=len(self.nodes), **kw)
        self.nodes.append(node)
        return node

    def read(self, env: dict[Any, int], var: Any) -> int | None:
        if isinstance(var, Literal):
            return None
        return env[var]

    def bind(self, env: dict[Any, int], var: Any, tid: int, path: tuple[int, ...]) -> None:
        env[var] = tid
        self.var_tensors[(path, var)] = tid

    def const(self, value: Any, name: str) -> int:
        aval = np.asarray(value) if not hasattr(value, "aval") else value.aval
        return self.tensor(aval, None, "const", name)

    def bytes_of(self, ids: Sequence[int | None]) -> float:
        return float(sum(self.tensors[t].nbytes for t in ids if t is not None))

    # ---------------------------------------------------------------- walking
    def walk(
        self,
        jaxpr: Jaxpr,
        env: dict[Any, int],
        path: tuple[int, ...],
        multiplier: float,
    ) -> None:
        for i, eqn in enumerate(jaxpr.eqns):
            name = eqn.primitive.name
            ins = [self.read(env, v) for v in eqn.invars]
            here = (*path, i)
            if name in INLINED_PRIMITIVES:
                self.inline(eqn, ins, env, path, here, multiplier)
            elif name == MARKER_NAME:  # identity: results are the operands' tensors
                for var, src, tid in zip(eqn.outvars, eqn.invars, ins, strict=True):
                    if tid is None:
                        tid = self.tensor(src.aval, None, "const", "literal")
                    self.bind(env, var, tid, path)
            elif name == "scan":
                self.scan(eqn, ins, env, path, here, multiplier)
            else:
                self.leaf(eqn, ins, env, path, here, multiplier)

    def leaf(self, eqn, ins, env, path, here, multiplier) -> None:
        name = eqn.primitive.name
        opaque = name in OPAQUE_PRIMITIVES
        node_id = len(self.nodes)
        outs = []
        for k, var in enumerate(eqn.outvars):
            tid = self.tensor(var.aval, node_id, "intermediate", f"{name}.{node_id}.{k}")
            outs.append(tid)
        facts = self._eqn_facts.get(id(eqn))
        if facts is None:
            flops = sum(jaxpr_flops(s) for s in subjaxprs(eqn)) if opaque else equation_flops(eqn)
            facts = self._eqn_facts[id(eqn)] = (flops, _source(eqn))
        flops, source = facts
        self.node(
            primitive=name,
            inputs=tuple(ins),
            outputs=tuple(outs),
            flops=flops,
            bytes_accessed=self.bytes_of(ins) + self.bytes_of(outs),
            multiplier=multiplier,
            comm_scale=self._comm_scale(path, eqn.outvars, multiplier),
            eqn=eqn,
            params=dict(eqn.params),
            kind="opaque" if opaque else "op",
            path=here,
            source=source,
        )
        for var, tid in zip(eqn.outvars, outs, strict=True):
            self.bind(env, var, tid, path)

    def _comm_scale(self, path, outvars, multiplier) -> float:
        """A reduction deferred out of accumulation loops runs at the outermost loop's exit."""
        exits = [self.reduced_at.get((path, v)) for v in outvars]
        if not exits or None in exits or not multiplier:
            return 1.0
        return max(exits) / multiplier

    def _defer_in_loop(self, eqn, path, here, multiplier) -> None:
        """Record which body values of an accumulating scan stay partial, and how often they
        are reduced: once per run of this scan, or later if the enclosing loop defers too."""
        p = eqn.params
        n_consts, n_carry = int(p["num_consts"]), int(p["num_carry"])
        outer = {k: self.reduced_at.get((path, v)) for k, v in enumerate(eqn.outvars)}
        ys = [k - n_carry for k, e in outer.items() if k >= n_carry and e is not None]
        body = p["jaxpr"].jaxpr
        found = loop_deferrable(body, n_consts, n_carry, here, ys)
        if not found:
            return
        acc = [k for k in range(n_carry) if (here, body.outvars[k]) in found]
        exits = [outer[k] if outer[k] is not None else multiplier for k in [*acc, *ys]]
        exit_at = max(exits, default=multiplier)
        for key in found:
            self.reduced_at.setdefault(key, exit_at)

    def inline(self, eqn, ins, env, path, here, multiplier) -> None:
        sub, consts = call_jaxpr_of(eqn)
        inner: dict[Any, int] = {}
        for var, value in zip(sub.constvars, consts, strict=True):
            self.bind(inner, var, self.const(value, "const"), here)
        operands = list(ins)
        for var, tid in zip(sub.invars, operands, strict=True):
            if tid is None:  # a literal operand: give it a constant tensor
                tid = self.tensor(var.aval, None, "const", "literal")
            self.bind(inner, var, tid, here)
        self.walk(sub, inner, here, multiplier)
        for outer, var in zip(eqn.outvars, sub.outvars, strict=True):
            tid = (
                self.tensor(var.aval, None, "const", "literal")
                if isinstance(var, Literal)
                else inner[var]
            )
            self.bind(env, outer, tid, path)

    def scan(self, eqn, ins, env, path, here, multiplier) -> None:
        p = eqn.params
        body: ClosedJaxpr = p["jaxpr"]
        length, n_consts, n_carry = int(p["length"]), int(p["num_consts"]), int(p["num_carry"])
        inner: dict[Any, int] = {}
        for var, value in zip(body.jaxpr.constvars, body.consts, strict=True):
            self.bind(inner, var, self.const(value, "const"), here)
        invars = body.jaxpr.invars
        carry_in_nodes: list[OpNode] = []
        for k, (var, tid) in enumerate(zip(invars, ins, strict=True)):
            if tid is None:
                tid = self.tensor(var.aval, None, "const", "literal")
            kind = "identity" if k < n_consts + n_carry else "unstack"
            node_id = len(self.nodes)
            out = self.tensor(var.aval, node_id, "intermediate", f"scan.{kind}.{node_id}")
            node = self.node(
                primitive=f"scan_{kind}",
                inputs=(tid,) if kind == "unstack" or k < n_consts else (tid, None),
                outputs=(out,),
                flops=0.0,
                bytes_accessed=0.0,
                multiplier=multiplier,
                # carry: entering once, looping back length - 1 times
                input_weights=None
                if kind == "unstack" or k < n_consts
                else (multiplier, multiplier * max(length - 1, 0)),
                kind=kind,
                path=here,
                params={"operand": k},
            )
            if n_consts <= k < n_consts + n_carry:
                carry_in_nodes.append(node)
            self.bind(inner, var, out, here)
        self._defer_in_loop(eqn, path, here, multiplier)
        self.walk(body.jaxpr, inner, here, multiplier * length)
        body_outs = [
            self.tensor(v.aval, None, "const", "literal") if isinstance(v, Literal) else inner[v]
            for v in body.jaxpr.outvars
        ]
        # Close each carry's loop: the carry-in node also reads the body's carry-out.
        for j, node in enumerate(carry_in_nodes):
            back = body_outs[j]
            if back == node.outputs[0] or self.tensors[back].role == "const":
                back = None  # the body passes the carry through unchanged, or returns a literal
            self.nodes[node.id] = _replace_inputs(node, (node.inputs[0], back))
        for k, (outer, tid) in enumerate(zip(eqn.outvars, body_outs, strict=True)):
            kind = "identity" if k < n_carry else "stack"
            node_id = len(self.nodes)
            out = self.tensor(outer.aval, node_id, "intermediate", f"scan.{kind}.{node_id}")
            self.node(
                primitive=f"scan_{kind}",
                inputs=(tid,),
                outputs=(out,),
                flops=0.0,
                bytes_accessed=0.0,
                multiplier=multiplier,
                kind=kind,
                path=here,
                params={"result": k},
            )
            self.bind(env, outer, out, path)


def _replace_inputs(node: OpNode, inputs: tuple[int | None, ...]) -> OpNode:
    return dataclasses.replace(node, inputs=inputs)


def _source(eqn: Any) -> str:
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # source info is a convenience; its API is private and may move
        return ""


def trace_jaxpr(
    closed: ClosedJaxpr,
    roles: Sequence[str],
    names: Sequence[str] | None = None,
) -> OpGraph:
    """The OpGraph of a closed jaxpr whose flat inputs play ``roles`` (see ``Tensor.role``)."""
    jaxpr = closed.jaxpr
    if len(roles) != len(jaxpr.invars):
        raise ValueError(f"roles: expected {len(jaxpr.invars)} entries, got {len(roles)}")
    names = list(names) if names is not None else [f"arg{i}" for i in range(len(roles))]
    b = _Builder()
    env: dict[Any, int] = {}
    for var, value in zip(jaxpr.constvars, closed.consts, strict=True):
        b.bind(env, var, b.const(value, "const"), ())
    inputs = []
    for var, role, name in zip(jaxpr.invars, roles, names, strict=True):
        tid = b.tensor(var.aval, None, role, name)
        b.bind(env, var, tid, ())
        inputs.append(tid)
    b.walk(jaxpr, env, (), 1.0)
    outputs = []
    for var in jaxpr.outvars:
        if isinstance(var, Literal):
            outputs.append(b.tensor(np.asarray(var.val), None, "const", "literal"))
        else:
            outputs.append(env[var])
    return OpGraph(
        nodes=tuple(b.nodes),
        tensors=tuple(b.tensors),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        var_tensors=b.var_tensors,
        warnings=tuple(b.warnings),
    )
