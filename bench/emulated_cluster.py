"""Run a torchrun job on N emulated nodes joined by rate-limited links, on one Linux host.

    sudo python bench/emulated_cluster.py --nodes 2 --procs-per-node 1 --link-mbit 1000 \
        -- bench/bench_collectives.py --sizes-mib 16 64

Each node is a network namespace with one NIC (`eth0`, a veth into a switch namespace that
holds a bridge). Both directions of every NIC are shaped with a token bucket (`tc tbf`) to
`--link-mbit`, so a node can send and receive at that rate at once, as on a full-duplex
Ethernet/EFA port behind a non-blocking switch; `--latency-ms` adds a one-way delay (netem).
Processes of one node talk over the kernel's local path (unshaped), like GPUs on NVLink.

Every node runs the real multi-node launch, `torchrun --nnodes N --node-rank k
--master-addr <node 0>`, with `GLOO_SOCKET_IFNAME=eth0`: nothing about the job knows it is
emulated. This is how the bandwidth-bound regime that compressed gradient sync is for gets
measured on a machine without a cluster. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and
`ip`/`tc` (iproute2). Everything it creates is removed on exit, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

SUBNET = "10.99.0"


def nic_tx_bytes() -> int | None:
    """Inside a job run by this tool: bytes this node's NIC has sent so far (None elsewhere)."""
    nic = os.environ.get("GLOO_SOCKET_IFNAME")
    path = f"/sys/class/net/{nic}/statistics/tx_bytes"
    return int(open(path).read()) if nic and os.path.exists(path) else None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _ns(ns: str, *cmd: str) -> None:
    _sh("ip", "netns", "exec", ns, *cmd)


def _shape(ns: str, dev: str, mbit: float, latency_ms: float) -> None:
    # burst must hold at least one MTU-sized packet plus a few ms of line rate, or tbf stalls.
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))
    if latency_ms > 0:
        _ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{latency_ms}ms")
        parent = ("parent", "1:1", "handle", "10:")
    else:
        parent = ("root",)
    _ns(ns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{mbit}mbit",
        "burst", str(burst), "latency", "20ms")


class Cluster:
    """Namespaces, bridge and shaped veth pairs for `nodes` emulated hosts."""

    def __init__(self, nodes: int, link_mbit: float, latency_ms: float = 0.0):
        tag = uuid.uuid4().hex[:6]
        self.switch = f"smp-sw-{tag}"
        self.hosts = [f"smp-n{k}-{tag}" for k in range(nodes)]
        self.link_mbit, self.latency_ms = link_mbit, latency_ms

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def __enter__(self) -> "Cluster":
        try:
            _sh("ip", "netns", "add", self.switch)
            _ns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            _ns(self.switch, "ip", "link", "set", "br0", "up")
            for k, host in enumerate(self.hosts):
                _sh("ip", "netns", "add", host)
                port = f"p{k}"
                _ns(self.switch, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host)
                _ns(self.switch, "ip", "link", "set", port, "master", "br0", "up")
                _ns(host, "ip", "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
                _ns(host, "ip", "link", "set", "eth0", "up")
                _ns(host, "ip", "link", "set", "lo", "up")
                _shape(host, "eth0", self.link_mbit, self.latency_ms)  # node -> switch
                _shape(self.switch, port, self.link_mbit, self.latency_ms)  # switch -> node
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for ns in [*self.hosts, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def run(self, procs_per_node: int, script_and_args: list[str], port: int = 29531) -> int:
        """torchrun on every node; returns the first non-zero exit code (0 if all succeed).
        Node 0's output goes to this terminal; the other nodes' to a log, shown if they fail."""
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", SMP_EMULATED_LINK_MBIT=f"{self.link_mbit:g}")
        env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no hostname warnings: the namespaces have no DNS
        jobs = []
        with tempfile.TemporaryDirectory(prefix="smp-emulated-") as logs:
            for k, host in enumerate(self.hosts):
                cmd = ["ip", "netns", "exec", host, sys.executable, "-m", "torch.distributed.run",
                       f"--nnodes={len(self.hosts)}", f"--nproc-per-node={procs_per_node}", f"--node-rank={k}",
                       f"--master-addr={self.address(0)}", f"--master-port={port}", *script_and_args]
                log = None if k == 0 else open(os.path.join(logs, f"node{k}.log"), "w")
                jobs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None), log))
            try:
                codes = _wait_all([job for job, _ in jobs])
            finally:
                _stop([job for job, _ in jobs])  # interrupted: no torchrun outlives its network
            for k, (code, (_, log)) in enumerate(zip(codes, jobs)):
                if log:
                    log.close()
                    if code:
                        print(f"--- node {k} exited with {code}; its output:", file=sys.stderr)
                        print(open(log.name).read()[-20000:], file=sys.stderr)
        return next((c for c in codes if c), 0)


def _wait_all(jobs: list[subprocess.Popen]) -> list[int]:
    """Wait for every node; once one fails, stop the others (they would wait for it until
    their collective timeout)."""
    while None in (codes := [job.poll() for job in jobs]):
        if any(codes):
            _stop(jobs)
            break
        time.sleep(0.2)
    return [job.wait() for job in jobs]


def _stop(jobs: list[subprocess.Popen]) -> None:
    for job in jobs:
        if job.poll() is None:
            job.terminate()  # torchrun forwards SIGTERM to its workers
    for job in jobs:
        try:
            job.wait(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--procs-per-node", type=int, default=1)
    parser.add_argument("--link-mbit", type=float, default=1000.0, help="per-node NIC rate, each direction")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay added per NIC direction")
    parser.add_argument("script_and_args", nargs=argparse.REMAINDER, help="-- script.py [args]")
    args = parser.parse_args()
    script = args.script_and_args[1:] if args.script_and_args[:1] == ["--"] else args.script_and_args
    if not script:
        parser.error("give the script to run after --")
    if os.geteuid() != 0:
        sys.exit("emulated_cluster.py needs root (network namespaces and tc); run it with sudo")
    # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so the namespaces are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with Cluster(args.nodes, args.link_mbit, args.latency_ms) as cluster:
        sys.exit(cluster.run(args.procs_per_node, script))


if __name__ == "__main__":
    main()
