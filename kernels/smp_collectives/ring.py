"""Ring reduce-scatter / all-gather / all-reduce over point-to-point sends.

Bandwidth-optimal: each rank sends (N-1)/N of the buffer per reduce-scatter or all-gather, the
lower bound for any algorithm without compression, whatever the topology. They are the
reference against which the compressed algorithms and the process group's own collectives are
measured (bytes are counted in `counters`), and the oracle in tests: on integer-valued inputs
their sums are exact, so they must agree bitwise with any correct reduce-scatter.

Rank r sends to r+1 and receives from r-1 (ranks within `group`). In reduce-scatter step k
(k = 0..N-2) rank r sends its running sum of chunk (r-k-1) mod N and adds its own data to the
incoming chunk (r-k-2) mod N; after N-1 steps it holds the full sum of chunk r.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from smp_collectives import counters


def _neighbours(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    to_global = (lambda g: dist.get_global_rank(group, g)) if group is not None else (lambda g: g)
    return n, r, to_global((r + 1) % n), to_global((r - 1) % n)


def _exchange(send: torch.Tensor, recv: torch.Tensor, dst: int, src: int, group) -> None:
    ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


@torch.no_grad()
def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, name: str = "ring",
) -> torch.Tensor:
    """output[C] = op over ranks of input.view(N, C)[rank]. SUM or AVG (sum, then / N)."""
    n, r, dst, src = _neighbours(group)
    chunks = input.reshape(n, -1)
    if output.numel() != chunks.shape[1]:
        raise ValueError(f"reduce_scatter output has {output.numel()} elements, expected {chunks.shape[1]}")
    if n == 1:
        output.copy_(chunks[0])
    else:
        running = chunks[(r - 1) % n].clone()
        incoming = torch.empty_like(running)
        for k in range(n - 1):
            _exchange(running, incoming, dst, src, group)
            running, incoming = incoming, running
            running += chunks[(r - k - 2) % n]
        output.copy_(running.view_as(output))
        counters.record(f"{name}.reduce_scatter", (n - 1) * running.numel() * running.element_size())
    if op == dist.ReduceOp.AVG:
        output.div_(n)
    elif op != dist.ReduceOp.SUM:
        raise ValueError(f"ring reduce_scatter supports SUM and AVG, not {op}")
    return output


@torch.no_grad()
def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, name: str = "ring"
) -> torch.Tensor:
    """output.view(N, C)[i] = input of rank i."""
    n, r, dst, src = _neighbours(group)
    chunks = output.view(n, -1)
    chunks[r].copy_(input.reshape(-1))
    for k in range(n - 1):
        # Forward the chunk received last step (own chunk first); receive the one before it.
        _exchange(chunks[(r - k) % n], chunks[(r - k - 1) % n], dst, src, group)
    if n > 1:
        counters.record(f"{name}.all_gather", (n - 1) * input.numel() * input.element_size())
    return output


@torch.no_grad()
def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, name: str = "ring",
) -> torch.Tensor:
    """In place: reduce-scatter then all-gather, 2 (N-1)/N of the buffer sent per rank."""
    n = dist.get_world_size(group)
    if n == 1:
        return tensor
    flat = tensor.reshape(-1)
    chunk = -(-flat.numel() // n)
    padded = torch.zeros(n * chunk, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()] = flat
    mine = torch.empty(chunk, dtype=tensor.dtype, device=tensor.device)
    reduce_scatter(mine, padded, group, op, name)
    all_gather(padded, mine, group, name)
    tensor.copy_(padded[: flat.numel()].view_as(tensor))
    return tensor
