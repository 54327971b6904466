"""Property tests of the config: whatever a user writes, smp answers with a config or a ConfigError.

Invalid input (wrong types, negative or non-dividing degrees, unknown or misspelled keys, YAML
that is not a mapping, ...) must raise `smp.ConfigError` naming the key: never another
exception from deep inside pydantic or torch. Valid input must round-trip through
`to_dict()` (and JSON / YAML files) to an equal config, and `ParallelDims.from_config` must
accept exactly the degrees that divide the world size (1-1024).
Example counts are small so that the file runs in a few seconds.
"""

from __future__ import annotations

import json
import math
import string
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import smp
from smp.config import SMPConfig, load_config
from smp.mesh import ParallelDims

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = ["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
TOP_KEYS = sorted(
    {name for name in SMPConfig.model_fields}
    | {f.alias for f in SMPConfig.model_fields.values() if f.alias}
)

# ----------------------------------------------------------------------------------------------
# Strategies: valid values per key; a key added later gets one derived from its type (_derived)

small_pos = st.integers(1, 64)
VALID_VALUES: dict[str, st.SearchStrategy] = {
    "hybrid_shard_degree": st.integers(0, 64),
    "tensor_parallel_degree": small_pos,
    "context_parallel_degree": st.just(1),
    "expert_parallel_degree": st.just(1),
    "pipeline_parallel_degree": st.just(1),  # its combinations: tests/pipeline/test_pipeline_config.py
    "activation_offloading": st.booleans(),
    "activation_loading_horizon": small_pos,
    "activation_checkpointing": st.one_of(
        st.sampled_from(["none", "full", "selective"]),
        st.booleans(),
        st.fixed_dictionaries({}, optional={
            "mode": st.sampled_from(["none", "full", "selective"]),
            "every_n_layers": small_pos,
        }),
    ),
    "random_seed": st.integers(0, 2**31),
    "fsdp_cache_flush_warnings": st.booleans(),
    "allow_empty_shards": st.booleans(),
    "mixed_precision": st.fixed_dictionaries({}, optional={
        "param_dtype": st.one_of(st.none(), st.sampled_from(DTYPES)),
        "reduce_dtype": st.one_of(st.none(), st.sampled_from(DTYPES)),
        "output_dtype": st.one_of(st.none(), st.sampled_from(DTYPES)),
        "cast_forward_inputs": st.booleans(),
    }),
    "cpu_offload": st.booleans(),
    "delayed_param_initialization": st.booleans(),
    "reshard_after_forward": st.one_of(st.booleans(), small_pos),
    "shard_modules": st.lists(st.text(string.ascii_letters, min_size=1, max_size=12), max_size=3),
    "tensor_parallel": st.fixed_dictionaries({}, optional={
        "sequence_parallel": st.booleans(),
        "loss_parallel": st.booleans(),
        "plan": st.one_of(st.none(), st.dictionaries(
            st.text(string.ascii_lowercase + ".*", min_size=1, max_size=12),
            st.sampled_from(["colwise", "rowwise", "sequence_parallel"]), max_size=3)),
    }),
    "gradient_sync": st.one_of(
        st.sampled_from(["default", "ring", "int8", "fp8"]),
        st.fixed_dictionaries({}, optional={
            "algorithm": st.sampled_from(["default", "ring", "int8", "fp8"]),
            "error_feedback": st.booleans(),
            "block_size": st.sampled_from([16, 64, 256, 1024]),
        }),
    ),
    "backend": st.one_of(st.none(), st.sampled_from(["nccl", "gloo"])),
    "collective_timeout_seconds": st.one_of(
        st.floats(0.001, 1e6, allow_nan=False), st.integers(1, 10**6)
    ),
    "activation_offload_min_bytes": st.integers(0, 1 << 24),
    "compile": st.one_of(st.booleans(), st.fixed_dictionaries({}, optional={
        "enabled": st.booleans(), "backend": st.sampled_from(["inductor", "aot_eager", "eager"]),
    })),
}


def _derived(field) -> st.SearchStrategy:
    """A strategy for a key added after this file was written: from its type and bounds."""
    import typing

    annotation = field.annotation
    if annotation is bool:
        return st.booleans()
    if typing.get_origin(annotation) is typing.Literal:
        return st.sampled_from(typing.get_args(annotation))
    if annotation is int:
        low = next((m.ge for m in field.metadata if getattr(m, "ge", None) is not None), 0)
        return st.integers(low, low + 64)
    default = field.default
    if hasattr(default, "model_dump"):  # a config section: its defaults, as a file would spell them
        return st.just(default.model_dump(mode="json"))
    return st.just(default)


VALID_VALUES.update({n: _derived(f) for n, f in SMPConfig.model_fields.items() if n not in VALID_VALUES})
valid_configs = st.fixed_dictionaries({}, optional=VALID_VALUES)


# Values of the wrong type for almost every key (None is valid for some: filtered per key).
wrong_type_values = st.one_of(
    st.text(max_size=8).filter(lambda s: s not in {"none", "full", "selective", "default", "ring", "int8", "fp8"}),
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not float(f).is_integer()),
    st.lists(st.integers(), min_size=1, max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), min_size=1, max_size=2),
)
INT_KEYS = ["hybrid_shard_degree", "tensor_parallel_degree", "activation_loading_horizon", "random_seed"]
BOOL_KEYS = ["sm_activation_offloading", "cpu_offload", "delayed_param_initialization",
             "fsdp_cache_flush_warnings", "allow_empty_shards"]


def _assert_names(err: smp.ConfigError, key: str) -> None:
    assert isinstance(err, ValueError)
    assert key in str(err), f"error does not name {key!r}:\n{err}"


def _load_expecting_error(config) -> smp.ConfigError:
    try:
        load_config(config)
    except smp.ConfigError as err:
        return err
    raise AssertionError(f"accepted invalid config {config!r}")


# ----------------------------------------------------------------------------------------------
# Valid configs round-trip


@SETTINGS
@given(valid_configs)
def test_valid_configs_round_trip(config):
    cfg = load_config(config)
    assert load_config(cfg.to_dict()) == cfg
    assert load_config(json.loads(json.dumps(cfg.to_dict()))) == cfg


@settings(max_examples=25, deadline=None)
@given(valid_configs, st.sampled_from([".yaml", ".yml", ".json"]))
def test_valid_configs_round_trip_through_files(config, suffix):
    cfg = load_config(config)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"smp{suffix}"
        text = json.dumps(cfg.to_dict()) if suffix == ".json" else yaml.safe_dump(cfg.to_dict())
        path.write_text(text)
        assert load_config(path) == cfg
        # The user's own spelling (shorthands, aliases) in a YAML file loads as the dict does.
        path.write_text(yaml.safe_dump(config)) if suffix != ".json" else path.write_text(json.dumps(config))
        assert load_config(path) == cfg


@SETTINGS
@given(valid_configs, st.integers(1, 1024))
def test_parallel_dims_accept_exactly_the_dividing_degrees(config, world):
    cfg = load_config(config)
    tp, hybrid = cfg.tensor_parallel_degree, cfg.hybrid_shard_degree
    divides = world % tp == 0 and (hybrid == 0 or (world // tp) % hybrid == 0)
    if divides:
        dims = ParallelDims.from_config(cfg, world)
        assert dims.dp_replicate * dims.dp_shard * dims.tp == world
        assert dims.tp == tp and dims.dp_shard == (hybrid or world // tp)
    else:
        with pytest.raises(smp.ConfigError) as err:
            ParallelDims.from_config(cfg, world)
        bad = "tensor_parallel_degree" if world % tp else "hybrid_shard_degree"
        _assert_names(err.value, f"{bad}=")
        assert f"world_size={world}" in str(err.value)


@SETTINGS
@given(st.integers(1, 1024), st.data())
def test_every_divisor_layout_is_valid(world, data):
    """Pick tp | world and hybrid | world/tp: always a mesh whose shape multiplies to world."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    tp = data.draw(st.sampled_from(divisors))
    dp = world // tp
    hybrid = data.draw(st.sampled_from([0] + [d for d in range(1, dp + 1) if dp % d == 0]))
    dims = ParallelDims.from_config(
        load_config({"tensor_parallel_degree": tp, "hybrid_shard_degree": hybrid}), world
    )
    assert math.prod(dims.shape) == world


# ----------------------------------------------------------------------------------------------
# Invalid configs: always ConfigError, always naming the key


@SETTINGS
@given(valid_configs, st.sampled_from(INT_KEYS + BOOL_KEYS + ["collective_timeout_seconds", "backend",
                                                             "mixed_precision", "tensor_parallel",
                                                             "shard_modules"]),
       wrong_type_values)
def test_wrong_types_name_the_key(config, key, value):
    if key in ("collective_timeout_seconds",) and isinstance(value, float) and value > 0 and value <= 1e9:
        assume(False)  # a positive float is a valid timeout
    err = _load_expecting_error({**config, key: value})
    _assert_names(err, key)


@SETTINGS
@given(valid_configs, st.sampled_from(["hybrid_shard_degree", "tensor_parallel_degree",
                                       "activation_loading_horizon", "random_seed",
                                       "collective_timeout_seconds", "reshard_after_forward"]),
       st.integers(-(2**40), -1))
def test_negative_numbers_name_the_key(config, key, value):
    _assert_names(_load_expecting_error({**config, key: value}), key)


@SETTINGS
@given(valid_configs, st.sampled_from(["tensor_parallel_degree", "activation_loading_horizon"]))
def test_zero_where_positive_is_required(config, key):
    _assert_names(_load_expecting_error({**config, key: 0}), key)


def _misspell(key: str, how: int, pos: int, char: str) -> str:
    pos %= len(key)
    if how == 0:  # drop a character
        return key[:pos] + key[pos + 1:]
    if how == 1:  # double a character
        return key[:pos] + key[pos] + key[pos:]
    if how == 2 and len(key) > 1:  # swap two neighbours
        pos = min(pos, len(key) - 2)
        return key[:pos] + key[pos + 1] + key[pos] + key[pos + 2:]
    return key[:pos] + char + key[pos + 1:]  # replace one


@SETTINGS
@given(valid_configs, st.sampled_from(TOP_KEYS), st.integers(0, 3), st.integers(0, 40),
       st.sampled_from(string.ascii_lowercase + "_"))
def test_misspelled_keys_are_named_with_a_suggestion(config, key, how, pos, char):
    wrong = _misspell(key, how, pos, char)
    assume(wrong not in TOP_KEYS)
    err = _load_expecting_error({**config, wrong: 1})
    _assert_names(err, f"unknown key '{wrong}'")
    assert "did you mean '" in str(err)


@SETTINGS
@given(valid_configs, st.sampled_from(["mixed_precision", "tensor_parallel", "gradient_sync"]),
       st.text(string.ascii_lowercase + "_", min_size=1, max_size=20))
def test_unknown_nested_keys_are_named_with_their_path(config, section, name):
    sub = config.get(section)
    sub = dict(sub) if isinstance(sub, dict) else {}
    from smp.config import _submodel_at

    assume(name not in _submodel_at((section,)).model_fields)
    err = _load_expecting_error({**config, section: {**sub, name: True}})
    _assert_names(err, f"unknown key '{section}.{name}'")


json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=10), st.integers()), children, max_size=3),
    ),
    max_leaves=10,
)


@SETTINGS
@given(st.dictionaries(st.one_of(st.sampled_from(TOP_KEYS), st.text(max_size=12), st.integers()),
                       json_like, max_size=5))
def test_random_dicts_never_raise_anything_but_config_error(config):
    try:
        cfg = load_config(config)
    except smp.ConfigError as err:
        assert "invalid smp config" in str(err)
        return
    assert load_config(cfg.to_dict()) == cfg  # whatever got through is a real config


@SETTINGS
@given(st.one_of(st.text(max_size=200), json_like.map(lambda v: yaml.safe_dump(v))))
def test_random_yaml_files_never_raise_anything_but_config_error(text):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "smp.yaml"
        path.write_text(text)
        try:
            load_config(path)
        except smp.ConfigError:
            pass


@pytest.mark.parametrize("source", [[], 3, 2.5, b"x", object()])
def test_non_mapping_sources_are_config_errors(source):
    with pytest.raises(smp.ConfigError, match="must be a dict"):
        load_config(source)


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e300, 0, -1.0])
def test_collective_timeout_must_be_finite_and_positive(value):
    """inf or 1e300 once passed and then overflowed datetime.timedelta inside smp.init."""
    _assert_names(_load_expecting_error({"collective_timeout_seconds": value}), "collective_timeout_seconds")
