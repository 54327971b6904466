"""Honest training metrics in one place: FLOPs per token, MFU, tokens/s, memory, and writers.

One formula (PaLM appendix B, as torchtitan and Megatron use it):

    FLOPs per token = 6 x (matmul parameters) + 12 x layers x (heads x head_dim) x seq_len

6 = 2 (multiply-add) x 3 (forward, input-grad, weight-grad) for every weight that takes part in
a matmul; embeddings are a lookup and do not count, the LM head does (once, even when tied).
The attention term is QK^T and AV, forward and backward, without discounting the causal mask
(the convention every published MFU uses, so numbers compare). MFU divides achieved FLOP/s by
the device's dense bf16 peak from `PEAK_FLOPS`; on a device not in the table (every CPU) it is
None and written as blank, never guessed.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from smp.expert_parallel.plan import expand_ep_plan, resolve_ep_plan
from smp.mesh import device_type_for

# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' datasheets.
# Matched in order against torch.cuda.get_device_name(): put specific names before general ones.
PEAK_FLOPS: list[tuple[tuple[str, ...], float]] = [
    (("H100", "PCIE"), 756e12),
    (("H100", "NVL"), 835e12),
    (("GH200",), 989e12),
    (("H200",), 989e12),
    (("H100",), 989e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    (("B200",), 2250e12),
    (("A100",), 312e12),
    (("L40S",), 362e12),
    (("L4",), 121e12),
    (("MI300X",), 1307e12),
]


def peak_flops(device_name: str | None) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None when it is not known (CPUs, unlisted GPUs)."""
    if not device_name:
        return None
    upper = device_name.upper()
    for words, flops in PEAK_FLOPS:
        if all(w in upper for w in words):
            return flops
    return None


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


# ----------------------------------------------------------------------------------------------
# FLOPs


@dataclass(frozen=True)
class ModelFlops:
    """What the FLOPs formula needs to know about a model."""

    matmul_params: int  # matmul weights a token uses (`count_matmul_params`): LM head in, embeddings out
    layers: int
    attention_width: int  # heads x head_dim (query side)

    def per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at sequence length `seq_len`."""
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.attention_width * seq_len


def _full_numel(t: torch.Tensor) -> int:
    return t.numel()  # a DTensor's numel is its global (unsharded) size


def _moe_routing(model: nn.Module) -> tuple[int, int]:
    """(top_k, E) of an MoE model's config: each token runs through top_k of its E experts.
    (1, 1) for a dense model."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    # Mixtral names the expert count num_local_experts; Qwen2-MoE and others num_experts.
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not experts or not top_k:
        return 1, 1
    return int(top_k), int(experts)


def count_matmul_params(model: nn.Module) -> int:
    """Weights a token multiplies through, each tensor counted once (sharded or not).

    - 2-D parameters: nn.Linear and transformers' Conv1D (GPT-2) weights, fused / packed
      projections (qkv, gate_up) included, the LM head (tied to the input embedding or not),
      and weights a module applies itself with F.linear (MoE routers);
    - 3-D parameters: E experts stacked [E, out, in] (transformers 5.x MoE: `experts.gate_up_proj`,
      `experts.down_proj`), of which a token uses top_k: top_k / E of them count, from the
      config's `num_experts_per_tok` and `num_local_experts` / `num_experts`;
    - embedding tables are a lookup, not a matmul; 1-D parameters (norms, biases) neither.
    """
    top_k, experts = _moe_routing(model)
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            continue  # a tied head's weight is counted by the head module
        for param in module.parameters(recurse=False):
            if id(param) in seen or param.dim() not in (2, 3):
                continue
            seen.add(id(param))
            total += _full_numel(param) if param.dim() == 2 else _full_numel(param) // experts * top_k
    return total


def model_flops(model: nn.Module, *, layers: int | None = None, heads: int | None = None,
                head_dim: int | None = None) -> ModelFlops:
    """ModelFlops of a transformers model (shape read from `model.config`) or of any model
    whose layer count, head count and head size are given."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    layers = layers if layers is not None else getattr(cfg, "num_hidden_layers", None)
    heads = heads if heads is not None else getattr(cfg, "num_attention_heads", None)
    if head_dim is None and cfg is not None:
        head_dim = getattr(cfg, "head_dim", None) or (cfg.hidden_size // cfg.num_attention_heads)
    if layers is None or heads is None or head_dim is None:
        raise ValueError(
            "model_flops needs the layer count, head count and head size: pass layers=, heads=, "
            "head_dim= for a model without a transformers config"
        )
    return ModelFlops(count_matmul_params(model), int(layers), int(heads) * int(head_dim))


def mfu(achieved_flops_per_s: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation, or None when the peak is unknown (blank, not guessed)."""
    if not peak:
        return None
    return achieved_flops_per_s / peak


# ----------------------------------------------------------------------------------------------
# Memory


def peak_memory_bytes(device: torch.device | str) -> dict[str, int]:
    """This rank's peak memory: the CUDA allocator's active and reserved peaks on a GPU; on a
    CPU the process's peak resident set (the only honest figure the host allocator gives)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {
            "peak_active": int(torch.cuda.max_memory_allocated(device)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(device)),
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return {"peak_rss": int(rss if sys.platform == "darwin" else rss * 1024)}


def gather_per_rank(value: float, device: torch.device | str | None = None) -> list[float]:
    """Every rank's value of a scalar, on every rank (rank order). `device` defaults to where
    the default group runs collectives: an NCCL group has no CPU backend, so the current CUDA
    device (the one smp.init set); else the CPU."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [float(value)]
    if device is None:
        device = device_type_for(dist.get_backend())
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]


# ----------------------------------------------------------------------------------------------
# MoE routing


class ExpertLoadMeter:
    """Token choices routed to each expert of each MoE layer, per step, for the step record.

    Counts come from the `top_k_index` every experts module receives (the modules the model's
    expert-parallel plan names, or `plan`; docs/expert-parallel.md), with or without expert
    parallelism, summed over the training-mode forwards since the last `record` (micro-batches
    included; evaluation in eval mode is not counted). A forward recomputed in backward by
    activation checkpointing is not counted again. A model without MoE layers records nothing."""

    def __init__(self, model: nn.Module, plan: dict[str, str] | None = None) -> None:
        ep_plan = resolve_ep_plan(model, plan)
        self.layers = expand_ep_plan(model, ep_plan, 1) if ep_plan.entries else []
        self._counts: list[torch.Tensor | None] = [None] * len(self.layers)
        for i, spec in enumerate(self.layers):
            spec.module.register_forward_pre_hook(self._counter(i, spec.num_experts), with_kwargs=True)

    def _counter(self, layer: int, num_experts: int):
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            # Evaluation (module.eval()) is not training; inside backward (a graph task is running)
            # a forward is a checkpointing recompute of one already counted (torch has no public
            # name for this test).
            if not module.training or torch._C._current_graph_task_id() != -1:
                return
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            counts = torch.bincount(index.reshape(-1), minlength=num_experts)  # stays on the device
            seen = self._counts[layer]
            self._counts[layer] = counts if seen is None else seen + counts

        return count

    def record(self, group: dist.ProcessGroup | None = None, copies: int = 1) -> dict[str, Any]:
        """This step's figures, then start counting the next step's:

        - `tokens_per_expert`: per MoE layer (module order), the token choices routed to each
          expert, summed over the ranks of `group` (None: this rank) and divided by `copies`, the
          number of its ranks that see the same tokens (tensor-parallel ranks);
        - `expert_load_max_over_mean`: the busiest expert's count over the mean count, in the
          least balanced layer (1.0: perfectly even; under expert parallelism the rank holding
          that expert sets the layer's pace). None when no token was routed.

        Every rank of `group` must call it (one all-reduce)."""
        if not self.layers:
            return {}
        sizes = [spec.num_experts for spec in self.layers]
        device = next((c.device for c in self._counts if c is not None), torch.device("cpu"))
        counts = torch.cat([c if c is not None else torch.zeros(n, dtype=torch.long, device=device)
                            for c, n in zip(self._counts, sizes)])
        self._counts = [None] * len(self.layers)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        per_layer = [part.tolist() for part in (counts // copies).split(sizes)]
        balance = [max(row) * len(row) / sum(row) for row in per_layer if sum(row)]
        return {"tokens_per_expert": per_layer, "expert_load_max_over_mean": max(balance) if balance else None}


# ----------------------------------------------------------------------------------------------
# Step metrics


@dataclass
class ThroughputMeter:
    """Tokens/s, TFLOP/s and MFU per device for one step."""

    flops_per_token: float
    world_size: int
    peak: float | None  # FLOP/s of one device, None when unknown

    def step(self, tokens_global: int, seconds: float) -> dict[str, float | None]:
        tokens_per_s = tokens_global / seconds if seconds > 0 else 0.0
        per_device = tokens_per_s / self.world_size
        achieved = per_device * self.flops_per_token
        return {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": per_device,
            "tflops_per_device": achieved / 1e12,
            "mfu": mfu(achieved, self.peak),
        }


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


# ----------------------------------------------------------------------------------------------
# Progress bar (rank 0)


class Progress:
    """A tqdm bar with loss, tokens/s and ETA when tqdm is installed; plain lines otherwise."""

    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, every: int = 5):
        self.enabled = enabled
        self.every = every
        self.total = total
        self._bar = None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             file=sys.stdout, mininterval=0.5)
        except ImportError:
            self._bar = None

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", refresh=False)
            self._bar.update(1)
        elif step % self.every == 0 or step == self.total - 1:
            print(f"step {step:5d}/{self.total}  loss {loss:.4f}  {tokens_per_s:.0f} tokens/s", flush=True)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
