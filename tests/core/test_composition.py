"""One table of what composes (smp/composition.py): `smp check` refuses exactly the feature sets
the table refuses, every pair of features enumerated; the checks that need the Trainer read it;
docs/composition.md's table is the table's; every test it names exists."""

from __future__ import annotations

import copy
import itertools
import json
import re
from pathlib import Path

import pytest

from smp import cli, composition
from smp.config import load_config
from smp.errors import ConfigError
from smp.mesh import ParallelDims
from tests import REPO_ROOT

ROOT = REPO_ROOT

# What each feature's example config turns on besides itself, worked out by hand (not by the
# code under test): sequence / loss parallel need tp; the schedules need pp, and the zero-bubble
# one is not proven under cp either; ep's and hsdp's ranks are data-parallel ranks; CUDA graphs
# replay compiled blocks.
IMPLIED = {
    "sp": {"tp"}, "loss_parallel": {"tp"}, "split_backward": {"pp", "unproven_cp_schedule"},
    "unproven_cp_schedule": {"pp"}, "ep": {"dp"}, "hsdp": {"dp"}, "cuda_graphs": {"compile"},
}
# Features of how smp runs (the Trainer) or of the model (smp.transform decides) are not in a config;
# fp8_gather_unsharded is fp8_gather where no FSDP sharding is (added by `_run_of`).
ENUMERATED = [name for name, f in composition.FEATURES.items()
              if f.where not in ("run", "model") and name != "fp8_gather_unsharded"]


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for key, value in b.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _run_of(pair: tuple[str, ...]) -> tuple[dict, int, frozenset[str]]:
    """(config, world size, the features it turns on) for a pair of features."""
    config: dict = {}
    for name in pair:
        config = _merge(config, composition.FEATURES[name].example)
    present = set(pair).union(*(IMPLIED.get(name, set()) for name in pair))
    degree = {k: config.get(k, 1) for k in ("pipeline_parallel_degree", "tensor_parallel_degree",
                                             "context_parallel_degree", "expert_parallel_degree")}
    data_parallel = degree["context_parallel_degree"] * degree["expert_parallel_degree"] * max(config.get("hybrid_shard_degree", 1), 1)
    if "dp" in present and data_parallel // degree["context_parallel_degree"] == 1:
        data_parallel *= 2  # one more data-parallel rank per stage
    world = degree["pipeline_parallel_degree"] * degree["tensor_parallel_degree"] * data_parallel
    if "fp8_gather" in present and "dp" not in present:  # every rank taken by other degrees: dp_shard 1
        present.add("fp8_gather_unsharded")
    return config, world, frozenset(present)


def _smp_check(config: dict, world: int, tmp_path: Path, capsys) -> tuple[int, str]:
    path = tmp_path / "smp.json"
    path.write_text(json.dumps(config))
    code = cli.main(["check", str(path), "--world-size", str(world)])
    return code, capsys.readouterr().err


def _leaves(config: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        out.update(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def _one_setting(a: str, b: str) -> bool:
    """Two features set by different values of one key (two pipeline schedules): no config has both."""
    la, lb = _leaves(composition.FEATURES[a].example), _leaves(composition.FEATURES[b].example)
    return any(la[k] != lb[k] for k in la.keys() & lb.keys())


PAIRS = [p for p in itertools.combinations(ENUMERATED, 2) if not _one_setting(*p)]


@pytest.mark.parametrize("pair", PAIRS, ids=["+".join(p) for p in PAIRS])
def test_every_pair_is_checked_as_the_table_says(pair, tmp_path, capsys):
    config, world, present = _run_of(pair)
    refused = composition.refusal(present)
    code, err = _smp_check(config, world, tmp_path, capsys)
    if refused is None:
        assert code == 0, (config, world, err)
        cfg = load_config(config)
        assert composition.features(cfg, ParallelDims.from_config(cfg, world)) == present
    else:
        assert code == 2 and refused.reason in " ".join(err.split()), (config, world, err)


def test_a_row_left_out_is_no_longer_refused(monkeypatch, tmp_path, capsys):
    """Negative control: `smp check` decides from the table alone: without the row refusing
    expert with tensor parallel, the same config passes the check."""
    config, world, _ = _run_of(("ep", "tp"))
    assert _smp_check(config, world, tmp_path, capsys)[0] == 2
    monkeypatch.setattr(composition, "REFUSED", tuple(r for r in composition.REFUSED if r.features != ("ep", "tp")))
    assert _smp_check(config, world, tmp_path, capsys)[0] == 0


def test_world_decides_the_world_rows():
    """A row with a mesh feature (data-parallel ranks) is decided at the world size: the config
    alone loads, the mesh at one world refuses, at another accepts."""
    config = load_config({"pipeline_parallel_degree": 2, "context_parallel_degree": 2})
    ParallelDims.from_config(config, 4)  # one data-parallel rank per stage
    with pytest.raises(ConfigError, match="pipeline x context parallel with one data-parallel rank"):
        ParallelDims.from_config(config, 8)


def test_run_features_are_refused_by_the_integration():
    """The Trainer's checks read the table: pipeline parallel is refused; a PEFT model with TP is
    not (tests/integrations/test_trainer.py proves it equal to one process)."""
    from smp.integrations.checks import check_no_pipeline, check_training_arguments

    with pytest.raises(ConfigError) as e:
        check_no_pipeline(load_config({"pipeline_parallel_degree": 2}))
    assert composition.row("trainer", "pp").reason in str(e.value)
    check_no_pipeline(load_config({"tensor_parallel_degree": 2}))

    class Args:
        fsdp = fsdp_config = deepspeed = load_best_model_at_end = False
        parallelism_config = None

    check_training_arguments(Args(), load_config({"tensor_parallel_degree": 2}), is_peft=True, has_model_init=False)
    check_training_arguments(Args(), load_config({}), is_peft=True, has_model_init=False)


def test_docs_table_is_the_table():
    """docs/composition.md holds the generated tables (regenerate: python -m smp.composition)."""
    page = (ROOT / "docs" / "composition.md").read_text()
    assert composition.markdown_table() in page and composition.feature_legend() in page


def test_every_named_test_exists():
    for name in [r.proof for r in composition.REFUSED] + list(composition.PROVEN.values()):
        path, test = name.split("::")
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(test)}\(", source, re.M), name


# --- the recipe: one ordered list of named steps (smp/transform.py) ----------------------------

def _steps(config: dict, world: int) -> list[str]:
    from smp.transform import RECIPE

    cfg = load_config(config)
    dims = ParallelDims.from_config(cfg, world)
    return [s.name for s in RECIPE if s.applies(dims, cfg)]


def test_recipe_steps_in_their_order():
    before = ["load_balancing", "activation_checkpointing"]
    after = ["fsdp", "image_paths", "batch_norm", "gradient_sync", "parameter_gather"]
    assert _steps({}, 2) == before + after
    assert _steps({}, 1) == before + [s for s in after if s != "batch_norm"]  # nothing splits the batch
    assert _steps({"tensor_parallel_degree": 2, "context_parallel_degree": 2, "compile": True}, 4) == [
        "tensor_parallel", "context_parallel", *before, "compile", *after, "attention_probe"]
    assert _steps({"expert_parallel_degree": 2, "activation_offloading": True}, 2) == [
        "expert_parallel", *before, "activation_offloading", *after]


def test_smp_plan_runs_the_recipe_and_its_order_matters(monkeypatch):
    """`smp plan` (the recipe on a meta model under a fake world) runs RECIPE; negative control:
    with FSDP moved before tensor parallel, the same plan fails (TP then meets sharded parameters)."""
    import importlib

    from smp.planning import plan

    transform = importlib.import_module("smp.transform")  # the module (smp.transform is also the function)

    config = load_config({"tensor_parallel_degree": 2})
    plan(config, "tiny", 4, seq_len=16, micro_batch=1)
    by_name = {s.name: s for s in transform.RECIPE}
    swapped = [by_name["fsdp"]] + [s for s in transform.RECIPE if s.name != "fsdp"]
    monkeypatch.setattr(transform, "RECIPE", tuple(swapped))
    with pytest.raises(ValueError, match="Cannot distribute a DTensor"):
        plan(config, "tiny", 4, seq_len=16, micro_batch=1)
