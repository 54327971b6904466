"""Per-rank memory and communication plan, computed by running smp's parallelism recipe for real.

`plan(config, model, world_size)` joins a *fake* process group (torch's FakeStore / "fake"
backend: collectives are no-ops) as one rank of a world of N, builds the model on the meta
device, and runs the recipe `smp.transform` runs on it without materialising. What FSDP2 and
tensor parallel then hold per rank is read from the sharded parameters themselves (padding
included), so the plan follows the exact placement code a real run uses, at any world size, in
seconds and with no memory: a 1024-rank plan of an 8B model runs on a laptop.

    fake_world.py     the fake process group
    memory.py         parameter, gradient, optimizer-state and gathered bytes from FSDP's shards
    communication.py  collective bytes per step (bandwidth-optimal formulas)
    activations.py    saved-tensor bytes of one meta forward (stand-ins for SDPA and MoE grouped matmul)
    experts.py        MoE experts: the expert parameters a rank holds
    report.py         `plan()` and its `ParallelismPlan` report
    search.py         `suggest()`: the smallest degrees that fit a device
"""

from smp.planning.communication import comm_bytes_per_step
from smp.planning.fake_world import fake_world
from smp.planning.memory import GiB, OPTIMIZER_STATE_FACTOR, human_bytes, sharded_bytes
from smp.planning.report import ParallelismPlan, plan
from smp.planning.search import suggest

__all__ = [
    "GiB",
    "OPTIMIZER_STATE_FACTOR",
    "ParallelismPlan",
    "comm_bytes_per_step",
    "fake_world",
    "human_bytes",
    "plan",
    "sharded_bytes",
    "suggest",
]
