"""The tensors of an `export_hf` that torch's safetensors consolidation cannot write: every
dtype that is not floating point (BatchNorm's int64 `num_batches_tracked`, Swin's int64
`relative_position_index`, bool masks, complex tables).

torch's consolidation (checked on 2.13) sizes each element with `torch.finfo`, which raises for
integer and bool dtypes after every rank has written its part, and gives complex64 half its
size. These tensors are small buffers that every rank holds whole (FSDP shards parameters,
not buffers), so they stay out of DCP: `check` proves, on every rank, that each one is whole
(a plain tensor or a DTensor replicated on every mesh dimension) and bitwise the same on every
rank holding it, and refuses by name otherwise; rank 0 then writes them as one more safetensors
file of the folder (`write`), listed in `model.safetensors.index.json`, before the folder's
metadata and commit marker, as `save_pretrained` would have written them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from smp.checkpointing import storage
from smp.checkpointing.collective import is_dist, world
from smp.checkpointing.format.pipeline import gather_over_pipeline
from smp.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
_CONSOLIDATED = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")  # DCP's names for the files it writes


def consolidatable(t: torch.Tensor) -> bool:
    """Written correctly by torch's consolidation (its element size from `torch.finfo`)."""
    return t.is_floating_point()


def _writable(dtype: torch.dtype) -> bool:
    """safetensors has this dtype (it has no complex128, for one)."""
    from safetensors.torch import save

    try:
        save({"t": torch.zeros(1, dtype=dtype)})
    except Exception:  # noqa: BLE001 - any failure means safetensors cannot write it
        return False
    return True


def _fingerprint(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    return str(t.dtype), tuple(t.shape), hashlib.sha256(data).hexdigest()


def check(tensors: dict[str, torch.Tensor], pp_group: dist.ProcessGroup | None, out_dir: str) -> dict[str, torch.Tensor]:
    """The whole value of each of `tensors` (this rank's non-floating state entries) on CPU,
    under a pipeline every stage's (for rank 0 to write). Collective over the world, always (a
    pipeline stage holding none still takes part). Raises CheckpointError on every rank alike,
    before anything is written, naming each tensor that is sharded, differs between ranks, or
    has a dtype safetensors cannot hold."""
    problems: list[str] = []
    values: dict[str, torch.Tensor] = {}
    for name, t in sorted(tensors.items()):
        if isinstance(t, DTensor):
            if not all(p.is_replicate() for p in t.placements):
                problems.append(f"{name} is a DTensor placed {tuple(t.placements)}, not whole on each rank")
                continue
            t = t.to_local()
        if not _writable(t.dtype):
            problems.append(f"{name} is {t.dtype}, which safetensors cannot hold")
            continue
        values[name] = t.detach().cpu().contiguous()
    fingerprints = {name: _fingerprint(t) for name, t in values.items()}
    gathered = [(fingerprints, problems)]
    if is_dist():
        gathered = [None] * world()
        dist.all_gather_object(gathered, (fingerprints, problems))
    problems = []  # every rank's, in rank order: the same message on every rank
    holders: dict[str, dict[tuple, list[int]]] = {}
    for rank, (prints, found) in enumerate(gathered):
        problems += [p for p in found if p not in problems]
        for name, fp in prints.items():
            holders.setdefault(name, {}).setdefault(fp, []).append(rank)
    for name, seen in sorted(holders.items()):
        if len(seen) > 1:
            sides = "; ".join(f"ranks {ranks} hold {dtype} {list(shape)} sha256 {digest[:12]}"
                              for (dtype, shape, digest), ranks in seen.items())
            problems.append(f"{name} differs between ranks ({sides})")
    if problems:
        raise CheckpointError(
            f"export_hf {out_dir!r}: {len(problems)} non-floating tensor(s) cannot be written as one value "
            f"each: {'; '.join(problems[:6])}{' ...' if len(problems) > 6 else ''}. export_hf writes integer, "
            "bool and complex tensors only when every rank holds the same whole value (smp never picks one "
            "rank's copy): make them agree (the same number of training steps on every rank for BatchNorm's "
            "num_batches_tracked), or save with smp.checkpointing.save to resume.")
    if pp_group is not None:
        values = {k: v for part in gather_over_pipeline(values, pp_group) for k, v in part.items()}
    return values


def write(directory: str, values: dict[str, torch.Tensor]) -> None:
    """(rank 0) Add `values` to the consolidated folder as the last of its files: the files
    DCP wrote, `model-0000k-of-0000n.safetensors`, become `model-0000k-of-0000<n+1>`, the new
    one is `model-0000<n+1>-of-0000<n+1>`, and the index lists its tensors (and their bytes in
    `total_size`). The folder is not committed yet: a crash here leaves a partial folder."""
    if not values:
        return
    from safetensors.torch import save

    fs = storage.current()
    index_path = os.path.join(directory, INDEX_FILE)
    index = json.loads(fs.read_bytes(index_path))
    weight_map: dict[str, str] = index["weight_map"]
    clash = sorted(set(values) & set(weight_map))
    if clash:
        raise CheckpointError(f"export_hf: {', '.join(clash[:4])} written twice (consolidated and as a non-floating tensor)")
    files = sorted(set(weight_map.values()))
    n = len(files)
    expected = [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    if files != expected or not all(_CONSOLIDATED.match(name) for name in files):
        raise CheckpointError(
            f"export_hf: torch's consolidation wrote {files[:4]}, not the files {expected[:4]} the index "
            "extension expects; the export was not committed")
    total = n + 1
    renamed = {old: f"model-{k:05d}-of-{total:05d}.safetensors" for k, old in enumerate(files, start=1)}
    for old, new in renamed.items():
        fs.rename(os.path.join(directory, old), os.path.join(directory, new))
    last = f"model-{total:05d}-of-{total:05d}.safetensors"
    data = save({k: v.clone() for k, v in values.items()}, metadata={"format": "pt"})  # own storage each
    fs.write_file(os.path.join(directory, last), data, durable=True)
    index["weight_map"] = {**{k: renamed[v] for k, v in weight_map.items()}, **dict.fromkeys(values, last)}
    meta = index.setdefault("metadata", {})
    meta["total_size"] = int(meta.get("total_size", 0)) + sum(v.numel() * v.element_size() for v in values.values())
    fs.write_file(index_path, json.dumps(index, indent=2).encode(), durable=True)
