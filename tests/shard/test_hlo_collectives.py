"""Tests of ``alpa_mini.inspect.hlo_collectives``: literal HLO snippets for every text form,
and real programs compiled for the 8 simulated CPU devices (conftest.py) to pin down which
collectives XLA's SPMD partitioner on CPU really emits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from alpa_mini.inspect.hlo_collectives import (
    KINDS,
    Collective,
    format_table,
    parse_collectives,
    parse_shape,
    shape_bytes,
    summarize,
)

# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("shape", "nbytes"),
    [
        ("f32[32,16]{1,0}", 32 * 16 * 4),
        ("f32[]", 4),
        ("pred[7]", 7),
        ("s8[3,5]{1,0}", 15),
        ("u8[4]", 4),
        ("s16[4]", 8),
        ("bf16[2,3]{0,1}", 12),
        ("f16[10]", 20),
        ("s32[6]", 24),
        ("u32[]", 4),
        ("s64[3]", 24),
        ("f64[2,2]", 32),
        ("c64[5]", 40),
        ("c128[5]", 80),
        ("s4[3]", 2),  # sub-byte: 12 bits round up to 2 bytes
        ("f32[<=16,8]{1,0}", 16 * 8 * 4),  # bounded dynamic dim counts at its bound
        ("f32[8,128]{1,0:T(8,128)}", 8 * 128 * 4),  # tiled layout
        ("(f32[4]{0}, /*index=1*/s32[2], (bf16[3], pred[]))", 16 + 8 + 6 + 1),
    ],
)
def test_shape_bytes(shape, nbytes):
    assert shape_bytes(shape) == nbytes


def test_parse_shape_structure():
    assert parse_shape("f32[32,16]{1,0}") == ("f32", (32, 16))
    assert parse_shape("(f32[], (s8[2], u32[]))") == [
        ("f32", ()),
        [("s8", (2,)), ("u32", ())],
    ]
    with pytest.raises(ValueError, match="unknown HLO element type"):
        shape_bytes("q7[3]")


# --------------------------------------------------------------------------- literal snippets


def _one(text: str) -> Collective:
    found = parse_collectives(text)
    assert len(found) == 1, found
    return found[0]


def test_tuple_all_reduce_named_mesh():
    text = """
HloModule m, num_partitions=8
ENTRY %main (p0: f32[32,16], p1: f32[8,32], p2: f32[]) -> f32[] {
  %p0 = f32[32,16]{1,0} parameter(0)
  %p1 = f32[8,32]{1,0} parameter(1)
  %p2 = f32[] parameter(2)
  %all-reduce.3 = (f32[32,16]{1,0}, f32[8,32]{1,0}, f32[]) all-reduce(%p0, %p1, %p2), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}, use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit(f)/psum(a, b)" stack_frame_id=3}
  ROOT %gte = f32[] get-tuple-element(%all-reduce.3), index=2
}
"""  # noqa: E501
    c = _one(text)
    assert c.kind == "all-reduce"
    assert c.name == "all-reduce.3"
    assert c.operand_bytes == (32 * 16 * 4, 8 * 32 * 4, 4)
    assert c.result_bytes == c.operand_bytes
    assert (c.group_size, c.num_groups) == (4, 2)
    assert c.mesh_axes == ("axis_0",)
    assert c.replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert c.op_name == "jit(f)/psum(a, b)"
    assert c.dimension is None
    assert c.num_tensors == 3
    assert c.bytes == 2048 + 1024 + 4
    assert not c.in_loop and c.trip_count == 1
    s = summarize([c])["all-reduce"]
    assert (s.count, s.instructions, s.bytes) == (3, 1, 3076)


def test_named_mesh_multi_axis_device_ids_and_sub_axis():
    # mesh[...] with a transposed device order: devices = iota(8).reshape(4,2).T.reshape(2,4)
    text = (
        "%ar = f32[16]{0} all-reduce(%x), channel_id=1, replica_groups=mesh['axis_0'=2,"
        "'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, use_global_device_ids=true, "
        "to_apply=%add"
    )
    c = _one(text)
    assert (c.group_size, c.num_groups) == (4, 2)
    assert c.replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    # Both axes: one group of all 8, in mesh order (axis_0 major).
    c = _one(text.replace("{'axis_1'}", "{'axis_0','axis_1'}"))
    assert (c.group_size, c.num_groups) == (8, 1)
    assert c.mesh_axes == ("axis_0", "axis_1")
    assert c.replica_groups == ((0, 2, 4, 6, 1, 3, 5, 7),)
    # Sub-axis 'axis_1':(2)2 is the minor half of axis_1 (pre-size 2, size 2).
    c = _one(text.replace("{'axis_1'}", "{'axis_1':(2)2}"))
    assert (c.group_size, c.num_groups) == (2, 4)
    assert c.mesh_axes == ("axis_1:(2)2",)
    assert c.replica_groups == ((0, 2), (4, 6), (1, 3), (5, 7))
    # ... and 'axis_1':(1)2 the major half.
    c = _one(text.replace("{'axis_1'}", "{'axis_1':(1)2}"))
    assert c.replica_groups == ((0, 4), (2, 6), (1, 5), (3, 7))
    # A size-1 mesh axis in a group of its own: every device alone.
    c = _one(
        "%ar = f32[4] all-reduce(%x), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_1'}, "
        "to_apply=%add"
    )
    assert (c.group_size, c.num_groups) == (1, 8)


def test_explicit_replica_groups():
    c = _one("%ar = f32[10]{0} all-reduce(%x), replica_groups={{0,1},{2,3}}, to_apply=%add")
    assert (c.group_size, c.num_groups) == (2, 2)
    assert c.replica_groups == ((0, 1), (2, 3))
    assert c.mesh_axes is None
    # operand %x is not defined in the snippet: derived from the result
    assert c.operand_bytes == (40,)


def test_iota_replica_groups():
    c = _one(
        "%ag = f32[64,8]{1,0} all-gather(%x), channel_id=2, replica_groups=[2,4]<=[8], "
        "dimensions={0}, use_global_device_ids=true"
    )
    assert c.kind == "all-gather"
    assert (c.group_size, c.num_groups) == (4, 2)
    assert c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert c.dimension == 0
    assert c.result_bytes == (64 * 8 * 4,)
    assert c.operand_bytes == (16 * 8 * 4,)  # derived: result / group size
    assert c.bytes == 64 * 8 * 4  # all-gather counts the gathered buffer

    c = _one(
        "%ag = f32[64,8]{1,0} all-gather(%x), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), "
        "dimensions={1}, use_global_device_ids=true"
    )
    assert (c.group_size, c.num_groups) == (2, 4)
    assert c.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert c.dimension == 1


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("HloModule m, num_partitions=8", 8),
        ("HloModule m, replica_count=2, num_partitions=4", 8),
        ("HloModule m", 1),
    ],
)
def test_empty_replica_groups_use_module_header(header, expected):
    text = f"""{header}
ENTRY %e (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %ar = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={{}}, use_global_device_ids=true, to_apply=%add
}}
"""  # noqa: E501
    c = _one(text)
    assert (c.group_size, c.num_groups) == (expected, 1)
    assert c.replica_groups == (tuple(range(expected)),)


def test_empty_groups_cross_partition_vs_cross_replica():
    head = "HloModule m, replica_count=2, num_partitions=4\n"
    # channel_id without global ids: cross-partition -> num_partitions
    c = _one(head + "%ar = f32[8] all-reduce(%p), channel_id=1, replica_groups={}, to_apply=%a")
    assert c.group_size == 4
    # no channel_id: cross-replica -> replica_count
    c = _one(head + "%ar = f32[8] all-reduce(%p), replica_groups={}, to_apply=%a")
    assert c.group_size == 2


def test_reduce_scatter_and_all_to_all_text():
    text = """
HloModule m, num_partitions=4
ENTRY %e (p: f32[64,8]) -> f32[16,8] {
  %p = f32[64,8]{1,0} parameter(0)
  %rs = f32[16,8]{1,0} reduce-scatter(%p), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
  %a2a = f32[16,8]{1,0} all-to-all(%rs), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={1}
  ROOT %a2a.t = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-to-all(%x, %y), channel_id=3, replica_groups={{0,1},{2,3}}
}
"""  # noqa: E501
    rs, a2a, a2a_t = parse_collectives(text)
    assert rs.kind == "reduce-scatter"
    assert rs.operand_bytes == (64 * 8 * 4,)  # looked up from %p
    assert rs.result_bytes == (16 * 8 * 4,)
    assert rs.bytes == 64 * 8 * 4  # the full buffer before scattering
    assert rs.dimension == 0
    assert a2a.kind == "all-to-all" and a2a.dimension == 1
    assert a2a.operand_bytes == (16 * 8 * 4,)
    assert a2a.num_tensors == 1
    # tuple form: one operand per peer, no dimension, one logical tensor
    assert a2a_t.dimension is None
    assert a2a_t.operand_bytes == (128, 128)
    assert a2a_t.num_tensors == 1
    summary = summarize([rs, a2a, a2a_t])
    assert summary["all-to-all"].count == 2
    assert summary["all-to-all"].instructions == 2
    assert summary["all-to-all"].bytes == 512 + 256
    assert summary["reduce-scatter"].bytes == 2048
    # derivation when the operand is unknown: reduce-scatter operand = result * group size
    c = _one(
        "%rs = bf16[4]{0} reduce-scatter(%q), replica_groups={{0,1,2}}, dimensions={0}, "
        "to_apply=%add"
    )
    assert c.operand_bytes == (24,)


def test_async_pairs_count_once():
    text = """
HloModule m, num_partitions=8
ENTRY %e (p: f32[8]) -> f32[64] {
  %p = f32[8]{0} parameter(0)
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(f32[8]{0} %p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %agd = f32[64]{0} all-gather-done((f32[8]{0}, f32[64]{0}) %ags)
  %ars = (f32[64]{0}, f32[8]{0}) all-reduce-start(%agd, %p), channel_id=2, replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add
  %ard = (f32[64]{0}, f32[8]{0}) all-reduce-done(%ars)
  %cps = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(%p), channel_id=3, source_target_pairs={{0,1},{1,2},{2,0}}
  %cpd = f32[8]{0} collective-permute-done(%cps)
  %rss = ((f32[64]{0}), f32[8]{0}, s32[]) reduce-scatter-start(%agd), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %rsd = f32[8]{0} reduce-scatter-done(%rss)
  ROOT %t = (f32[64]{0}, f32[8]{0}) tuple(%agd, %cpd)
}
"""  # noqa: E501
    found = parse_collectives(text)
    assert [c.kind for c in found] == [
        "all-gather",
        "all-reduce",
        "collective-permute",
        "reduce-scatter",
    ]
    ag, ar, cp, rs = found
    assert all(c.is_async for c in found)
    assert ag.operand_bytes == (32,) and ag.result_bytes == (256,)
    assert ar.operand_bytes == (256, 32) and ar.num_tensors == 2
    assert ar.group_size == 8
    assert cp.operand_bytes == (32,) and cp.result_bytes == (32,)
    assert cp.source_target_pairs == ((0, 1), (1, 2), (2, 0))
    assert (cp.group_size, cp.num_groups) == (3, 1)
    assert rs.operand_bytes == (256,) and rs.result_bytes == (32,)
    summary = summarize(found)
    assert all(summary[k].instructions == 1 for k in KINDS if k != "all-to-all")
    assert summary["all-to-all"].instructions == 0


def test_while_and_conditional_context():
    text = """
HloModule m, num_partitions=2

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner (q: f32[4]) -> f32[4] {
  %q = f32[4]{0} parameter(0)
  ROOT %ar.inner = f32[4]{0} all-reduce(%q), channel_id=1, replica_groups={{0,1}}, to_apply=%add
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %c = f32[4]{0} call(%v), to_apply=%inner
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %c)
}

%cond (t.1: (s32[], f32[4])) -> pred[] {
  %t.1 = (s32[], f32[4]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

%br0 (z: f32[4]) -> f32[4] {
  %z = f32[4]{0} parameter(0)
  ROOT %ag.br = f32[4]{0} all-gather(%z), channel_id=3, replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %p)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %out = f32[4]{0} get-tuple-element(%w), index=1
  %pr = pred[] constant(false)
  %sel = f32[4]{0} conditional(%pr, %out, %out), true_computation=%br0, false_computation=%inner
  ROOT %ar.top = f32[4]{0} all-reduce(%sel), channel_id=2, replica_groups={{0,1}}, to_apply=%add
}
"""  # noqa: E501
    by_name = {c.name: c for c in parse_collectives(text)}
    assert set(by_name) == {"ar.inner", "ag.br", "ar.top"}
    # %inner is called both from the loop body and as a conditional branch
    inner = by_name["ar.inner"]
    assert inner.in_loop and inner.in_conditional
    assert inner.trip_count is None  # two call paths (5 trips and 1) disagree
    assert by_name["ag.br"].in_conditional and not by_name["ag.br"].in_loop
    top = by_name["ar.top"]
    assert not top.in_loop and not top.in_conditional and top.trip_count == 1
    summary = summarize(by_name.values())
    assert summary["all-reduce"].loop_instructions == 1
    assert summary["all-reduce"].loop_bytes == 16
    # without the conditional, the loop's trip count comes through
    single = text.replace(", false_computation=%inner", ", false_computation=%br0")
    inner = {c.name: c for c in parse_collectives(single)}["ar.inner"]
    assert inner.in_loop and inner.trip_count == 5 and not inner.in_conditional


def test_strings_with_brackets_do_not_confuse_the_parser():
    c = _one(
        "%ar = f32[2]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add, "
        'metadata={op_name="jit(f)/odd name ) { replica_groups={{0}} \\" (" source_file="a.py"}'
    )
    assert c.replica_groups == ((0, 1),)
    assert c.op_name == 'jit(f)/odd name ) { replica_groups={{0}} \\" ('


def test_format_table_lists_every_kind_and_total():
    c = _one("%ar = f32[256]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add")
    table = format_table(summarize([c]))
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["kind", "tensors", "instructions", "bytes/device"]
    for kind in KINDS:
        assert any(line.startswith(kind) for line in lines)
    ar_line = next(line for line in lines if line.startswith("all-reduce"))
    assert ar_line.split()[1:4] == ["1", "1", "1024"]
    assert lines[-1].split()[:4] == ["total", "1", "1", "1024"]
    assert format_table([c]) == table


# --------------------------------------------------------------------------- real programs


def _mesh(*shape_names):
    shape = tuple(s for s, _ in shape_names)
    names = tuple(n for _, n in shape_names)
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def _compiled(f, args, in_shardings, out_shardings=None):
    jitted = jax.jit(f, in_shardings=in_shardings, out_shardings=out_shardings)
    return jitted.lower(*args).compile().as_text()


def _kinds(collectives):
    return sorted(c.kind for c in collectives)


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs the 8 simulated CPU devices of conftest.py")


def test_data_parallel_gradients_one_combined_all_reduce():
    mesh = _mesh((8, "x"))
    rep = NamedSharding(mesh, P())

    def loss(params, x):
        w1, b1, w2 = params
        return jnp.mean((jnp.tanh(x @ w1 + b1) @ w2) ** 2)

    params = (jnp.ones((32, 16)), jnp.ones((16,)), jnp.ones((16, 8)))
    x = jnp.ones((64, 32))
    text = _compiled(jax.grad(loss), (params, x), ((rep, rep, rep), NamedSharding(mesh, P("x"))))
    found = parse_collectives(text)
    # XLA CPU's all-reduce combiner merges the three gradient all-reduces into one
    # tuple-shaped instruction.
    assert _kinds(found) == ["all-reduce"]
    (ar,) = found
    assert sorted(ar.operand_bytes) == sorted([32 * 16 * 4, 16 * 4, 16 * 8 * 4])
    assert (ar.group_size, ar.num_groups) == (8, 1)
    assert ar.replica_groups == (tuple(range(8)),)
    assert ar.dtypes == ("f32", "f32", "f32")
    s = summarize(found)["all-reduce"]
    assert (s.count, s.instructions, s.bytes) == (3, 1, (512 + 16 + 128) * 4)


@pytest.mark.parametrize(
    ("axis", "groups"),
    [
        ("a", ((0, 2, 4, 6), (1, 3, 5, 7))),  # devices sharing the "b" index
        ("b", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ],
)
def test_row_split_weight_all_reduce_over_the_split_axis(axis, groups):
    mesh = _mesh((4, "a"), (2, "b"))

    def f(x, w):
        return x @ w

    text = _compiled(
        f,
        (jnp.ones((16, 32)), jnp.ones((32, 8))),
        (NamedSharding(mesh, P(None, axis)), NamedSharding(mesh, P(axis, None))),
        NamedSharding(mesh, P()),
    )
    found = parse_collectives(text)
    assert _kinds(found) == ["all-reduce"]
    (ar,) = found
    size = mesh.shape[axis]
    assert (ar.group_size, ar.num_groups) == (size, 8 // size)
    assert ar.replica_groups == groups
    assert ar.operand_bytes == (16 * 8 * 4,)  # the full partial-sum output on every device
    assert ar.mesh_axes is not None and len(ar.mesh_axes) == 1
    assert ar.op_name is not None and ar.op_name.endswith("dot_general")


def test_transposed_resharding_is_one_tuple_all_to_all():
    mesh = _mesh((8, "x"))
    text = _compiled(
        lambda a: a,
        (jnp.ones((64, 32)),),
        (NamedSharding(mesh, P("x", None)),),
        NamedSharding(mesh, P(None, "x")),
    )
    found = parse_collectives(text)
    # XLA CPU: P("x", None) -> P(None, "x") is a single all-to-all in the tuple form (one
    # operand per peer, no dimensions=), not an all-gather followed by a slice.
    assert _kinds(found) == ["all-to-all"]
    (a2a,) = found
    assert a2a.dimension is None
    assert a2a.group_size == 8 and a2a.num_groups == 1
    assert a2a.operand_bytes == (64 * 32 * 4 // 64,) * 8
    assert a2a.bytes == 64 * 32 * 4 // 8  # the local shard, exchanged
    assert a2a.num_tensors == 1
    s = summarize(found)["all-to-all"]
    assert (s.count, s.instructions, s.bytes) == (1, 1, 1024)


def test_gather_to_replicated_is_an_all_gather_of_the_full_tensor():
    mesh = _mesh((8, "x"))
    text = _compiled(
        lambda a: a * 2,
        (jnp.ones((64, 32)),),
        (NamedSharding(mesh, P("x", None)),),
        NamedSharding(mesh, P()),
    )
    found = parse_collectives(text)
    assert _kinds(found) == ["all-gather"]
    (ag,) = found
    assert ag.dimension == 0
    assert ag.result_bytes == (64 * 32 * 4,)
    assert ag.operand_bytes == (8 * 32 * 4,)
    assert summarize(found)["all-gather"].bytes == 64 * 32 * 4


def test_2d_sharded_to_replicated_is_one_all_gather_per_axis():
    mesh = _mesh((4, "a"), (2, "b"))
    text = _compiled(
        lambda a: a + 1,
        (jnp.ones((64, 32)),),
        (NamedSharding(mesh, P("a", "b")),),
        NamedSharding(mesh, P()),
    )
    found = parse_collectives(text)
    assert _kinds(found) == ["all-gather", "all-gather"]
    by_size = {c.group_size: c for c in found}
    assert set(by_size) == {2, 4}
    assert by_size[2].replica_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert by_size[4].replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert by_size[4].result_bytes == (64 * 32 * 4,)


def test_bf16_collectives_are_upcast_to_f32_on_cpu():
    mesh = _mesh((8, "x"))
    text = _compiled(
        lambda a: a + 1,
        (jnp.ones((64, 32), jnp.bfloat16),),
        (NamedSharding(mesh, P("x", None)),),
        NamedSharding(mesh, P()),
    )
    (ag,) = parse_collectives(text)
    # XLA CPU has no bf16 collectives: the gather moves f32 (twice the bf16 bytes).
    assert ag.dtypes == ("f32",)
    assert ag.result_bytes == (64 * 32 * 4,)


def test_sum_constrained_sharded_is_all_reduce_then_slice_on_cpu():
    mesh = _mesh((8, "x"))
    sharded = NamedSharding(mesh, P("x"))

    def f(x):
        return jax.lax.with_sharding_constraint(x.sum(0), sharded)

    text = _compiled(f, (jnp.ones((8, 64)),), (NamedSharding(mesh, P("x", None)),))
    found = parse_collectives(text)
    # XLA CPU emits no reduce-scatter: the partial sums are all-reduced in full (64 floats)
    # and each device slices its part (dynamic-slice on partition-id) afterwards.
    assert _kinds(found) == ["all-reduce"]
    (ar,) = found
    assert ar.operand_bytes == (64 * 4,)
    assert ar.group_size == 8
    assert "dynamic-slice" in text
    s = summarize(found)
    assert s["reduce-scatter"].instructions == 0
    assert s["all-reduce"].bytes == 256


def test_scan_gradient_all_reduce_is_in_loop_with_trip_count():
    mesh = _mesh((8, "x"))
    rep = NamedSharding(mesh, P())

    def loss(ws, x):
        def body(h, w):
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(body, x, ws)
        return jnp.sum(h)

    text = _compiled(
        jax.grad(loss),
        (jnp.ones((3, 32, 32)), jnp.ones((64, 32))),
        (rep, NamedSharding(mesh, P("x", None))),
    )
    found = parse_collectives(text)
    assert _kinds(found) == ["all-reduce"]
    (ar,) = found
    # one weight gradient per layer, all-reduced inside the backward while loop
    assert ar.in_loop and ar.trip_count == 3
    assert ar.operand_bytes == (32 * 32 * 4,)
    s = summarize(found)["all-reduce"]
    assert (s.loop_instructions, s.loop_bytes) == (1, 4096)


def test_axis_swap_uses_a_sub_axis_all_to_all_plus_permute():
    # P("a", "b") -> P("b", "a") on a (4, 2) mesh. XLA CPU emits an all-to-all whose groups
    # are printed with a sub-axis ('axis_1':(2)2), then a collective-permute. After the
    # all-to-all a device holds two adjacent "a" row blocks of one "b" column block, so its
    # group must be the devices with equal b and a in {2k, 2k+1}: d = 2a + b -> {4k+b, 4k+2+b}.
    mesh = _mesh((4, "a"), (2, "b"))
    text = _compiled(
        lambda a: a,
        (jnp.ones((64, 32)),),
        (NamedSharding(mesh, P("a", "b")),),
        NamedSharding(mesh, P("b", "a")),
    )
    found = parse_collectives(text)
    assert _kinds(found) == ["all-to-all", "collective-permute"]
    a2a = next(c for c in found if c.kind == "all-to-all")
    assert a2a.mesh_axes is not None and any(":(" in a for a in a2a.mesh_axes)
    assert sorted(a2a.replica_groups) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert a2a.bytes == 64 * 32 * 4 // 8
    cp = next(c for c in found if c.kind == "collective-permute")
    assert cp.operand_bytes == (64 * 32 * 4 // 8,)
    assert cp.source_target_pairs is not None and len(cp.source_target_pairs) == 8
