"""``AutoLayerOption`` by default relaxes the flop balance as far as the model needs (and says
so in the plan); a given eps stays a strict limit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import alpa_mini
from alpa_mini import (
    AutoLayerOption,
    ClusterSpec,
    InfeasibleError,
    PipeshardParallel,
    PipeshardPlan,
    UniformStageOption,
)
from alpa_mini.models import make_train_step, sgd


def _lopsided_loss(params, batch):
    """One wide matmul holds most of the flops: two layers cannot balance within 1.1."""
    h = jnp.tanh(batch["x"] @ params["wide"])
    h = jnp.tanh(h @ params["narrow"])
    return jnp.mean((h - batch["y"]) ** 2)


def _args():
    params = {
        "wide": jax.ShapeDtypeStruct((256, 16), jnp.float32),
        "narrow": jax.ShapeDtypeStruct((16, 16), jnp.float32),
    }
    batch = {
        "x": jax.ShapeDtypeStruct((32, 256), jnp.float32),
        "y": jax.ShapeDtypeStruct((32, 16), jnp.float32),
    }
    opt_state = jax.eval_shape(sgd(0.1).init, params)
    return params, opt_state, batch


def _plan(layer_option):
    step = make_train_step(_lopsided_loss, sgd(0.1), alpa_mini.value_and_grad)
    method = PipeshardParallel(layer_option=layer_option, stage_option=UniformStageOption(2))
    return alpa_mini.plan(step, *_args(), method=method, cluster=ClusterSpec.named("cpu-1x8"))


def test_the_default_balance_relaxes_and_the_plan_reports_it() -> None:
    plan = _plan(AutoLayerOption(2))
    assert plan.num_layers == 2 and plan.layer_eps is not None and plan.layer_eps > 0.1
    assert PipeshardPlan.from_json(plan.to_json()).layer_eps == plan.layer_eps
    with pytest.raises(InfeasibleError, match="eps"):
        _plan(AutoLayerOption(2, eps=0.1))
    # The strict form at the eps the default chose works too.
    assert _plan(AutoLayerOption(2, eps=plan.layer_eps)).layer_starts == plan.layer_starts


def test_a_marker_inside_a_scan_body_is_refused_by_name() -> None:
    from alpa_mini import ConfigError, ManualLayerOption

    def scanned_loss(params, batch):
        def body(h, w):
            h = jnp.tanh(h @ w)
            alpa_mini.mark_pipeline_boundary()
            return h, None

        h, _ = jax.lax.scan(body, batch["x"], params["stack"])
        return jnp.mean((h - batch["y"]) ** 2)

    params = {"stack": jax.ShapeDtypeStruct((4, 16, 16), jnp.float32)}
    batch = {
        "x": jax.ShapeDtypeStruct((32, 16), jnp.float32),
        "y": jax.ShapeDtypeStruct((32, 16), jnp.float32),
    }
    step = make_train_step(scanned_loss, sgd(0.1), alpa_mini.value_and_grad)
    method = PipeshardParallel(layer_option=ManualLayerOption(), stage_option=UniformStageOption(1))
    with pytest.raises(ConfigError, match=r"mark_pipeline_boundary\(\): called inside a scan body"):
        alpa_mini.plan(step, params, jax.eval_shape(sgd(0.1).init, params), batch,
                       method=method, cluster=ClusterSpec.named("cpu-1x8"))  # fmt: skip


@pytest.mark.parametrize("num_layers", [3, 5])
def test_an_unmarked_gpt_is_cut_where_its_marked_twin_has_markers(num_layers: int) -> None:
    """The repeated blocks found in the unmarked GPT's loss start exactly where the marked
    GPT's markers end its layers (counted without the markers), with the head and loss one
    more layer."""
    from alpa_mini.graph.jaxpr_walk import flatten_calls
    from alpa_mini.graph.markers import MARKER_NAME
    from alpa_mini.models import GPTConfig, gpt_abstract_batch, gpt_abstract_params, gpt_loss
    from alpa_mini.pipeline.layers import repeated_block_starts

    def loss_jaxpr(marks: bool):
        config = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_heads=4,
                           num_layers=num_layers, pipeline_marks=marks)  # fmt: skip
        loss = lambda p, b: gpt_loss(p, b, config)  # noqa: E731
        args = (gpt_abstract_params(config), gpt_abstract_batch(config, 4))
        return flatten_calls(jax.make_jaxpr(loss)(*args)).jaxpr

    marked, unmarked = loss_jaxpr(True), loss_jaxpr(False)
    markers = [i for i, e in enumerate(marked.eqns) if e.primitive.name == MARKER_NAME]
    assert len(markers) == num_layers  # after the embedding and each block but the last
    expected = [i - k for k, i in enumerate(markers)]  # where each layer after one starts
    found = repeated_block_starts(unmarked)
    assert found is not None and len(unmarked.eqns) == len(marked.eqns) - num_layers
    assert list(found[: num_layers + 1]) == [0, *expected] and len(found) == num_layers + 2
