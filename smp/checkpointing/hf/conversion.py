"""Checkpoint tensors that `from_pretrained` converts, not only renames, loaded by `load_hf`
through transformers' own converters.

transformers (5.x) maps some checkpoint layouts onto a model with a `WeightConverter` from its
conversion mapping: per-expert `experts.<i>.w1.weight` / `w3.weight` stacked and joined into one
`experts.gate_up_proj` (MergeModulelist, Concatenate), a fused `attn.qkv` chunked into q, k and v
(Chunk), expert tensors transposed (Transpose). `save_pretrained` writes those tensors back in
the original layout, so a folder it writes needs the conversion to load again. load_hf applies
the same converters the way from_pretrained does (`smp._compat.CheckpointConversion`):

1. Planning, the same on every rank, before anything is read: the file's keys a converter
   matches are grouped by the model key they are renamed to (one group per first target, as
   from_pretrained files them), each group's sources in from_pretrained's key order (the order a
   merge stacks them in). Each group's converter runs once on meta tensors of the file's shapes,
   which names its results and their shapes; those are checked against the model with the
   renamed tensors. A converter that does not run on the file's shapes, or two groups (or a
   group and a renamed key) writing one tensor, is refused naming the key.
2. Loading, on each rank: each group with a result this rank holds reads its source tensors
   whole (a merge needs every expert) by byte range (read.py: nothing stays mapped), cast to
   the model's dtype as from_pretrained casts them, runs the same converter and copies this
   rank's part of each result into the model (what the DTensor's placements give this rank, by
   local slicing). One group at a time: beside the model, at most one group's sources and
   results are in memory. Renamed tensors keep the box-by-box read (`load_hf`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from smp.checkpointing.format.packed import place
from smp.errors import CheckpointError


@dataclass
class Group:
    """The file's keys one converter turns into one or more model tensors."""

    pattern: str  # a source pattern of the converter (which converter: CheckpointConversion.convert)
    layer: str  # the model key from_pretrained files the group under: its first target
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> file keys, in load order
    targets: dict[str, list[int]] = field(default_factory=dict)  # model key -> whole shape

    def keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]


def in_load_order(keys: list[str], conversion: Any) -> list[str]:
    """The file's keys in the order from_pretrained visits them (`experts.2` before `experts.10`):
    a converter stacks its sources in that order."""
    return sorted(keys, key=conversion.key_order)


def plan(matched: dict[str, tuple[str, str]], saved: dict[str, list[int]], conversion: Any,
         source: str) -> list[Group]:
    """The groups of `matched` ({file key: (model key, converter source pattern)}), each with the
    names and shapes of its results from a run of its converter on meta tensors."""
    groups: dict[str, Group] = {}
    for key in in_load_order(list(matched), conversion):
        layer, pattern = matched[key]
        group = groups.setdefault(layer, Group(pattern, layer))
        if conversion.converter_of(pattern) is not conversion.converter_of(group.pattern):
            first = group.keys()[0]
            raise CheckpointError(
                f"{source}: {key!r} and {first!r} are converted into {layer!r} by two different "
                f"transformers converters ({conversion.converter_of(pattern)!r}, "
                f"{conversion.converter_of(group.pattern)!r}); from_pretrained's result is not defined "
                "for such a file. Load it with from_pretrained and save it again with save_pretrained."
            )
        group.sources.setdefault(pattern, []).append(key)
    written: dict[str, str] = {}
    for group in groups.values():
        metas = {p: [(k, torch.empty(saved[k], device="meta")) for k in keys] for p, keys in group.sources.items()}
        try:
            results = conversion.convert(group.pattern, group.layer, metas)
        except Exception as e:  # noqa: BLE001 - any failure: the conversion is not provably from_pretrained's
            raise CheckpointError(
                f"{source}: transformers' converter for {group.keys()[0]!r} "
                f"({conversion.converter_of(group.pattern)!r}) does not run on the file's shapes "
                f"({type(e).__name__}: {str(e)[:200]}), so load_hf cannot reproduce from_pretrained for it. "
                "Load the folder with from_pretrained, then smp.transform the model."
            ) from None
        group.targets = {name: list(t.shape) for name, t in results.items()}
        for name in group.targets:
            if name in written:
                raise CheckpointError(
                    f"{source}: {written[name]!r} and {group.keys()[0]!r} are both converted into "
                    f"{name!r}; from_pretrained's result is not defined for such a file"
                )
            written[name] = group.keys()[0]
    return list(groups.values())


def load(groups: list[Group], conversion: Any, folder: dict[str, Any], state: dict[str, torch.Tensor],
         source: str) -> None:
    """Fill the tensors of `state` (this rank's, keyed by model key) that `groups` convert, each
    source read whole from `folder` (checks.read_folder) by byte range: no file stays mapped
    or open between reads, so only the group in hand is resident."""
    with torch.no_grad():
        for group in groups:
            local = [name for name in group.targets if name in state]
            if not local:
                continue
            dtypes = {state[name].dtype for name in local}
            if len(dtypes) > 1:
                raise CheckpointError(
                    f"{source}: the tensors converted from {group.keys()[0]!r} ({', '.join(local)}) have "
                    f"different dtypes in this model ({sorted(map(str, dtypes))}); from_pretrained casts "
                    "a converter's sources to one dtype. Give them one dtype before load_hf."
                )
            dtype = dtypes.pop()  # from_pretrained casts the sources to the model's dtype, then converts
            # Readers, not tensors: transformers' converter reads each source when it runs and
            # drops them after its first step (a merge's stack), so they are never held beside
            # both of its results.
            sources = {p: [(k, functools.partial(folder[k].whole, dtype)) for k in keys]
                       for p, keys in group.sources.items()}
            try:
                results = _converted(conversion, group, sources)
            except Exception as e:  # noqa: BLE001 - ran on the shapes, failed on the data: named
                raise CheckpointError(
                    f"{source}: transformers' converter for {group.keys()[0]!r} failed on the file's tensors "
                    f"({type(e).__name__}: {str(e)[:200]}); from_pretrained would leave {group.layer!r} at its init"
                ) from None
            del sources
            shapes = {name: list(t.shape) for name, t in results.items()}
            if shapes != group.targets:  # the run on the data differs from the planned one
                raise CheckpointError(
                    f"{source}: transformers' converter for {group.keys()[0]!r} gave {shapes} on the "
                    f"file's tensors, {group.targets} on their shapes; refused rather than guessed"
                )
            for name in local:
                place(results[name], state[name], name, source)
            del results


def _converted(conversion: Any, group: Group, sources: dict[str, list[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    return conversion.convert(group.pattern, group.layer, sources)
