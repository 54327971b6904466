"""Rank-side cases for `load_hf` of folders whose tensors from_pretrained converts, not only
renames (tests/checkpointing/test_checkpointing.py, `test_load_hf_convert*`): tiny models built from
transformers configs, written by save_pretrained (which writes the converted tensors back in
their original layout), loaded by load_hf into the transformed model and compared with
from_pretrained of the same folder. Each function returns plain data to the test."""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

import smp
from smp.checkpointing.format import packed
from smp.checkpointing.hf import conversion as hf_conversion
from smp.testing.distributed import full_tensor


def build(family: str) -> torch.nn.Module:
    """mixtral: 4 experts per layer, saved per expert (`experts.<i>.w1/w2/w3.weight`), which
    from_pretrained stacks (MergeModulelist) and joins (Concatenate w1 then w3). tipsv2: a
    vision backbone with swiglu, saved with fused `attn.qkv` and `mlp.w12`, which from_pretrained
    chunks into q/k/v and gate/up (Chunk)."""
    import transformers as T

    if family == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2))
    if family == "tipsv2":
        return T.Tipsv2VisionBackbone(T.Tipsv2VisionConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8,
            use_swiglu_ffn=True))
    raise ValueError(family)


def _tampered(tamper: str):
    """(patch, undo) for a deliberately broken load: `expert_order` stacks the experts in reverse
    order; `swap_outputs` gives a converter's first two results each other's values; `box_read`
    reads a packed tensor-parallel weight as one box (DCP's chunk offsets)."""
    if tamper == "expert_order":
        original, name = hf_conversion.in_load_order, "in_load_order"
        patched = lambda keys, conversion: original(keys, conversion)[::-1]  # noqa: E731
    elif tamper == "swap_outputs":
        original, name = hf_conversion._converted, "_converted"

        def patched(conversion, group, sources):
            out = original(conversion, group, sources)
            first, second = list(out)[:2]
            out[first], out[second] = out[second], out[first]
            return out
    elif tamper == "box_read":  # load_hf asks packed.boxes which boxes a rank's part is made of
        original = packed.boxes

        def one_box(t):  # DCP's view: one box from the first index held, of the local shape
            local = list(t.to_local().shape)
            return [([int(packed._held(t, d)[0]) for d in range(t.ndim)], local, [0] * t.ndim)]
        return (lambda: setattr(packed, "boxes", one_box)), (lambda: setattr(packed, "boxes", original))
    else:
        raise ValueError(tamper)
    return (lambda: setattr(hf_conversion, name, patched)), (lambda: setattr(hf_conversion, name, original))


def load_like_from_pretrained(config: dict, family: str, directory: str, tampers: tuple[str, ...] = ("",),
                              meta: bool = False, model_layout: bool = False) -> dict:
    """save_pretrained (rank 0) -> load_hf into the transformed model, once per entry of
    `tampers` ("" = as shipped), each compared with from_pretrained of the folder: {tamper:
    {"error", "differ" (names not bitwise equal), "compared"}}, plus "converted_keys" (the
    folder's keys in the original layout, proof that a conversion was needed). `model_layout`:
    the folder holds the model's own state dict instead (fused experts: nothing to convert)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out: dict = {}
    try:
        with smp.session(config):
            if dist.get_rank() == 0:
                torch.manual_seed(7)
                model = build(family)
                if model_layout:
                    os.makedirs(directory)
                    model.config.save_pretrained(directory)
                    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
                else:
                    model.save_pretrained(directory)
            dist.barrier()
            with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
                out["converted_keys"] = sorted(k for k in f.keys() if ".experts.0." in k or ".qkv." in k or ".w12." in k)
            reference = type(build(family)).from_pretrained(directory).state_dict()
            for tamper in tampers:
                if meta:
                    with torch.device("meta"):
                        model = build(family)
                    model = smp.transform(model, materialize=False)
                else:
                    torch.manual_seed(99)  # other values than the folder's
                    model = smp.transform(build(family))
                patch, undo = _tampered(tamper) if tamper else (lambda: None, lambda: None)
                patch()
                try:
                    smp.checkpointing.load_hf(directory, model)
                except smp.CheckpointError as e:
                    out[tamper] = {"error": str(e)}
                    continue
                finally:
                    undo()
                state = model.state_dict()
                differ = sorted(n for n, t in state.items() if not torch.equal(full_tensor(t.detach()), reference[n]))
                out[tamper] = {"error": "", "differ": differ, "compared": len(state),
                               "missing": sorted(set(reference) - set(state))}
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# The folder's files (hf_checks.read_folder): which files load_hf reads, and what it refuses


def _llama() -> torch.nn.Module:
    import transformers as T

    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))


def _folder_variants(root: str) -> dict[str, str]:
    """Rank 0 writes a sharded save_pretrained folder (index + 2 or more files) and its variants:
    `stray`: one more file the index does not name, holding `model.norm.weight` = 9.0 (a file
    from_pretrained ignores); `single_stray`: the same beside a one-file `model.safetensors`;
    `fifo`: a FIFO in place of a file the index names; `fifo_unindexed`: a folder of files with
    no index (read whole) holding a FIFO named `*.safetensors`; `duplicate`: the stray file (with
    one more key) named by the index for that key, so two named files hold the norm;
    `duplicate_unindexed`: the stray file in a folder with no index; `outside`: an index entry
    `../elsewhere.safetensors`."""
    import json

    from safetensors.torch import save_file

    torch.manual_seed(3)
    model = _llama()
    paths = {kind: os.path.join(root, kind) for kind in
             ("clean", "stray", "single", "single_stray", "fifo", "fifo_unindexed", "duplicate",
              "duplicate_unindexed", "outside")}
    model.save_pretrained(paths["clean"], max_shard_size="60KB")
    model.save_pretrained(paths["single"])
    stray = {"model.norm.weight": torch.full((64,), 9.0)}
    for kind in ("stray", "fifo", "fifo_unindexed", "duplicate", "duplicate_unindexed", "outside"):
        shutil.copytree(paths["clean"], paths[kind])
    shutil.copytree(paths["single"], paths["single_stray"])
    for kind in ("stray", "single_stray", "duplicate_unindexed"):
        save_file(stray, os.path.join(paths[kind], "model-stray.safetensors"), metadata={"format": "pt"})
    os.remove(os.path.join(paths["duplicate_unindexed"], "model.safetensors.index.json"))
    save_file({**stray, "extra.bias": torch.zeros(2)}, os.path.join(paths["duplicate"], "model-stray.safetensors"),
              metadata={"format": "pt"})
    index_path = os.path.join(paths["duplicate"], "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"]["extra.bias"] = "model-stray.safetensors"
    json.dump(index, open(index_path, "w"))
    index_path = os.path.join(paths["fifo"], "model.safetensors.index.json")
    named = sorted(set(json.load(open(index_path))["weight_map"].values()))[-1]
    os.remove(os.path.join(paths["fifo"], named))
    os.mkfifo(os.path.join(paths["fifo"], named))
    os.remove(os.path.join(paths["fifo_unindexed"], "model.safetensors.index.json"))
    os.mkfifo(os.path.join(paths["fifo_unindexed"], "zz-pipe.safetensors"))
    index_path = os.path.join(paths["outside"], "model.safetensors.index.json")
    index = json.load(open(index_path))
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    json.dump(index, open(index_path, "w"))
    return paths


def folder_files(config: dict, root: str) -> dict:
    """load_hf of each variant of `_folder_variants` into the transformed model: {kind: {"error",
    "seconds", "differ" (names not bitwise equal to from_pretrained of the clean folder)}}, plus
    what from_pretrained loads for the stray folders' norm (`from_pretrained_norm`) and the
    stray value (`stray_norm`): the oracle distinguishes the two."""
    import time

    from transformers import LlamaForCausalLM

    out: dict = {}
    try:
        with smp.session(config):
            if dist.get_rank() == 0:
                _folder_variants(root)
            dist.barrier()
            paths = {kind: os.path.join(root, kind) for kind in os.listdir(root)}
            reference = LlamaForCausalLM.from_pretrained(paths["clean"]).state_dict()
            for kind in ("stray", "single_stray"):
                norm = LlamaForCausalLM.from_pretrained(paths[kind]).state_dict()["model.norm.weight"]
                out[f"{kind}_from_pretrained_equal"] = bool(torch.equal(norm, reference["model.norm.weight"]))
            out["stray_norm"] = 9.0
            out["reference_norm"] = float(reference["model.norm.weight"][0])
            for kind in ("clean", "stray", "single_stray", "fifo", "fifo_unindexed", "duplicate",
                         "duplicate_unindexed", "outside"):
                torch.manual_seed(99)  # other values than the folder's
                model = smp.transform(_llama())
                start = time.monotonic()
                try:
                    smp.checkpointing.load_hf(paths[kind], model)
                    error = ""
                except smp.CheckpointError as e:
                    error = str(e)
                entry = {"error": error, "seconds": time.monotonic() - start}
                if not error:
                    state = model.state_dict()
                    entry["differ"] = sorted(n for n, t in state.items()
                                             if not torch.equal(full_tensor(t.detach()), reference[n]))
                out[kind] = entry
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return out
