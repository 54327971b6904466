"""A rendezvous store that survives torchrun restarts.

torchrun (c10d or static rendezvous) lets workers share its own TCPStore
(TORCHELASTIC_USE_AGENT_STORE=True), and that store outlives a worker group: after
`--max-restarts` restarts the new group finds the previous attempt's keys. gloo then reads the
dead workers' addresses and fails with "Gloo connectFullMesh failed ... Connection refused"
(seen on torch 2.13 with --standalone and the static rendezvous). smp joins through the same
store under a prefix per attempt, so each attempt meets only itself.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def restart_safe_store(timeout: datetime.timedelta) -> dist.Store | None:
    """torchrun's shared store, namespaced by TORCHELASTIC_RESTART_COUNT; None outside torchrun
    (or when it does not share its store), where init_process_group's own env:// path is right."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"smp/attempt_{attempt}/", client)
