"""Hugging Face import: `load_hf` streams a local safetensors folder into a transformed model.

The files `from_pretrained` would read (checks.py: the index followed, every file a regular
file, every header checked), read by byte range with no memory mapping (read.py): each rank
reads exactly the boxes of each tensor that its shards hold, straight into them, so it holds its
own shards plus one slab of at most read.CHUNK_BYTES in flight, in private and in resident
memory alike: the whole model is never materialised on one rank. A packed tensor-parallel
weight (fused q|k|v), whose part on a rank is several boxes, is read box by box (packed.boxes).
Tensors from_pretrained converts with transformers' own converters (per-expert tensors stacked,
a fused qkv chunked) are placed source by source into the rank's shards where the converter
only stacks and joins, else read whole, one converter's sources at a time (conversion.py). Keys
are matched by from_pretrained's rules (`_plan_hf_load`); a meta model is allocated and filled.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from smp import _compat
from smp.checkpointing.collective import agree
from smp.checkpointing.collective import rank as _rank
from smp.checkpointing.format import metadata, packed
from smp.checkpointing.format.pipeline import stages_view, whole_model_shapes
from smp.checkpointing.hf import conversion as hf_conversion
from smp.checkpointing.hf.checks import read_folder
from smp.checkpointing.hf.read import Damaged, Stored, load_host_bytes
from smp.checkpointing.hf.ties import clean, tied_groups
from smp.checkpointing.sharded import wait
from smp.errors import CheckpointError, SMPWarning
from smp.regular_files import NotReadable
from smp.sharding.delayed_init import _user_class, has_meta_tensors

def _from_pretrained_rules(model: nn.Module) -> tuple[str, re.Pattern | None, re.Pattern | None, set[str]]:
    """What `from_pretrained` forgives, for this model: its base-model prefix, the patterns of
    checkpoint keys it ignores when unexpected (the class's `_keys_to_ignore_on_load_unexpected`,
    plus the legacy `rotary_emb.inv_freq` / `position_ids` buffers it drops for models that now
    hold them as non-persistent buffers) and when missing (`_keys_to_ignore_on_load_missing`),
    and the names of the model's non-persistent buffers (never in a state dict, often in old files)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    unexpected, missing = _compat.keys_to_ignore_on_load(model)
    buffers = [clean(n) for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):
        unexpected.add(r"(^|\.)position_ids$")
    non_persistent = {
        clean(f"{module_name}.{name}" if module_name else name)
        for module_name, module in model.named_modules()
        for name in _compat.non_persistent_buffers(module)
    }

    def compiled(patterns: set[str]) -> re.Pattern | None:
        return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else None

    return prefix, compiled(unexpected), compiled(missing), non_persistent


def _model_key(key: str, model_keys: set[str], prefix: str) -> str | None:
    """The model's name for checkpoint key `key`: itself, or with the base-model prefix
    stripped (a `bert.`-prefixed file into a base BertModel) or added (the reverse), as
    from_pretrained does; None when nothing matches."""
    if key in model_keys:
        return key
    if prefix:
        if key.startswith(prefix + ".") and key[len(prefix) + 1:] in model_keys:
            return key[len(prefix) + 1:]
        if f"{prefix}.{key}" in model_keys:
            return f"{prefix}.{key}"
    return None


def _key_converter(model: nn.Module) -> _compat.CheckpointConversion | None:
    """transformers' own conversion of checkpoint keys and tensors for `model`'s class (what
    `from_pretrained` applies: LLaVA's `language_model.model.*` -> `model.language_model.*`, ViT's
    `vit.encoder.layer.*` -> `vit.layers.*`, the legacy renames, and converters such as
    per-expert tensors stacked into one), or None outside transformers or where it has none.
    Asked of the class rebuilt from its config on the meta device: the transformed model's
    classes (FSDP's `FSDP<Name>`) and module paths (checkpoint wrappers) are not the ones
    transformers looks up."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            plain = _user_class(model)(model.config)
    except Exception:  # noqa: BLE001 - no rebuild: keys are matched as they are (mismatches raise)
        return None
    conversion = _compat.CheckpointConversion(plain)
    return None if conversion.empty else conversion


def _plan_hf_load(
    saved: dict[str, list[int]], model: nn.Module, model_shapes: dict[str, list[int]], source: str,
    conversion: _compat.CheckpointConversion | None = None,
) -> tuple[dict[str, str], list[hf_conversion.Group], list[str]]:
    """(checkpoint key -> model key for each tensor read as it is, the groups of keys transformers'
    converters turn into model tensors (hf_conversion.plan), what was forgiven, for the log).

    Follows from_pretrained's rules: keys renamed by transformers' own conversion for the model
    (`conversion`, from `_key_converter`; a key the model holds as it is stays itself), then
    `_from_pretrained_rules`; a tied parameter is read once, from the first of its names the
    file holds. Raises CheckpointError for anything else that does not match: missing or
    unexpected keys, shape mismatches (a converted tensor's shape is its converter's result).
    """
    prefix, ignore_unexpected, ignore_missing, non_persistent = _from_pretrained_rules(model)
    model_keys = set(model_shapes)
    lookup = dict.fromkeys(model_keys, True)  # transformers asks `model_keys.get(name) is not None`
    mapping: dict[str, str] = {}
    present: set[str] = set()
    ignored: list[str] = []
    unexpected: dict[str, list[int]] = {}
    converted: dict[str, tuple[str, str]] = {}  # checkpoint key -> (model key, converter pattern)
    for key in saved:
        target, renamed, pattern = None, key, None
        if conversion is not None:
            renamed, pattern = conversion.rename(key, lookup)
            if renamed not in model_keys and key in model_keys:
                renamed, pattern = key, None  # from_pretrained's fallback: the key as it is
            if renamed in model_keys:
                target = renamed
        if pattern is not None and target is not None:
            converted[key] = (target, pattern)
            continue
        if target is None and pattern is None:
            target = _model_key(renamed, model_keys, prefix)
        if target is None:
            target = _model_key(renamed, non_persistent, prefix)
            if target is not None or (ignore_unexpected and ignore_unexpected.search(key)):
                ignored.append(key)
            else:
                unexpected[key] = saved[key]
        elif target in present:  # the same tensor under its prefixed and its plain name
            ignored.append(key)
        else:
            mapping[key] = target
            present.add(target)
    groups = hf_conversion.plan(converted, saved, conversion, source) if converted else []
    produced = {name: shape for group in groups for name, shape in group.targets.items()}
    both = sorted(present & set(produced))
    if both:
        key = next(k for k, v in mapping.items() if v == both[0])
        raise CheckpointError(
            f"{source} holds {key!r}, the model's {both[0]!r}, and also tensors that from_pretrained "
            f"converts into it; from_pretrained's result is not defined for such a file"
        )
    tied_converted = sorted(n for names in tied_groups(model) for n in names if n in produced)
    if tied_converted:
        raise CheckpointError(
            f"{source}: {tied_converted[0]!r} is a tied parameter and a converted tensor; load_hf does not "
            "load converted tensors into tied parameters. Load the folder with from_pretrained, then "
            "smp.transform the model."
        )
    present |= set(produced)
    tied_alias: set[str] = set()
    for names in tied_groups(model):
        in_file = [n for n in names if n in present]
        if not in_file:
            continue  # none of its names in the file: reported missing below
        # A tied parameter is one tensor: read it from the first name the file holds; the
        # other names (absent, or a second copy of the same values) load nothing.
        tied_alias.update(n for n in names if n != in_file[0])
        for duplicate in in_file[1:]:
            key = next(k for k, v in mapping.items() if v == duplicate)
            del mapping[key]
            ignored.append(key)
    absent = model_keys - present - tied_alias
    forgiven_missing = {k for k in absent if ignore_missing is not None and ignore_missing.search(k)}
    # A base-model checkpoint (every key found under the prefix) into a model with a task head:
    # from_pretrained keeps the head's fresh init, so its keys are not "missing" (the fine-tuning
    # start: bert-base into BertForSequenceClassification).
    if prefix and mapping and all(v == f"{prefix}.{k}" for k, v in mapping.items()):
        forgiven_missing |= {k for k in absent if not k.startswith(prefix + ".")}
    ignored.extend(sorted(f"{k} (missing, keeps its init)" for k in forgiven_missing))
    try:
        metadata.check_compatible(
            {**{mapping[k]: v for k, v in saved.items() if k in mapping}, **produced, **unexpected},
            model_shapes, source, frozenset(tied_alias | forgiven_missing),
        )
    except CheckpointError as e:
        if conversion is None or "missing keys" not in str(e):
            raise
        config = getattr(model, "config", None)
        detail = str(e).split("\n", 1)[-1]
        raise CheckpointError(
            f"{source} leaves tensors of this model unloaded after transformers' own key conversion for "
            f"{_user_class(model).__name__} (model_type {getattr(config, 'model_type', None)!r}), which "
            "from_pretrained applies too: it would leave them at a fresh random init (if save_pretrained "
            "wrote this folder from this class, transformers' saving and loading disagree for this class "
            f"and config):\n{detail}"
        ) from None
    return mapping, groups, ignored


def _meta_names(model: nn.Module) -> list[str]:
    return sorted({clean(n) for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta})


def _computed_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Values for the model's non-persistent buffers still on the meta device (rotary
    `inv_freq`, `position_ids`: never in a checkpoint), computed as from_pretrained computes
    them: by the model's own `_init_weights` on each module holding one, run on a copy of that
    module rebuilt from the config (so no loaded weight is touched). A buffer the init does not
    write, or writes differently from one run to the next, is refused by name."""
    wanted = {
        clean(f"{module_name}.{name}" if module_name else name)
        for module_name, module in model.named_modules()
        for name, t in _compat.own_buffers(module).items()
        if t is not None and t.is_meta and name in _compat.non_persistent_buffers(module)
    }
    if not wanted:
        return {}
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = None
    why = "it is not a transformers model, so no init call is known to compute them"
    values: dict[str, torch.Tensor] = {}
    if PreTrainedModel is not None and isinstance(model, PreTrainedModel):
        why = "its class does not rebuild from its config"
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                plain = _user_class(model)(model.config)
        except Exception:  # noqa: BLE001 - no rebuild, no values: refused below
            plain = None
        if plain is not None:
            why = "the model's _init_weights does not set them (the same way twice)"
            values = _init_buffers(plain, wanted)
    unset = sorted(wanted - set(values))
    if unset:
        raise CheckpointError(
            f"load_hf cannot fill the non-persistent buffers {', '.join(unset[:8])}"
            f"{' ...' if len(unset) > 8 else ''} of this meta model: no checkpoint holds them and {why}. "
            "Build those buffers on a real device (accelerate's init_empty_weights() keeps buffers "
            "real), or build the model eagerly."
        )
    return values


def _init_buffers(plain: nn.Module, wanted: set[str]) -> dict[str, torch.Tensor]:
    """{name: value} for the buffers of `wanted` that transformers' init computes on the meta
    rebuild `plain`: each module holding one is allocated alone (its own tensors), and the
    nearest PreTrainedModel's `_init_weights` runs on it twice, from two different fills: a value
    counts only if both runs give it bitwise (written, and not drawn at random)."""
    from transformers import PreTrainedModel

    owner: dict[str, nn.Module] = {}
    for name, module in plain.named_modules():  # parents come first: the nearest one wins
        if isinstance(module, PreTrainedModel):
            owner.update({n: module for n, _ in module.named_modules(prefix=name)})
    values: dict[str, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for module_name, module in plain.named_modules():
            own = {n for n in _compat.non_persistent_buffers(module)
                   if (f"{module_name}.{n}" if module_name else n) in wanted}
            if not own:
                continue
            for store in (_compat.own_parameters(module), _compat.own_buffers(module)):
                for key, t in store.items():
                    if t is not None:
                        store[key] = (nn.Parameter(torch.empty_like(t, device="cpu"), t.requires_grad)
                                      if isinstance(t, nn.Parameter) else torch.empty_like(t, device="cpu"))
            runs = []
            for fill in (0, 1):
                for n in own:
                    buf = _compat.own_buffers(module)[n]
                    buf.fill_(fill) if buf.dtype != torch.bool else buf.fill_(bool(fill))
                _compat.clear_initialized_marks((module, *module.parameters(recurse=False), *module.buffers(recurse=False)))
                try:
                    _compat.init_weights_function(owner[module_name])(module)
                except Exception:  # noqa: BLE001 - an init that cannot run sets nothing: refused by the caller
                    break
                runs.append({n: _compat.own_buffers(module)[n].clone() for n in own})
            if len(runs) == 2:
                for n in own:
                    if torch.equal(runs[0][n], runs[1][n]):
                        values[f"{module_name}.{n}" if module_name else n] = runs[0][n]
    return values


def _tied_copies(whole_mapping: dict[str, str], mapping: dict[str, str], groups: list[list[str]],
                 local: dict[str, Any]) -> list[tuple[str, str]]:
    """For a tie across pipeline stages (each stage its own copy): a rank whose copies no key of
    the file reads (`mapping`: this rank's reads) reads the tied tensor's key (`whole_mapping`:
    the whole model's) into one of them; the copies on this rank that no key reads are filled
    from the one read. (source, target) pairs."""
    pairs = []
    for names in groups:
        held = [n for n in names if n in local]
        if not held:
            continue
        loaded = [n for n in held if n in mapping.values()]
        if not loaded:
            key = next((k for k, v in whole_mapping.items() if v in names), None)
            if key is None:
                continue  # no name of it in the file: reported missing
            mapping[key] = held[0]
            loaded = [held[0]]
        pairs += [(loaded[0], n) for n in held if n not in loaded]
    return pairs


def _allocate(model: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor]) -> None:
    """Give a meta model (sharded by smp.transform(materialize=False), or not) its memory on
    `device`: tensors already real are kept, non-persistent buffers get `buffers`, every other
    value is left for the checkpoint to write (the caller has checked that it holds them all)."""
    from smp.sharding.delayed_init import _real_values, _tensor_slots

    real = _real_values(model)
    tied_before = tied_groups(model)
    model.to_empty(device=device)
    held = {clean(n) for n, _ in model.named_parameters(remove_duplicate=False)}
    whole = all(len(held & set(g)) in (0, len(g)) for g in tied_before)  # False: a stage holds one copy of a tie
    if hasattr(model, "tie_weights") and whole:
        model.tie_weights()  # to_empty gives each name of a tied parameter its own tensor
    if tied_groups(model) != tied_before:
        raise CheckpointError(
            "load_hf: allocating the meta model untied its tied parameters "
            f"({[g for g in tied_before if g not in tied_groups(model)]}); build the model eagerly"
        )
    with torch.no_grad():
        for qualified, store, name in _tensor_slots(model):
            value = real.get(qualified, buffers.get(clean(qualified)))
            if value is not None:
                _local(store[name]).copy_(value)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _read_boxes(folder: dict[str, Stored], mapping: dict[str, str], state: dict[str, Any]) -> None:
    """Read each key of `mapping` into this rank's part of its model tensor: one box for a
    shard, several for a packed tensor-parallel weight (packed.boxes), in file order."""
    def place(key: str) -> tuple[str, int]:
        entry = folder[key].pieces[0][0]
        return entry.file, entry.start

    for key in sorted(mapping, key=place):
        target = state[mapping[key]]
        for offsets, sizes, local_at in packed.held_boxes(target):
            out = _local(target)
            for dim, (at, size) in enumerate(zip(local_at, sizes)):
                out = out.narrow(dim, at, size)
            folder[key].read(offsets, sizes, out)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_hf(hf_dir: str | os.PathLike, model: nn.Module, *, device: torch.device | str | None = None) -> None:
    """Stream a local HF safetensors checkpoint into an already transformed model. Collective.

    Every rank reads only its own slices. Tensors are cast to the model's dtypes. Loads what
    `from_pretrained` loads for the same model: keys renamed by transformers' own conversion
    for the model's class (older layouts such as LLaVA's `language_model.model.*`), tensors
    transformers' own converters turn into the model's (per-expert weights stacked, a fused qkv
    chunked: this rank's part of each source placed, or read whole, converted, this rank's part kept), legacy and ignorable keys skipped
    (named in one warning on rank 0), base-model prefixes added or stripped, a tied weight in
    the file once or twice; any other mismatch raises CheckpointError.

    A model still on the meta device (`smp.transform(model, materialize=False)`, or
    `smp.transform(model, weights=hf_dir)` which calls this) is allocated on `device` (default:
    the current CUDA device, else CPU) and filled from the file: every parameter and persistent
    buffer must be in it, non-persistent buffers (rotary `inv_freq`) are computed by the model's
    own init as from_pretrained does, or refused by name; nothing is left as empty memory.
    """
    wait()
    hf_dir = os.path.abspath(os.fspath(hf_dir))
    folder = read_folder(hf_dir)  # from_pretrained's files, every header checked before any read
    on_meta = has_meta_tensors(model)
    source = f"Hugging Face checkpoint {hf_dir!r}"
    # A pipelined model: each rank reads its stages' tensors; the file is matched against the
    # whole model (from_pretrained's rules asked of a stage, which has the model's class).
    model, stages, pp_group = stages_view(model)
    state = get_model_state_dict(model)
    local_shapes = metadata.tensor_shapes(state)
    shapes = whole_model_shapes(local_shapes, pp_group, f"load_hf {hf_dir!r}")
    conversion = _key_converter(stages[0])
    saved = {key: stored.shape for key, stored in folder.items()}
    mapping, groups, ignored = _plan_hf_load(saved, stages[0], shapes, source, conversion)
    whole_mapping, mapping = mapping, {key: target for key, target in mapping.items() if target in local_shapes}
    copies = _tied_copies(whole_mapping, mapping, tied_groups(model), local_shapes)
    if on_meta:
        read = (set(mapping.values()) | {n for g in tied_groups(model) if set(g) & set(mapping.values()) for n in g}
                | {name for group in groups for name in group.targets})
        unread = [n for n in _meta_names(model) if n in state and n not in read]
        if unread:
            raise CheckpointError(
                f"{source} does not hold {', '.join(unread[:8])}{' ...' if len(unread) > 8 else ''}, which "
                "this meta model has no values for (from_pretrained would initialise them; load_hf "
                "does not replay init on a meta model). Build the model eagerly, or let "
                "smp.transform initialise it (materialize=True) and then call load_hf."
            )
        for part in stages:  # each stage holds its own copies of the buffers outside its parts
            _allocate(part, torch.device(device) if device is not None else _default_device(), _computed_buffers(part))
        state = get_model_state_dict(model)
    if ignored and _rank() == 0:
        warnings.warn(
            f"smp: load_hf {hf_dir!r} ignored {len(ignored)} key(s) that from_pretrained also ignores "
            f"(legacy buffers, ignorable or duplicate tied keys): {', '.join(ignored)}",
            SMPWarning, stacklevel=2,
        )
    # Each rank reads the boxes of each tensor its shards hold, straight into them (read.py:
    # no mapping, so only what it keeps stays resident); transformers' converters' sources are
    # placed the same way where they only stack and join, else read whole, one group at a
    # time (conversion.py). Local reads: the only collective is the agreement that
    # every rank read everything (one rank's I/O error raises on all, none waits).
    problem = None
    try:
        _read_boxes(folder, mapping, state)
        hf_conversion.load(groups, conversion, folder, state, source)
    except (Damaged, NotReadable, OSError) as e:
        problem = f"rank {_rank()}: {e}"
    agree(problem, f"load_hf {hf_dir!r}: a file failed while read (its header passed the checks)")
    with torch.no_grad():
        for loaded, other in copies:  # the other copies of a tie across pipeline stages
            _local(state[other]).copy_(_local(state[loaded]))
    set_model_state_dict(model, state)


def eager_load_note(model: nn.Module, shard_ranks: int) -> str | None:
    """A line saying what building `model` whole on every rank cost, when it was (no tensor on
    the meta device, and its parameters are to be sharded over `shard_ranks` > 1 ranks), and
    what the meta path would hold instead; None otherwise."""
    if shard_ranks <= 1 or has_meta_tensors(model):
        return None
    sizes = [t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values()]
    if not sizes:
        return None
    figures = load_host_bytes(sum(sizes), max(sizes), sum(sizes) // shard_ranks)
    return (f"smp.transform: this model was built whole on every rank ({figures['eager'] / 2**30:.2f} GiB of host "
            f"memory per rank before sharding, more while from_pretrained converts a file's dtype); built on the "
            f"meta device and filled by smp.transform(model, weights=FOLDER), each rank holds about "
            f"{figures['weights'] / 2**30:.2f} GiB while loading (docs/checkpoints.md)")
