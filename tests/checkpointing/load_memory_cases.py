"""Rank-side cases for tests/checkpointing/test_load_memory.py: the resident memory `smp.transform(meta model,
weights=folder)` adds on a rank, against the bound docs/checkpoints.md states (this rank's part
of the model plus its largest tensor), and the same load with every read through a memory
mapping kept open to the end (what safetensors' readers do), the negative control."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import shutil
import warnings

import torch
import torch.distributed as dist

import smp
from smp.checkpointing.hf import read as hf_read


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _config():
    import transformers as T

    return T.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)


@contextlib.contextmanager
def _mapped_reads():
    """Stored.read through a mapping of the whole file, kept until the load ends."""
    maps: dict[str, mmap.mmap] = {}
    original = hf_read.Stored.read

    def read(self, offsets, sizes, out):
        for entry, _ in self.pieces:
            if entry.file not in maps:
                with open(entry.file, "rb") as f:
                    maps[entry.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a read-only buffer: only read here
                whole = torch.frombuffer(maps[entry.file], dtype=entry.dtype, offset=entry.start,
                                         count=max(1, int(torch.Size(entry.shape).numel()))).view(entry.shape)
            for dim, (o, z) in enumerate(zip(offsets, sizes)):
                whole = whole.narrow(dim, o, z)
            out.copy_(whole)

    hf_read.Stored.read = read
    try:
        yield
    finally:
        hf_read.Stored.read = original
        for m in maps.values():
            with contextlib.suppress(BufferError):
                m.close()


def load_ratio(config: dict, root: str, mapped: bool) -> dict:
    """Peak VmHWM above the rank's resident memory before `smp.transform(meta, weights=)`, over
    (model bytes / world + largest tensor): {"ratio", "peak_mib", "bound_mib"}."""
    from transformers import LlamaForCausalLM

    folder = os.path.join(root, "llama")
    try:
        with smp.session(config):
            if dist.get_rank() == 0:
                torch.manual_seed(0)
                LlamaForCausalLM(_config()).save_pretrained(folder)
            dist.barrier()
            with torch.device("meta"):
                meta = LlamaForCausalLM(_config())
            sizes = [t.numel() * t.element_size() for t in meta.state_dict().values()]
            bound = sum(sizes) / dist.get_world_size() + max(sizes)
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the kernel: the load's own pages count
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = _status("VmRSS")
            with _mapped_reads() if mapped else contextlib.nullcontext():
                model = smp.transform(meta, weights=folder)
                peak = _status("VmHWM") - base
            del model
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    return {"ratio": peak / bound, "peak_mib": peak / 2**20, "bound_mib": bound / 2**20}


def export_in_pieces(config: dict, root: str, piece_bytes: int) -> dict:
    """export_hf with each rank's intermediate files cut at `piece_bytes` of the model (many
    pieces per output file, and output files smaller than a piece): {"differ": names not bitwise
    equal to the model after from_pretrained of the export, "files": the output files}."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from smp.checkpointing.hf import export as hf_export
    from smp.testing.distributed import full_tensor

    config_small = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    out = os.path.join(root, "hf")
    original = hf_export.PIECE_BYTES
    hf_export.PIECE_BYTES = piece_bytes
    try:
        with smp.session(config):
            torch.manual_seed(0)
            model = smp.transform(LlamaForCausalLM(config_small))
            smp.checkpointing.export_hf(out, model, max_shard_bytes=60_000)
            mine = {n: full_tensor(p.detach()) for n, p in model.state_dict().items()}
            back = LlamaForCausalLM.from_pretrained(out).state_dict()
            return {"differ": sorted(n for n in mine if not torch.equal(mine[n], back[n])),
                    "files": sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))}
    finally:
        hf_export.PIECE_BYTES = original
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)


def export_packed(config: dict, root: str, family: str, one_file: bool = False) -> dict:
    """export_hf of a tiny GPT-2 (fused q|k|v c_attn) or Mixtral (gate|up) built from seed 0,
    transformed under `config`, into `root`/<family>: {"packed": the parameters held as a packed
    tensor-parallel part, "files": {safetensors file or index: its bytes' sha256}}. `one_file`
    (the negative control): the boxes of a packed weight go into one file, as DCP's writer
    files a tensor's chunks."""
    import hashlib

    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    from smp.checkpointing.format import packed
    from smp.checkpointing.hf import export as hf_export
    from tests.checkpointing.checkpoint_cases import _packed_model

    out = os.path.join(root, family)
    original = hf_export._PieceWriter._split_by_storage_plan
    if one_file:
        hf_export._PieceWriter._split_by_storage_plan = HuggingFaceStorageWriter._split_by_storage_plan
    try:
        with smp.session(config):
            model = smp.transform(_packed_model(family, 0))
            held = sorted(n for n, p in model.named_parameters() if packed.read_whole(p))
            smp.checkpointing.export_hf(out, model, max_shard_bytes=200_000)
            dist.barrier()
    finally:
        hf_export._PieceWriter._split_by_storage_plan = original
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors") or f.endswith(".index.json"))
    digests = {}
    for name in files:
        with open(os.path.join(out, name), "rb") as f:
            digests[name] = hashlib.sha256(f.read()).hexdigest()
    return {"packed": held, "files": digests}
