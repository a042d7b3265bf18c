"""Saved pipeshard plans are checked before anything runs: every field of a valid plan, mutated
(wrong type, out of range, missing, duplicated), is refused with a ``ConfigError`` that names
the field; never a bare ``IndexError``/``AssertionError``, never accepted silently."""

from __future__ import annotations

import copy
import functools
import json
import math
from typing import Any

import jax
import pytest

import alpa_mini
from alpa_mini import (
    AutoLayerOption,
    ClusterSpec,
    ConfigError,
    PipeshardParallel,
    UniformStageOption,
)
from alpa_mini.models import make_train_step, sgd
from alpa_mini.models.gpt import GPTConfig, gpt_abstract_batch, gpt_abstract_params, gpt_loss
from alpa_mini.pipeline.executable import apply_scan_splits, trace_step
from alpa_mini.pipeline.plan import PipeshardPlan
from alpa_mini.pipeline.plan_check import check_plan

CLUSTER = ClusterSpec.named("cpu-1x8")
GPT = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_heads=4, num_layers=4, scan_layers=True)
B = 2
#: Keys a plan may leave out (defaults, or records kept for inspection only).
OPTIONAL = {
    "inner_specs", "out_bytes", "residual_bytes", "layer_eps", "scan_splits", "stage_problem",
    "stage_solution", "planning", "cluster_spec",
}  # fmt: skip
#: Informational records: refused when a leaf has the wrong type (values inside them are
#: the planner's own bookkeeping, so only their form is checked).
RECORDS = ("stage_problem", "stage_solution", "planning", "cluster_spec")


@functools.cache
def _setup() -> tuple[str, Any]:
    """A valid 2-stage plan of a scanned GPT (its JSON) and the traced step to check it on."""
    params = gpt_abstract_params(GPT)
    opt = sgd(0.1)
    args = (params, jax.eval_shape(opt.init, params), gpt_abstract_batch(GPT, 8))
    train = make_train_step(functools.partial(gpt_loss, config=GPT), opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(
        num_micro_batches=B, layer_option=AutoLayerOption(2), stage_option=UniformStageOption(2)
    )
    plan = alpa_mini.plan(train, *args, method=method, cluster=CLUSTER)
    flat, tree = jax.tree.flatten(args)
    roles = ["param"] * len(jax.tree.leaves(args[0])) + ["state"] * len(jax.tree.leaves(args[1]))
    roles += ["batch"] * len(jax.tree.leaves(args[2]))

    def step(*leaves):
        return train(*jax.tree.unflatten(tree, leaves))

    traced = trace_step(step, flat, roles, B)
    return plan.to_json(), (traced, roles)


def _load_and_check(text: str) -> PipeshardPlan:
    """What replaying a plan file does before it compiles anything."""
    _, ((step, _, capture, forward), roles) = _setup()
    plan = PipeshardPlan.from_json(text)
    try:
        _, capture, forward, _ = apply_scan_splits(step, capture, forward, plan.scan_splits, roles)
    except ValueError as err:
        raise ConfigError(f"plan.{err}") from None
    check_plan(plan, CLUSTER, forward, capture, B)
    return plan


def test_the_valid_plan_passes() -> None:
    text, _ = _setup()
    assert _load_and_check(text) == PipeshardPlan.from_json(text)


def _leaves(node: Any, path: tuple) -> list[tuple[tuple, Any]]:
    """(path, value) of every leaf and container below ``node``, outermost first."""
    found = [(path, node)] if path else []
    if isinstance(node, dict):
        for k, v in node.items():
            found += _leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _leaves(v, (*path, i))
    return found


def _name(path: tuple) -> str:
    out = "plan"
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _field(path: tuple) -> str:
    """The named field a mutation at ``path`` must be blamed on: up to its last key."""
    keys = [i for i, p in enumerate(path) if isinstance(p, str)]
    return _name(path[: keys[-1] + 1])


def _mutations(path: tuple, value: Any) -> list[tuple[str, Any]]:
    """(kind, new value or the marker "missing"/"duplicated") that make the plan invalid."""
    out: list[tuple[str, Any]] = [("wrong type", "x" if not isinstance(value, str) else 7)]
    if path[0] in (*RECORDS, "cluster"):  # the records' form; the cluster's name
        return out
    if isinstance(value, bool):
        return out
    if isinstance(value, int):
        out += [("out of range", -1), ("not an integer", 0.5), ("out of range", 10**9)]
    elif isinstance(value, float):
        out += [("out of range", -1.0), ("not finite", math.nan)]
    inside_spec = any(p in ("in_specs", "out_specs", "inner_specs") for p in path) and (
        isinstance(path[-1], int) and len([p for p in path if isinstance(p, int)]) >= 3
    )
    if not inside_spec and path[-1] not in OPTIONAL and value is not None:
        out.append(("missing", "missing"))
    if isinstance(path[-1], int) and not inside_spec and path[-2] != "inner_specs":
        out.append(("duplicated", "duplicated"))
    return out


def _mutated(doc: dict, path: tuple, new: Any) -> dict:
    doc = copy.deepcopy(doc)
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if new == "missing":
        del parent[last]
    elif new == "duplicated":
        parent.insert(last, copy.deepcopy(parent[last]))
    else:
        parent[last] = new
    return doc


def _cases() -> list[tuple[str, tuple, str, Any]]:
    text, _ = _setup()
    doc = json.loads(text)
    cases = []
    for path, value in _leaves(doc, ()):
        if path[0] in RECORDS and (isinstance(value, dict | list) or hash(path) % 7):
            continue  # a sample of the records' leaves: their form is checked generically
        if path[0] == "format":
            cases.append(("wrong", path, "wrong type", "alpa_mini.PipeshardPlan/0"))
            continue
        for kind, new in _mutations(path, value):
            cases.append(("", path, kind, new))
    return cases


def test_every_mutated_field_is_refused_by_name() -> None:
    text, _ = _setup()
    doc = json.loads(text)
    accepted, unnamed = [], []
    cases = _cases()
    assert len(cases) > 150  # every stage field, the plan's own and a sample of the records
    for _, path, kind, new in cases:
        bad = json.dumps(_mutated(doc, path, new))
        try:
            _load_and_check(bad)
        except ConfigError as err:
            field = _field(path) if path[0] != "format" else "plan.format"
            stage = _name(path[:2]) if path[0] == "stages" else field
            msg = str(err)
            if field not in msg and not (stage in msg and str(path[2]) in msg):
                unnamed.append((_name(path), kind, msg[:160]))
        else:
            accepted.append((_name(path), kind))
    assert not accepted, accepted[:10]
    assert not unnamed, "\n".join(map(str, unnamed))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d["stages"][1]["devices"].__setitem__(0, 2), r"device 2 is already used"),
        (lambda d: d["stages"][0]["devices"].__setitem__(1, -3), r"devices\[1\]: -3 is inval"),
        (lambda d: d["stages"][0].__setitem__("latency", math.nan), r"latency: nan is invalid"),
        (lambda d: d["stages"][0]["equations"].__setitem__(1, 999), r"equations: \[0, 999\]"),
        (lambda d: d.__setitem__("num_equations", 3), r"num_equations: 3, but this step"),
        (
            lambda d: d["scan_splits"][0].__setitem__("lengths", [3, 3]),
            r"lengths: \[3, 3\] is inval",
        ),
    ],
)
def test_named_errors_for_typical_edits(edit, match) -> None:
    text, _ = _setup()
    doc = json.loads(text)
    edit(doc)
    with pytest.raises(ConfigError, match=match):
        _load_and_check(json.dumps(doc))
