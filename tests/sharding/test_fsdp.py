"""FSDP2 through smp.transform vs the single-process run: loss and gradients.

Tolerances (fp32, docs/platform.md): sharded reductions reorder float sums, so losses agree to
~1e-6 and gradients to ~1e-7; we assert 1e-5 and 1e-5. A broken gradient sync moves the
gradients by ~1e-2, which the same check catches (test_broken_sync_is_caught).
"""

from __future__ import annotations

import pytest

from tests.sharding import dist_cases

LOSS_TOL, GRAD_TOL = 1e-5, 1e-5

CASES = [
    # world, config, name
    (1, {}, "world1"),
    (2, {}, "full-shard-2"),
    (2, {"hybrid_shard_degree": 1}, "replicate-2"),
    (4, {}, "full-shard-4"),
    (4, {"hybrid_shard_degree": 2}, "hybrid-2x2"),
    (4, {"hybrid_shard_degree": 1}, "replicate-4"),
]


@pytest.mark.parametrize("kind", ["plain", "llama"])
@pytest.mark.parametrize("world,config,name", CASES, ids=[c[2] for c in CASES])
def test_matches_single_process(ranks, world, config, name, kind):
    reports = ranks(world).run(dist_cases.equivalence, config=config, kind=kind)
    for report in reports:
        assert report["param_diff"] == 0.0
        assert report["loss_diff"] < LOSS_TOL, report
        assert report["grad_diff"] < GRAD_TOL, report
    assert reports[0]["losses"][1] < reports[0]["losses"][0]  # it trains


@pytest.mark.parametrize("world,config,wrapped", [
    (2, {}, True),
    (1, {}, False),  # one rank: nothing to shard or reduce
    (2, {"tensor_parallel_degree": 2}, False),  # TP takes the whole world
    # over one rank FSDP still casts (mixed precision), offloads, or carries smp's collectives
    (2, {"tensor_parallel_degree": 2, "mixed_precision": {"param_dtype": "bf16"}}, True),
    (2, {"tensor_parallel_degree": 2, "cpu_offload": True}, True),
    (2, {"tensor_parallel_degree": 2, "gradient_sync": "ring"}, True),
], ids=["shard-2", "world-1", "tp-2", "tp-2-bf16", "tp-2-offload", "tp-2-ring"])
def test_fsdp_only_where_it_has_work(ranks, world, config, wrapped):
    """FSDP over one rank shards nothing and adds copies to every step: skipped (the TP and
    world-1 equivalence tests prove training unchanged), kept where one of its other jobs is on."""
    units = ranks(world).run(dist_cases.fsdp_units, config=config, kind="llama")
    assert all(u > 0 for u in units) if wrapped else units == [0] * world, units


def test_broken_sync_is_caught(ranks):
    """The equivalence check must fail when gradients are not reduced across ranks."""
    reports = ranks(2).run(dist_cases.equivalence, config={}, kind="plain", steps=1, break_sync=True)
    assert max(r["grad_diff"] for r in reports) > 100 * GRAD_TOL


@pytest.mark.parametrize("world,config", [(2, {}), (4, {"hybrid_shard_degree": 2})])
@pytest.mark.parametrize("kind", ["plain", "llama", "gpt2"])
def test_delayed_init_equals_eager(ranks, world, config, kind):
    reports = ranks(world).run(dist_cases.equivalence, config=config, kind=kind, steps=1, delayed=True)
    for report in reports:
        assert report["param_diff"] == 0.0, report  # bitwise: same RNG draws, same order
        assert report["grad_diff"] < GRAD_TOL, report


def test_mixed_precision_bf16(ranks):
    config = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
    for report in ranks(2).run(dist_cases.equivalence, config=config, kind="plain"):
        assert report["loss_diff"] < 2e-2, report  # bf16 compute: ~1e-3 (docs/platform.md)
        assert report["loss_diff"] > 0.0  # bf16 really ran (fp32 would agree far better)


def test_cpu_offload(ranks):
    for report in ranks(2).run(dist_cases.equivalence, config={"cpu_offload": True}, kind="plain"):
        assert report["loss_diff"] < LOSS_TOL and report["grad_diff"] < GRAD_TOL, report


def test_reshard_after_forward_false(ranks):
    for report in ranks(2).run(dist_cases.equivalence, config={"reshard_after_forward": False}, kind="llama"):
        assert report["loss_diff"] < LOSS_TOL and report["grad_diff"] < GRAD_TOL, report


BF16 = {"mixed_precision": {"param_dtype": "bf16"}}


@pytest.mark.parametrize("world,config,gathered", [
    # one-rank shard group, unset: no FSDP units at all, the casts kept from forward to backward
    # (tests/sharding/test_host_layout.py); set by the user: FSDP units, resharded as set
    (1, {**BF16, "reshard_after_forward": True}, False),
    (2, BF16, False),  # sharded over two ranks: resharded after forward, the default
], ids=["world-1-explicit", "world-2"])
def test_reshard_after_forward_default_over_one_rank(ranks, world, config, gathered):
    for blocks in ranks(world).run(dist_cases.blocks_gathered_after_forward, config=config, kind="llama"):
        assert blocks and all(b == gathered for b in blocks), blocks


@pytest.mark.parametrize("world,config", [(2, {}), (4, {"hybrid_shard_degree": 2})])
def test_clip_grad_norm(ranks, world, config):
    for norm_diff, grad_diff in ranks(world).run(dist_cases.clip_equivalence, config=config):
        assert norm_diff < 1e-5 and grad_diff < 1e-7


def test_gradient_accumulation_no_sync(ranks):
    for grad_diff in ranks(2).run(dist_cases.accumulation_equivalence, config={}):
        assert grad_diff < GRAD_TOL


@pytest.mark.parametrize("world,config,shard", [(2, {}, 2), (4, {}, 4), (4, {"hybrid_shard_degree": 2}, 2)])
def test_parameter_bytes_per_rank(ranks, world, config, shard):
    for local, full in ranks(world).run(dist_cases.shard_bytes, config=config, kind="llama"):
        assert local <= 1.05 * full / shard, (local, full)


def test_state_describes_mesh(ranks):
    states = ranks(4).run(dist_cases.describe_state, config={"hybrid_shard_degree": 2})
    assert [s["dp_rank"] for s in states] == [0, 1, 2, 3]
    assert all(s["shape"] == (1, 2, 2, 1, 1, 1) and s["dp_size"] == 4 for s in states)
    assert states[0]["mesh_names"] == ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")


def test_bad_degree_fails_before_collectives(ranks):
    errors = ranks(4).run(dist_cases.init_error, config={"hybrid_shard_degree": 3})
    for message in errors:
        assert "hybrid_shard_degree=3" in message and "world_size=4" in message
        assert "tensor_parallel_degree=1" in message


def test_reinit_same_config_is_noop_different_is_error(ranks):
    same, error, after = ranks(1).run(dist_cases.reinit_behaviour)[0]
    assert same == "same"
    assert "different config" in error and "smp.shutdown()" in error
    assert after == "seed=4"


def test_unknown_shard_module_class_is_named(ranks):
    message = ranks(1).run(dist_cases.transform_error, config={"shard_modules": ["DecoderLayer"]},
                           kind="llama")[0]
    assert "ConfigError" in message and "DecoderLayer" in message and "LlamaDecoderLayer" in message


def test_delayed_init_without_reset_parameters_is_refused(ranks):
    message = ranks(1).run(dist_cases.transform_error, config={}, kind="no_reset", meta=True)[0]
    assert "reset_parameters" in message and "'<root>'" in message
