"""smp's configuration: one typed tree, loaded from a dict / JSON / YAML by `load_config`.

Everything a user can set lives here and is validated here, before any collective runs.
SageMaker model parallelism v2 spellings are accepted verbatim (as field names or aliases),
so an SMP v2 config works unchanged.
"""

from __future__ import annotations

import difflib
import json
import os
import reprlib
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from smp.composition import CONTEXT_PARALLEL_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, check_config  # noqa: F401 - re-exported
from smp.config_file import parse_json_config, read_config_file
from smp.errors import ConfigError  # raised by load_config; importable from here too


DTypeName = Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]

_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def canonical_dtype(name: str | None) -> str | None:
    return None if name is None else _DTYPE_ALIASES.get(name, name)


class _Strict(BaseModel):
    # extra="forbid": a misspelled key is an error, never silently ignored.
    # populate_by_name: both the field name and its alias (SMP v2 spelling) are accepted.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, frozen=True)


class MixedPrecisionConfig(_Strict):
    """FSDP2 MixedPrecisionPolicy. None keeps the parameter's own dtype."""

    param_dtype: DTypeName | None = None
    # fp32 reduction costs 2x the bytes of bf16 but keeps small gradient updates exact;
    # set "bf16" when the network is the bottleneck.
    reduce_dtype: DTypeName | None = "float32"
    output_dtype: DTypeName | None = None
    cast_forward_inputs: bool = True


class ActivationCheckpointingConfig(_Strict):
    # none: keep every activation (fastest, most memory). full: keep only each block's input and
    # recompute the block in backward (least memory, ~1 extra forward). selective: keep the
    # outputs of the ops in `save_ops`, recompute the rest (cheap pointwise ops and norms: a
    # small Llama keeps ~0.58 of `none` and re-runs no matmul; see BENCHMARKS.md).
    mode: Literal["none", "full", "selective"] = "none"
    # Checkpoint every n-th block (blocks 0, n, 2n, ...): 1 = all blocks (least memory, most
    # recompute); larger trades memory back for speed.
    every_n_layers: int = Field(default=1, ge=1)
    # Ops whose outputs selective checkpointing saves ("namespace.op" or "namespace.op.overload");
    # everything else is recomputed. Matmuls and attention are expensive to recompute and cheap
    # to keep relative to their cost; a reduce-scatter is saved so recompute never re-runs it.
    save_ops: list[str] = [
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "_c10d_functional.reduce_scatter_tensor",
    ]

    @field_validator("save_ops")
    @classmethod
    def _ops_exist(cls, value: list[str]) -> list[str]:
        from smp.activations.ops import resolve_op  # torch is imported only when ops are named

        for name in value:
            resolve_op(name)  # raises ValueError naming the op and how to spell it
        return value


class GradientSyncConfig(_Strict):
    # default: the process group's own collectives (NCCL / gloo). The others dispatch to
    # smp_collectives (kernels/): ring is the reference; int8/fp8 cut bytes ~4x at a bounded error.
    algorithm: Literal["default", "ring", "int8", "fp8"] = "default"
    # Lossy algorithms only: carry each step's quantisation error into the next step's gradient,
    # so no update is lost, only delayed (costs one fp32 gradient-sized buffer per module).
    error_feedback: bool = True
    # Hybrid sharding only (ignored without replicas): sync replicas through smp's all-reduce
    # hook instead of native HSDP. int8/fp8 compress just that (inter-node) hop; ring sends it
    # uncompressed (equals native HSDP; the reference).
    cross_replica: Literal["default", "ring", "int8", "fp8"] = "default"
    # Block size for quantisation scales: smaller = tighter error, more scale bytes (4 B / block:
    # 256 -> int8 sends 0.254x the fp32 bytes). A power of two (Triton tiles need one).
    block_size: int = Field(default=256, ge=16)

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"gradient_sync.block_size must be a power of two (e.g. 256), got {value}")
        return value


class ParameterGatherConfig(_Strict):
    # default: FSDP2's own all-gather (exact). int8/fp8: each unit's shard is sent as 1-byte
    # block-quantised codes + an fp32 scale per block and decoded into the parameter dtype
    # (~0.51x the bf16 bytes; per value within absmax/254 of its block (int8) or 2**-4 relative
    # (fp8)). Only the gathered copy is lossy; the optimizer updates the exact sharded parameters.
    algorithm: Literal["default", "int8", "fp8"] = "default"
    # Values per scale: smaller = tighter error, more scale bytes (4 B / block). A power of two.
    block_size: int = Field(default=256, ge=16)
    # hpZ: true (ranks per node from $LOCAL_WORLD_SIZE) or the number of consecutive ranks of a
    # node: after forward each block stays sharded over its node's ranks and backward gathers
    # there, exact, instead of over every shard rank (memory: 1/k of a block's parameters per rank).
    hierarchical: Union[bool, int] = False

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"parameter_gather.block_size must be a power of two (e.g. 256), got {value}")
        return value

    @field_validator("hierarchical")
    @classmethod
    def _group_size(cls, value: bool | int) -> bool | int:
        if not isinstance(value, bool) and value < 2:
            raise ValueError(f"parameter_gather.hierarchical is true, false or the ranks per node (>= 2), got {value}")
        return value


FP8_GATHER_ON_META = (
    "fp8.all_gather wraps each float8 layer's weight in torchao's float8-castable class, which smp's "
    "initialisation of a meta-device model (delayed_param_initialization, or a model built on the meta device) "
    "does not handle; build the model on the CPU or the device (delayed_param_initialization: false), or set "
    "fp8.all_gather: false"
)


class FP8Config(_Strict):
    """FP8 training through torchao's float8 (smp/fp8.py): Linear matmuls in float8 with dynamic
    scales; needs CUDA with compute capability >= 8.9 and torchao (refused at smp.init otherwise)."""

    # tensorwise: one scale per tensor (fastest); rowwise: one per row (closer to bf16, slower).
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    # FSDP all-gathers the converted layers' weights in float8 (1 byte per element, half of
    # bf16's), cast with the whole weight's scale before the gather (torchao's
    # enable_fsdp_float8_all_gather). Off by default: it pays where the all-gather's bytes set
    # the step time (many ranks, slow links); tensorwise under FSDP / HSDP only (smp/composition.py).
    all_gather: bool = False

    @model_validator(mode="after")
    def _all_gather_is_tensorwise(self) -> "FP8Config":
        if self.all_gather and self.recipe != "tensorwise":
            raise ValueError(
                f"fp8.all_gather casts each weight with one scale for the whole tensor before FSDP gathers it, "
                f"which torchao provides for recipe 'tensorwise' only, not {self.recipe!r}; set recipe: "
                "tensorwise or all_gather: false"
            )
        return self


class TensorParallelConfig(_Strict):
    # Norms (and dropout) between attention/MLP run on a 1/tp slice of the sequence: activations
    # there shrink by tp, for an all-gather + reduce-scatter in place of each all-reduce.
    sequence_parallel: bool = False
    # The LM head keeps its logits vocab-sharded and cross-entropy runs on the shards (compute
    # the loss and call backward inside `smp.tensor_parallel.loss_parallel()`).
    loss_parallel: bool = False
    # Module-name pattern ("layers.*.mlp.up_proj") -> style name (smp.tensor_parallel.STYLE_NAMES:
    # "colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "packed_qkv_colwise",
    # ...). Overrides the model's own plan; `smp.transform(model, tp_plan=...)` overrides this.
    plan: dict[str, str] | None = None


# Backends under which torch replays CUDA graphs (smp/compile.py maps each to its torch.compile call).
CUDA_GRAPH_BACKENDS = ("inductor", "aot_eager", "cudagraphs")


class CompileConfig(_Strict):
    # torch.compile each block (smp/compile.py). Off by default: the first steps pay the compile
    # time (tens of seconds for a Llama block with inductor), and not every model traces.
    enabled: bool = False
    # A torch.compile backend (torch.compiler.list_backends()): "inductor" generates fused
    # kernels; "aot_eager" traces the same graphs without code generation (CPU tests).
    backend: str = "inductor"
    # Replay each compiled block's forward and backward as CUDA graphs (torch's cudagraph trees:
    # inductor's mode="reduce-overhead"; with aot_eager, torch's "cudagraphs" backend). Pays where
    # the host sets the step's pace (small or medium models on a fast GPU) and shapes are static:
    # a new batch shape records new graphs (one more copy of its activations in the graphs' pool).
    # CUDA only, world 1 without FSDP units (smp/composition.py says what else it refuses).
    # `compile: {cuda_graphs: true}` turns compile on too.
    cuda_graphs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _cuda_graphs_compile(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        graphs, backend = data.get("cuda_graphs"), data.get("backend")
        if backend == "cudagraphs":  # torch's own CUDA-graphs backend: the same as cuda_graphs over aot_eager
            if graphs is False:
                raise ValueError("compile.backend 'cudagraphs' replays CUDA graphs; remove cuda_graphs: false, "
                                 "or pick backend 'aot_eager' to compile without them")
            if data.get("enabled") is True or graphs is True:
                data, graphs = {**data, "cuda_graphs": True}, True
        if graphs is True:
            if data.get("enabled") is False:
                raise ValueError("compile.cuda_graphs: true replays compiled blocks, but compile.enabled is false; "
                                 "remove enabled: false, or set cuda_graphs: false")
            data = {**data, "enabled": True}
        return data

    @field_validator("backend")
    @classmethod
    def _backend_exists(cls, value: str) -> str:
        import torch.compiler  # torch is imported only when a backend is named

        known = torch.compiler.list_backends(exclude_tags=())
        if value not in known:
            raise ValueError(f"unknown torch.compile backend {value!r}; one of {', '.join(known)}")
        return value

    @model_validator(mode="after")
    def _cuda_graphs_backend(self) -> "CompileConfig":
        if self.cuda_graphs and self.backend not in CUDA_GRAPH_BACKENDS:
            raise ValueError(
                f"compile.cuda_graphs needs backend {' / '.join(CUDA_GRAPH_BACKENDS)} (torch captures CUDA graphs "
                f"only behind these), got backend {self.backend!r}; set backend: inductor, or cuda_graphs: false"
            )
        return self


class ContextParallelConfig(_Strict):
    """How attention runs across the `context_parallel_degree` chunks of each sequence
    (docs/context-parallel.md)."""

    # ring: K/V blocks travel around the cp ring, one step per rank, overlapped with the
    # attention of the block in hand (K/V memory 2/cp of the sequence). allgather: one all-gather
    # of K/V, then attention (the whole sequence's K/V on every rank; fewer, larger messages).
    # ulysses: all-to-all over heads, each rank attends heads/cp of the heads over the whole
    # sequence (bytes per rank flat in cp; heads and key/value heads must divide by cp x tp).
    algorithm: Literal["ring", "allgather", "ulysses"] = "ring"
    # Causal attention: split each sequence into 2 x cp chunks, rank i gets chunks i and
    # 2cp-1-i, so every rank does the same attention work (else rank cp-1 does ~2cp-1 times
    # rank 0's). Needs a sequence length divisible by 2 x cp.
    load_balance: bool = True


class MoEConfig(_Strict):
    """Mixture-of-experts options (the `moe:` section; SMP v2's MoEConfig keys). The load-balancing
    keys apply to any MoE model smp.transform shards, capacity_factor and plan when
    expert_parallel_degree > 1; docs/expert-parallel.md says what each does."""

    # aux_loss: the model's own load-balancing loss (its router logits are returned), computed
    # from the router statistics of the whole data-parallel batch, as one process would.
    # none: no balancing loss. None keeps the model's own `output_router_logits` setting.
    # SMP v2's sinkhorn / balanced routing are not implemented: refused, never ignored.
    moe_load_balancing: Literal["aux_loss", "none", "sinkhorn", "balanced"] | None = None
    # The load-balancing loss weight; None keeps the model's own `router_aux_loss_coef`.
    moe_aux_loss_coeff: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # Router z-loss weight: not implemented, so only 0 is accepted.
    moe_z_loss_coeff: float = Field(default=0.0, ge=0)
    # Tokens go to the ranks of their experts by all-to-all, within each expert-parallel group;
    # SMP v2's global shuffle and its all-gather dispatcher are not implemented.
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = Field(default=True, alias="moe_all2all_dispatcher")
    # None: no token is dropped. c: each expert takes at most ceil(c x tokens x top_k / experts)
    # of a rank's token choices per layer; the overflow contributes zero and is counted
    # (smp.expert_parallel.expert_load).
    capacity_factor: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Module-name pattern -> "ep_dispatch_experts" (an experts module) or "grouped_gemm" (one
    # of its [num_experts, ...] parameters). Overrides the model's own `base_model_ep_plan`.
    plan: dict[str, str] | None = None

    @field_validator("moe_load_balancing")
    @classmethod
    def _balancing_implemented(cls, value: str | None) -> str | None:
        if value in ("sinkhorn", "balanced"):
            raise ValueError(f"moe_load_balancing={value!r} is not implemented by smp; use 'aux_loss' or 'none'")
        return value

    @field_validator("moe_z_loss_coeff")
    @classmethod
    def _z_loss_implemented(cls, value: float) -> float:
        if value:
            raise ValueError("the router z-loss is not implemented by smp; set moe_z_loss_coeff: 0")
        return value

    @field_validator("global_token_shuffle")
    @classmethod
    def _shuffle_implemented(cls, value: bool) -> bool:
        if value:
            raise ValueError("global_token_shuffle is not implemented by smp; set it to false")
        return value

    @field_validator("moe_all_to_all_dispatcher")
    @classmethod
    def _all_to_all_only(cls, value: bool) -> bool:
        if not value:
            raise ValueError("smp dispatches tokens by all-to-all only; set moe_all_to_all_dispatcher: true")
        return value


# torch.distributed.pipelining's schedules by smp's lower-case names (docs/pipeline-parallel.md).
PIPELINE_SCHEDULES = (
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev",
)
# SMP v1's `pipeline: simple | interleaved`: simple ran every micro-batch's forward, then every
# backward (GPipe); interleaved started each backward as soon as it could (1F1B on one stage per
# rank; not the virtual-stage "interleaved 1F1B").
PIPELINE_SCHEDULE_ALIASES = {"simple": "gpipe", "interleaved": "1f1b"}
# Schedules that run one stage per rank, and the V schedules that run exactly two (stage r and
# 2p-1-r on rank r); the others loop stages r, r+p, r+2p, ... over the ranks.
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")
# SPLIT_BACKWARD_SCHEDULES (torch refuses them under torch.compile) and CONTEXT_PARALLEL_SCHEDULES
# (proven under context parallel) live in smp/composition.py, whose table reads them.


class PipelineConfig(_Strict):
    """How the `pipeline_parallel_degree` stages run (the `pipeline:` section; a string is short
    for `{schedule: ...}`, SMP v1's `pipeline: interleaved`)."""

    schedule: Literal[PIPELINE_SCHEDULES] = "1f1b"  # type: ignore[valid-type]
    # Micro-batches per step (SMP v1's key). More shrinks the bubble ((p-1)/(m+p-1) for gpipe and
    # 1f1b) but makes each micro-batch smaller; gpipe holds all m micro-batches' activations, 1f1b
    # at most p. None: one per stage (the fewest every schedule accepts).
    microbatches: int | None = Field(default=None, ge=1)
    # Stages each rank holds (virtual stages). None: 1 for gpipe / 1f1b, 2 for the others.
    stages_per_rank: int | None = Field(default=None, ge=1)
    # auto: contiguous decoder layers per stage, balanced by parameter count (the embedding on
    # the first stage, the final norm and head on the last). A list: the index of the first layer
    # of every stage after the first ([2] puts layers 0-1 on stage 0, the rest on stage 1).
    split: Union[Literal["auto"], list[int]] = "auto"

    @field_validator("schedule", mode="before")
    @classmethod
    def _schedule_alias(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.lower()
            if value not in PIPELINE_SCHEDULES and value not in PIPELINE_SCHEDULE_ALIASES:
                close = difflib.get_close_matches(value, PIPELINE_SCHEDULES, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"unknown pipeline schedule {value!r}{hint} (one of {', '.join(PIPELINE_SCHEDULES)}, "
                    f"or SMP v1's 'simple' / 'interleaved')"
                )
            return PIPELINE_SCHEDULE_ALIASES.get(value, value)
        return value

    @field_validator("split")
    @classmethod
    def _split_increasing(cls, value: Any) -> Any:
        if isinstance(value, list) and (
            any(i < 1 for i in value) or any(b <= a for a, b in zip(value, value[1:]))
        ):
            raise ValueError(
                f"pipeline.split lists the first layer of each stage after the first: increasing "
                f"indices >= 1, e.g. [2] or [4, 8, 12]"
            )
        return value

    def local_stages(self) -> int:
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 1 if self.schedule in SINGLE_STAGE_SCHEDULES else 2


class SMPConfig(_Strict):
    # --- parallel degrees (SMP v2 keys) ---
    # 0: shard over all data-parallel ranks; 1: replicate (no sharding);
    # k: shard inside groups of k, replicate across groups (HSDP).
    hybrid_shard_degree: int = Field(default=0, ge=0)
    tensor_parallel_degree: int = Field(default=1, ge=1)
    context_parallel_degree: int = Field(default=1, ge=1)
    expert_parallel_degree: int = Field(default=1, ge=1)
    # Pipeline stages (SMP v1's key): the outermost mesh axis, each stage a contiguous slice of
    # the model's layers (docs/pipeline-parallel.md).
    pipeline_parallel_degree: int = Field(default=1, ge=1)

    # --- activations ---
    # Offload each block's saved activations to host memory (SMP v2: sm_activation_offloading).
    activation_offloading: bool = Field(default=False, alias="sm_activation_offloading")
    # How many layers' offloaded activations are brought back ahead of backward. Larger hides
    # more copy latency, costs horizon x (one layer's activations) of device memory.
    activation_loading_horizon: int = Field(default=2, ge=1)
    # Saved tensors smaller than this stay on the device: their copy costs more in launch
    # latency than it frees (norm statistics, masks). Lower it for tiny models and tests.
    # A config that says `sm_activation_offloading` (SMP v2's key) and not this one gets 0:
    # SMP v2 offloads every checkpointed activation (`_smp_v2_offloading` below).
    activation_offload_min_bytes: int = Field(default=1 << 20, ge=0)
    activation_checkpointing: ActivationCheckpointingConfig = ActivationCheckpointingConfig()

    # --- misc SMP v2 keys ---
    # torch.manual_seed's range (numpy is seeded with it modulo 2**32): a larger seed would
    # pass here and fail in smp.init.
    random_seed: int = Field(default=12345, ge=0, le=2**64 - 1)
    fsdp_cache_flush_warnings: bool = True
    allow_empty_shards: bool = True

    # --- sharding (smp's own keys) ---
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
    # Keep parameters (and grads, optimizer state) in host memory; saves device memory at the
    # cost of a host<->device copy per unit per step.
    cpu_offload: bool = False
    # Build the model under `smp.init_context()` on the meta device; `transform` materialises
    # it shard by shard. Models that already hold meta parameters are materialised regardless.
    delayed_param_initialization: bool = Field(default=False, alias="delayed_parameter_initialization")
    # True frees the gathered parameters after forward (least memory, one more all-gather in
    # backward); False keeps them (ZeRO-2-like, faster); an int reshards to a smaller group.
    reshard_after_forward: Union[bool, int] = True
    # Class names of the modules that become FSDP units. Empty: a HF model's
    # `_no_split_modules`, else the children of the model's nn.ModuleLists.
    shard_modules: list[str] = []

    tensor_parallel: TensorParallelConfig = TensorParallelConfig()
    context_parallel: ContextParallelConfig = ContextParallelConfig()
    gradient_sync: GradientSyncConfig = GradientSyncConfig()
    parameter_gather: ParameterGatherConfig = ParameterGatherConfig()
    compile: CompileConfig = CompileConfig()
    moe: MoEConfig = MoEConfig()
    pipeline: PipelineConfig = PipelineConfig()
    fp8: Union[FP8Config, None] = None  # absent: no float8 training

    # --- runtime ---
    backend: Literal["nccl", "gloo"] | None = None
    # Collective timeout: a rank that dies mid-step makes the others fail after this long
    # instead of hanging forever.
    # Bounded above (about 31 years): torch turns it into a timedelta, which inf would overflow.
    collective_timeout_seconds: float = Field(default=600.0, gt=0, le=1e9)

    @model_validator(mode="before")
    @classmethod
    def _smp_v2_offloading(cls, data: Any) -> Any:
        """A config in SMP v2's terms offloads as SMP v2 does: every saved activation."""
        if isinstance(data, dict) and "sm_activation_offloading" in data and "activation_offload_min_bytes" not in data:
            data = {**data, "activation_offload_min_bytes": 0}
        return data

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _ac_from_string(cls, value: Any) -> Any:
        # `activation_checkpointing: full` is the common spelling; the object form adds options.
        if isinstance(value, str):
            return {"mode": value}
        if isinstance(value, bool):
            return {"mode": "full" if value else "none"}
        return value

    @field_validator("gradient_sync", mode="before")
    @classmethod
    def _sync_from_string(cls, value: Any) -> Any:
        return {"algorithm": value} if isinstance(value, str) else value

    @field_validator("parameter_gather", mode="before")
    @classmethod
    def _gather_from_string(cls, value: Any) -> Any:
        return {"algorithm": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _fp8_gather_proven(self) -> "SMPConfig":
        # What fp8.all_gather composes with is in smp/composition.py's table; these values (no
        # feature there) are refused here. smp.transform refuses a model built on the meta device.
        if self.fp8 is None or not self.fp8.all_gather:
            return self
        if self.delayed_param_initialization:
            raise ValueError(FP8_GATHER_ON_META)
        sync = self.gradient_sync
        if sync.algorithm in ("int8", "fp8") or sync.cross_replica != "default":  # ring: the table's row
            raise ValueError(
                f"fp8.all_gather with gradient_sync {{algorithm: {sync.algorithm}, cross_replica: "
                f"{sync.cross_replica}}}: smp has proven fp8.all_gather with FSDP's own gradient reduction only; "
                "set gradient_sync: default, or set fp8.all_gather: false"
            )
        return self

    @model_validator(mode="after")
    def _hierarchical_gather_reshards(self) -> "SMPConfig":
        # What parameter_gather composes with is in smp/composition.py's table; this one value
        # (reshard_after_forward: false, no feature there) is refused here.
        if self.parameter_gather.hierarchical is not False and self.reshard_after_forward is False:
            raise ValueError(
                "parameter_gather.hierarchical keeps each block's parameters sharded inside the node after forward, "
                "but reshard_after_forward: false keeps them whole (no backward gather to keep in the node); "
                "remove reshard_after_forward, or set hierarchical: false"
            )
        return self

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_from_bool(cls, value: Any) -> Any:
        # `compile: true` turns it on with the default backend; the object form picks one
        # (and `{cuda_graphs: true}` turns it on with CUDA graphs).
        return {"enabled": value} if isinstance(value, bool) else value

    @field_validator("pipeline", mode="before")
    @classmethod
    def _pipeline_from_string(cls, value: Any) -> Any:
        return {"schedule": value} if isinstance(value, str) else value

    @field_validator("reshard_after_forward", mode="before")
    @classmethod
    def _reshard_value(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("an int reshard_after_forward is a group size and must be >= 1")
        return value

    @model_validator(mode="after")
    def _pipeline_fits(self) -> "SMPConfig":
        if self.pipeline_parallel_degree > 1:
            check_pipeline(self.pipeline, self.pipeline_parallel_degree)
        return self

    @model_validator(mode="after")
    def _composes(self) -> "SMPConfig":
        # Which features combine is one table (smp/composition.py); what needs the world size
        # is checked against it by ParallelDims.from_config.
        check_config(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def check_pipeline(pipe: PipelineConfig, pp: int, batch_size: int | None = None) -> None:
    """Raise ValueError naming the degrees when `pipe` cannot run over `pp` ranks (and, when
    known, a batch of `batch_size` rows). The same rules torch's schedules enforce, said first."""
    local = pipe.local_stages()
    stages = pp * local
    m = pipe.microbatches if pipe.microbatches is not None else stages
    where = (
        f"(pipeline_parallel_degree={pp}, pipeline.schedule={pipe.schedule!r}, "
        f"pipeline.stages_per_rank={local}, pipeline.microbatches={m})"
    )
    if pipe.schedule in SINGLE_STAGE_SCHEDULES and local != 1:
        raise ValueError(
            f"pipeline.schedule {pipe.schedule!r} runs one stage per rank {where}; set stages_per_rank: 1 "
            f"or pick interleaved_1f1b / looped_bfs / interleaved_zero_bubble for virtual stages"
        )
    if pipe.schedule in V_SCHEDULES and local != 2:
        raise ValueError(
            f"pipeline.schedule {pipe.schedule!r} runs a V of exactly 2 stages per rank {where}; set "
            f"stages_per_rank: 2"
        )
    if pipe.schedule in ("1f1b", "dualpipev") and m < stages:
        raise ValueError(
            f"pipeline.schedule {pipe.schedule!r} needs at least one micro-batch per stage: microbatches={m} "
            f"< {stages} stages {where}; set microbatches >= {stages}"
        )
    if pipe.schedule in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            raise ValueError(
                f"pipeline.schedule {pipe.schedule!r} runs micro-batches in rounds of "
                f"pipeline_parallel_degree: microbatches={m} must be a multiple of {rounds} = "
                f"max(1, microbatches // {pp}) {where}; e.g. microbatches: {rounds * pp}"
            )
    if isinstance(pipe.split, list) and len(pipe.split) != stages - 1:
        raise ValueError(
            f"pipeline.split lists {len(pipe.split)} stage boundaries, but {stages} stages need "
            f"{stages - 1} {where}"
        )
    if batch_size is not None and batch_size % m:
        raise ValueError(
            f"pipeline.microbatches={m} does not divide the batch of {batch_size} rows {where}: every "
            f"micro-batch must hold the same number of rows; pick a batch size that is a multiple of {m}"
        )


# ----------------------------------------------------------------------------------------------
# Loading


def _known_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(name)
        if field.alias:
            keys.append(field.alias)
    return keys


def _submodel_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    model: type[BaseModel] = SMPConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            by_alias = {f.alias: f for f in model.model_fields.values() if f.alias}
            field = by_alias.get(part)
        annotation = getattr(field, "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            break
    return model


def _format_error(err: dict[str, Any]) -> str:
    loc = tuple(p for p in err["loc"] if not str(p).startswith(("function-", "literal")))
    key = ".".join(str(p) for p in loc) if loc else "<config>"
    if err["type"] == "extra_forbidden":
        parent, name = loc[:-1], str(loc[-1])
        for field_name, field in _submodel_at(parent).model_fields.items():
            if field.alias and name in (field_name, field.alias):  # a known key: the other spelling came too
                return (f"'{_clip(key)}' is given twice, as '{field_name}' and as its other spelling "
                        f"'{field.alias}'; keep one")
        close = difflib.get_close_matches(name, _known_keys(_submodel_at(parent)), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return f"unknown key '{_clip(key)}'{hint}"
    message = err["msg"].removeprefix("Value error, ")
    return f"'{_clip(key)}': {message} (got {_clip(_INPUT_REPR.repr(err.get('input')))})"


# A value quoted in an error is cut short: the input may be megabytes (or an alias bomb).
_INPUT_REPR = reprlib.Repr()
_INPUT_REPR.maxlevel, _INPUT_REPR.maxstring, _INPUT_REPR.maxother, _INPUT_REPR.maxlong = 3, 120, 120, 60
# More errors than this in one config are counted, not listed.
_MAX_ERRORS_SHOWN = 10


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


ConfigSource = Union[SMPConfig, dict, str, os.PathLike, None]


def load_config(source: ConfigSource = None) -> SMPConfig:
    """A validated SMPConfig from a dict, a .json/.yaml/.yml path, an SMPConfig, or None.

    None reads the environment (`_config_from_environment`), else gives the defaults.
    Every problem raises ConfigError naming the key.
    """
    if isinstance(source, SMPConfig):
        return source
    if source is None:
        return _config_from_environment()
    if isinstance(source, (str, os.PathLike)):
        source = read_config_file(Path(source))  # bounded: size, aliases, depth, duplicate keys
    if not isinstance(source, dict):
        raise ConfigError(f"smp config must be a dict, a file path or None, not {type(source).__name__}")
    try:
        return SMPConfig.model_validate(source)
    except ValidationError as e:
        errors = e.errors()
        lines = [_format_error(err) for err in errors[:_MAX_ERRORS_SHOWN]]
        if len(errors) > _MAX_ERRORS_SHOWN:
            lines.append(f"... and {len(errors) - _MAX_ERRORS_SHOWN} more errors")
        raise ConfigError("invalid smp config:\n  " + "\n  ".join(lines)) from None


# How SageMaker delivers the estimator's `mp_parameters` (SMP v2's config) to the script: JSON.
SAGEMAKER_CONFIG_ENV = "SM_HP_MP_PARAMETERS"


def _config_from_environment() -> SMPConfig:
    """The config $SM_HP_MP_PARAMETERS holds (JSON), else the file $SMP_CONFIG names, else the
    defaults. Both set is allowed only when they say the same (docs/migrating-from-smp-v2.md#config)."""
    env_path = os.environ.get("SMP_CONFIG")
    from_path = load_config(env_path if env_path else {})
    raw = os.environ.get(SAGEMAKER_CONFIG_ENV)
    if not raw:
        return from_path
    # The config file's bounds: size, nesting depth (a RecursionError otherwise), duplicate keys.
    data = parse_json_config(raw, f"${SAGEMAKER_CONFIG_ENV}")
    try:
        from_sagemaker = load_config(data)
    except ConfigError as e:
        raise ConfigError(f"${SAGEMAKER_CONFIG_ENV}: {e}") from None
    if env_path and from_sagemaker != from_path:
        raise ConfigError(
            f"two different configs in the environment: ${SAGEMAKER_CONFIG_ENV} (SageMaker's "
            f"mp_parameters: {raw[:200]}) and $SMP_CONFIG={env_path!r}; unset one of them, or make "
            f"them say the same"
        )
    return from_sagemaker


def json_schema() -> dict[str, Any]:
    """JSON schema of the config, for editors (`smp check --schema`)."""
    return SMPConfig.model_json_schema(by_alias=False)
