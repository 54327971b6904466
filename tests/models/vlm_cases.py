"""Rank-side cases for vision and multimodal models (tests/models/test_vlm.py): tiny LLaVA, Qwen2.5-VL,
Gemma3, PaliGemma, Mllama, ViT, DINOv2, CLIP and SigLIP built from transformers configs, and the
text families with tied embeddings, through `export_hf` / `load_hf` / `from_pretrained`.
Each function returns plain data to the test."""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

import smp
from smp.testing.distributed import full_tensor
from tests import REPO_ROOT

# The tiny shapes: a 2-layer text model (vocab 256) and a 2-layer vision tower on 16x16 images.
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, head_dim=16)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=16, patch_size=8, num_channels=3)
SMALL_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=256, max_position_embeddings=16)

TIED_TEXT_FAMILIES = ("llama-tied", "gemma", "qwen2-tied", "gpt2")
MULTIMODAL_FAMILIES = ("llava", "qwen2_5_vl", "gemma3", "paligemma", "mllama", "vit", "dinov2", "clip", "siglip")


def build(family: str) -> torch.nn.Module:
    """The tiny `family` model, built eagerly from its config (initialised by the current seed)."""
    import transformers as T

    from smp.testing.models import tiny_gpt2, tiny_llama

    if family == "llama-tied":
        return tiny_llama(tie_word_embeddings=True)
    if family == "gpt2":
        return tiny_gpt2()
    if family == "gemma":
        return T.GemmaForCausalLM(T.GemmaConfig(**TEXT))
    if family == "qwen2-tied":
        return T.Qwen2ForCausalLM(T.Qwen2Config(**TEXT, tie_word_embeddings=True))
    if family == "llava":
        return T.LlavaForConditionalGeneration(T.LlavaConfig(
            text_config=T.LlamaConfig(**TEXT), vision_config=T.CLIPVisionConfig(**VISION, projection_dim=32),
            image_token_id=255, vision_feature_layer=-1, projector_hidden_act="gelu"))
    if family == "qwen2_5_vl":
        text = {k: v for k, v in TEXT.items() if k != "head_dim"}
        return T.Qwen2_5_VLForConditionalGeneration(T.Qwen2_5_VLConfig(
            text_config=dict(**text, rope_scaling={"type": "mrope", "mrope_section": [2, 2, 4]},
                             bos_token_id=0, eos_token_id=1),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                               patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                               fullatt_block_indexes=[1], window_size=8),
            image_token_id=250, video_token_id=251, vision_start_token_id=252))
    if family == "gemma3":
        return T.Gemma3ForConditionalGeneration(T.Gemma3Config(
            text_config=T.Gemma3TextConfig(**TEXT, sliding_window=16), vision_config=T.SiglipVisionConfig(**VISION),
            mm_tokens_per_image=4, image_token_index=255, boi_token_index=253, eoi_token_index=254))
    if family == "paligemma":
        return T.PaliGemmaForConditionalGeneration(T.PaliGemmaConfig(
            text_config=T.GemmaConfig(**TEXT), vision_config=T.SiglipVisionConfig(**VISION, projection_dim=64),
            image_token_index=255, projection_dim=64, hidden_size=64))
    if family == "mllama":
        return T.MllamaForConditionalGeneration(T.MllamaConfig(
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=256, cross_attention_layers=[1],
                             pad_token_id=0, bos_token_id=1, eos_token_id=2),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=4, image_size=16, patch_size=8, max_num_tiles=2,
                               vision_output_dim=64, intermediate_layers_indices=[0],
                               supported_aspect_ratios=[[1, 1], [1, 2]]),
            image_token_index=255))
    if family == "vit":
        return T.ViTForImageClassification(T.ViTConfig(**VISION, num_labels=3))
    if family == "dinov2":
        return T.Dinov2ForImageClassification(T.Dinov2Config(**VISION, num_labels=3))
    if family == "clip":
        return T.CLIPModel(T.CLIPConfig(text_config=dict(**SMALL_TEXT, bos_token_id=0, eos_token_id=1),
                                        vision_config=VISION, projection_dim=16))
    if family == "siglip":
        return T.SiglipModel(T.SiglipConfig(text_config=dict(**SMALL_TEXT, bos_token_id=0, eos_token_id=1),
                                            vision_config=VISION))
    raise ValueError(f"unknown family {family!r}")


def _shared_dir(prefix: str) -> str:
    """A fresh folder made by rank 0, its path agreed by every rank."""
    path = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    return path[0]


def _max_diff(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> float:
    """Largest gap between `model`'s tensors (sharded or not) and `expected`, by name; inf
    when a name is absent from `expected`."""
    worst = 0.0
    for name, t in model.state_dict().items():
        if name not in expected:
            return float("inf")
        full = full_tensor(t.detach()).float()
        if full.numel():
            worst = max(worst, float((full - expected[name].float()).abs().max()))
    return worst


# --- 1. export_hf of tied embeddings -----------------------------------------------------------

def tied_export_round_trip(config: dict, family: str, keep_both: bool = False) -> dict:
    """`family` (tied input/output embeddings) transformed, one SGD step, `export_hf`, then
    transformers' `from_pretrained` of the folder: {"error", "diff" (every tensor vs the
    transformed model), "tied" (the tie restored), "files"}. `keep_both` (negative control)
    writes both names of the tied weight, as export_hf did before."""
    from smp.checkpointing.hf import export as hf_export

    out = _shared_dir(f"tied-{family}-")
    original = hf_export.one_copy_of_tied
    if keep_both:
        hf_export.one_copy_of_tied = lambda state, model: state
    try:
        with smp.session(config):
            torch.manual_seed(0)
            model = smp.transform(build(family))
            ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
            model(input_ids=ids, labels=ids).loss.backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            expected = {n: full_tensor(t.detach()).clone() for n, t in model.state_dict().items()}
            try:
                smp.checkpointing.export_hf(os.path.join(out, "hf"), model)
            except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                return {"error": f"{type(e).__name__}: {e}"}
            loaded = type(build(family)).from_pretrained(os.path.join(out, "hf"))
            inp, outp = loaded.get_input_embeddings().weight, loaded.get_output_embeddings().weight
            with torch.no_grad():
                diff = max(float((loaded.state_dict()[n].float() - v.float()).abs().max()) for n, v in expected.items())
            return {"error": "", "diff": diff, "tied": inp.data_ptr() == outp.data_ptr(),
                    "files": sorted(os.listdir(os.path.join(out, "hf")))}
    finally:
        hf_export.one_copy_of_tied = original
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(out, ignore_errors=True)


# --- 2. load_hf of the folders save_pretrained writes, through transformers' key conversion ----

def _saved_folder(family: str, seed: int = 7, builder=None) -> tuple[str, torch.nn.Module]:
    """(a shared folder holding `family` written by save_pretrained under `src/`, the one-process
    `from_pretrained` of it: the reference). `builder()` builds the model (default: `build`)."""
    from transformers.utils.logging import disable_progress_bar

    builder = builder or (lambda: build(family))
    disable_progress_bar()
    root = _shared_dir(f"pretrained-{family}-")
    src = os.path.join(root, "src")
    if dist.get_rank() == 0:
        torch.manual_seed(seed)
        builder().save_pretrained(src)
    dist.barrier()
    model = builder()
    return root, type(model).from_pretrained(src)


def pretrained_round_trip(config: dict, family: str, convert: bool = True, builder=None) -> dict:
    """save_pretrained -> load_hf (into the transformed model) -> export_hf -> from_pretrained:
    {"error", "loaded_diff" (the transformed model vs from_pretrained of the saved folder),
    "round_trip_diff" (from_pretrained of the export vs the same)}. `convert=False` (negative
    control) skips transformers' key conversion, as load_hf did before. `builder()` builds the
    model (default: `build(family)`; the coverage matrix passes its own)."""
    from smp.checkpointing.hf import load as hf_load

    builder = builder or (lambda: build(family))
    original = hf_load._key_converter
    if not convert:
        hf_load._key_converter = lambda model: None
    root = None
    try:
        with smp.session(config):
            root, expected = _saved_folder(family, builder=builder)
            reference = expected.state_dict()
            torch.manual_seed(99)  # other values than the checkpoint's
            model = smp.transform(builder())
            try:
                smp.checkpointing.load_hf(os.path.join(root, "src"), model)
            except smp.CheckpointError as e:
                return {"error": str(e)}
            loaded = _max_diff(model, reference)
            smp.checkpointing.export_hf(os.path.join(root, "out"), model)
            back = type(expected).from_pretrained(os.path.join(root, "out")).state_dict()
            diff = max(float((back[n].float() - t.float()).abs().max()) if n in back else float("inf")
                       for n, t in reference.items() if t.numel())
            return {"error": "", "loaded_diff": loaded, "round_trip_diff": diff}
    finally:
        hf_load._key_converter = original
        if root is not None:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)


# --- 3. a meta model filled from a pretrained folder ------------------------------------------

def meta_load(config: dict, family: str, compute_buffers: bool = True, one_call: bool = False,
              builder=None) -> dict:
    """`family` built on the meta device, `smp.transform(model, materialize=False)`, then
    `load_hf` of a save_pretrained folder, vs `from_pretrained` of the same folder transformed:
    {"error", "diff" (every parameter and buffer, persistent or not), "buffers" (names of the
    non-persistent buffers compared)}. `compute_buffers=False` (negative control) leaves the
    non-persistent buffers as `to_empty` memory. `builder()` builds the model (default:
    `build(family)`; the coverage matrix passes its own)."""
    from smp.checkpointing.hf import load as hf_load

    builder = builder or (lambda: build(family))

    original = hf_load._computed_buffers
    if not compute_buffers:
        hf_load._computed_buffers = lambda model: {}
    root = None
    try:
        with smp.session(config):
            root, expected = _saved_folder(family, builder=builder)
            reference = smp.transform(expected)
            with torch.device("meta"):
                model = builder()
            try:
                if one_call:  # the documented one call
                    model = smp.transform(model, weights=os.path.join(root, "src"))
                else:
                    model = smp.transform(model, materialize=False)
                    smp.checkpointing.load_hf(os.path.join(root, "src"), model)
            except smp.Error as e:
                return {"error": f"{type(e).__name__}: {e}"}
            ref = {n: full_tensor(t.detach()) for n, t in (*reference.named_parameters(), *reference.named_buffers())}
            diff, buffers = 0.0, []
            for name, t in (*model.named_parameters(), *model.named_buffers()):
                full = full_tensor(t.detach())
                if t.is_meta:
                    return {"error": f"{name} left on the meta device"}
                if name not in dict(model.state_dict()):
                    buffers.append(name)
                if full.numel():
                    same = torch.equal(full, ref[name])
                    diff = max(diff, 0.0 if same else float((full.double() - ref[name].double()).abs().max().nan_to_num(float("inf"))))
            return {"error": "", "diff": diff, "buffers": sorted(buffers)}
    finally:
        hf_load._computed_buffers = original
        if root is not None:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)


# --- 4. batches where a rank holds no image ---------------------------------------------------

ROWS, SEQ = 2, 12  # rows per rank, tokens per row


def _vlm_rows(family: str, rank: int, with_images: bool) -> dict:
    """Rank `rank`'s rows of the global batch: image rows (image tokens, then text) or text-only
    rows; the same on every call (seeded by rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(3, 240, (ROWS, SEQ), generator=g)
    batch = {"input_ids": ids}
    if not with_images:
        return batch
    if family == "llava":  # 16x16 image, 8x8 patches: 4 image tokens (CLS dropped)
        ids[:, :4] = 255
        batch["pixel_values"] = torch.randn(ROWS, 3, 16, 16, generator=g)
    elif family == "qwen2_5_vl":  # 16x16 image: 4x4 patches of 4, merged 2x2: 4 image tokens
        ids[:, 0], ids[:, 1:5] = 252, 250
        batch["pixel_values"] = torch.randn(ROWS * 16, 3 * 2 * 4 * 4, generator=g)
        batch["image_grid_thw"] = torch.tensor([[1, 4, 4]] * ROWS)
    else:
        raise ValueError(family)
    return batch


def _global_batch(family: str, image_ranks: tuple[int, ...], world: int) -> dict:
    parts = [_vlm_rows(family, r, r in image_ranks) for r in range(world)]
    out = {"input_ids": torch.cat([p["input_ids"] for p in parts])}
    for key in ("pixel_values", "image_grid_thw"):
        if any(key in p for p in parts):
            out[key] = torch.cat([p[key] for p in parts if key in p])
    return out


def _grad_gap(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        g = torch.zeros(p.shape) if p.grad is None else full_tensor(p.grad).float()
        r = torch.zeros(p.shape) if ref[name].grad is None else ref[name].grad.float()
        if g.numel():
            worst = max(worst, float((g - r).abs().max()))
    return worst


def mixed_batch(config: dict, family: str, image_ranks: tuple[int, ...] = (0,), steps: int = 3,
                run_tower_everywhere: bool = True, freeze_tower: bool = False) -> dict:
    """`family` transformed at world 2 on a global batch where only `image_ranks` hold images,
    vs the same model in one process on the whole batch: {"loss_diff", "grad_diff", "losses",
    "tower_grad"} over `steps` SGD steps. `run_tower_everywhere=False` (negative control, run in
    a subprocess: gloo aborts the process) turns smp's fix off."""
    import copy

    recipe = importlib.import_module("smp.transform")  # the module (smp.transform is the function)
    from smp.testing.distributed import world_mean

    original = recipe.install_image_path_on_every_rank
    if not run_tower_everywhere:
        recipe.install_image_path_on_every_rank = lambda model, groups: []
    try:
        with smp.session(config):
            torch.manual_seed(0)
            reference = build(family)
            if freeze_tower:
                tower = reference.model.vision_tower if family == "llava" else reference.model.visual
                tower.requires_grad_(False)
            model = smp.transform(copy.deepcopy(reference))
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
            ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
            rank, world = dist.get_rank(), dist.get_world_size()
            local = _vlm_rows(family, rank, rank in image_ranks)
            whole = _global_batch(family, image_ranks, world)
            report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": [], "tower_grad": 0.0}
            for _ in range(steps):
                loss = model(**local, labels=local["input_ids"]).loss
                loss.backward()
                ref_loss = reference(**whole, labels=whole["input_ids"]).loss
                ref_loss.backward()
                report["losses"].append(float(ref_loss.detach()))
                report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss.detach()) - float(ref_loss.detach())))
                report["grad_diff"] = max(report["grad_diff"], _grad_gap(model, reference))
                report["tower_grad"] = max([report["tower_grad"], *(
                    float(p.grad.abs().max()) for n, p in reference.named_parameters()
                    if p.grad is not None and ("vision" in n or "visual" in n))])
                opt.step(), ref_opt.step()
                opt.zero_grad(), ref_opt.zero_grad()
            return {**report, **_offloaded_by_tower(model)}
    finally:
        recipe.install_image_path_on_every_rank = original


def _offloaded_by_tower(model: torch.nn.Module) -> dict:
    """Bytes the activation offloader moved to host in the last forward, in the vision tower's
    blocks and in the others (empty when offloading is off)."""
    from smp.activations import offload_stats

    stats = offload_stats(model)
    if stats is None:
        return {}
    offloader = model._smp_activation_offloader
    tower = [any(k in type(b).__name__ for k in ("Vision", "CLIPEncoder", "Siglip")) for b in offloader.blocks]
    return {"tower_offloaded": sum(o for o, t in zip(stats.offloaded_bytes, tower) if t),
            "tower_blocks": sum(tower),
            "other_offloaded": sum(o for o, t in zip(stats.offloaded_bytes, tower) if not t)}


def mixed_batch_in_subprocess(family: str, timeout: float = 150.0) -> dict:
    """Run `mixed_batch` with smp's fix off in a fresh 2-rank pool inside a subprocess (the
    collective mismatch aborts the processes): {"returncode", "tail"}."""
    import subprocess
    import sys

    code = (
        "from smp.testing.rank_pool import RankPool\n"
        "from tests.models import vlm_cases\n"
        "pool = RankPool(2)\n"
        "try:\n"
        f"    print('RESULT', pool.run(vlm_cases.mixed_batch, config={{}}, family={family!r}, steps=1,"
        f" run_tower_everywhere=False, timeout={timeout - 60}))\n"
        "finally:\n"
        "    pool.close(force=True)\n"
    )
    root = str(REPO_ROOT)
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return {"returncode": None, "tail": f"timed out: {(e.stdout or '')[-500:]}"}
    return {"returncode": done.returncode, "tail": (done.stdout + done.stderr)[-2000:]}


# --- 6. 0-d parameters and contrastive losses ---------------------------------------------------

def contrastive(config: dict, family: str, gather: bool = True, steps: int = 3) -> dict:
    """CLIP / SigLIP at world 2, each rank its 2 rows of a 4-row batch, the loss over the global
    batch from smp.vision's gathered embeddings, vs the model's own loss (`return_loss=True`) on
    the whole batch in one process: {"loss_diff", "grad_diff", "losses", "scalar_is_0d"} over
    `steps` SGD steps. `gather=False` (negative control) uses only this rank's rows."""
    import copy

    from smp.testing.distributed import world_mean
    from smp.vision import contrastive as losses

    with smp.session(config):
        torch.manual_seed(0)
        reference = build(family)
        model = smp.transform(copy.deepcopy(reference))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(5)
        ids, pixels = torch.randint(3, 250, (4, 8), generator=g), torch.randn(4, 3, 16, 16, generator=g)
        rows = slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
        group = None if gather else dist.new_group([dist.get_rank()])
        report = {"loss_diff": 0.0, "grad_diff": 0.0, "losses": [], "scalar_is_0d": model.logit_scale.dim() == 0}
        for _ in range(steps):
            out = model(input_ids=ids[rows], pixel_values=pixels[rows])
            if family == "clip":
                loss = losses.clip_loss(out.image_embeds, out.text_embeds, model.logit_scale, group)
            else:
                loss = losses.siglip_loss(out.image_embeds, out.text_embeds, model.logit_scale, model.logit_bias, group)
            loss.backward()
            ref_loss = reference(input_ids=ids, pixel_values=pixels, return_loss=True).loss
            ref_loss.backward()
            report["losses"].append(float(ref_loss.detach()))
            report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss.detach()) - float(ref_loss.detach())))
            report["grad_diff"] = max(report["grad_diff"], _grad_gap(model, reference))
            opt.step(), ref_opt.step()
            opt.zero_grad(), ref_opt.zero_grad()
        return report


class _Scaled(torch.nn.Module):
    """Two blocks and a 0-d temperature, as CLIP's logit_scale."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x * self.scale.exp()).logsumexp(-1).mean()


def scalar_parameter(average: bool = True, steps: int = 3) -> dict:
    """A model with a 0-d parameter at world 2, each rank its half of the batch, vs one process:
    {"loss_diff", "grad_diff", "scale_grad_diff"}. `average=False` (negative control) leaves the
    0-d parameter's gradient unaveraged (each rank's own)."""
    import copy

    from smp.sharding import fsdp
    from smp.testing.distributed import world_mean

    original = fsdp.average_scalar_gradients
    if not average:
        fsdp.average_scalar_gradients = lambda params, mesh: None
    try:
        with smp.session({}):
            torch.manual_seed(0)
            reference = _Scaled()
            model = smp.transform(copy.deepcopy(reference))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
            local = batch[2 * dist.get_rank(): 2 * dist.get_rank() + 2]
            report = {"loss_diff": 0.0, "grad_diff": 0.0, "scale_grad_diff": 0.0, "scalar_is_0d": model.scale.dim() == 0}
            for _ in range(steps):
                loss = model(local)
                loss.backward()
                ref_loss = reference(batch)
                ref_loss.backward()
                report["loss_diff"] = max(report["loss_diff"], abs(world_mean(loss.detach()) - float(ref_loss.detach())))
                report["grad_diff"] = max(report["grad_diff"], _grad_gap(model, reference))
                report["scale_grad_diff"] = max(report["scale_grad_diff"], float((model.scale.grad - reference.scale.grad).abs()))
                opt.step(), ref_opt.step()
                opt.zero_grad(), ref_opt.zero_grad()
            return report
    finally:
        fsdp.average_scalar_gradients = original


def frozen_tower_offloaded_anyway(config: dict) -> dict:
    """`mixed_batch` with a frozen LLaVA tower and the offloader's gradient check off."""
    from smp.activations import offloading

    original = offloading._needs_grad
    offloading._needs_grad = lambda module, args, kwargs: True
    try:
        return mixed_batch(config, "llava", image_ranks=(0, 1), steps=1, freeze_tower=True)
    finally:
        offloading._needs_grad = original


def mixed_batch_refused(config: dict) -> str:
    """Mllama (no `get_image_features`: its tower needs aspect-ratio ids and tile masks) with an
    image on rank 0 only: the error each rank raises before the forward runs, or ''."""
    with smp.session(config):
        torch.manual_seed(0)
        model = smp.transform(build("mllama"))
        batch = {"input_ids": torch.randint(3, 240, (1, 8))}
        if dist.get_rank() == 0:  # never reaches the model: the refusal comes first
            batch["pixel_values"] = torch.zeros(1, 1, 2, 3, 16, 16)
        try:
            model(**batch)
        except smp.Error as e:
            return f"{type(e).__name__}: {e}"
        return ""
