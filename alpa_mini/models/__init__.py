"""Small pure-JAX models and optimisers for tests, the demo and benchmarks.

Every model is a set of plain functions over a nested dict of fp32 arrays: ``init_*``,
``*_forward``, ``*_loss(params, batch)``, ``make_*_batch`` and a closed-form ``*_num_params``;
each module's docstring documents its parameter layout.
"""

from __future__ import annotations

from .gpt import (
    GPT2_1_3B,
    GPT_SMALL,
    GPT_TINY,
    GPTConfig,
    gpt_abstract_batch,
    gpt_abstract_params,
    gpt_forward,
    gpt_loss,
    gpt_num_params,
    init_gpt,
    make_gpt_batch,
    stack_layers,
    unstack_layers,
)
from .mlp import (
    MLPConfig,
    count_params,
    init_mlp,
    make_mlp_batch,
    mlp_forward,
    mlp_loss,
    mlp_num_params,
)
from .moe import (
    MoEConfig,
    init_moe,
    make_moe_batch,
    moe_forward,
    moe_loss,
    moe_num_params,
    moe_routing,
)
from .optim import Optimizer, adam, make_train_step, sgd
from .wide_resnet import (
    WideResNetConfig,
    init_wide_resnet,
    make_wide_resnet_batch,
    wide_resnet_forward,
    wide_resnet_loss,
    wide_resnet_num_params,
)

__all__ = [
    "GPT2_1_3B",
    "GPT_SMALL",
    "GPT_TINY",
    "GPTConfig",
    "MLPConfig",
    "MoEConfig",
    "Optimizer",
    "WideResNetConfig",
    "adam",
    "count_params",
    "gpt_abstract_batch",
    "gpt_abstract_params",
    "gpt_forward",
    "gpt_loss",
    "gpt_num_params",
    "init_gpt",
    "init_mlp",
    "init_moe",
    "init_wide_resnet",
    "make_gpt_batch",
    "make_mlp_batch",
    "make_moe_batch",
    "make_train_step",
    "make_wide_resnet_batch",
    "mlp_forward",
    "mlp_loss",
    "mlp_num_params",
    "moe_forward",
    "moe_loss",
    "moe_num_params",
    "moe_routing",
    "sgd",
    "stack_layers",
    "unstack_layers",
    "wide_resnet_forward",
    "wide_resnet_loss",
    "wide_resnet_num_params",
]
