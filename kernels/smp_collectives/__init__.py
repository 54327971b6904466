"""smp_collectives: gradient-synchronisation collectives for FSDP2, usable without smp.

- `ring`: bandwidth-optimal reduce-scatter / all-gather / all-reduce over point-to-point;
- `quantized_reduce_scatter` / `QuantizedReduceScatter`: int8 / fp8 block-quantised
  reduce-scatter with fp32 scales and optional error feedback;
- `CrossReplicaAllReduce`: an FSDP2 all-reduce hook that compresses only the cross-replica hop;
- `ParameterAllGather` / `quantized_parameter_all_gather`: int8 / fp8 block-quantised parameter
  all-gather (ZeRO++'s qwZ), decoded straight into the parameter dtype;
- `quantize` / `dequantize` / `dequantize_accumulate`: fused Triton kernels on GPUs, bitwise
  equal pure-torch paths elsewhere;
- `counters`: bytes each rank sent, per collective.

Install on a module built with `fully_shard`:
    module.set_custom_reduce_scatter(QuantizedReduceScatter("int8"))
"""

from smp_collectives import counters, ring
from smp_collectives._version import __version__
from smp_collectives.comms import (
    CrossReplicaAllReduce,
    QuantizedReduceScatter,
    RingAllGather,
    RingReduceScatter,
    fp32_bytes_bound,
    quantized_all_gather,
    quantized_bytes,
    quantized_reduce_scatter,
)
from smp_collectives.error_feedback import Residual
from smp_collectives.formats import KINDS
from smp_collectives.parameter_gather import ParameterAllGather, quantized_parameter_all_gather
from smp_collectives.quantization import dequantize, dequantize_accumulate, error_bound, quantize

__all__ = [
    "KINDS",
    "ParameterAllGather",
    "CrossReplicaAllReduce",
    "QuantizedReduceScatter",
    "Residual",
    "RingAllGather",
    "RingReduceScatter",
    "counters",
    "dequantize",
    "dequantize_accumulate",
    "error_bound",
    "fp32_bytes_bound",
    "quantize",
    "quantized_all_gather",
    "quantized_bytes",
    "quantized_parameter_all_gather",
    "quantized_reduce_scatter",
    "ring",
]
