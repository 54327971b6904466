"""Which features compose: one table, read by every check that refuses a combination.

A *feature* is one thing a run turns on (tensor parallel, a pipeline schedule that splits each
backward, the router's load-balancing loss, the Trainer, ...), read off the config, the mesh
(`ParallelDims`) or where smp runs. `REFUSED` lists the feature sets smp cannot make equal to the
one-process run, each with the reason, the fix and the test that shows it; `PROVEN` lists the
combinations a test proves equal to one process. A set holding a refused set is refused; the
rest is allowed.

The checks read the table instead of deciding themselves: the config's validators
(`check_config`, before anything runs: `load_config`, `smp check`), `ParallelDims.from_config`
(`check_world`: what depends on the world size, at `smp.init` / `smp check` / `smp plan`), the
Trainer integration, and the checks that need the model (the router loss under pipeline
parallel, under context parallel) take their decision's message from here (`message`).
docs/composition.md's table is generated from it (`markdown_table`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from smp.errors import ConfigError

# Schedules that split each backward into input- and weight-gradient halves (torch refuses them
# under torch.compile).
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
# Schedules proven equal to one process under context parallel (tests/pipeline/test_pipeline_cp.py).
CONTEXT_PARALLEL_SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Feature:
    name: str
    where: str  # "config": read off the config alone; "world": needs the mesh; "run": how smp is run;
    # "model": decided by smp.transform from the model (checked with `check_run`)
    on: Callable[[Any, Any], bool]  # (config, dims or None) -> whether this run has it
    setting: Callable[[Any, Any], str]  # how the user turned it on, for messages
    example: dict  # the smallest config turning it on (tests/core/test_composition.py enumerates these)
    meaning: str = ""  # for features the model decides ("model") or derived ones: what turns them on, for the legend


def _degree(key: str) -> tuple[Callable[[Any, Any], bool], Callable[[Any, Any], str]]:
    return (lambda c, d: getattr(c, key) > 1), (lambda c, d: f"{key}={getattr(c, key)}")


def _pp(c: Any) -> bool:
    return c.pipeline_parallel_degree > 1


def _fp8_gather(c: Any) -> bool:
    return c.fp8 is not None and c.fp8.all_gather


FEATURES = {f.name: f for f in (
    Feature("tp", "config", *_degree("tensor_parallel_degree"), {"tensor_parallel_degree": 2}),
    Feature("sp", "config", lambda c, d: c.tensor_parallel_degree > 1 and c.tensor_parallel.sequence_parallel,
            lambda c, d: "tensor_parallel.sequence_parallel: true",
            {"tensor_parallel_degree": 2, "tensor_parallel": {"sequence_parallel": True}}),
    Feature("loss_parallel", "config", lambda c, d: c.tensor_parallel_degree > 1 and c.tensor_parallel.loss_parallel,
            lambda c, d: "tensor_parallel.loss_parallel: true",
            {"tensor_parallel_degree": 2, "tensor_parallel": {"loss_parallel": True}}),
    Feature("cp", "config", *_degree("context_parallel_degree"), {"context_parallel_degree": 2}),
    Feature("ep", "config", *_degree("expert_parallel_degree"), {"expert_parallel_degree": 2}),
    Feature("pp", "config", *_degree("pipeline_parallel_degree"), {"pipeline_parallel_degree": 2}),
    Feature("hsdp", "config", lambda c, d: c.hybrid_shard_degree > 0,
            lambda c, d: f"hybrid_shard_degree={c.hybrid_shard_degree}", {"hybrid_shard_degree": 2}),
    Feature("selective_ac", "config", lambda c, d: c.activation_checkpointing.mode == "selective",
            lambda c, d: "activation_checkpointing 'selective'", {"activation_checkpointing": "selective"}),
    Feature("offloading", "config", lambda c, d: c.activation_offloading,
            lambda c, d: "activation_offloading: true", {"activation_offloading": True}),
    Feature("compile", "config", lambda c, d: c.compile.enabled, lambda c, d: "compile: true", {"compile": True}),
    Feature("cuda_graphs", "config", lambda c, d: c.compile.enabled and c.compile.cuda_graphs,
            lambda c, d: "compile.cuda_graphs: true", {"compile": {"cuda_graphs": True}}),
    Feature("cpu_offload", "config", lambda c, d: c.cpu_offload, lambda c, d: "cpu_offload: true", {"cpu_offload": True}),
    Feature("param_cast", "config", lambda c, d: c.mixed_precision.param_dtype not in (None, "float32", "fp32"),
            lambda c, d: f"mixed_precision.param_dtype {c.mixed_precision.param_dtype!r}",
            {"mixed_precision": {"param_dtype": "bf16"}}),
    Feature("aux_loss", "config", lambda c, d: c.moe.moe_load_balancing == "aux_loss",
            lambda c, d: "moe.moe_load_balancing 'aux_loss'", {"moe": {"moe_load_balancing": "aux_loss"}}),
    Feature("split_backward", "config", lambda c, d: _pp(c) and c.pipeline.schedule in SPLIT_BACKWARD_SCHEDULES,
            lambda c, d: f"pipeline.schedule {c.pipeline.schedule!r}",
            {"pipeline_parallel_degree": 2, "pipeline": {"schedule": "interleaved_zero_bubble", "microbatches": 4}}),
    Feature("unproven_cp_schedule", "config",
            lambda c, d: _pp(c) and c.pipeline.schedule not in CONTEXT_PARALLEL_SCHEDULES,
            lambda c, d: f"pipeline schedule {c.pipeline.schedule!r}",
            {"pipeline_parallel_degree": 2, "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 4}}),
    Feature("reshard", "config",
            lambda c, d: "reshard_after_forward" in c.model_fields_set and c.reshard_after_forward is not False,
            lambda c, d: f"reshard_after_forward={c.reshard_after_forward!r}", {"reshard_after_forward": True}),
    Feature("param_gather", "config", lambda c, d: c.parameter_gather.algorithm != "default",
            lambda c, d: f"parameter_gather.algorithm {c.parameter_gather.algorithm!r}",
            {"parameter_gather": {"algorithm": "int8"}}),
    Feature("hierarchical_gather", "config", lambda c, d: c.parameter_gather.hierarchical is not False,
            lambda c, d: f"parameter_gather.hierarchical: {c.parameter_gather.hierarchical!r}",
            {"parameter_gather": {"hierarchical": 2}}),
    Feature("ring_sync", "config", lambda c, d: c.gradient_sync.algorithm == "ring",
            lambda c, d: "gradient_sync.algorithm 'ring'", {"gradient_sync": {"algorithm": "ring"}}),
    Feature("fp8_gather", "config", lambda c, d: _fp8_gather(c), lambda c, d: "fp8.all_gather: true",
            {"fp8": {"all_gather": True}}),
    Feature("dp", "world", lambda c, d: d is not None and d.dp > 1,
            lambda c, d: f"{d.dp} data-parallel ranks per stage", {}),
    Feature("fp8_gather_unsharded", "world", lambda c, d: d is not None and _fp8_gather(c) and d.dp_shard == 1,
            lambda c, d: f"fp8.all_gather: true with dp_shard={d.dp_shard}", {"fp8": {"all_gather": True}},
            "fp8.all_gather: true where FSDP shards over one rank (dp_shard 1: the other degrees take every rank)"),
    Feature("trainer", "run", lambda c, d: False, lambda c, d: "SMPTrainer", {}),
    Feature("fsdp_units", "model", lambda c, d: False, lambda c, d: "FSDP units (built by smp.transform for this model)",
            {}, "FSDP units built at world 1: parameters not all float32 under mixed precision, smp's gradient-sync "
            "or parameter-gather collectives, cpu_offload, reshard_after_forward set"),
    Feature("experts", "model", lambda c, d: False, lambda c, d: "a mixture-of-experts model", {},
            "a mixture-of-experts model (modules holding [num_experts, ...] parameters)"),
    Feature("peft", "run", lambda c, d: False, lambda c, d: "a PEFT (LoRA) model", {}),
)}


@dataclass(frozen=True)
class Refusal:
    features: tuple[str, ...]  # in the order the message names them
    reason: str
    fix: str
    proof: str  # the test that shows the combination wrong (or refused, where it cannot run at all)

    def message(self, config: Any, dims: Any = None, degrees: str = "") -> str:
        names = " with ".join(FEATURES[f].setting(config, dims) for f in self.features)
        return f"{names} is not supported{f' ({degrees})' if degrees else ''}: {self.reason}; {self.fix}"


REFUSED = (
    Refusal(("ep", "tp"), "expert-parallel ranks come out of the sharded data-parallel ranks, and smp "
            "(like SMP v2) does not split experts and tensor-parallel layers over one mesh",
            "set tensor_parallel_degree: 1 or expert_parallel_degree: 1",
            "tests/expert_parallel/test_expert_parallel.py::test_degree_errors_list_every_degree"),
    Refusal(("ep", "cp"), "smp (like SMP v2) does not combine expert parallel with context parallel: the "
            "dispatch would route each rank's chunk of a row without the rest of the row",
            "set context_parallel_degree: 1 or expert_parallel_degree: 1",
            "tests/pipeline/test_pipeline_cp.py::test_unproven_compositions_are_refused"),
    Refusal(("ep", "selective_ac"), "selective checkpointing replays cached op outputs by invocation order, "
            "which the dispatch's data-dependent collectives break (full checkpointing recomputes them)",
            "use activation_checkpointing 'full' or 'none'",
            "tests/expert_parallel/test_expert_parallel.py::test_selective_checkpointing_is_refused"),
    Refusal(("cp", "unproven_cp_schedule"), "smp has proven context parallel under pipeline parallelism for "
            f"{sorted(CONTEXT_PARALLEL_SCHEDULES)} only", "set pipeline.schedule to one of them",
            "tests/pipeline/test_pipeline_cp.py::test_unproven_compositions_are_refused"),
    Refusal(("pp", "cp", "tp"), "smp has proven pipeline x context parallel alone only",
            "set tensor_parallel_degree: 1, context_parallel_degree: 1 or pipeline_parallel_degree: 1",
            "tests/pipeline/test_pipeline_compose.py::test_pp_x_cp_beyond_what_is_proven_is_refused_with_the_reason"),
    Refusal(("pp", "cp", "dp"), "smp has proven pipeline x context parallel with one data-parallel rank "
            "per stage only", "make pipeline_parallel_degree x context_parallel_degree the world size, or set "
            "context_parallel_degree: 1", "tests/core/test_composition.py::test_every_pair_is_checked_as_the_table_says"),
    Refusal(("sp", "pp"), "stages before the last hold no output head to gather the sequence back",
            "set tensor_parallel.sequence_parallel: false",
            "tests/pipeline/test_pipeline_compose.py::test_tp_options_that_do_not_compose_are_refused"),
    Refusal(("loss_parallel", "pp"), "the schedule computes the loss on the last stage outside "
            "smp.tensor_parallel.loss_parallel()", "set tensor_parallel.loss_parallel: false",
            "tests/pipeline/test_pipeline_compose.py::test_tp_options_that_do_not_compose_are_refused"),
    Refusal(("aux_loss", "pp"), "the load-balancing loss multiplies router statistics summed over every MoE "
            "layer and the whole batch, which lie on different stages and micro-batches",
            "turn it off (moe: {moe_load_balancing: none})",
            "tests/pipeline/test_pipeline_compose.py::test_load_balancing_loss_across_stages_is_refused"),
    Refusal(("aux_loss", "cp"), "context parallel splits each row's tokens over ranks, and the router "
            "statistics of a row's tokens would be multiplied per chunk, not over the row",
            "turn it off (moe: {moe_load_balancing: none})",
            "tests/expert_parallel/test_expert_parallel.py::test_aux_loss_refused_where_it_cannot_be_global"),
    Refusal(("compile", "split_backward"), "that schedule splits each backward into input and weight halves, "
            "which torch does not support under torch.compile",
            "set compile: false or pick gpipe / 1f1b / interleaved_1f1b / looped_bfs",
            "tests/pipeline/test_pipeline_config.py::test_composed_and_refused_degrees"),
    Refusal(("split_backward", "dp", "reshard"), "the schedule runs each micro-batch's weight gradients after "
            "later forwards, when FSDP has resharded the parameters they belong to (measured: gradients off by "
            "3e-2 at PP 2 x FSDP 2)", "leave reshard_after_forward unset (false under pipeline parallelism) or "
            "pick gpipe / 1f1b / interleaved_1f1b / looped_bfs",
            "tests/pipeline/test_pipeline_compose.py::test_split_backward_with_resharding_is_caught_and_refused"),
    Refusal(("param_gather", "ring_sync"), "the ring algorithm replaces FSDP's parameter all-gather too, which "
            "parameter_gather replaces", "use gradient_sync int8 / fp8 / default beside parameter_gather",
            "tests/sharding/test_parameter_gather.py::test_conflicting_settings_refused"),
    Refusal(("hierarchical_gather", "ring_sync"), "the ring algorithm replaces FSDP's parameter all-gather too, "
            "which parameter_gather replaces", "use gradient_sync int8 / fp8 / default beside parameter_gather",
            "tests/sharding/test_parameter_gather.py::test_conflicting_settings_refused"),
    Refusal(("hierarchical_gather", "tp"), "FSDP2 cannot reshard tensor-parallel (DTensor) parameters to the "
            "node's ranks after forward", "set hierarchical: false (algorithm int8 / fp8 still applies)",
            "tests/sharding/test_parameter_gather.py::test_conflicting_settings_refused"),
    Refusal(("hierarchical_gather", "reshard"), "parameter_gather.hierarchical sets the blocks' "
            "reshard_after_forward to the ranks per node", "remove reshard_after_forward, or set hierarchical: false",
            "tests/sharding/test_parameter_gather.py::test_conflicting_settings_refused"),
    Refusal(("hierarchical_gather", "pp"), "each pipeline stage stays gathered from its first forward to its "
            "last backward (reshard_after_forward false): there is no backward gather to keep inside the node",
            "set hierarchical: false (algorithm int8 / fp8 applies to each stage's gather)",
            "tests/sharding/test_parameter_gather.py::test_conflicting_settings_refused"),
    Refusal(("trainer", "pp"), "the Trainer runs the whole model's forward on every rank (compute_loss, "
            "prediction_step), while a pipelined model holds one stage per rank and trains only through "
            "smp.step(model, batch)", "set pipeline_parallel_degree: 1 (FSDP / tensor "
            "parallel work with the Trainer), or train with pipeline parallelism in a plain loop such as "
            "examples/finetune_causal_lm.py (docs/pipeline-parallel.md)",
            "tests/integrations/test_trainer.py::test_pipeline_parallel_is_refused_at_construction"),
)

# CUDA graphs (compile.cuda_graphs) replay each compiled block from fixed addresses, with nothing
# between the graphs but the step's own Python: what smp has proven is world 1 without FSDP units.
_UNITS = ("FSDP units free each block's gathered parameters and allocate them again (addresses the captured "
          "graphs do not read: torch records the graphs again each step), and run their hooks and collectives "
          "between the graphs; smp replays CUDA graphs where no FSDP unit is built (world 1)")
_NOT_CAPTURED = "its collectives run inside each block, and smp has not proven them captured in CUDA graphs"
_OFF = "or set compile.cuda_graphs: false"
_CUDA_GRAPH_PROOF = "tests/core/test_cuda_graphs.py::test_refused_layouts_name_the_key_and_the_fix"
CUDA_GRAPH_REFUSALS = tuple(Refusal(("cuda_graphs", feature), reason, f"{fix}, {_OFF}", proof) for feature, reason, fix, proof in (
    ("tp", _NOT_CAPTURED, "set tensor_parallel_degree: 1", _CUDA_GRAPH_PROOF),
    ("cp", _NOT_CAPTURED, "set context_parallel_degree: 1", _CUDA_GRAPH_PROOF),
    ("ep", "each expert receives a data-dependent number of tokens, known only after a host sync, which a CUDA "
     "graph cannot hold", "set expert_parallel_degree: 1", _CUDA_GRAPH_PROOF),
    ("pp", "the schedule runs each stage per micro-batch with sends and receives between them, which smp has not "
     "proven under CUDA graphs", "set pipeline_parallel_degree: 1", _CUDA_GRAPH_PROOF),
    ("offloading", "offloading copies saved activations to host memory from hooks outside the graphs, and a "
     "graph's outputs live in a pool the next replay overwrites", "set activation_offloading: false", _CUDA_GRAPH_PROOF),
    ("cpu_offload", _UNITS, "set cpu_offload: false", _CUDA_GRAPH_PROOF),
    ("param_cast", "smp's world-1 mixed precision casts each parameter into a new tensor at every forward, while the "
     "graphs read parameters at fixed addresses (torch would record them again each step)",
     "remove mixed_precision.param_dtype and run the step under torch.autocast (the casts then happen inside the "
     "graphs)", _CUDA_GRAPH_PROOF),
    ("param_gather", _UNITS, "set parameter_gather.algorithm: default", _CUDA_GRAPH_PROOF),
    ("hierarchical_gather", _UNITS, "set parameter_gather.hierarchical: false", _CUDA_GRAPH_PROOF),
    ("ring_sync", _UNITS, "set gradient_sync.algorithm: default", _CUDA_GRAPH_PROOF),
    ("reshard", _UNITS, "remove reshard_after_forward (at world 1 smp then builds no FSDP unit)", _CUDA_GRAPH_PROOF),
    # After the config's rows: a config refused on its own is refused for its own reason at any world size.
    ("dp", _UNITS, "run at world 1 (one data-parallel rank)", _CUDA_GRAPH_PROOF),
    ("fsdp_units", _UNITS, "keep the parameters float32 (train under torch.autocast rather than mixed_precision."
     "param_dtype), leave gradient_sync and parameter_gather at default",
     "tests/core/test_cuda_graphs.py::test_fsdp_units_at_world_1_are_refused"),
    ("experts", "each expert receives a data-dependent number of tokens, known only after a host sync, which a CUDA "
     "graph cannot hold", "compile: true alone still compiles the blocks",
     "tests/core/test_cuda_graphs.py::test_experts_are_refused"),
))
REFUSED += CUDA_GRAPH_REFUSALS

# fp8.all_gather (torchao's float8 all-gather of FSDP's weights): proven equal to the run without it
# under FSDP and HSDP alone; everything else that touches the gather, or is not proven with it, is
# refused.
_FP8_GATHER_PROOF = "tests/training/test_fp8.py::test_all_gather_refusals_name_the_key_and_the_fix"
_FP8_GATHER_OFF = "or set fp8.all_gather: false (fp8 itself composes with it)"
_FP8_GATHER_UNPROVEN = "smp has proven fp8.all_gather under FSDP and HSDP alone"
FP8_GATHER_REFUSALS = tuple(Refusal(("fp8_gather", feature), reason, f"{fix}, {_FP8_GATHER_OFF}", _FP8_GATHER_PROOF)
          for feature, reason, fix in (
    ("tp", "torchao takes a weight's float8 scale for the all-gather from its amax over the FSDP ranks alone, so "
     "each tensor-parallel shard would be cast with its own scale (measured: gradients 1e-2 off one process); "
     "whole-weight scales need torchao's precompute_float8_dynamic_scale_for_fsdp after every optimizer step, "
     "which smp does not own", "set tensor_parallel_degree: 1"),
    ("param_gather", "parameter_gather replaces FSDP's all-gather, which fp8.all_gather turns into a float8 one",
     "set parameter_gather.algorithm: default"),
    ("hierarchical_gather", "parameter_gather.hierarchical replaces FSDP's backward all-gather, which "
     "fp8.all_gather turns into a float8 one", "set parameter_gather.hierarchical: false"),
    ("ring_sync", "the ring algorithm replaces FSDP's parameter all-gather too, which fp8.all_gather turns into a "
     "float8 one", "use gradient_sync default"),
    ("cpu_offload", f"{_FP8_GATHER_UNPROVEN}: not with the shards in host memory", "set cpu_offload: false"),
    ("param_cast", "the float8 gather casts the float32 shard straight to float8, while the run without it casts "
     "to mixed_precision.param_dtype first and then to float8: the weights differ in float8 rounding (measured "
     "under bf16: gradients 7.7e-3 apart)",
     "remove mixed_precision.param_dtype (train under torch.autocast)"),
    ("reshard", f"{_FP8_GATHER_UNPROVEN}, with the default resharding", "remove reshard_after_forward"),
    ("cp", _FP8_GATHER_UNPROVEN, "set context_parallel_degree: 1"),
    ("ep", _FP8_GATHER_UNPROVEN, "set expert_parallel_degree: 1"),
    ("pp", _FP8_GATHER_UNPROVEN, "set pipeline_parallel_degree: 1"),
    ("compile", _FP8_GATHER_UNPROVEN, "set compile: false"),
    ("selective_ac", _FP8_GATHER_UNPROVEN, "use activation_checkpointing 'full' or 'none'"),
    ("offloading", _FP8_GATHER_UNPROVEN, "set activation_offloading: false"),
)) + (
    # After the config's rows: a config refused on its own is refused for its own reason at any world size.
    Refusal(("fp8_gather_unsharded",), "there is no FSDP all-gather to run in float8 where FSDP shards over one "
            "rank", "give FSDP more than one rank to shard over (dp_shard > 1), or set fp8.all_gather: false",
            _FP8_GATHER_PROOF),
)
REFUSED += FP8_GATHER_REFUSALS

# Combinations a test proves equal to one process (loss and gradients), beyond each feature alone.
PROVEN = {
    ("tp", "dp"): "tests/tensor_parallel/test_tensor_parallel.py::test_matches_single_process",
    ("tp", "hsdp"): "tests/tensor_parallel/test_tensor_parallel.py::test_hybrid_shard_with_tp",
    ("tp", "sp"): "tests/tensor_parallel/test_tensor_parallel.py::test_tp4_with_sequence_parallel",
    ("tp", "loss_parallel"): "tests/tensor_parallel/test_tensor_parallel.py::test_loss_parallel_keeps_logits_sharded",
    ("tp", "offloading"): "tests/training/test_activations.py::test_tensor_parallel_with_checkpointing_and_offloading",
    ("cp", "dp"): "tests/context_parallel/test_context_parallel.py::test_matches_single_process",
    ("cp", "tp"): "tests/context_parallel/test_context_parallel.py::test_with_tensor_parallel",
    ("cp", "hsdp"): "tests/context_parallel/test_context_parallel.py::test_with_hybrid_shard_and_mixed_precision_offload",
    ("ep", "dp"): "tests/expert_parallel/test_expert_parallel.py::test_matches_single_process",
    ("aux_loss", "dp"): "tests/expert_parallel/test_expert_parallel.py::test_fsdp_without_ep_makes_the_aux_loss_global",
    ("aux_loss", "ep"): "tests/training/test_step.py::test_router_loss_matches_one_process",
    ("pp", "dp"): "tests/pipeline/test_pipeline.py::test_pp2_x_fsdp2_matches_one_process",
    ("pp", "tp"): "tests/pipeline/test_pipeline_compose.py::test_pp2_x_tp2_matches_one_process",
    ("pp", "tp", "dp"): "tests/pipeline/test_pipeline_compose.py::test_pp2_x_tp2_x_fsdp2_matches_one_process",
    ("pp", "ep"): "tests/pipeline/test_pipeline_compose.py::test_pp2_x_ep2_mixtral_matches_one_process",
    ("pp", "cp"): "tests/pipeline/test_pipeline_cp.py::test_pp2_x_cp2_matches_one_process",
    ("split_backward", "dp"): "tests/pipeline/test_pipeline_compose.py::test_split_backward_schedules_x_fsdp2_match_one_process",
    ("pp", "compile"): "tests/pipeline/test_pipeline.py::test_offloading_and_compile_inside_stages",
    ("pp", "offloading"): "tests/pipeline/test_pipeline.py::test_offloading_and_compile_inside_stages",
    ("trainer", "tp", "dp"): "tests/integrations/test_trainer.py::test_tp_2_fsdp_2",
    ("trainer", "peft", "tp"): "tests/integrations/test_trainer.py::test_lora_under_tp_matches_single_process",
    ("trainer", "peft", "tp", "dp"): "tests/integrations/test_trainer.py::test_lora_under_tp_matches_single_process",
    ("hierarchical_gather", "dp"): "tests/sharding/test_parameter_gather.py::test_hierarchical_default_equals_flat_bitwise",
    ("hierarchical_gather", "hsdp"): "tests/sharding/test_parameter_gather.py::test_world8_hierarchical_equals_flat_bitwise",
    ("fp8_gather", "dp"): "tests/training/test_fp8.py::test_all_gather_matches_without_it_and_one_process",
    ("fp8_gather", "hsdp"): "tests/training/test_fp8.py::test_all_gather_matches_without_it_and_one_process",
}


def features(config: Any, dims: Any = None, run: tuple[str, ...] = ()) -> frozenset[str]:
    """The features `config` turns on (with `dims`, the mesh's too; `run`: "trainer", "peft")."""
    return frozenset(f.name for f in FEATURES.values() if f.on(config, dims)) | frozenset(run)


def refusal(present: frozenset[str] | set[str]) -> Refusal | None:
    """The first row of REFUSED whose features are all `present`, or None: allowed."""
    return next((r for r in REFUSED if set(r.features) <= set(present)), None)


def row(*names: str) -> Refusal:
    """The REFUSED row of exactly these features (for checks that need the model to decide)."""
    return next(r for r in REFUSED if set(r.features) == set(names))


def degrees(config: Any, world_size: int | None = None) -> str:
    """Every degree of `config`, for messages: the user sees which number to change."""
    text = ", ".join(f"{k}={getattr(config, k)}" for k in (
        "pipeline_parallel_degree", "tensor_parallel_degree", "hybrid_shard_degree", "context_parallel_degree",
        "expert_parallel_degree"))
    return text + (f", world_size={world_size}" if world_size is not None else "")


def check_config(config: Any) -> None:
    """Raise ValueError (the config validators turn it into ConfigError) for a refused set of
    the config's own features."""
    found = refusal(features(config))
    if found is not None:
        raise ValueError(found.message(config, degrees=degrees(config)))


def check_world(config: Any, dims: Any) -> None:
    """Raise ConfigError for a refused set that the mesh decides (e.g. data-parallel ranks)."""
    found = refusal(features(config, dims))
    if found is not None:
        raise ConfigError(found.message(config, dims, degrees(config, dims.world_size)))


def check_run(config: Any, run: tuple[str, ...]) -> None:
    """Raise ConfigError for a refused set including how smp runs (`run`: "trainer", "peft") or
    what smp.transform found in the model ("fsdp_units", "experts")."""
    found = refusal(features(config, None, run))
    if found is not None:
        raise ConfigError(found.message(config, degrees=degrees(config)))


def markdown_table() -> str:
    """docs/composition.md's table: every refused set and every proven combination (the tests
    that show them stay in the code: docs are for the user)."""
    def names(features: tuple[str, ...]) -> str:
        return " + ".join(f"`{f}`" for f in features)

    lines = ["| features | composes? | why / fix |", "|---|---|---|"]
    for r in REFUSED:
        lines.append(f"| {names(r.features)} | refused | {r.reason}; {r.fix} |")
    for combination in PROVEN:
        lines.append(f"| {names(combination)} | yes, proven equal to one process | |")
    return "\n".join(lines) + "\n"


def feature_legend() -> str:
    """What each feature name in the table means: the smallest config that turns it on."""
    import json

    lines = ["| feature | turned on by |", "|---|---|"]
    for f in FEATURES.values():
        how = f.meaning or {
            "world": "more than one data-parallel rank per stage (world size / other degrees)",
            "run": "SMPTrainer" if f.name == "trainer" else "a PEFT model under SMPTrainer",
        }.get(f.where)
        lines.append(f"| `{f.name}` | {how or '`' + json.dumps(f.example) + '`'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # prints the tables docs/composition.md holds
    print(feature_legend())
    print(markdown_table())
