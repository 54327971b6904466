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
2. Placing, for a converter that only stacks and joins (MergeModulelist, Concatenate: Mixtral's
   experts): each source tensor lands in one box of the result, which `_stacked` works out
   from the operations, the sources' order and shapes. transformers' converter is the oracle:
   it runs on small stand-ins of the sources (each dim cut to at most 2, every value distinct)
   and its result must equal the boxes filled with the same stand-ins, or the group falls back
   to step 3.
3. Loading, on each rank, one group at a time. A placed group reads, for each box of each result
   this rank holds, only the parts of the sources that fall in it, one source at a time,
   straight into the rank's own shard (read.py: by byte range, cast as read, no mapping), so
   nothing beside the shard is held but a read slab. Any other group reads its sources whole,
   cast to the model's dtype as from_pretrained casts them, runs the same converter and copies
   this rank's part of each result into the model (what the DTensor's placements give this rank,
   by local slicing): beside the model, at most one group's sources and results are in memory.
   Renamed tensors keep the box-by-box read (`load_hf`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from smp.checkpointing.format.packed import held_boxes, place
from smp.errors import CheckpointError


@dataclass
class Group:
    """The file's keys one converter turns into one or more model tensors."""

    pattern: str  # a source pattern of the converter (which converter: CheckpointConversion.convert)
    layer: str  # the model key from_pretrained files the group under: its first target
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> file keys, in load order
    targets: dict[str, list[int]] = field(default_factory=dict)  # model key -> whole shape
    placed: dict[str, list[Piece]] | None = None  # model key -> where each source lands (step 2), or None


    def keys(self) -> list[str]:
        return [key for keys in self.sources.values() for key in keys]


@dataclass(frozen=True)
class Piece:
    """Where one source tensor lands in a converter's result: the box at `offsets` of size
    `sizes`, which is the source with a size-1 dim inserted at each of `inserted` (a stack's)."""

    key: str
    offsets: list[int]
    sizes: list[int]
    inserted: tuple[int, ...] = ()


def _stacked(steps: list[tuple[str, int]], order: list[str],
             sources: dict[str, list[tuple[str, list[int]]]]) -> tuple[list[int], list[Piece]] | None:
    """(shape, pieces) of the one tensor that `steps` (CheckpointConversion.stacking: torch.stack
    of each source pattern's list, torch.cat over the patterns in the converter's `order`) make of
    `sources` ({source pattern: [(file key, shape)]} in load order); None where the steps do not
    end in one tensor or would not run on these shapes."""
    Block = tuple[list[int], list[Piece]]
    values: dict[str, Block | list[Block]] = {
        p: [(list(shape), [Piece(key, [0] * len(shape), list(shape))]) for key, shape in items]
        for p, items in sources.items()
    }
    for op, dim in steps:
        if op == "stack":
            for p, value in values.items():
                if not isinstance(value, list):
                    continue  # already one tensor: MergeModulelist passes it through
                shapes = {tuple(shape) for shape, _ in value}
                if len(shapes) != 1:
                    return None
                shape = list(shapes.pop())
                d = dim + len(shape) + 1 if dim < 0 else dim
                if not 0 <= d <= len(shape):
                    return None
                pieces = [Piece(piece.key, piece.offsets[:d] + [i] + piece.offsets[d:],
                                piece.sizes[:d] + [1] + piece.sizes[d:],
                                tuple(sorted((x + 1 if x >= d else x) for x in piece.inserted) + [d]))
                          for i, (_, block) in enumerate(value) for piece in block]
                values[p] = (shape[:d] + [len(value)] + shape[d:], pieces)
        else:  # cat: the patterns in the converter's order, each list's tensors in their order
            blocks: list[Block] = []
            for p in order:
                if p in values:
                    value = values.pop(p)
                    blocks.extend(value if isinstance(value, list) else [value])
            if not blocks or len({len(shape) for shape, _ in blocks}) != 1:
                return None
            ndim = len(blocks[0][0])
            d = dim + ndim if dim < 0 else dim
            if not 0 <= d < ndim or len({tuple(s[:d] + s[d + 1:]) for s, _ in blocks}) != 1:
                return None
            shape, pieces, at = list(blocks[0][0]), [], 0
            for block_shape, block in blocks:
                for piece in block:
                    offsets = list(piece.offsets)
                    offsets[d] += at
                    pieces.append(Piece(piece.key, offsets, piece.sizes, piece.inserted))
                at += block_shape[d]
            shape[d] = at
            values = {order[0]: (shape, pieces)}
    if len(values) != 1:
        return None
    value = next(iter(values.values()))
    return None if isinstance(value, list) else value


def _placement(conversion: Any, group: Group, saved: dict[str, list[int]]) -> dict[str, list[Piece]] | None:
    """{the group's one result: its Pieces} when its converter only stacks and joins and the
    converter itself, run on stand-ins (each dim cut to at most 2, every value distinct), gives
    exactly the stand-ins placed by the same rule; None otherwise (the group is converted whole)."""
    steps = conversion.stacking(group.pattern)
    if not steps or len(group.targets) != 1:
        return None
    order = conversion.source_patterns(group.pattern)
    (name, shape), = group.targets.items()
    real = _stacked(steps, order, {p: [(k, saved[k]) for k in keys] for p, keys in group.sources.items()})
    if real is None or real[0] != shape:
        return None
    small = {p: [(k, [min(n, 2) for n in saved[k]]) for k in keys] for p, keys in group.sources.items()}
    probe = _stacked(steps, order, small)
    if probe is None:
        return None
    stand_ins, start = {}, 0
    for items in small.values():
        for key, dims in items:
            count = 1
            for n in dims:
                count *= n
            stand_ins[key] = torch.arange(start, start + count, dtype=torch.float64).reshape(dims)
            start += count
    try:
        out = conversion.convert(group.pattern, group.layer,
                                 {p: [(k, stand_ins[k]) for k, _ in items] for p, items in small.items()})
    except Exception:  # noqa: BLE001 - the converter decides; not provable here: converted whole
        return None
    if list(out) != [name]:
        return None
    placed = torch.full(probe[0], float("nan"), dtype=torch.float64)
    for piece in probe[1]:
        _box(placed, piece.offsets, piece.sizes).copy_(stand_ins[piece.key].reshape(piece.sizes))
    return {name: real[1]} if torch.equal(placed, out[name]) else None


def _box(t: torch.Tensor, offsets: list[int], sizes: list[int]) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        t = t.narrow(dim, offset, size)
    return t


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
        group.placed = _placement(conversion, group, saved)
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
    """Fill the tensors of `state` (this rank's, keyed by model key) that `groups` convert from
    `folder` (checks.read_folder), by byte range: a placed group (step 2) reads only this rank's
    parts of its sources, into place; any other reads its sources whole and converts them. No
    file stays mapped or open between reads, so only the group in hand is resident."""
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
            if group.placed is not None and not any(
                    isinstance(state[name], DTensor) and any(p.is_partial() for p in state[name].placements)
                    for name in local):
                for name in local:
                    _read_placed(group.placed[name], folder, state[name])
                continue
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


def _read_placed(pieces: list[Piece], folder: dict[str, Any], target: torch.Tensor) -> None:
    """Fill this rank's part of `target` from the sources' parts that fall in each box it holds,
    one source at a time, read straight into place (cast as read)."""
    local = target.to_local() if isinstance(target, DTensor) else target
    for offsets, sizes, local_at in held_boxes(target):
        for piece in pieces:
            low = [max(a, b) for a, b in zip(offsets, piece.offsets)]
            high = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, piece.offsets, piece.sizes)]
            if any(h <= lo for lo, h in zip(low, high)):
                continue
            out = _box(local, [at + lo - o for at, lo, o in zip(local_at, low, offsets)],
                       [h - lo for lo, h in zip(low, high)])
            for dim in sorted(piece.inserted, reverse=True):
                out = out.squeeze(dim)
            keep = [dim for dim in range(len(low)) if dim not in piece.inserted]
            folder[piece.key].read([low[d] - piece.offsets[d] for d in keep], [high[d] - low[d] for d in keep], out)


def _converted(conversion: Any, group: Group, sources: dict[str, list[tuple[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    return conversion.convert(group.pattern, group.layer, sources)
