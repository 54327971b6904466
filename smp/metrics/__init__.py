"""Honest training metrics in one place: FLOPs per token, MFU, tokens/s, memory, and writers.

One formula (PaLM appendix B, as torchtitan and Megatron use it):

    FLOPs per token = 6 x (matmul parameters) + 12 x layers x (heads x head_dim) x seq_len

6 = 2 (multiply-add) x 3 (forward, input-grad, weight-grad) for every weight that takes part in
a matmul; embeddings are a lookup and do not count, the LM head does (once, even when tied).
The attention term is QK^T and AV, forward and backward, without discounting the causal mask
(the convention every published MFU uses, so numbers compare). MFU divides achieved FLOP/s by
the device's dense bf16 peak from `PEAK_FLOPS`; on a device not in the table (every CPU) it is
None and written as blank, never guessed.

One module per job: flops.py (the formula, MFU), devices.py (peak FLOP/s table, peak memory),
throughput.py (the per-step meter), experts.py (tokens per expert), writer.py (JSONL and
TensorBoard), plot.py (the PNG), progress.py (the bar).
"""

from __future__ import annotations

from smp.metrics.devices import PEAK_FLOPS, device_name, gather_per_rank, peak_flops, peak_memory_bytes
from smp.metrics.experts import ExpertLoadMeter
from smp.metrics.flops import ModelFlops, count_matmul_params, mfu, model_flops
from smp.metrics.plot import plot
from smp.metrics.progress import Progress
from smp.metrics.throughput import ThroughputMeter
from smp.metrics.writer import MetricsWriter, read_jsonl

__all__ = [
    "PEAK_FLOPS", "ExpertLoadMeter", "MetricsWriter", "ModelFlops", "Progress", "ThroughputMeter",
    "count_matmul_params", "device_name", "gather_per_rank", "mfu", "model_flops", "peak_flops",
    "peak_memory_bytes", "plot", "read_jsonl",
]
