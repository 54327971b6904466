"""CUDA graphs of the compiled blocks (`compile: {cuda_graphs: true}`, smp/compile.py).

On this CPU machine: the config's forms and errors, the refusal at smp.init (every rank), the
layouts the composition table refuses (config, world, and the model-level rows smp.transform
checks), and the torch.compile call each block gets (the device check bypassed, the compile
call recorded instead of run). That the graphs replay the compiled step exactly is the GPU
check's (smp/gpu_check/cuda_graphs.py).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from torch import nn

import smp
from smp import composition, runtime
from smp.compile import compile_options
from smp.config import load_config
from smp.errors import ConfigError
from smp.mesh import ParallelDims
from smp.testing.models import tiny_llama

transform_module = importlib.import_module("smp.transform")  # the module (smp.transform is also the function)


# --- the config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("form, backend", [
    ({"cuda_graphs": True}, "inductor"),  # short: turns compile on too
    ({"enabled": True, "backend": "inductor", "cuda_graphs": True}, "inductor"),  # long
    ({"backend": "aot_eager", "cuda_graphs": True}, "aot_eager"),
    ({"enabled": True, "backend": "cudagraphs"}, "cudagraphs"),  # torch's own CUDA-graphs backend is the same switch
])
def test_forms(form, backend):
    cfg = load_config({"compile": form}).compile
    assert (cfg.enabled, cfg.cuda_graphs, cfg.backend) == (True, True, backend)


def test_off_by_default_and_compile_alone_keeps_it_off():
    assert load_config({}).compile.cuda_graphs is False
    assert load_config({"compile": True}).compile.cuda_graphs is False
    assert load_config({"compile": {"backend": "cudagraphs"}}).compile.enabled is False  # a backend alone turns nothing on


@pytest.mark.parametrize("form, says", [
    ({"enabled": False, "cuda_graphs": True}, "remove enabled: false, or set cuda_graphs: false"),
    ({"cuda_graphs": True, "backend": "eager"}, "set backend: inductor, or cuda_graphs: false"),
    ({"backend": "cudagraphs", "cuda_graphs": False}, "remove cuda_graphs: false"),
    ({"cuda_graphs": "yes"}, "valid boolean"),
    ({"cuda_graph": True}, "did you mean 'cuda_graphs'"),
])
def test_bad_values_name_the_key_and_the_fix(form, says):
    with pytest.raises(ConfigError) as e:
        load_config({"compile": form})
    assert "cuda_graph" in str(e.value) and says in str(e.value)


# --- refused where it cannot be proven ------------------------------------------------------------

def test_refused_at_init_on_cpu():
    with pytest.raises(ConfigError) as e:
        smp.init({"compile": {"cuda_graphs": True}})
    assert "compile.cuda_graphs: true needs a CUDA device" in str(e.value) and "this run is on cpu" in str(e.value)
    assert "set compile.cuda_graphs: false" in str(e.value)
    assert not smp.is_initialized()  # refused before the process group exists


def refusal_on_this_rank(config: dict) -> str:
    """Rank case: smp.init's error on this rank (the run must not get past init)."""
    try:
        smp.init(config)
    except ConfigError as e:
        return str(e)
    smp.shutdown()
    return "initialised"


def test_every_rank_refuses_at_init(ranks):
    # World 2: the data-parallel row refuses on every rank, before any collective; world 2 with one
    # data-parallel rank (tensor parallel) is refused by the config already.
    for message in ranks(2).run(refusal_on_this_rank, {"compile": {"cuda_graphs": True}}):
        assert "compile.cuda_graphs: true with 2 data-parallel ranks" in message and "run at world 1" in message


def _config_of(feature: str) -> tuple[dict, int]:
    if feature == "dp":
        return {"compile": {"cuda_graphs": True}}, 2
    example = composition.FEATURES[feature].example
    world = 1
    for key in ("tensor_parallel_degree", "context_parallel_degree", "expert_parallel_degree", "pipeline_parallel_degree"):
        world *= example.get(key, 1)
    return {**example, "compile": {"cuda_graphs": True}}, world


CONFIG_ROWS = [r for r in composition.CUDA_GRAPH_REFUSALS if composition.FEATURES[r.features[1]].where != "model"]


@pytest.mark.parametrize("row", CONFIG_ROWS, ids=[r.features[1] for r in CONFIG_ROWS])
def test_refused_layouts_name_the_key_and_the_fix(row):
    config, world = _config_of(row.features[1])
    with pytest.raises(ConfigError) as e:
        ParallelDims.from_config(load_config(config), world)
    message = " ".join(str(e.value).split())
    assert "compile.cuda_graphs: true with" in message and row.reason in message and row.fix in message
    # Negative control: the same layout without CUDA graphs is accepted (compile alone composes).
    config["compile"] = {"enabled": True}
    ParallelDims.from_config(load_config(config), world)


def test_allowed_layout_passes_the_checks():
    for extra in ({}, {"activation_checkpointing": "full"}, {"activation_checkpointing": "selective"},
                  {"mixed_precision": {"reduce_dtype": "fp32"}}, {"hybrid_shard_degree": 1}):
        ParallelDims.from_config(load_config({**extra, "compile": {"cuda_graphs": True}}), 1)


# --- inside smp.transform: the compile call, and the rows that need the model ---------------------

@contextlib.contextmanager
def cuda_graph_session(config: dict, monkeypatch):
    """A world-1 session with CUDA graphs on this CPU: the device check bypassed, and each
    module.compile() recorded (its kwargs) instead of run. Yields the list of recorded calls."""
    monkeypatch.setattr(runtime, "check_cuda_graphs", lambda *a, **k: None)
    calls: list[tuple[nn.Module, dict]] = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, *a, **k: calls.append((self, k)))
    with smp.session(config):
        yield calls


@pytest.mark.parametrize("backend, expected", [
    ("inductor", {"backend": "inductor", "mode": "reduce-overhead", "dynamic": False}),
    ("aot_eager", {"backend": "cudagraphs", "dynamic": False}),
])
def test_each_block_is_compiled_with_cuda_graphs(backend, expected, monkeypatch):
    with cuda_graph_session({"compile": {"backend": backend, "cuda_graphs": True}}, monkeypatch) as calls:
        model = smp.transform(tiny_llama())
    blocks = list(model.model.layers)
    assert [m for m, _ in calls] == blocks
    assert all(kwargs == expected for _, kwargs in calls), calls
    # Negative control: compile without CUDA graphs passes the backend alone (what the GPU check's
    # bitwise oracle runs).
    assert compile_options(backend, cuda_graphs=False) == {"backend": backend}


def test_fsdp_units_at_world_1_are_refused(monkeypatch):
    """A bfloat16 model with a mixed-precision setting builds FSDP units at world 1 (the cast
    layout needs float32 parameters): refused, naming the key and the fix. Negative control:
    without the layout step the same transform builds the units and passes."""
    from torch.distributed.fsdp import FSDPModule

    config = {"compile": {"backend": "aot_eager", "cuda_graphs": True}, "mixed_precision": {"output_dtype": "bf16"}}
    with cuda_graph_session(config, monkeypatch):
        with pytest.raises(ConfigError) as e:
            smp.transform(tiny_llama().to(torch.bfloat16))
    message = " ".join(str(e.value).split())
    row = composition.row("cuda_graphs", "fsdp_units")
    assert "compile.cuda_graphs: true with FSDP units" in message and row.reason in message and row.fix in message
    monkeypatch.setattr(transform_module, "RECIPE", tuple(s for s in transform_module.RECIPE if s.name != "cuda_graph_layout"))
    with cuda_graph_session(config, monkeypatch):
        model = smp.transform(tiny_llama().to(torch.bfloat16))
        assert any(isinstance(m, FSDPModule) for m in model.modules())


def test_experts_are_refused(monkeypatch):
    from transformers import MixtralConfig, MixtralForCausalLM

    moe = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    with cuda_graph_session({"compile": {"backend": "aot_eager", "cuda_graphs": True}}, monkeypatch):
        with pytest.raises(ConfigError, match="compile.cuda_graphs: true with a mixture-of-experts model"):
            smp.transform(MixtralForCausalLM(moe))
    with cuda_graph_session({"compile": {"backend": "aot_eager"}}, monkeypatch):  # compile alone: accepted
        smp.transform(MixtralForCausalLM(moe))


def test_the_table_decides_the_model_rows(monkeypatch):
    """Negative control: without the table's row, the model-level check lets the experts through."""
    config = load_config({"compile": {"backend": "aot_eager", "cuda_graphs": True}})
    from smp.compile import check_cuda_graph_layout

    with pytest.raises(ConfigError):
        check_cuda_graph_layout(config, nn.Linear(2, 2), experts=("model.layers.0.mlp.experts",))
    monkeypatch.setattr(composition, "REFUSED", tuple(r for r in composition.REFUSED if "experts" not in r.features))
    check_cuda_graph_layout(config, nn.Linear(2, 2), experts=("model.layers.0.mlp.experts",))
