"""FP8 training config (`fp8: {recipe: tensorwise | rowwise}`, torchao float8).

The config, the refusal at smp.init (no CUDA; a GPU below compute capability 8.9, simulated),
the module swap on the meta device, and training under FSDP, tensor parallel (+ sequence
parallel) and both together vs the same float8 model in one process. torchao's float8 matmuls
run on CPU under torch >= 2.13 (slowly: a tiny Llama, 2 SGD steps); the cases lift smp.init's
CUDA check inside the ranks (tests/training/fp8_cases.py). Without torchao they skip.

Tolerances. Float8 scales are dynamic: tensorwise takes one amax per tensor, rowwise one per row
(power-of-2 scales). Under TP the amax of a sharded tensor is reduced over the TP group (DTensor's
max), so every rank casts with the scales one process uses; under FSDP each rank's activation and
gradient scales come from its own rows, so the oracle runs those rows as micro-batches in one
process (gradient accumulation). What remains is the order of float32 sums: we assert 1e-5 on the
loss and every gradient (measured: loss <= 2.4e-7, gradients <= 3e-8). One exception, rowwise
under TP: torchao returns rowwise-scaled products in bfloat16 (cuBLAS has no float32 output for
them), so each rank's partial sum (a row-parallel layer's output, a column-parallel layer's
input gradient) is rounded to bfloat16 before the all-reduce, where one process rounds the
total once; that is bf16 TP's rounding, with its bound
(loss 2e-3, gradients 1e-2; measured loss <= 7.4e-4, gradients <= 4.2e-3). With the products
kept in float32 on both sides (in the test only) rowwise under TP meets 1e-5 too (measured
loss <= 2.4e-7, gradients <= 1.9e-8): the scales are exact.

Negative controls: TP ranks casting with their own shard's amax (tensorwise: gradients
1.0e-2), and the reference left unconverted (float32 vs float8: gradients 8.4e-3 under FSDP,
6.3e-3 rowwise under TP); all exceed 100x the 1e-5 bound. (A shard's amax is no control for
rowwise: its power-of-2 row scales mostly land on the whole row's.)

Measured against one pass over the whole batch instead of per-rank micro-batches, FSDP's
float8 differs by the scales' choice of rows (tensorwise: gradients 1.1e-2; rowwise, whose
power-of-2 row scales rarely move, 2e-4): that is data parallelism's float8, not an error, and
what the docs state.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import smp
from smp import composition, fp8
from smp.config import load_config
from smp.mesh import ParallelDims
from tests.training import fp8_cases


def test_config_section():
    assert load_config({}).fp8 is None
    assert load_config({"fp8": {}}).fp8.recipe == "tensorwise"
    assert load_config({"fp8": {"recipe": "rowwise"}}).fp8.recipe == "rowwise"
    with pytest.raises(smp.ConfigError, match="fp8.recipe"):
        load_config({"fp8": {"recipe": "delayed"}})
    assert load_config({"fp8": {}}).fp8.all_gather is False
    assert load_config({"fp8": {"all_gather": True}}).fp8.all_gather is True


def test_refused_at_init_on_cpu():
    with pytest.raises(smp.ConfigError) as e:
        smp.init({"fp8": {"recipe": "tensorwise"}})
    assert "CUDA device of compute capability >= 8.9" in str(e.value) and "this run is on cpu" in str(e.value)
    assert not smp.is_initialized()  # refused before the process group exists


def test_refused_below_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "A100")
    with pytest.raises(smp.ConfigError, match="A100 has 8.0"):
        fp8.check_fp8("rowwise", torch.device("cuda", 0))


def test_accepted_on_capability_9_0_with_torchao(monkeypatch):
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_fp8("tensorwise", torch.device("cuda", 0))
    fp8.check_fp8(None, torch.device("cpu"))  # off: nothing to check


def test_without_torchao_the_error_names_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(smp.ConfigError, match="pip install torchao"):
        fp8.check_fp8("tensorwise", torch.device("cuda", 0))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_module_swap_on_meta(recipe):
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from smp.testing.models import tiny_llama

    with torch.device("meta"):
        model = tiny_llama(vocab_size=128, hidden_size=32, intermediate_size=64)
    converted = fp8.apply_fp8(model, recipe)
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert converted and set(converted) < linears
    for name, module in model.named_modules():
        if name in converted:
            assert isinstance(module, Float8Linear), name
            assert module.weight.is_meta
    assert "lm_head" not in converted and type(model.lm_head) is nn.Linear  # the output head stays
    # k/v projections are 16 wide (2 key/value heads x 8): converted; nothing narrower than 16 is
    assert all(model.get_submodule(n).in_features % 16 == 0 for n in converted)


def test_layer_filter():
    assert fp8.fp8_layer("model.layers.0.mlp.up_proj", nn.Linear(32, 64, device="meta"))
    assert not fp8.fp8_layer("model.layers.0.mlp.up_proj", nn.Linear(32, 60, device="meta"))  # 60 % 16
    assert not fp8.fp8_layer("lm_head", nn.Linear(32, 64, device="meta"))
    assert not fp8.fp8_layer("model.layers.0.block_sparse_moe.gate", nn.Linear(32, 64, device="meta"))  # routers
    assert not fp8.fp8_layer("layers.0.moe.router", nn.Linear(32, 64, device="meta"))
    assert fp8.fp8_layer("model.layers.0.mlp.gate_proj", nn.Linear(32, 64, device="meta"))
    assert not fp8.fp8_layer("model.norm", nn.LayerNorm(32, device="meta"))


# --- training under FSDP / TP / TP x FSDP vs the same float8 model in one process ----------

EXACT = 1e-5  # float32 summation order only (see the module docstring)
ROWWISE_TP_LOSS, ROWWISE_TP_GRAD = 2e-3, 1e-2  # bf16 rounding of each TP rank's partial sum

FSDP2 = {}  # world 2: FSDP shards every block over both ranks
TP2 = {"tensor_parallel_degree": 2}
TP2_SP = {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}

# (world, config, id): world 4 is TP 2 x FSDP 2, every axis > 1
EXACT_LAYOUTS = [
    (2, FSDP2, "tensorwise", "fsdp2"),
    (2, FSDP2, "rowwise", "fsdp2"),
    (2, TP2, "tensorwise", "tp2"),
    (2, TP2_SP, "tensorwise", "tp2-sp"),
    pytest.param(4, TP2, "tensorwise", "tp2xfsdp2", marks=pytest.mark.slow),
    pytest.param(4, TP2_SP, "tensorwise", "tp2xfsdp2-sp", marks=pytest.mark.slow),
]


def _trained_in_fp8(reports: list[dict], tp: bool) -> None:
    for report in reports:
        assert report["fp8_layers"] == report["converted"] > 0, report  # the swap ran on both sides
        assert (report["tp_sharded"] > 0) == tp, report
    assert reports[0]["losses"][1] < reports[0]["losses"][0]  # it trains


@pytest.fixture
def _torchao():
    pytest.importorskip("torchao.float8")


@pytest.mark.usefixtures("_torchao")
@pytest.mark.parametrize("world,config,recipe,layout", EXACT_LAYOUTS,
                         ids=lambda v: v if isinstance(v, str) else None)
def test_matches_one_process(ranks, world, config, recipe, layout):
    reports = ranks(world).run(fp8_cases.equivalence, config=config, recipe=recipe, timeout=400)
    _trained_in_fp8(reports, tp="tp" in layout)
    for report in reports:
        assert report["loss_diff"] < EXACT and report["grad_diff"] < EXACT, report


@pytest.mark.usefixtures("_torchao")
@pytest.mark.parametrize("world,config", [(2, TP2), pytest.param(4, TP2_SP, marks=pytest.mark.slow)],
                         ids=["tp2", "tp2xfsdp2-sp"])
def test_rowwise_under_tp_exact_scales(ranks, world, config):
    """Products kept in float32 on both sides: TP's rowwise scales are one process's."""
    reports = ranks(world).run(fp8_cases.equivalence, config=config, recipe="rowwise", fp32_outputs=True, timeout=400)
    _trained_in_fp8(reports, tp=True)
    for report in reports:
        assert report["loss_diff"] < EXACT and report["grad_diff"] < EXACT, report


@pytest.mark.usefixtures("_torchao")
@pytest.mark.parametrize("world,config", [(2, TP2_SP), pytest.param(4, TP2_SP, marks=pytest.mark.slow)],
                         ids=["tp2-sp", "tp2xfsdp2-sp"])
def test_rowwise_under_tp_within_bf16_rounding(ranks, world, config):
    """As shipped: torchao's bfloat16 rowwise products round each rank's partial sum."""
    reports = ranks(world).run(fp8_cases.equivalence, config=config, recipe="rowwise", timeout=400)
    _trained_in_fp8(reports, tp=True)
    for report in reports:
        assert report["loss_diff"] < ROWWISE_TP_LOSS and report["grad_diff"] < ROWWISE_TP_GRAD, report


@pytest.mark.usefixtures("_torchao")
def test_tp_scales_from_one_shard_are_caught(ranks):
    reports = ranks(2).run(fp8_cases.equivalence, config=TP2, recipe="tensorwise", negative="local_amax", steps=1,
                           timeout=400)
    assert max(r["grad_diff"] for r in reports) > 100 * EXACT


@pytest.mark.usefixtures("_torchao")
@pytest.mark.parametrize("config,recipe", [(FSDP2, "tensorwise"), (TP2, "rowwise")], ids=["fsdp2", "tp2-rowwise"])
def test_reference_without_fp8_is_caught(ranks, config, recipe):
    reports = ranks(2).run(fp8_cases.equivalence, config=config, recipe=recipe, fp32_outputs=recipe == "rowwise",
                           negative="no_fp8", steps=1, timeout=400)
    assert max(r["grad_diff"] for r in reports) > 100 * EXACT


@pytest.mark.usefixtures("_torchao")
def test_packed_projection_under_tp_refused(ranks):
    """A fused [q | k | v] Linear split per part multiplies local shards: its float8 scales would
    be the shard's (measured unrefused: loss 1.8e-3, gradients 1.3e-3 off one process)."""
    error = ranks(2).run(fp8_cases.transform_error, config=TP2, recipe="tensorwise", kind="user")[0]
    assert "fp8 with tensor_parallel_degree 2" in error and "'layers.0.attn_in'" in error, error
    assert "packed_qkv_colwise" in error and "one Linear per part" in error, error
    assert ranks(2).run(fp8_cases.transform_error, config=FSDP2, recipe="tensorwise", kind="user")[0] == ""


# --- fp8.all_gather: FSDP gathers the float8 weights (torchao's enable_fsdp_float8_all_gather) ---

HSDP2x2 = {"hybrid_shard_degree": 2}  # world 4: 2 replicas x FSDP 2


@pytest.mark.usefixtures("_torchao")
@pytest.mark.parametrize("world,config,layout", [(2, FSDP2, "fsdp2"),
                                                 pytest.param(4, HSDP2x2, "hsdp2x2", marks=[pytest.mark.slow, pytest.mark.long])],
                         ids=["fsdp2", "hsdp2x2"])
def test_all_gather_matches_without_it_and_one_process(ranks, world, config, layout):
    """Each shard is cast to float8 with the whole weight's scale (its amax all-reduced over the
    FSDP ranks), so the gathered float8 weight is the one the run without it casts after its
    gather: the same loss and gradients (measured: identical, both layouts), over 2 steps (the
    second gathers the updated weights)."""
    on, off = (ranks(world).run(fp8_cases.equivalence, config=config, recipe="tensorwise", all_gather=all_gather,
                                timeout=400) for all_gather in (True, False))
    _trained_in_fp8(on, tp=False)
    assert (on[0]["dp_shard"], on[0]["dp_replicate"]) == ((2, 1) if layout == "fsdp2" else (2, 2)), on[0]
    for report in on:
        assert len(report["fp8_gathers"]) == 2 and min(report["fp8_gathers"]) > 0, report  # every step, in float8
        assert report["loss_diff"] < EXACT and report["grad_diff"] < EXACT, report
    assert max(off[0]["fp8_gathers"]) == 0  # the run without it gathers the weights as they are
    assert on[0]["losses"] == off[0]["losses"]
    assert max(float((on[0]["grads"][n] - off[0]["grads"][n]).abs().max()) for n in off[0]["grads"]) < EXACT


@pytest.mark.usefixtures("_torchao")
def test_all_gather_scale_from_one_shard_is_caught(ranks):
    """Negative control: each FSDP rank casts its shard with its own amax before the float8
    gather (measured: gradients 1.6e-2 off one process)."""
    reports = ranks(2).run(fp8_cases.equivalence, config=FSDP2, recipe="tensorwise", all_gather=True,
                           negative="shard_weight_scale", steps=1, timeout=400)
    assert min(reports[0]["fp8_gathers"]) > 0
    assert max(r["grad_diff"] for r in reports) > 100 * EXACT


@pytest.mark.usefixtures("_torchao")
def test_all_gather_checkpoints_hold_plain_tensors(ranks, tmp_path):
    """The model's weights are torchao subclasses under fp8.all_gather; smp's checkpoint (the files
    themselves: before the fix they named torchao's class), full_state_dict and export_hf give
    plain float32 tensors, and loading the checkpoint resumes exactly, gathering in float8 again."""
    reports = ranks(2).run(fp8_cases.checkpoint_round_trip, folder=str(tmp_path), timeout=400)
    for report in reports:
        assert "WeightWithDynamicFloat8CastTensor:float32" in report["model_params"], report
        assert report["saved"] == report["full"] == ["Tensor:float32"], report
        assert report["resumed_loss_diff"] == 0 and report["resumed_param_diff"] == 0, report
        assert report["gathers_after_load"] > 0, report
    assert reports[0]["files_naming_torchao"] == [] and reports[0]["exported"] == ["Tensor:float32"], reports[0]


def _all_gather_with(feature: str) -> dict:
    config = {"fp8": {"all_gather": True}}
    for key, value in composition.FEATURES[feature].example.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def test_all_gather_refusals_name_the_key_and_the_fix():
    """Every combination the table refuses with fp8.all_gather is refused by the config (or, for
    FSDP over one rank, by the mesh) with the key, the reason and the fix; FSDP and HSDP load."""
    rows = composition.FP8_GATHER_REFUSALS
    assert {r.features[-1] for r in rows} >= {"tp", "param_gather", "hierarchical_gather", "ring_sync", "cpu_offload",
                                              "param_cast", "cp", "ep", "pp", "fp8_gather_unsharded"}
    for row in rows:
        if row.features == ("fp8_gather_unsharded",):
            continue
        with pytest.raises(smp.ConfigError) as e:
            load_config(_all_gather_with(row.features[1]))
        message = " ".join(str(e.value).split())
        assert "fp8.all_gather: true" in message and row.reason in message and "fp8.all_gather: false" in message
    for algorithm in ("int8", "fp8"):  # both replace FSDP's gather
        with pytest.raises(smp.ConfigError, match="parameter_gather.algorithm"):
            load_config({"fp8": {"all_gather": True}, "parameter_gather": algorithm})
    with pytest.raises(smp.ConfigError) as e:
        load_config({"fp8": {"recipe": "rowwise", "all_gather": True}})
    assert "fp8.all_gather" in str(e.value) and "recipe: tensorwise or all_gather: false" in str(e.value)
    config = load_config({"fp8": {"all_gather": True}})
    with pytest.raises(smp.ConfigError, match=r"fp8.all_gather: true with dp_shard=1 .*dp_shard > 1"):
        ParallelDims.from_config(config, 1)  # FSDP's shard is the whole weight: nothing to gather
    assert ParallelDims.from_config(config, 2).dp_shard == 2
    # smp's meta-device initialisation does not handle torchao's weight class: refused, by the
    # config and by smp.transform for a model built on the meta device
    with pytest.raises(smp.ConfigError, match="delayed_param_initialization: false"):
        load_config({"fp8": {"all_gather": True}, "delayed_parameter_initialization": True})
    with pytest.raises(smp.ConfigError, match="fp8.all_gather: false"):
        fp8.check_fp8_materialized(all_gather=True, materialize_meta=True)
    fp8.check_fp8_materialized(all_gather=True, materialize_meta=False)  # smp plan's meta model: fine
    for sync in ({"algorithm": "int8"}, {"algorithm": "fp8"}, {"cross_replica": "int8"}):  # not proven
        with pytest.raises(smp.ConfigError, match="set gradient_sync: default, or set fp8.all_gather: false"):
            load_config({"fp8": {"all_gather": True}, "gradient_sync": sync, **HSDP2x2})
    assert ParallelDims.from_config(load_config({**HSDP2x2, "fp8": {"all_gather": True}}), 4).dp_replicate == 2


# --- fp8 under expert parallelism ----------------------------------------------------------

EP2 = {"expert_parallel_degree": 2}


@pytest.mark.usefixtures("_torchao")
@pytest.mark.parametrize("world,kind", [(2, "qwen2_moe"), pytest.param(4, "mixtral", marks=pytest.mark.slow)],
                         ids=["ep2-qwen2_moe", "ep2xfsdp2-mixtral"])
def test_expert_parallel_matches_one_process(ranks, world, kind):
    """Attention projections (and Qwen2-MoE's shared expert) in float8, the experts split over
    2 ranks ([E, ...] parameters, left in their dtype), the routers no Linear: each data-parallel
    rank's scales come from its rows, as under FSDP (measured: loss 2.4e-7, gradients <= 1.5e-8)."""
    reports = ranks(world).run(fp8_cases.equivalence, config=EP2, recipe="tensorwise", kind=kind, timeout=400)
    _trained_in_fp8(reports, tp=False)
    for report in reports:
        assert report["expert_parallel"] == 2, report  # both MoE layers dispatch over the ep ranks
        assert report["loss_diff"] < EXACT and report["grad_diff"] < EXACT, report


@pytest.mark.usefixtures("_torchao")
def test_expert_parallel_reference_without_fp8_is_caught(ranks):
    reports = ranks(2).run(fp8_cases.equivalence, config=EP2, recipe="tensorwise", kind="qwen2_moe",
                           negative="no_fp8", steps=1, timeout=400)
    assert max(r["grad_diff"] for r in reports) > 100 * EXACT
