"""bench/emulated_cluster.py: the links it builds really are rate-limited and full-duplex, and
a failing node does not leave the others waiting. Needs root with network namespaces and tc
(skipped elsewhere, e.g. unprivileged CI containers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests import REPO_ROOT

ROOT = REPO_ROOT
TOOL = ROOT / "bench" / "emulated_cluster.py"

PROBE = """
import json, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
x = torch.ones(2 * 2**20)  # 8 MiB from node 0 to node 1
dist.barrier()
t = time.perf_counter()
dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
dist.barrier()
if rank == 0:
    open(sys.argv[1], "w").write(json.dumps({"mbit_per_s": x.numel() * 32 / (time.perf_counter() - t) / 1e6}))
dist.destroy_process_group()
"""


def _can_emulate() -> bool:
    """Root, iproute2, network namespaces, veth pairs and the tbf qdisc all usable here."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    ns = f"smp-probe-{os.getpid()}"
    steps = [
        ["ip", "netns", "add", ns],
        ["ip", "netns", "exec", ns, "ip", "link", "add", "vprobe0", "type", "veth", "peer", "name", "vprobe1"],
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "vprobe0", "root", "tbf",
         "rate", "100mbit", "burst", "64kb", "latency", "20ms"],
    ]
    try:
        return all(subprocess.run(cmd, capture_output=True).returncode == 0 for cmd in steps)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _can_emulate(), reason="needs root, iproute2 and network namespaces"),
]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("smp-")}


def test_link_is_rate_limited(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    result = tmp_path / "rates.json"
    before = _namespaces()
    run = subprocess.run(
        [sys.executable, str(TOOL), "--nodes", "2", "--link-mbit", "200", "--", str(script), str(result)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rate = json.loads(result.read_text())["mbit_per_s"]
    # 8 MiB at 200 Mbit/s takes ~0.34 s; unshaped loopback moves it 20-100x faster.
    assert 100 < rate < 220, f"measured {rate:.0f} Mbit/s through a 200 Mbit/s link"
    assert _namespaces() == before  # everything it created is gone


def test_failing_node_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text(
        "import os, time, torch.distributed as dist\n"
        "if os.environ['GROUP_RANK'] == '1':\n"
        "    raise SystemExit('node 1 fails before joining')\n"
        "dist.init_process_group('gloo')  # would wait for node 1 for 30 min\n"
    )
    before = _namespaces()
    run = subprocess.run(
        [sys.executable, str(TOOL), "--nodes", "2", "--link-mbit", "1000", "--", str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode != 0
    assert "node 1 fails before joining" in run.stderr
    assert _namespaces() == before
