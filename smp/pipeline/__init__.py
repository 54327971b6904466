"""Pipeline parallelism: the model split into stages over the "pp" mesh axis, run by
torch.distributed.pipelining's schedules (docs/pipeline-parallel.md). Train with `smp.step`;
`step` and `evaluate` here are kept for one release."""

from smp.pipeline.evaluate import evaluate
from smp.pipeline.schedule import SCHEDULE_CLASSES, PipelinedModel, PipelineOutput, build_pipeline, step
from smp.pipeline.split import StageInfo, build_stage_module, check_layer_chain, find_parts, plan_split, stage_indices

__all__ = [
    "SCHEDULE_CLASSES",
    "PipelineOutput",
    "PipelinedModel",
    "StageInfo",
    "build_pipeline",
    "build_stage_module",
    "check_layer_chain",
    "evaluate",
    "find_parts",
    "plan_split",
    "stage_indices",
    "step",
]
