"""Per-rank random-number-generator state: Python, NumPy, torch CPU and every CUDA device.

Each rank draws its own dropout masks (and data shuffles, if any), so exact resume needs each
rank's own generators back, not rank 0's. The states are plain values (ints, lists, tensors),
so they load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()  # this rank's device only: visible devices may differ on resume
    return state


def restore(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch_cpu"])
    if "numpy" in state:
        try:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])
