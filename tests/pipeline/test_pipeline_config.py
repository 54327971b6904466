"""The `pipeline_parallel_degree` key, the `pipeline:` section and the pp mesh axis: every bad
combination is one ConfigError naming the degrees, raised before any collective."""

from __future__ import annotations

import pytest

import smp
from smp.config import PIPELINE_SCHEDULES, check_pipeline, load_config
from smp.mesh import ParallelDims

PP2 = {"pipeline_parallel_degree": 2}


def test_defaults():
    cfg = load_config({})
    assert cfg.pipeline_parallel_degree == 1
    assert (cfg.pipeline.schedule, cfg.pipeline.microbatches, cfg.pipeline.split) == ("1f1b", None, "auto")


@pytest.mark.parametrize("name", PIPELINE_SCHEDULES)
def test_every_schedule_by_name(name):
    cfg = load_config({**PP2, "pipeline": {"schedule": name, "microbatches": 4}})
    assert cfg.pipeline.schedule == name
    assert cfg.pipeline.local_stages() == (1 if name in ("gpipe", "1f1b") else 2)


@pytest.mark.parametrize("alias,name", [("simple", "gpipe"), ("interleaved", "1f1b"), ("GPipe", "gpipe")])
def test_smp_v1_aliases_and_string_form(alias, name):
    assert load_config({**PP2, "pipeline": alias}).pipeline.schedule == name
    assert load_config({**PP2, "pipeline": {"schedule": alias}}).pipeline.schedule == name


@pytest.mark.parametrize("raw,needle", [
    ({"pipeline": {"shedule": "gpipe"}}, "unknown key 'pipeline.shedule'; did you mean 'schedule'?"),
    ({"pipeline": {"microbatch": 4}}, "did you mean 'microbatches'?"),
    ({"pipeline": "gpip"}, "did you mean 'gpipe'?"),
    ({"pipeline_paralel_degree": 2}, "did you mean 'pipeline_parallel_degree'?"),
    ({"pipeline_parallel_degree": 0}, "pipeline_parallel_degree"),
    ({"pipeline": {"split": [2, 2]}}, "increasing"),
    ({"pipeline": {"microbatches": 0}}, "pipeline.microbatches"),
])
def test_bad_keys_name_the_key(raw, needle):
    with pytest.raises(smp.ConfigError, match=None) as e:
        load_config(raw)
    assert needle in str(e.value)


@pytest.mark.parametrize("pipeline,needle", [
    ({"schedule": "zbv_zero_bubble", "stages_per_rank": 1}, "exactly 2 stages per rank"),
    ({"schedule": "dualpipev", "stages_per_rank": 3}, "exactly 2 stages per rank"),
    ({"schedule": "gpipe", "stages_per_rank": 2}, "one stage per rank"),
    ({"schedule": "1f1b", "microbatches": 1}, "microbatches=1 < 2 stages"),
    ({"schedule": "dualpipev", "microbatches": 3}, "microbatches=3 < 4 stages"),
    ({"schedule": "interleaved_1f1b", "microbatches": 5}, "multiple of 2"),
    ({"schedule": "gpipe", "split": [1, 2]}, "2 stages need 1"),
])
def test_schedule_combinations_name_the_degrees(pipeline, needle):
    with pytest.raises(smp.ConfigError) as e:
        load_config({**PP2, "pipeline": pipeline})
    assert needle in str(e.value) and "pipeline_parallel_degree=2" in str(e.value)


def test_composed_and_refused_degrees():
    # TP, EP (tests/pipeline/test_pipeline_compose.py) and CP (tests/pipeline/test_pipeline_cp.py) compose with pp;
    # CP under a schedule not proven with it is refused.
    for key in ("tensor_parallel_degree", "expert_parallel_degree", "context_parallel_degree"):
        assert getattr(load_config({**PP2, key: 2}), key) == 2
    with pytest.raises(smp.ConfigError, match="context_parallel_degree=2 with pipeline schedule 'interleaved_1f1b' is not supported"):
        load_config({**PP2, "context_parallel_degree": 2, "pipeline": "interleaved_1f1b"})
    with pytest.raises(smp.ConfigError, match="torch.compile"):
        load_config({**PP2, "compile": True, "pipeline": {"schedule": "zbv_zero_bubble"}})


def test_pipeline_section_without_pp_is_accepted():
    assert load_config({"pipeline": "gpipe"}).pipeline_parallel_degree == 1


def test_microbatches_must_divide_the_batch():
    pipe = load_config({**PP2, "pipeline": {"schedule": "gpipe", "microbatches": 4}}).pipeline
    check_pipeline(pipe, 2, batch_size=8)
    with pytest.raises(ValueError, match="microbatches=4 does not divide the batch of 6 rows"):
        check_pipeline(pipe, 2, batch_size=6)


def test_mesh_pp_outermost():
    dims = ParallelDims.from_config(load_config({**PP2, "hybrid_shard_degree": 2}), 8)
    assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp, dims.world_size) == (2, 2, 2, 1, 8)
    assert dims.mesh_dim_names == ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
    assert dims.shape == (2, 2, 2, 1, 1, 1)
    assert dims.describe() == "world 8 = pp 2 x dp_replicate 2 x dp_shard 2 x tp 1"
    plain = ParallelDims.from_config(load_config({}), 8)
    assert plain.shape == (1, 1, 8, 1, 1, 1) and plain.mesh_dim_names == dims.mesh_dim_names  # every axis, always


def test_mesh_errors_name_every_degree():
    with pytest.raises(smp.ConfigError) as e:
        ParallelDims.from_config(load_config({"pipeline_parallel_degree": 3}), 8)
    assert "pipeline_parallel_degree=3 does not divide the world size 8" in str(e.value)
    assert "hybrid_shard_degree=0" in str(e.value)
    with pytest.raises(smp.ConfigError) as e:
        ParallelDims.from_config(load_config({**PP2, "hybrid_shard_degree": 3}), 8)
    assert "pipeline_parallel_degree=2" in str(e.value) and "world_size=8" in str(e.value)
