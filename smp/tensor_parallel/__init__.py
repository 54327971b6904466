"""Tensor parallelism: plans as data, applied with torch.distributed.tensor.parallel.

`apply_tensor_parallel` (called by `smp.transform`) is the one entry point; `plans.py` says
where a model's plan comes from, `styles.py` what each style name does, `loss.py` how to
compute a causal-LM loss on vocab-sharded logits.
"""

from smp.tensor_parallel.apply import apply_tensor_parallel
from smp.tensor_parallel.loss import causal_lm_loss, loss_parallel
from smp.tensor_parallel.plans import SMP_TABLES, resolve_plan
from smp.tensor_parallel.styles import STYLE_NAMES

__all__ = ["SMP_TABLES", "STYLE_NAMES", "apply_tensor_parallel", "causal_lm_loss", "loss_parallel", "resolve_plan"]
