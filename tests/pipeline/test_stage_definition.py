"""One definition of a stage: the cotangents the planner prices for each stage are exactly
those the compiled backward consumes and produces, for the GPT, MoE and Wide-ResNet test
models under auto and uniform stages."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import AutoLayerOption, AutoStageOption, PipeshardParallel, UniformStageOption
from alpa_mini.models import make_train_step, sgd
from alpa_mini.pipeline.executable import StepFun, prepare_step
from alpa_mini.pipeline.stage_search import _StageModel
from helpers.parallel_cases import initial, model_case

STAGES = {
    "auto": AutoStageOption(),
    "uniform": UniformStageOption(2, (1, 4)),
}


def _avals(values: Any) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(np.shape(x)), str(np.dtype(x.dtype))) for x in values]


def _priced(method: PipeshardParallel, step: Any, args: tuple[Any, ...]) -> list[tuple]:
    """Per planned stage: the (cotangents in, gradients out) the planner's ILP priced."""
    leaves, tree = jax.tree.flatten(args)
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    roles = [r for a, r in zip(args, ("param", "state", "batch"), strict=True) for _ in
             jax.tree.leaves(a)]  # fmt: skip
    cluster = alpa_mini.current_cluster()
    prepared = prepare_step(StepFun(step, (), tree), avals, roles, method, cluster)
    model = _StageModel(prepared.forward, prepared.capture, cluster, method, 0.0, 0.0)
    out = []
    for st in prepared.plan.stages:
        _, diff_in, _, diff_out, _, _ = model._io(st.eqn_start, st.eqn_end)
        out.append((_avals([v.aval for v in diff_out]), _avals([v.aval for v in diff_in])))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("stages", sorted(STAGES))
@pytest.mark.parametrize("model", ["gpt", "moe", "wide_resnet"])
def test_priced_cotangents_are_the_compiled_backwards(devices8, model: str, stages: str) -> None:
    params, batches = initial(model)
    opt = sgd(0.1)
    step = make_train_step(model_case(model).loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(  # unfused: the test records each bwd{s} program
        num_micro_batches=2,
        layer_option=AutoLayerOption(2, eps=0.5),
        stage_option=STAGES[stages],
        fuse_programs=False,
    )
    args = (params, opt.init(params), batches[0])
    ex = alpa_mini.parallelize(step, method=method).get_executable(*args)
    seen: dict[int, tuple] = {}
    for s in range(ex.plan.num_stages):
        program = ex.runtime.programs[f"bwd{s}"]
        accs = ex.compiled.accumulators[s]
        kept = _step_inputs_read(ex, s)

        def recorded(
            res: Any, *rest: Any, s: int = s, program: Any = program, accs=accs, kept=kept
        ) -> Any:
            cts = rest[kept : len(rest) - len(accs)]
            outs = program(res, *rest)
            acts = outs[: len(outs) - len(accs)]
            # A partial accumulator holds one gradient per data-parallel group.
            grads = [
                (tuple(np.shape(a))[1:] if partial else tuple(np.shape(a)), str(a.dtype))
                for a, (_, partial) in zip(outs[len(acts) :], accs, strict=True)
            ]
            seen[s] = (_avals(cts), sorted(_avals(acts) + grads))
            return outs

        ex.runtime.programs[f"bwd{s}"] = recorded
    ex(*args)
    priced = [(cts, sorted(grads)) for cts, grads in _priced(method, step, args)]
    assert len(priced) == ex.plan.num_stages >= 1
    assert [seen[s] for s in range(ex.plan.num_stages)] == priced
    if ex.plan.num_stages > 1:  # an inner boundary carries cotangents both sides agree on
        assert priced[0][0] and priced[1][1]


def _aux_loss(params: Any, batch: Any) -> tuple[Any, Any]:
    """Stage 0 computes ``scale``, a value returned as auxiliary output *and* read by stage 1:
    its cotangent crosses the boundary, although it is also an aux output."""
    h = jax.numpy.tanh(batch["x"] @ params[0])
    scale = jax.numpy.mean(h)
    alpa_mini.mark_pipeline_boundary()
    out = jax.numpy.tanh(h @ params[1]) * scale
    return jax.numpy.mean((out - batch["y"]) ** 2), scale


def _step_inputs_read(ex: Any, s: int) -> int:
    """How many step-input buffers (parameters, batch slices) stage ``s``'s backward reads
    after its residuals: the forward does not copy them into its residuals."""
    from alpa_mini.runtime.instructions import Run

    run = next(i for i in ex.compiled.stream if isinstance(i, Run) and i.program == f"bwd{s}")
    return sum(name.startswith("arg") for name in run.inputs[1:])


def test_an_aux_output_read_by_a_later_stage_carries_a_cotangent(devices8) -> None:
    k = jax.random.split(jax.random.key(0), 4)
    params = [jax.random.normal(k[i], (16, 16)) * 0.3 for i in range(2)]
    batch = {"x": jax.random.normal(k[2], (8, 16)), "y": jax.random.normal(k[3], (8, 16))}
    opt = sgd(0.1)

    def step(p: Any, s: Any, b: Any) -> Any:
        (loss, scale), grads = alpa_mini.value_and_grad(_aux_loss, has_aux=True)(p, b)
        p, s = opt.update(grads, s, p)
        return p, s, loss, scale

    method = PipeshardParallel(
        num_micro_batches=2, stage_option=UniformStageOption(2, (1, 4)), fuse_programs=False
    )
    args = (params, opt.init(params), batch)
    ex = alpa_mini.parallelize(step, method=method).get_executable(*args)
    priced = _priced(method, step, args)
    assert ((), "float32") in priced[0][0]  # scale's cotangent, priced for stage 0's backward
    seen = {}
    program = ex.runtime.programs["bwd0"]
    num_accs = len(ex.compiled.accumulators[0])
    kept = _step_inputs_read(ex, 0)

    def recorded(res: Any, *rest: Any) -> Any:
        seen["cts"] = _avals(rest[kept : len(rest) - num_accs])  # then the accumulators
        return program(res, *rest)

    ex.runtime.programs["bwd0"] = recorded
    ex(*args)
    assert seen["cts"] == priced[0][0]
