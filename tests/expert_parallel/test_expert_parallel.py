"""Expert parallelism (x FSDP2) through smp.transform vs the single-process run.

Families: Mixtral, Qwen2-MoE (with its shared expert), Qwen3-MoE, OLMoE (their own transformers
`base_model_ep_plan`) and a user-defined MoE model with a user plan; tiny configs (hidden 64,
2 layers, 4 experts, top-2, vocab 256). Loss, load-balancing loss and every gradient are compared
over 3 SGD steps.

Tolerances (fp32): the dispatched run applies the routing weights after the experts and sums in
the same expert order, so it differs from one process only by rounding (measured: loss <= 7.2e-7,
gradients <= 7.5e-8 for Mixtral at EP=2); we assert 1e-5. A broken dispatch (results returned to
the wrong tokens and ranks; a return all-to-all without its backward) moves gradients by more
than 1e-3, which the same check catches (test_broken_dispatch_is_caught). At EP=2 x FSDP 2
(world 4): Mixtral 3.6e-7 / 1.0e-7, Qwen2-MoE 4.8e-7 / 1.0e-7, Qwen3-MoE 6.0e-7 / 1.4e-7, OLMoE
6.0e-7 / 9.3e-8 (loss / gradients). Plain FSDP 2 (EP=1) with the router statistics reduced:
7.2e-7 / 7.5e-8, and 2.7e-3 on the aux loss without the reduction. bf16: see BF16_TOL.
"""

from __future__ import annotations

import pytest
import torch

from smp.config import load_config
from smp.errors import ConfigError
from smp.expert_parallel import SMP_TABLES
from smp.expert_parallel.load_balancing import is_standard_loss
from smp.mesh import ParallelDims
from tests.expert_parallel import expert_parallel_cases as cases

TOL = 1e-5

EP2 = {"expert_parallel_degree": 2}

MATRIX = [
    # world, config, name, kind: EP=2 alone, EP=2 x FSDP 2 (dp_shard 4 = dp_shard_mod_ep 2 x ep 2)
    # for three transformers families. Each world-4 case takes 4-9 s once the pool is warm (the
    # first pays the 4 ranks' start and imports).
    (2, EP2, "ep2", "mixtral"),
    (2, EP2, "ep2", "user"),
    (4, EP2, "ep2xfsdp2", "mixtral"),
    (4, EP2, "ep2xfsdp2", "qwen2_moe"),
    (4, EP2, "ep2xfsdp2", "qwen3_moe"),
    (4, EP2, "ep2xfsdp2", "olmoe"),
]
# The other families and compositions (each 40-150 s on a loaded 2-core machine).
SLOW = [
    (2, EP2, "ep2", "qwen2_moe"),
    (2, EP2, "ep2", "qwen3_moe"),
    (2, EP2, "ep2", "olmoe"),
    (4, EP2, "ep2xfsdp2", "user"),
    (4, {**EP2, "hybrid_shard_degree": 2}, "ep2-hybrid2", "qwen3_moe"),
    (4, {"expert_parallel_degree": 4}, "ep4", "mixtral"),
    (2, {**EP2, "activation_checkpointing": "full"}, "ep2-ac-full", "mixtral"),
    (2, {**EP2, "activation_checkpointing": "full"}, "ep2-ac-full", "user"),
    (2, {**EP2, "delayed_parameter_initialization": True}, "ep2-delayed-init", "olmoe"),
    (2, {**EP2, "activation_offloading": True, "activation_offload_min_bytes": 0}, "ep2-offload", "mixtral"),
    (2, {**EP2, "cpu_offload": True}, "ep2-cpu-offload", "user"),
    (2, {**EP2, "mixed_precision": {"param_dtype": "float32", "reduce_dtype": "float32"}}, "ep2-mp", "qwen3_moe"),
]


def _check(reports: list[dict], world: int, ep: int) -> None:
    for report in reports:
        assert report["loss_diff"] < TOL, report
        assert report["aux_diff"] < TOL, report
        assert report["grad_diff"] < TOL, report
        assert report["experts_modules"] == 2, report
        # Expert parameters on a rank: 1/ep of the experts (Shard(0) over "ep"), then FSDP's
        # share of that (Shard(1) over dp_shard_mod_ep): exactly total / (world / replicas).
        assert report["expert_local"] * world == report["expert_total"] * report["replicas"], report
        assert report["ep_placements"] == ["(Shard(dim=1), Shard(dim=0))"] or world // ep > 1, report
        assert report["dropped"] == 0, report  # no capacity: no token choice dropped
    received = [sum(sum(v) for v in r["tokens_per_expert"].values()) for r in reports]
    # Every token choice of the global batch (4 x 8 tokens x top-2 x 2 layers) reached an expert.
    assert sum(received) == cases.GLOBAL_BATCH * cases.SEQ * cases.TOP_K * 2, received
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]  # it trains


@pytest.mark.parametrize("world,config,name,kind", MATRIX, ids=[f"{m[2]}-{m[3]}" for m in MATRIX])
def test_matches_single_process(ranks, world, config, name, kind):
    _check(ranks(world).run(cases.equivalence, config=config, kind=kind, timeout=300), world, config["expert_parallel_degree"])


@pytest.mark.slow
@pytest.mark.parametrize("world,config,name,kind", SLOW, ids=[f"{m[2]}-{m[3]}" for m in SLOW])
def test_matches_single_process_more(ranks, world, config, name, kind):
    _check(ranks(world).run(cases.equivalence, config=config, kind=kind, timeout=400), world, config["expert_parallel_degree"])


@pytest.mark.parametrize("corrupt", ["misroute", "no_backward_a2a"])
def test_broken_dispatch_is_caught(ranks, corrupt):
    """Negative controls for the equivalence check: each mutation of the dispatch fails it."""
    reports = ranks(2).run(cases.equivalence, config=EP2, kind="mixtral", steps=1, corrupt=corrupt)
    assert max(r["grad_diff"] for r in reports) > 1e-3, reports


# bf16 parameters (fp32 reduction) against the fp32 single process, as the other bf16 tests do
# (tests/sharding/test_fsdp.py): the gap is bf16 rounding of weights and activations, not the dispatch.
BF16 = {"mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}
BF16_TOL = 2e-2


def test_bf16_mixed_precision(ranks):
    """EP=2 with bf16 compute (experts FSDP units included) vs the fp32 single process: loss,
    load-balancing loss and every gradient within BF16_TOL; bf16 really ran (the loss differs
    by far more than the fp32 run's ~1e-7)."""
    reports = ranks(2).run(cases.equivalence, config={**EP2, **BF16}, kind="mixtral", timeout=300)
    for r in reports:
        assert r["loss_diff"] < BF16_TOL and r["aux_diff"] < BF16_TOL and r["grad_diff"] < BF16_TOL, r
    assert max(r["loss_diff"] for r in reports) > 1e-5, reports


def test_fsdp_without_ep_makes_the_aux_loss_global(ranks):
    """Plain FSDP 2 (EP=1) on Mixtral with its load-balancing loss: each rank holds half the
    batch, so smp sums the router statistics over the data-parallel ranks as under EP. Loss
    (with aux), aux loss and every gradient within 1e-5 of one process; the negative control
    (the model's own per-rank aux loss) misses by far more."""
    for r in ranks(2).run(cases.equivalence, config={}, kind="mixtral", timeout=300):
        assert r["loss_diff"] < TOL and r["aux_diff"] < TOL and r["grad_diff"] < TOL, r
    control = ranks(2).run(cases.equivalence, config={}, kind="mixtral", steps=1, per_rank_aux=True)
    assert max(r["aux_diff"] for r in control) > 1e-3 and max(r["grad_diff"] for r in control) > 1e-4, control


def test_only_the_standard_aux_loss_is_reduced():
    """smp swaps in its reduced loss only where the family's function is the Switch-Transformer
    formula it reduces; Doge's and Switch Transformers' are other formulas."""
    import transformers.models.doge.modeling_doge as doge
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers.models.switch_transformers.modeling_switch_transformers as switch

    assert is_standard_loss(mixtral.load_balancing_loss_func)
    assert not is_standard_loss(doge.load_balancing_loss_func)
    assert not is_standard_loss(switch.load_balancing_loss_func)


def test_tokens_per_expert_in_the_step_record():
    """smp.metrics.ExpertLoadMeter on one process: a router that is a fixed rule on the token ids
    (counts known by hand), summed over two micro-batches; and Mixtral's own router, whose
    counts must be the top-k of the router logits it returns."""
    from smp.metrics import ExpertLoadMeter

    torch.manual_seed(0)
    model = cases.IdRoutedModel()
    meter = ExpertLoadMeter(model, plan=cases.ID_PLAN)
    batch = torch.randint(0, cases.VOCAB, (cases.GLOBAL_BATCH, cases.SEQ), generator=torch.Generator().manual_seed(7))
    for chunk in batch.chunk(2):
        model(chunk).backward()
    record = meter.record()
    expected = cases.expected_tokens_per_expert(batch)
    assert record["tokens_per_expert"] == expected, record
    assert record["expert_load_max_over_mean"] == max(max(r) * cases.EXPERTS / sum(r) for r in expected)
    assert meter.record() == {"tokens_per_expert": [[0] * cases.EXPERTS] * 2, "expert_load_max_over_mean": None}
    model.eval()
    model(batch)  # evaluation: not a training step's routing
    assert meter.record()["tokens_per_expert"] == [[0] * cases.EXPERTS] * 2

    mixtral = cases.build("mixtral")
    meter = ExpertLoadMeter(mixtral)
    out = mixtral(input_ids=batch, labels=batch)
    by_router = [torch.bincount(torch.topk(logits, cases.TOP_K, dim=-1).indices.reshape(-1), minlength=cases.EXPERTS)
                 .tolist() for logits in out.router_logits]
    assert meter.record()["tokens_per_expert"] == by_router
    with torch.device("meta"):
        assert ExpertLoadMeter(cases.build("dense")).record() == {}  # no MoE layer: nothing recorded


@pytest.mark.parametrize("config", [{}, {**EP2, "activation_checkpointing": "full"}], ids=["fsdp2", "ep2-ac-full"])
def test_tokens_per_expert_summed_over_ranks(ranks, config):
    """The step record over 2 ranks (FSDP 2; EP=2 with full checkpointing, whose recompute in
    backward must not count twice) equals the hand count of the global batch."""
    for r in ranks(2).run(cases.expert_load_metrics, config=config, timeout=300):
        assert r["tokens_per_expert"] == r["expected"], r
        assert r["after"]["tokens_per_expert"] == [[0] * cases.EXPERTS] * 2, r  # reset after each record


def test_aux_loss_refused_where_it_cannot_be_global(ranks):
    """Context parallel splits each row's tokens over ranks, whose router statistics smp does not
    gather: with the loss on, transform refuses naming the fix; with it off, it goes through."""
    cp2 = {"context_parallel_degree": 2}
    refused = ranks(2).run(cases.transform_error, config=cp2, kind="mixtral")[0]
    assert "context_parallel_degree=2" in refused and "MixtralForCausalLM" in refused, refused
    assert "moe_load_balancing: none" in refused, refused
    off = {**cp2, "moe": {"moe_load_balancing": "none"}}
    assert ranks(2).run(cases.transform_error, config=off, kind="mixtral")[0] == ""


def test_aux_loss_is_not_per_row():
    """Why smp reduces the router statistics over the data-parallel ranks: the load-balancing
    loss of a batch is not the mean of the losses of its halves (a product of batch means),
    so per-rank aux losses averaged would not be the one-process loss; the reduced one is."""
    torch.manual_seed(0)
    model = cases.build("mixtral")
    ids = torch.randint(0, cases.VOCAB, (cases.GLOBAL_BATCH, cases.SEQ), generator=torch.Generator().manual_seed(1))
    whole = float(model(input_ids=ids, labels=ids).aux_loss)
    halves = [float(model(input_ids=half, labels=half).aux_loss) for half in ids.chunk(2)]
    assert abs(sum(halves) / 2 - whole) > 1e-4, (whole, halves)
    # smp's global version with no group is the transformers function, exactly.
    logits = model(input_ids=ids, labels=ids).router_logits
    assert float(cases.global_load_balancing_loss(logits, cases.EXPERTS, cases.TOP_K)) == pytest.approx(whole, abs=1e-7)


def test_capacity_factor_drops_and_counts(ranks):
    reports = ranks(2).run(cases.capacity_drops, config=EP2, capacity_factor=0.5)
    assert all(r["finite"] for r in reports)
    assert sum(r["dropped"] for r in reports) > 0, reports
    total = cases.GLOBAL_BATCH * cases.SEQ * cases.TOP_K * 2
    assert sum(r["dropped"] + r["received"] for r in reports) == total, reports


def test_errors_before_any_collective(ranks):
    """A dense model, and experts that the degree does not divide: one ConfigError each that
    names the model, the expert count and the degree."""
    dense = ranks(2).run(cases.transform_error, config=EP2, kind="dense")[0]
    assert "LlamaForCausalLM has no mixture-of-experts layer" in dense and "expert_parallel_degree=2" in dense, dense
    uneven = ranks(2).run(cases.transform_error, config=EP2, kind="mixtral3")[0]
    assert "MixtralForCausalLM" in uneven and "holds 3 experts" in uneven and "expert_parallel_degree=2" in uneven, uneven
    not_experts = ranks(2).run(cases.transform_error, config=EP2, kind="user",
                               moe={"plan": {"layers.*.moe.router": "ep_dispatch_experts"}})[0]
    assert "UserMoEModel" in not_experts and "num_experts=" in not_experts, not_experts


def test_degree_errors_list_every_degree():
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(load_config({"expert_parallel_degree": 3}), 4)
    for part in ("expert_parallel_degree=3", "tensor_parallel_degree=1", "hybrid_shard_degree=0", "world_size=4"):
        assert part in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="expert_parallel_degree=2 with tensor_parallel_degree=2"):
        ParallelDims.from_config(load_config({"expert_parallel_degree": 2, "tensor_parallel_degree": 2}), 4)
    with pytest.raises(ConfigError, match="does not divide the data-parallel shard size 2"):
        ParallelDims.from_config(load_config({"expert_parallel_degree": 4, "hybrid_shard_degree": 2}), 4)
    dims = ParallelDims.from_config(load_config({"expert_parallel_degree": 2, "hybrid_shard_degree": 2}), 8)
    assert dims.mesh_dim_names == ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
    assert dims.shape == (1, 4, 1, 2, 1, 1) and dims.dp == 8


@pytest.mark.parametrize(
    "moe,expected",
    [
        ({"moe_load_balancing": "sinkhorn"}, "moe_load_balancing='sinkhorn' is not implemented"),
        ({"moe_load_balancing": "balanced"}, "moe_load_balancing='balanced' is not implemented"),
        ({"moe_z_loss_coeff": 0.001}, "z-loss is not implemented"),
        ({"global_token_shuffle": True}, "global_token_shuffle is not implemented"),
        ({"moe_all2all_dispatcher": False}, "all-to-all only"),
        ({"capacity_factor": 0}, "'moe.capacity_factor'"),
        ({"moe_aux_los_coeff": 0.1}, "did you mean 'moe_aux_loss_coeff'"),
    ],
)
def test_moe_config_refuses_what_is_not_implemented(moe, expected):
    with pytest.raises(ConfigError) as err:
        load_config({"expert_parallel_degree": 2, "moe": moe})
    assert expected in str(err.value)


def test_moe_config_accepts_smp_v2_keys():
    cfg = load_config({"expert_parallel_degree": 2, "moe": {
        "moe_load_balancing": "aux_loss", "moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0,
        "global_token_shuffle": False, "moe_all2all_dispatcher": True}})
    assert cfg.expert_parallel_degree == 2 and cfg.moe.moe_aux_loss_coeff == 0.01


# transformers families with an experts module but no `base_model_ep_plan`: none follows the
# experts contract (docs/expert-parallel.md), so smp refuses them with expert_parallel_degree > 1.
WITHOUT_PLAN = {
    "dbrx": "expert weights flattened to [experts x ffn, hidden] in a child module",
    "jetmoe": "experts inside attention (mixture of attention heads)",
    "llama4": "experts take pre-routed inputs, forward(hidden) only",
    "longcat_flash": "zero (identity) experts beside the routed ones",
    "nllb_moe": "one module per expert",
    "switch_transformers": "one module per expert",
}


def test_every_transformers_moe_family_ships_a_plan():
    """smp reads transformers' `base_model_ep_plan`; its own table is for families without one.
    Every family whose experts follow the contract ships one; the others are known."""
    import importlib
    import pkgutil

    import transformers.models as models

    missing = []
    for info in pkgutil.iter_modules(models.__path__):
        try:
            modeling = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
            configuration = importlib.import_module(f"transformers.models.{info.name}.configuration_{info.name}")
        except Exception:
            continue
        has_experts = any(getattr(cls, "__module__", "") == modeling.__name__ and cls.__name__.endswith("Experts")
                          for cls in vars(modeling).values() if isinstance(cls, type))
        plans = [getattr(c, "base_model_ep_plan", None) for c in vars(configuration).values() if isinstance(c, type)]
        if has_experts and not any(plans) and info.name not in SMP_TABLES:
            missing.append(info.name)
    assert missing == sorted(WITHOUT_PLAN), missing


def test_checkpoint_reshards_across_degrees_and_world_sizes(ranks, tmp_path):
    """Saved at EP=2 (world 2): loads at EP=1 (world 2) and at EP=2 x FSDP 2 (world 4)."""
    path = str(tmp_path / "ep2")
    ranks(2).run(cases.save_checkpoint, config=EP2, kind="mixtral", path=path)
    for world, config in ((2, {}), (4, EP2)):
        for r in ranks(world).run(cases.load_checkpoint, config=config, kind="mixtral", path=path):
            assert r["max_diff"] == 0.0 and r["step"] == 1, (world, config, r)


def test_hf_export_keeps_the_model_layout(ranks, tmp_path):
    report = ranks(2).run(cases.export_and_reload, config=EP2, kind="mixtral", out_dir=str(tmp_path / "hf"))[0]
    assert report["expert_shape"] == [cases.EXPERTS, 2 * 32, cases.HIDDEN], report
    assert report["max_diff"] == 0.0, report


def test_selective_checkpointing_is_refused():
    """Selective checkpointing replays op outputs by invocation order, which the dispatch's
    data-dependent collectives break: refused up front (full checkpointing is tested above)."""
    with pytest.raises(ConfigError, match="'selective' is not supported"):
        load_config({**EP2, "activation_checkpointing": "selective"})


def test_older_transformers_plan_vocabulary_reads_as_todays():
    """transformers 5.17 ships Mixtral's plan as {gate: ep_router, experts: moe_tp_experts, its two
    tensors: grouped_gemm}; smp reads it as today's plan (the router dropped: smp's dispatch runs
    it whole), so expert parallelism finds the same experts modules on either transformers."""
    from smp.expert_parallel.plan import expand_ep_plan, resolve_ep_plan

    model = cases.build("mixtral")
    today = resolve_ep_plan(model, None).entries
    model.config.base_model_ep_plan = {
        "layers.*.mlp.gate": "ep_router",
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    older = resolve_ep_plan(model, None)
    assert older.entries == today, older.entries
    found = expand_ep_plan(model, older, 2)
    assert [e.name for e in found] == [f"model.layers.{i}.mlp.experts" for i in range(len(found))] and found
    # A style smp does not know is still refused, in the model's plan as in the config's.
    model.config.base_model_ep_plan = {"layers.*.mlp.experts": "moe_some_other_style"}
    with pytest.raises(ConfigError, match="unknown styles"):
        expand_ep_plan(model, resolve_ep_plan(model, None), 2)
