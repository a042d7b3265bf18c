"""Sizes the planner cannot represent are refused by name before any large allocation; corrupt
files are reported with their name; memory figures print in a unit that shows them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import jax
import pytest

import alpa_mini
from alpa_mini import ClusterSpec, ConfigError, PipeshardParallel
from alpa_mini._validate import format_bytes
from alpa_mini.models import GPTConfig, make_train_step, sgd
from alpa_mini.models.gpt import gpt_abstract_batch, gpt_abstract_params, gpt_loss
from alpa_mini.models.specs import ModelSpec
from alpa_mini.solvers.errors import SolverInputError
from alpa_mini.solvers.sharding.problem import load_iopddl

EXAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "iopddl" / "example.json"


def _cluster_yaml(tmp_path: Path, **fields) -> Path:
    spec = ClusterSpec.named("cpu-1x8").to_dict()
    spec.update(fields)
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("num_hosts", 10**12, r"num_hosts: 1000000000000 is too large; expected an integer "
         r"from 1 to 4096"),
        ("devices_per_host", 10**6, r"devices_per_host: 1000000 is too large"),
        ("num_hosts", 0, r"num_hosts: 0 is invalid"),
    ],
)  # fmt: skip
def test_cluster_sizes_are_bounded_by_name(tmp_path, field, value, match) -> None:
    with pytest.raises(ConfigError, match=match):
        ClusterSpec.from_yaml(_cluster_yaml(tmp_path, **{field: value}))
    with pytest.raises(ConfigError, match=r"num_hosts: .* too large"):
        ClusterSpec.named("cpu-1x8").with_hosts(10**9)


def test_model_sizes_past_what_shapes_hold_are_refused_by_name() -> None:
    text = (
        "family: gpt\nbatch_size: 8\nmodel:\n  vocab_size: 1000\n  seq_len: 128\n"
        "  hidden: 1000000000000000\n  num_heads: 8\n  num_layers: 2\n"
    )
    with pytest.raises(ConfigError, match=r"hidden: 1000000000000000 is too large"):
        ModelSpec.from_yaml(text)
    with pytest.raises(ConfigError, match=r"GPTConfig.seq_len: .* too large"):
        GPTConfig(vocab_size=8, seq_len=2**40, hidden=8, num_heads=1, num_layers=1)


def test_corrupt_and_truncated_problem_files_name_the_file(tmp_path) -> None:
    whole = gzip.compress(EXAMPLE.read_bytes())
    truncated = tmp_path / "truncated.json.gz"
    truncated.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SolverInputError, match=r"truncated\.json\.gz: not a complete gzip"):
        load_iopddl(truncated)
    plain = tmp_path / "plain.json.gz"
    plain.write_bytes(EXAMPLE.read_bytes())  # not gzip at all
    with pytest.raises(SolverInputError, match=r"plain\.json\.gz: not a complete gzip"):
        load_iopddl(plain)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(SolverInputError, match=r"binary\.json: not "):
        load_iopddl(binary)


def test_byte_counts_print_in_a_unit_that_shows_them() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**20, 2) == "3.00 MiB"
    assert format_bytes(5 * 2**40) == "5.0 TiB"


@pytest.mark.slow  # 5 s: full suite
def test_three_devices_a_host_plan_with_submeshes_that_pack() -> None:
    """Widths 1 and 3 (not 2, which could fill the devices yet not pack into hosts)."""
    cpu = ClusterSpec.named("cpu-1x8")
    cluster = ClusterSpec("cpu-2x3", 2, 3, cpu.device, cpu.intra_host, cpu.inter_host)
    config = GPTConfig(vocab_size=64, seq_len=8, hidden=24, num_heads=4, num_layers=4)
    params = gpt_abstract_params(config)
    opt = sgd(0.1)
    args = (params, jax.eval_shape(opt.init, params), gpt_abstract_batch(config, 6))

    def loss(p, b):
        return gpt_loss(p, b, config)

    step = make_train_step(loss, opt, alpa_mini.value_and_grad)
    plan = alpa_mini.plan(step, *args, method=PipeshardParallel(num_micro_batches=2),
                          cluster=cluster)  # fmt: skip
    assert sum(len(s.devices) for s in plan.stages) == 6
    assert all(s.submesh[1] in (1, 3) for s in plan.stages)
