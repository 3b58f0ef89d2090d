"""Two "machines" on this one, for the multi-node launch tests.

Each node is a network namespace of its own, the two joined by a veth pair whose addresses
exist only inside them, so traffic between the nodes crosses a real (virtual) link and never
touches this machine's own interfaces. A command runs on a node with that node's network, its
own host name (node0, node1) and a hosts file naming both nodes, bind-mounted over /etc/hosts
in a private mount namespace: launchers and gloo then find their peers by host name as they
would on a cluster. Only the hosts file is written (in a temporary folder deleted by
:meth:`TwoNodes.stop`, which also ends every process left inside the namespaces and deletes
them, the veth pair with them). Where the machine cannot host this (not root, no ``ip netns``,
iproute2 missing and not installable), :func:`start_nodes` raises ``pytest.skip``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests import tiers

PREFIX = "pretrain-test-"  # namespace names: PREFIX<pid of the test process>-<node>
HOSTS = ("node0", "node1")
SUBNET = "10.201.0"  # node i is SUBNET.(i+1)/24, inside its namespace only


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _ensure_tools() -> None:
    """Root, iproute2 (installed with apt-get when missing), nsenter and unshare, or skip."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        if shutil.which("apt-get") is None:
            pytest.skip("iproute2 (ip) is not installed and apt-get is not available")
        quiet = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "iproute2"]):
            done = subprocess.run(cmd, env=quiet, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                pytest.skip(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
    missing = [t for t in ("ip", "nsenter", "unshare", "hostname", "mount") if not shutil.which(t)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not found")


def _remove_stale() -> None:
    """Delete namespaces left by a test process that was killed before it could clean up."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name.removeprefix(PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _kill_inside(name)
            _ip("netns", "delete", name, check=False)


def _kill_inside(namespace: str) -> None:
    """End every process in ``namespace`` (all of them were started by the test using it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _ip("netns", "pids", namespace, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while pids and time.time() < deadline:
            pids = _ip("netns", "pids", namespace, check=False).stdout.split()
            time.sleep(0.1)
        if not pids:
            return


class TwoNodes:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="netns-test-"))
        self.namespaces = [f"{PREFIX}{os.getpid()}-{i}" for i in range(len(HOSTS))]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(len(HOSTS))]
        self.hosts_file = self.root / "hosts"
        self.veths = [f"vpt{os.getpid()}{i}" for i in range(len(HOSTS))]  # <= 15 characters

    def start(self) -> None:
        self.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{addr} {host}\n" for addr, host in zip(self.addresses, HOSTS, strict=True)))
        for ns in self.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
        for ns, veth, addr in zip(self.namespaces, self.veths, self.addresses, strict=True):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def command(self, node: int, cmd: list[str]) -> list[str]:
        """``cmd`` as it runs on ``node``: its network, host name and hosts file."""
        setup = ('hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"')
        return ["nsenter", f"--net=/run/netns/{self.namespaces[node]}", "unshare", "--uts",
                "--mount", "sh", "-c", setup, HOSTS[node], str(self.hosts_file), *cmd]

    def popen(self, node: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, cmd), **kwargs)

    def stop(self) -> None:
        for ns in self.namespaces:
            if Path(f"/run/netns/{ns}").exists():
                _kill_inside(ns)
                _ip("netns", "delete", ns, check=False)  # deletes its end of the veth pair too
        if Path(f"/sys/class/net/{self.veths[0]}").exists():  # start() failed before moving it
            _ip("link", "delete", self.veths[0], check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def start_nodes() -> TwoNodes:
    tiers.require("cluster", "starts two network-namespace nodes")
    _ensure_tools()
    _remove_stale()
    nodes = TwoNodes()
    try:
        nodes.start()
    except RuntimeError as err:
        nodes.stop()
        pytest.skip(f"cannot create two network namespaces joined by a veth pair: {err}")
    return nodes
