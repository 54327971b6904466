"""Per-step metrics written to JSONL (always) and TensorBoard (when installed), and read back."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch


class MetricsWriter:
    """Per-step metrics to JSONL (always) and TensorBoard (when installed); a PNG plot at the end
    (when matplotlib is installed). Write from rank 0 only: pass enabled=False on other ranks."""

    def __init__(self, out_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True,
                 append: bool = False):
        self.out_dir = os.fspath(out_dir)
        self.enabled = enabled
        self.path = os.path.join(self.out_dir, "metrics.jsonl")
        self._file = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(self.out_dir, exist_ok=True)
        self._file = open(self.path, "a" if append else "w", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(self.out_dir, "tensorboard"))
            except ImportError:  # tensorboard is optional
                self._tb = None

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        # A NaN loss or inf grad norm is exactly when the log matters: write it as null
        # (blank, like an unknown MFU) rather than fail the run.
        # Unknown values (MFU on a CPU) are null too: blank, not zero.
        values = {k: _finite_or_none(v) for k, v in values.items()}
        record = {"step": step, "time": time.time(), **values}
        self._file.write(json.dumps(record, default=_json_default, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to the metrics file")


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
