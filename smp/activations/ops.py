"""Op names as users write them in the config ("aten.mm") -> the torch ops they denote."""

from __future__ import annotations

import torch

from smp._compat import OpOverload, OpOverloadPacket


def resolve_op(name: str) -> OpOverloadPacket | OpOverload:
    """`"aten.mm"` -> torch.ops.aten.mm (every overload); `"aten.mm.default"` -> that overload.

    Raises ValueError naming the op when it does not exist in this torch build.
    """
    parts = name.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"op name {name!r} must look like 'aten.mm' or 'aten.mm.default'")
    namespace, op_name = parts[0], parts[1]
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return getattr(packet, parts[2]) if len(parts) == 3 else packet
    except (AttributeError, RuntimeError):
        raise ValueError(
            f"op {name!r} does not exist in torch {torch.__version__}; name an aten op such as "
            "'aten.mm' (see torch.ops.aten)"
        ) from None


def op_matcher(names: list[str]):
    """A predicate on OpOverloads: True for the ops `names` denote."""
    overloads, packets = set(), set()
    for name in names:
        op = resolve_op(name)
        (overloads if isinstance(op, OpOverload) else packets).add(op)

    def matches(op: OpOverload) -> bool:
        return op in overloads or getattr(op, "overloadpacket", None) in packets

    return matches
