"""Tied parameters (one tensor under two or more names: `lm_head.weight` and the embedding)
as the export writes them and the import reads them, decided from the module tree so that every
rank reaches the same answer whatever its shard holds."""

from __future__ import annotations

import torch
from torch import nn


def one_copy_of_tied(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """`state` with each tied parameter under one name only, as `save_pretrained` writes it
    (safetensors refuses two names for one tensor): transformers' tie targets
    (`all_tied_weights_keys`, {target: source}: `lm_head.weight` tied to the embedding) are
    dropped, and `from_pretrained` ties them again from the source; outside transformers the
    first name in model order is kept. Decided from the module tree, the same on every rank
    (a pipeline stage holding one copy of a tie writes it only if it is the name kept)."""
    targets = set((getattr(model, "all_tied_weights_keys", None) or {}).keys())
    for names in tied_groups(model):
        present = [n for n in names if n in state]
        keep = next((n for n in names if n not in targets), names[0])
        for name in present:
            if name != keep:
                del state[name]
    return state


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The names of each parameter used under two or more names (tied weights), in model order.
    Decided from the module structure, so every rank reaches the same answer whatever its
    shard holds."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(clean(name))
    groups = [names for names in names_of.values() if len(names) > 1]
    # A pipeline stage holding one copy of a tie across stages (smp.pipeline.tied): the whole
    # model's names of it, which build_pipeline recorded on the stage.
    for names in getattr(model, "_smp_tied_names", None) or ():
        if [clean(n) for n in names] not in groups:
            groups.append([clean(n) for n in names])
    return groups
