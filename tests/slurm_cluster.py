"""A real slurm cluster on this machine for the launch tests.

munged, one slurmctld and two slurmd "nodes" (n0, n1) that both listen on 127.0.0.1 on
ports of their own, with every configuration, spool, log and PID file in one temporary
folder that :meth:`Cluster.stop` deletes after stopping the daemons (or, should the test
process be killed first, the next start does). Nothing outside that folder is written, except
that slurm-wlm and munge are installed from Debian's registry when missing. Where the machine
cannot host this (not root, no apt-get, the install fails, a daemon does not start),
:func:`start_cluster` raises ``pytest.skip`` with the reason.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests import tiers

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")
NODES = ("n0", "n1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_slurm_installed() -> None:
    """Install slurm-wlm and munge with apt-get when missing (about 10 s), or skip."""
    if os.geteuid() != 0:
        pytest.skip("starting slurm daemons needs root")
    if all(shutil.which(t) for t in DAEMONS):
        return
    if shutil.which("apt-get") is None:
        pytest.skip("slurm is not installed and apt-get is not available to install it")
    quiet = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm",
                 "munge"]):
        try:
            done = subprocess.run(cmd, env=quiet, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(cmd)} took over 10 minutes")
        if done.returncode != 0:
            pytest.skip(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
    missing = [t for t in DAEMONS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"slurm-wlm installed but {', '.join(missing)} not found")


def _slurm_conf(root: Path, ctld_port: int, node_ports: list[int]) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs=2 "
        "RealMemory=2000" for name, port in zip(NODES, node_ports, strict=True))
    # cred_expire=5: a requeued job restarts after ~5 s instead of ~2 min. MinJobAge=4 and
    # the short scheduler intervals keep `sbatch --wait` and requeues quick.
    # A random first job id: job.sh derives the rendezvous port from the job id, and two
    # clusters started at once (two test sessions on one machine) must not share ports.
    return f"""ClusterName=launchtest
FirstJobId={random.randrange(1000, 19000)}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerParameters=bf_interval=2,sched_interval=2
MinJobAge=4
KillWait=5
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


PREFIX = "slurm-test-"
OWNER = "owner"  # the test process that started a cluster's daemons


def _remove_stale() -> None:
    """Stop the daemons and delete the folder of a cluster whose test process was killed before
    it could do so itself. Only processes started from that folder's own slurm.conf, munge
    socket or key are signalled."""
    for root in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        owner = root / OWNER
        if not owner.is_file() or Path(f"/proc/{owner.read_text().strip()}").exists():
            continue
        for pid_file in root.glob("*.pid"):
            pid = pid_file.read_text().strip()
            cmdline = Path(f"/proc/{pid}/cmdline")
            if pid.isdigit() and cmdline.exists() and str(root) in cmdline.read_text():
                os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)


class Cluster:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=PREFIX))
        self.root.chmod(0o755)  # munged's socket must be reachable
        (self.root / OWNER).write_text(str(os.getpid()))
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def _daemon(self, *cmd: str) -> None:
        log = (self.root / f"{Path(cmd[0]).name}-{len(self.procs)}.out").open("w")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=log,
                                           start_new_session=True))

    def start(self) -> None:
        r = self.root
        for sub in ("state", *(f"spool/{n}" for n in NODES)):
            (r / sub).mkdir(parents=True)
        shutil.copy("/etc/munge/munge.key", r / "munge.key")
        (r / "munge.key").chmod(0o600)
        (r / "slurm.conf").write_text(_slurm_conf(r, _free_port(), [_free_port(), _free_port()]))
        self._daemon("munged", "-F", f"--socket={r}/munge.sock", f"--key-file={r}/munge.key",
                     f"--pid-file={r}/munged.pid", f"--seed-file={r}/munged.seed",
                     f"--log-file={r}/munged.log")
        self._wait_for(lambda: (r / "munge.sock").exists(), "munged")
        self._daemon("slurmctld", "-D", "-f", str(r / "slurm.conf"))
        for node in NODES:
            self._daemon("slurmd", "-D", "-f", str(r / "slurm.conf"), "-N", node)
        self._wait_for(self._nodes_idle, "slurmctld and both slurmd")

    def _nodes_idle(self) -> bool:
        done = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        return done.returncode == 0 and done.stdout.split().count("idle") == len(NODES)

    def _wait_for(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if ready():
                return
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        logs = "; ".join(f"{p.name}: {p.read_text()[-300:]}" for p in self.root.glob("*.log"))
        self.stop()
        pytest.skip(f"{what} did not start on this machine ({logs})")

    def run(self, *cmd: str, check: bool = True, timeout: float = 60, **kw):
        done = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True,
                              timeout=timeout, **kw)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr}")
        return done

    def job_id(self, name: str) -> str | None:
        ids = self.run("squeue", "-h", "-n", name, "-o", "%i").stdout.split()
        return ids[0] if ids else None

    def stop(self) -> None:
        """Cancel what is left of the jobs, stop the daemons we started, delete the folder."""
        if self.procs and self.procs[0].poll() is None and len(self.procs) > 1:
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                deadline = time.time() + 30
                while time.time() < deadline and self.run(
                        "squeue", "-h", "-o", "%i", check=False).stdout.split():
                    time.sleep(0.5)
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs = []
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster() -> Cluster:
    tiers.require("cluster", "starts a slurm cluster")
    ensure_slurm_installed()
    _remove_stale()
    cluster = Cluster()
    cluster.start()
    return cluster
