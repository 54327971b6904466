"""Loss and throughput against step, as a PNG (when matplotlib is installed)."""

from __future__ import annotations

import os
from typing import Any, Iterable


def plot(records: Iterable[dict[str, Any]], out_png: str | os.PathLike) -> str | None:
    """Loss (train and eval) and throughput against step, as a PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = list(records)
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend()
    tput = [r for r in train if r.get("tokens_per_s_per_device") is not None]
    ax_tput.plot([r["step"] for r in tput], [r["tokens_per_s_per_device"] for r in tput])
    ax_tput.set_xlabel("step")
    ax_tput.set_ylabel("tokens/s per device")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return os.fspath(out_png)
