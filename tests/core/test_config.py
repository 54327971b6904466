"""Config loading: every path in, every error out names its key."""

from __future__ import annotations

import json

import pytest
import yaml

import smp
from smp.config import SMPConfig, json_schema, load_config
from smp.mesh import ParallelDims

SMP_V2 = {
    "hybrid_shard_degree": 2,
    "tensor_parallel_degree": 1,
    "sm_activation_offloading": True,
    "activation_loading_horizon": 3,
    "random_seed": 7,
    "fsdp_cache_flush_warnings": False,
    "allow_empty_shards": True,
    "context_parallel_degree": 1,
    "expert_parallel_degree": 1,
}


def test_dict_json_yaml_are_equal(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(SMP_V2))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(SMP_V2))
    (tmp_path / "c.yml").write_text(yaml.safe_dump(SMP_V2))
    configs = [load_config(SMP_V2)] + [load_config(tmp_path / n) for n in ("c.json", "c.yaml", "c.yml")]
    assert all(c == configs[0] for c in configs)
    assert configs[0].activation_offloading and configs[0].activation_loading_horizon == 3


def test_smp_v2_keys_accepted_verbatim():
    cfg = load_config(SMP_V2)
    assert (cfg.hybrid_shard_degree, cfg.random_seed, cfg.fsdp_cache_flush_warnings) == (2, 7, False)


@pytest.mark.parametrize(
    "alias,field,value",
    [
        ("sm_activation_offloading", "activation_offloading", True),
        ("delayed_parameter_initialization", "delayed_param_initialization", True),
    ],
)
def test_aliases(alias, field, value):
    assert getattr(load_config({alias: value}), field) == value


def test_shorthands():
    cfg = load_config({"activation_checkpointing": "selective", "gradient_sync": "int8"})
    assert cfg.activation_checkpointing.mode == "selective"
    assert cfg.gradient_sync.algorithm == "int8"
    assert load_config({"activation_checkpointing": True}).activation_checkpointing.mode == "full"


def test_defaults_and_env(tmp_path, monkeypatch):
    assert load_config(None) == SMPConfig()
    path = tmp_path / "env.yaml"
    path.write_text("hybrid_shard_degree: 4\n")
    monkeypatch.setenv("SMP_CONFIG", str(path))
    assert load_config(None).hybrid_shard_degree == 4


def test_round_trip():
    cfg = load_config({**SMP_V2, "mixed_precision": {"param_dtype": "bf16"}, "gradient_sync": "fp8"})
    assert load_config(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "config,expected",
    [
        ({"hybird_shard_degree": 2}, "unknown key 'hybird_shard_degree'; did you mean 'hybrid_shard_degree'"),
        ({"activation_offloading": True, "sm_activation_offloading": True},
         "'activation_offloading' is given twice, as 'activation_offloading' and as its other spelling 'sm_activation_offloading'"),
        ({"mixed_precision": {"parm_dtype": "bf16"}}, "unknown key 'mixed_precision.parm_dtype'; did you mean 'param_dtype'"),
        ({"tensor_parallel_degree": "2"}, "'tensor_parallel_degree'"),
        ({"tensor_parallel_degree": 0}, "'tensor_parallel_degree'"),
        ({"hybrid_shard_degree": -1}, "'hybrid_shard_degree'"),
        ({"activation_loading_horizon": 0}, "'activation_loading_horizon'"),
        ({"activation_checkpointing": "partial"}, "'activation_checkpointing.mode'"),
        ({"gradient_sync": {"algorithm": "int4"}}, "'gradient_sync.algorithm'"),
        ({"mixed_precision": {"param_dtype": "int8"}}, "'mixed_precision.param_dtype'"),
        ({"reshard_after_forward": 0}, "'reshard_after_forward'"),
        ({"context_parallel": {"algorithm": "tree"}}, "'context_parallel.algorithm'"),
        ({"context_parallel_degree": 0}, "'context_parallel_degree'"),
        ({"expert_parallel_degree": 0}, "'expert_parallel_degree'"),
        ({"moe": {"moe_load_balancing": "sinkhorn"}}, "moe_load_balancing='sinkhorn' is not implemented"),
        ({"sm_activation_offloading": "yes"}, "'sm_activation_offloading'"),
    ],
)
def test_errors_name_the_key(config, expected):
    with pytest.raises(smp.ConfigError) as err:
        load_config(config)
    assert expected in str(err.value)
    assert isinstance(err.value, ValueError)


def test_file_errors(tmp_path):
    with pytest.raises(smp.ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("hybrid_shard_degree: [1,\n")
    with pytest.raises(smp.ConfigError, match="not valid yaml"):
        load_config(bad)
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    with pytest.raises(smp.ConfigError, match="must hold a mapping"):
        load_config(lst)
    txt = tmp_path / "c.toml"
    txt.write_text("")
    with pytest.raises(smp.ConfigError, match="use a .json, .yaml or .yml"):
        load_config(txt)


@pytest.mark.parametrize(
    "world,config,shape",
    [
        # (pp, dp_replicate, dp_shard_mod_ep, ep, cp, tp): every axis, size 1 when off
        (8, {}, (1, 1, 8, 1, 1, 1)),
        (8, {"hybrid_shard_degree": 1}, (1, 8, 1, 1, 1, 1)),
        (8, {"hybrid_shard_degree": 2}, (1, 4, 2, 1, 1, 1)),
        (8, {"tensor_parallel_degree": 2}, (1, 1, 4, 1, 1, 2)),
        (8, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, (1, 2, 2, 1, 1, 2)),
        (1024, {"tensor_parallel_degree": 8, "hybrid_shard_degree": 64}, (1, 2, 64, 1, 1, 8)),
    ],
)
def test_parallel_dims(world, config, shape):
    assert ParallelDims.from_config(load_config(config), world).shape == shape


@pytest.mark.parametrize(
    "world,config,key",
    [
        (6, {"tensor_parallel_degree": 4}, "tensor_parallel_degree=4"),
        (8, {"hybrid_shard_degree": 3}, "hybrid_shard_degree=3"),
        (8, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 8}, "hybrid_shard_degree=8"),
    ],
)
def test_degree_errors_list_every_degree(world, config, key):
    with pytest.raises(smp.ConfigError) as err:
        ParallelDims.from_config(load_config(config), world)
    message = str(err.value)
    assert key in message and f"world_size={world}" in message
    for name in ("tensor_parallel_degree=", "hybrid_shard_degree=", "context_parallel_degree="):
        assert name in message


def test_json_schema_lists_keys():
    props = json_schema()["properties"]
    assert "hybrid_shard_degree" in props and "gradient_sync" in props


def test_state_before_init_is_a_clear_error():
    with pytest.raises(RuntimeError, match="call smp.init"):
        smp.state.rank
