"""Rank-side cases for the vision, multimodal and speech section of the model-coverage matrix.

Families come from transformers' auto mappings (image-text-to-text, zero-shot image
classification, image classification, vision backbones, speech seq2seq, audio classification,
CTC), each under the first of those kinds that lists it; nothing is listed by hand. Each is
built from its own config with every size shrunk (nested text / vision / audio sub-configs too)
and fed inputs of its modality built without a processor: image tokens counted from the
model's own `get_image_features`, pixel values at the config's image size, mel features at the
encoder's length, raw audio for wav2vec2-style encoders. The loss is the kind's: LM loss with
labels for image-text and speech seq2seq, classification / CTC loss with labels, the global-batch
contrastive loss (smp.vision.clip_loss / siglip_loss over gathered embeddings) for CLIP-like
models, a feature-map loss for backbones. Each function returns plain data to the test.
"""

from __future__ import annotations

import copy
import inspect
import traceback

import torch
import torch.distributed as dist

import smp
from smp.testing.distributed import world_mean
from smp.testing.distributed import full_tensor
from tests.models.model_coverage_cases import TOL, _param_diff, _unproven, _what_acted

ROWS = 4  # rows of the global batch (split over the data-parallel ranks)
SEQ = 16  # text tokens after the image tokens
VOCAB = 256
FIRST_SPECIAL = 240  # token ids from here up are kept for the config's special tokens

# kind -> the auto mapping (in transformers.models.auto.modeling_auto) whose families it covers,
# in the order a family listed under several is given its kind
KINDS = {
    "image-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "contrastive": "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "backbone": "MODEL_FOR_BACKBONE_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "audio-classification": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "ctc": "MODEL_FOR_CTC_MAPPING_NAMES",
}

# The tiny shape: every size key a config (or any of its sub-configs) has is set to this.
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=VOCAB, max_position_embeddings=128, text_hidden_size=64, vision_hidden_size=64,
    projection_dim=64, projector_hidden_size=64, out_hidden_size=64, embed_dim=64, depth=2, num_heads=4,
    d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=128, decoder_ffn_dim=128, num_layers=2, num_decoder_layers=2, d_ff=128, d_kv=16,
    max_source_positions=32, max_target_positions=64, mm_tokens_per_image=4, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, sliding_window=16,
    num_labels=3, num_mel_bins=16, conv_dim=[32, 32], conv_kernel=[10, 3], conv_stride=[5, 2],
    num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, tdnn_dim=[32, 32], tdnn_kernel=[3, 3],
    tdnn_dilation=[1, 1], xvector_output_dim=32, projection_size=64, num_groups=8, num_feat_extract_layers=2,
    # SpecAugment-style masking draws random numbers in every training forward: off
    apply_spec_augment=False, mask_time_prob=0.0, mask_feature_prob=0.0,
)
# Sizes of a convolutional stage list, one entry per stage: kept to their length, shrunk.
STAGE_LISTS = dict(depths=1, hidden_sizes=16, embed_dims=16, embedding_size=16)


def vision_families() -> list[tuple[str, str]]:
    """(model_type, kind) for every family of the kinds' auto mappings, each under the first
    kind that lists it, in the mappings' order."""
    from transformers.models.auto import modeling_auto

    seen, out = set(), []
    for kind, mapping in KINDS.items():
        for model_type in getattr(modeling_auto, mapping, {}):
            if model_type not in seen:
                seen.add(model_type)
                out.append((model_type, kind))
    return out


def model_class(family: str, kind: str) -> type:
    import transformers
    from transformers.models.auto import modeling_auto

    name = getattr(modeling_auto, KINDS[kind])[family]
    return getattr(transformers, name if isinstance(name, str) else name[0])


def _shrink(d: dict, specials: list[int]) -> dict:
    """The config dict `d` (nested sub-config dicts too) with its sizes at TINY, dropout off,
    token ids beyond the tiny vocabulary moved to distinct ids at its top."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and (key.endswith("config") or "model_type" in value):
            out[key] = _shrink(value, specials)
            if key == "text_config" and isinstance(value.get("rope_parameters"), dict):
                # multimodal RoPE (Qwen-VL style) splits head_dim / 2 in three; its default split
                # (16, 24, 24) is read when the key is absent, for the full-size head. Others ignore it.
                out[key]["rope_parameters"] = {"mrope_section": [2, 2, 4], **out[key]["rope_parameters"]}
        elif key in TINY and value is not None and type(value) is type(TINY[key]):
            out[key] = TINY[key]
        elif key in TINY and isinstance(TINY[key], int) and isinstance(value, list) \
                and len(value) == d.get("num_hidden_layers") and all(isinstance(v, int) for v in value):
            out[key] = [TINY[key]] * TINY["num_hidden_layers"]  # one per layer
        elif key in STAGE_LISTS and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            out[key] = [STAGE_LISTS[key] * (1 if key == "depths" else i + 1) for i in range(len(value))]
        elif key in STAGE_LISTS and isinstance(value, int) and key == "embedding_size":
            out[key] = STAGE_LISTS[key]
        elif key in TINY and isinstance(TINY[key], int) and isinstance(value, list) and isinstance(d.get("depths"), list) \
                and len(value) == len(d["depths"]) and key not in ("num_heads", "num_attention_heads") \
                and all(isinstance(v, int) for v in value):
            out[key] = [TINY[key]] * len(value)  # one per stage of a hierarchical model
        elif key in ("num_heads", "num_attention_heads") and isinstance(value, list):
            out[key] = [2] * len(value)  # per stage: 2 heads divide every tiny stage width
        elif key in ("layer_types", "fullatt_block_indexes", "out_features", "out_indices", "stage_names",
                     "per_layer_config") \
                or key.endswith("_layer_indices"):
            continue  # recomputed by the config from the layer count (or its default)
        elif isinstance(value, float) and ("dropout" in key or "pdrop" in key or key == "layerdrop"):
            out[key] = 0.0
        elif isinstance(value, dict) and isinstance(value.get("mrope_section"), list):
            out[key] = {**value, "mrope_section": [2, 2, 4]}  # its sum is half the tiny head_dim (16)
        elif isinstance(value, int) and not isinstance(value, bool) and (key.endswith("token_id") or key.endswith("token_index")):
            if value >= FIRST_SPECIAL:
                specials.append(specials[-1] - 1 if specials else VOCAB - 1)
                out[key] = specials[-1]
            else:
                out[key] = value
        else:
            out[key] = value
    if isinstance(out.get("image_size"), int) and isinstance(out.get("patch_size"), int) and "depths" not in out:
        out["image_size"] = 4 * out["patch_size"]  # 4 x 4 patches: every merge / pooling of 2 or 4 divides it
    elif isinstance(out.get("image_size"), int):
        out["image_size"] = min(out["image_size"], 64)  # a convolutional stack: 64 x 64 pixels
    return out


def tiny_config(family: str, kind: str):
    """`family`'s default config with every size at the tiny shape (nested configs too)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[family]
    shrunk = _shrink(config_class().to_dict(), [])
    shrunk.pop("transformers_version", None)
    shrunk.pop("architectures", None)
    return config_class.from_dict(shrunk)


MAX_PARAMETERS = 30_000_000  # a sub-config the shrinking cannot reach keeps its full size


def build_vision(family: str, kind: str) -> torch.nn.Module:
    """The tiny `family` model, built eagerly (initialised by the current seed). Refused when
    the shrunk config still has more than MAX_PARAMETERS parameters (counted on the meta device
    first: a full-size model would take the machine's memory)."""
    config = tiny_config(family, kind)
    with torch.device("meta"):
        count = sum(p.numel() for p in model_class(family, kind)(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"the shrunk config still has {count / 1e6:.0f}M parameters (some sizes are not reached)")
    return model_class(family, kind)(config)


# --- inputs ----------------------------------------------------------------------------------

def _vision_config(config):
    return getattr(config, "vision_config", None) or config


def _image_hw(config) -> tuple[int, int]:
    size = getattr(_vision_config(config), "image_size", None) or 64
    return (size, size) if isinstance(size, int) else tuple(size)[-2:]


def _channels(config) -> int:
    v = _vision_config(config)
    return getattr(v, "num_channels", None) or getattr(v, "in_channels", None) or 3


def _forward_params(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _image_token(config) -> int | None:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def image_layout(model) -> dict:
    """How one image enters `model` (an image-text model), without a processor: the pixel
    tensor of one image, its extra inputs and the number of image tokens the text holds for
    it, counted from the model's own image features."""
    config = model.config
    token = _image_token(config)
    h, w = _image_hw(config)
    if token is None:  # the model places the image itself (BLIP, GIT, Kosmos-2, ...)
        return {"pixel_values": torch.randn(1, _channels(config), h, w), "extra": {}, "tokens": 0, "token": None}
    v = _vision_config(config)
    if "image_grid_thw" in _forward_params(model):  # Qwen-VL style: flattened patches + grid
        patch, temporal = v.patch_size, getattr(v, "temporal_patch_size", 2) or 1
        merge = getattr(v, "spatial_merge_size", 2)
        grid = 2 * merge
        pixels = torch.randn(grid * grid, _channels(config) * temporal * patch * patch)
        return {"pixel_values": pixels, "extra": {"image_grid_thw": torch.tensor([[1, grid, grid]])},
                "tokens": grid * grid // (merge * merge), "token": token}
    features = getattr(model, "get_image_features", None)
    if features is None:
        raise ValueError(f"{type(model).__name__} has no get_image_features")
    hidden = model.get_input_embeddings().embedding_dim
    extra = {"image_sizes": torch.tensor([[h, w]])} if "image_sizes" in inspect.signature(features).parameters else {}
    first = None
    for pixels in (torch.randn(1, _channels(config), h, w), torch.randn(1, 1, _channels(config), h, w)):
        try:
            with torch.no_grad():
                out = features(pixel_values=pixels, **extra)
        except Exception as e:  # noqa: BLE001 - the other layout, or the reason it cannot run
            first = first or e
            continue
        if hasattr(out, "pooler_output") and out.pooler_output is not None:
            out = out.pooler_output
        elif hasattr(out, "last_hidden_state"):
            out = out.last_hidden_state
        parts = out if isinstance(out, (list, tuple)) else [out]
        total = sum(p.numel() for p in parts)
        if total % hidden:
            raise ValueError(f"image features of {total} values are no whole number of tokens of width {hidden}")
        return {"pixel_values": pixels, "extra": extra, "tokens": total // hidden, "token": token}
    raise first


def _special_ids(d: dict) -> set[int]:
    """Every token id a config dict (nested configs too) names (`*_token_id`, `*_token_index`)."""
    found = set()
    for key, value in d.items():
        if isinstance(value, dict):
            found |= _special_ids(value)
        elif isinstance(value, int) and not isinstance(value, bool) and key.endswith(("token_id", "token_index")):
            found.add(value)
    return found


def _text_row(g: torch.Generator, length: int, config=None) -> torch.Tensor:
    """Random text ids, none of them a special token of `config` (an image token drawn as text
    would ask for one more image than the row holds)."""
    allowed = [i for i in range(3, FIRST_SPECIAL - 20) if i not in (_special_ids(config.to_dict()) if config else ())]
    return torch.tensor(allowed)[torch.randint(0, len(allowed), (1, length), generator=g)]


def rows(model, kind: str, seed: int, with_images: tuple[bool, ...] = (True,) * ROWS,
         layout: dict | None = None) -> list[dict]:
    """One input dict per row (labels included) of the global batch for `model` of `kind`;
    image-text rows with `with_images[i]` False are text-only, with the same labelled length."""
    g = torch.Generator().manual_seed(seed)
    config = model.config
    out = []
    for i, image in enumerate(with_images):
        if kind == "image-text":
            layout = layout or image_layout(model)
            start = getattr(config, "vision_start_token_id", None)
            prefix = layout["tokens"] + (1 if start is not None else 0)
            ids = _text_row(g, prefix + SEQ, config)
            row = {}
            if image:
                if start is not None:
                    ids[0, 0] = start
                if layout["tokens"]:
                    ids[0, prefix - layout["tokens"]:prefix] = layout["token"]
                row["pixel_values"] = layout["pixel_values"] + 0.1 * i
                row.update(layout["extra"])
            labels = ids.clone()
            labels[0, :prefix] = -100  # every row's loss over the same number of text tokens
            row.update(input_ids=ids, labels=labels)
            for name in ("token_type_ids", "mm_token_type_ids"):
                if name in _forward_params(model):
                    row[name] = (ids == layout["token"]).long()
        elif kind in ("image-classification", "backbone", "contrastive"):
            h, w = _image_hw(config)
            row = {"pixel_values": torch.randn(1, _channels(config), h, w, generator=g)}
            if kind == "image-classification":
                row["labels"] = torch.randint(0, config.num_labels, (1,), generator=g)
            if kind == "contrastive":
                row["input_ids"] = _text_row(g, 8, config)
        else:
            row = _audio_row(model, kind, g)
        out.append(row)
    return out


def _audio_row(model, kind: str, g: torch.Generator) -> dict:
    config = model.config
    name = getattr(model, "main_input_name", "input_features")
    if name == "input_features":
        if getattr(config, "max_source_positions", None) and getattr(config, "num_mel_bins", None):
            shape = (1, config.num_mel_bins, 2 * config.max_source_positions)  # Whisper's fixed length
        else:
            feat = getattr(config, "input_feat_per_channel", None) or getattr(config, "num_mel_bins", None) or 80
            shape = (1, 64, feat * (getattr(config, "input_channels", None) or 1))
        row = {name: torch.randn(*shape, generator=g)}
    else:
        row = {name: torch.randn(1, 4000, generator=g)}  # raw audio: 4000 samples
    if kind == "speech-seq2seq":
        row["labels"] = _text_row(g, 6, config)
    elif kind == "audio-classification":
        row["labels"] = torch.randint(0, config.num_labels, (1,), generator=g)
    else:  # ctc
        row["labels"] = torch.randint(1, min(config.vocab_size, 30), (1, 3), generator=g)
    return row


def collate(parts: list[dict]) -> dict:
    """Rows concatenated key by key (a key only some rows have: those rows' values)."""
    keys = dict.fromkeys(k for p in parts for k in p)
    return {k: torch.cat([p[k] for p in parts if k in p]) for k in keys}


def local_part(parts: list[dict]) -> list[dict]:
    """This rank's rows of the global batch, by data-parallel rank (a TP group shares them)."""
    per = len(parts) // smp.state.dp_size
    return parts[smp.state.dp_rank * per:(smp.state.dp_rank + 1) * per]


# --- losses ----------------------------------------------------------------------------------

def loss_of(model, kind: str, batch: dict, group=None) -> torch.Tensor:
    """The kind's loss of `model` on `batch`; contrastive models: over the embeddings of
    `group`'s ranks gathered (None: this rank's rows only, as one process on the whole batch)."""
    if kind == "contrastive":
        from smp.vision import contrastive

        out = model(**batch)
        scale = model.logit_scale
        if getattr(model, "logit_bias", None) is not None:
            return contrastive.siglip_loss(out.image_embeds, out.text_embeds, scale, model.logit_bias, group)
        return contrastive.clip_loss(out.image_embeds, out.text_embeds, scale, group)
    if kind == "backbone":
        # A fixed random weighting of each row's feature maps (the same for every row and every
        # run). The mean square is no test: after a backbone's final LayerNorm it is ~1 whatever
        # the features, so the layers below got ~0 gradient and a random training forward
        # (stochastic depth) left the loss unchanged.
        maps = model(**batch).feature_maps
        return sum((m.float() * _fixed_weights(tuple(m.shape[1:]))).mean() for m in maps)
    return model(**batch).loss


def _fixed_weights(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1234))


def _single_group():
    """A process group of this rank alone (every rank creates every one, as new_group needs)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def can_build(family: str, kind: str) -> str | None:
    """None, or why the tiny `family` cannot run here: built from the shrunk config and
    trained one step in one process on its kind's inputs, without smp."""
    try:
        torch.manual_seed(0)
        model = build_vision(family, kind)
        batch = collate(rows(model, kind, seed=100))  # the cells' global batch
        loss = loss_of(model, kind, batch)
        loss.backward()
        if not torch.isfinite(loss):
            return f"its loss at the tiny shape is {float(loss)}"
    except Exception as e:  # noqa: BLE001 - recorded as the skip reason
        return f"does not run in one process at the tiny shape: {type(e).__name__}: {e}".splitlines()[0][:200]
    return None


# --- the cells -------------------------------------------------------------------------------

def _grad_diff(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """Largest gradient gap by parameter name, relative to the reference gradient's largest
    value where that is above 1 (a tiny model's default init gives some gradients of 1e9, e.g.
    Gemma3's projector, where float32 rounding alone is 1e2); a gradient no loss reached counts
    as 0."""
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        g = torch.zeros(p.shape) if p.grad is None else full_tensor(p.grad).float()
        r = torch.zeros(p.shape) if ref[name].grad is None else ref[name].grad.float()
        if g.numel():
            worst = max(worst, float((g - r).abs().max()) / max(1.0, float(r.abs().max())))
    return worst


def training_forward_is_random(model: torch.nn.Module, kind: str, parts: list[dict], group) -> bool:
    """Whether `model`'s training forward draws random numbers (same batch, other seed, other
    loss), as model_coverage_cases' check: such draws differ between one process and each
    rank's rows, so the comparison runs in eval mode and says so."""
    state = torch.get_rng_state()
    losses = []
    with torch.no_grad():
        for seed in (1, 2):
            torch.manual_seed(seed)
            losses.append(float(loss_of(model, kind, collate(parts), group)))
    torch.set_rng_state(state)
    return losses[0] != losses[1]

def equivalence(config: dict, family: str, kind: str, delayed: bool = False, skip_tower: bool = False,
                frozen_norms: bool = False, gather: bool = True) -> dict:
    """`family` transformed under `config` vs the same model in one process, one SGD step on
    one global batch: loss, gradient and parameter gaps and what the mode did. `skip_tower`
    (negative control) drops the images of this rank's rows on every rank but the first, so
    that the one-process run sees images the transformed one never computes. `frozen_norms`
    puts every BatchNorm layer in eval mode (its running statistics), in both models. `gather=False`
    (negative control) computes a contrastive loss over this rank's rows only."""
    with smp.session(config):
        torch.manual_seed(smp.state.config.random_seed)
        reference = build_vision(family, kind)
        reference.train()
        if delayed:
            with torch.device("meta"):
                model = build_vision(family, kind)
        else:
            model = copy.deepcopy(reference)
        parts = rows(reference, kind, seed=100)
        alone = _single_group() if kind == "contrastive" else None
        eval_mode = training_forward_is_random(copy.deepcopy(reference), kind, parts, alone)
        if eval_mode:
            reference.eval()
        model = smp.transform(model)
        model.train(reference.training)
        if frozen_norms:
            from smp.sharding.batch_norm import BATCH_NORMS

            for m in (*model.modules(), *reference.modules()):
                if isinstance(m, BATCH_NORMS):
                    m.eval()
        report = {"param_diff": _param_diff(model, reference)}
        group = (smp.state.dp_mesh.get_group() if gather else alone) if kind == "contrastive" else None
        local = local_part(parts)
        if skip_tower and smp.state.dp_rank > 0:
            local = [_text_only(p, model.config) for p in local]
        loss = loss_of(model, kind, collate(local), group)
        loss.backward()
        ref_loss = loss_of(reference, kind, collate(parts), alone)
        ref_loss.backward()
        report["loss_diff"] = abs(world_mean(loss) - float(ref_loss))
        report["grad_diff"] = _grad_diff(model, reference)
        return {**report, "eval_mode": eval_mode, **_what_acted(model)}


def _text_only(row: dict, config) -> dict:
    """`row` without its image: pixel inputs dropped, image tokens turned into text."""
    row = {k: v for k, v in row.items() if k not in ("pixel_values", "image_grid_thw")}
    ids = row["input_ids"].clone()
    if _image_token(config) is not None:
        ids[ids == _image_token(config)] = 5
    return {**row, "input_ids": ids}


def _status(report: dict, config: dict, delayed: bool) -> dict:
    exact = report["loss_diff"] < TOL and report["grad_diff"] < TOL and (not delayed or report["param_diff"] == 0.0)
    unproven = _unproven(config, report)
    if exact and unproven:
        return {"status": "unproven", "detail": unproven}
    cell = {"status": "exact" if exact else "mismatch", "detail": report}
    if report.get("eval_mode"):
        cell["note"] = "eval mode: its training forward draws random numbers"
    return cell


def _guarded(run) -> dict:
    try:
        return run()
    except smp.Error as e:
        return {"status": "refused", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    except Exception as e:  # noqa: BLE001 - a crash is a finding, reported with its traceback
        return {"status": "crash", "detail": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"}


def classify(config: dict, family: str, kind: str, delayed: bool = False, skip_tower: bool = False,
             frozen_norms: bool = False, gather: bool = True) -> dict:
    """One cell of the section, statuses as model_coverage_cases.classify's."""
    return _guarded(lambda: _status(equivalence(config, family, kind, delayed, skip_tower, frozen_norms, gather),
                                    config, delayed))


def mixed_batch(config: dict, family: str, kind: str, image_ranks: tuple[int, ...] = (0,)) -> dict:
    """The 'mixed batch' cell (image-text families): world 2, only `image_ranks` hold images,
    vs one process on the whole batch."""

    def run() -> dict:
        with smp.session(config):
            torch.manual_seed(smp.state.config.random_seed)
            reference = build_vision(family, kind)
            model = smp.transform(copy.deepcopy(reference))
            per = ROWS // dist.get_world_size()
            flags = tuple(r in image_ranks for r in range(dist.get_world_size()) for _ in range(per))
            parts = rows(reference, kind, seed=100, with_images=flags)
            rank = dist.get_rank()
            loss = loss_of(model, kind, collate(parts[rank * per:(rank + 1) * per]))
            loss.backward()
            ref_loss = loss_of(reference, kind, collate(parts))
            ref_loss.backward()
            report = {"loss_diff": abs(world_mean(loss) - float(ref_loss)), "grad_diff": _grad_diff(model, reference)}
            return _status({**report, **_what_acted(model)}, config, False)

    return _guarded(run)


def pretrained_round_trip(config: dict, family: str, kind: str) -> dict:
    """The 'pretrained round trip' cell: save_pretrained -> load_hf into the transformed model
    -> export_hf -> from_pretrained, every tensor bitwise (tests/models/vlm_cases.py's case)."""
    from tests.models import vlm_cases

    def run() -> dict:
        report = vlm_cases.pretrained_round_trip(config, family, builder=lambda: build_vision(family, kind))
        if report["error"]:  # its detail lines joined: the page shows a cell's first line
            return {"status": "refused", "detail": " ".join(report["error"].split())[:300]}
        exact = report["loaded_diff"] == 0.0 and report["round_trip_diff"] == 0.0
        return {"status": "exact" if exact else "mismatch", "detail": report}

    return _guarded(run)


def pretrained_on_meta(config: dict, family: str, kind: str) -> dict:
    """The 'pretrained on meta' cell: built on the meta device, `smp.transform(model,
    weights=folder)` of a save_pretrained folder vs `from_pretrained` of it transformed, every
    parameter and buffer (non-persistent ones too) bitwise (tests/models/vlm_cases.py's case)."""
    from tests.models import vlm_cases

    def run() -> dict:
        report = vlm_cases.meta_load(config, family, one_call=True, builder=lambda: build_vision(family, kind))
        if report["error"]:
            return {"status": "refused", "detail": " ".join(report["error"].split())[:300]}
        return {"status": "exact" if report["diff"] == 0.0 else "mismatch", "detail": report}

    return _guarded(run)

