"""Tensor parallelism: plans as data, applied with torch.distributed.tensor.parallel.

`apply_tensor_parallel` (called by `smp.transform`) is the one entry point; `tp_plan.py` says
where a model's plan comes from and what it names, `rules.py` what it implies beyond its entries,
`registry.py` each style name's facts and the `styles.py` class it builds, `loss.py` how to
compute a causal-LM loss on vocab-sharded logits. Only `loss_parallel()` here reads smp's run.
"""

from __future__ import annotations

import contextlib

from smp import runtime
from smp.tensor_parallel.apply import apply_tensor_parallel
from smp.tensor_parallel.loss import causal_lm_loss, loss_parallel_if
from smp.tensor_parallel.registry import STYLE_NAMES
from smp.tensor_parallel.tp_plan import SMP_TABLES, resolve_plan

__all__ = ["SMP_TABLES", "STYLE_NAMES", "apply_tensor_parallel", "causal_lm_loss", "loss_parallel", "resolve_plan"]


def loss_parallel() -> contextlib.AbstractContextManager[None]:
    """Wrap the loss computation *and* `backward()` when logits may be vocab-sharded: on when
    smp runs with tensor_parallel_degree > 1 and `tensor_parallel.loss_parallel`, else it does
    nothing (see loss.py)."""
    st = runtime.current() if runtime.is_initialized() else None
    return loss_parallel_if(st is not None and st.dims.tp > 1 and st.config.tensor_parallel.loss_parallel)
