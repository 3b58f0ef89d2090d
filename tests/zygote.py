"""A preloaded interpreter for the CLI tests: ``python -m pretrain ARGS`` without the start-up.

A tiny CLI run is mostly start-up: importing torch and megatron-core takes ~4 s of CPU, the
run itself ~1 s, and the suite starts ~150 such processes straight from its tests. This server
imports what a run imports once, then forks one child per request; the child takes the
request's arguments, environment, working directory and standard streams and runs
``pretrain`` as ``__main__``, as ``python -m pretrain`` would from the point where its imports
are done, and the server reports the child's exit status.

What a child does not share with a fresh interpreter, and why the requests it takes do not
notice:

- Imports happened before the request. The server takes only requests whose environment
  equals the one it was started with (:data:`VOLATILE` aside) and whose working directory is
  its own, so every import read what the fresh process would have read. A modified
  environment, ``--verbose`` (whose import-time notices a fresh process shows) or a GPU goes
  to a real process (:func:`tests.pretrain_fixtures.cli` decides).
- Import-time output. The server sets up the console as the CLI does before importing; if
  anything still reached its stderr (a new notice a fresh process would print), it refuses to
  serve, so that noise stays visible to the tests that check the console.
- Its parent is this server, and it leads a process group of its own: the caller ends it and
  whatever it started together (a timeout), and tests about signals, process trees and
  launchers start real processes instead.

A request for ``nproc`` > 1 ranks is served as ``torchrun --standalone --nproc-per-node
NPROC`` would serve it: one child per rank with the variables torchrun's agent gives its
workers (:func:`rank_environ`; rank 0 hosts the rendezvous store on a free port, where under
torchrun the agent hosts it), each with an error file of its own, so that a mistake is
reported once (:func:`runtime.launcher.report_error`); all write to the same streams, as under
torchrun. When a rank fails the others are sent SIGTERM, then SIGKILL after
:data:`GRACE_S`, and the launch exits 1, as torchrun's does.

Protocol: a ``SOCK_SEQPACKET`` Unix socket in the abstract namespace (nothing on disk to
clean up); one request per connection, ``{"args", "env", "cwd", "nproc", "module"}`` as JSON
(``module``: ``pretrain`` or a test's wrapper of it) with the children's stdin, stdout and
stderr passed as descriptors; answers ``{"pids"}`` once forked, then ``{"returncode"}``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from runtime.launcher import free_port

REPO = Path(__file__).resolve().parent.parent
READY = b"ready\n"

# Variables that change from test to test and are read only while running.
VOLATILE = ("PYTEST_CURRENT_TEST",)

# Seconds the other ranks of a failed launch get between SIGTERM and SIGKILL (torchrun's
# agent waits 30 s by default).
GRACE_S = 30.0


def torchrun(nproc: int) -> list[str]:
    """The interpreter arguments that start ``-m MODULE`` on ``nproc`` local ranks (none for
    one process)."""
    return ["-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}"] if nproc > 1 else []


def stable_environ(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` as imports read it: what a preloaded parent must share with a request."""
    return {k: v for k, v in environ.items() if k not in VOLATILE}


# ---------------------------------------------------------------------------- the server ----

def _die_with_parent() -> None:
    """SIGTERM when the process that started the server ends (Linux), however it ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _preload() -> bool:
    """Import :mod:`tests.preload` behind the CLI's console set-up; whether the server may
    serve: nothing printed and no thread started (a fork copies only the thread that forks)."""
    import tempfile

    from pretrain.report import console

    console.setup()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as noise:
        os.dup2(noise.fileno(), 2)
        try:
            import tests.preload  # noqa: F401
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        quiet = os.fstat(noise.fileno()).st_size == 0
    threads = len(os.listdir("/proc/self/task"))
    return quiet and threads == 1 and threading.active_count() == 1


def serve(name: str) -> str:
    """Answer requests at the abstract socket ``name`` until the caller goes; returns only in
    a forked child, turned into the requested process: the module it is to run."""
    _die_with_parent()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + name)
    listener.listen(4)
    serving = _preload()
    sys.stdout.buffer.write(READY if serving else b"refused\n")
    sys.stdout.flush()
    if not serving:
        sys.exit(1)
    while True:
        conn, _ = listener.accept()
        with conn:
            message, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            nproc = request.get("nproc", 1)
            errors = tempfile.mkdtemp(prefix="zygote-errors-") if nproc > 1 else None
            port = free_port() if nproc > 1 else 0
            pids = []
            for rank in range(nproc):
                environ = request["env"] if errors is None else \
                    rank_environ(request["env"], rank, nproc, port, errors)
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    _become(request["cwd"], request["args"], environ, fds, conn)
                    return request.get("module", "pretrain")
                with contextlib.suppress(OSError):  # as the child does: no signal may miss it
                    os.setpgid(pid, pid)
                pids.append(pid)
            _send(conn, {"pids": pids})
            returncode = _wait(pids, fds[2])
            for fd in fds:
                os.close(fd)
            if errors is not None:
                shutil.rmtree(errors, ignore_errors=True)
            _send(conn, {"returncode": returncode})


def rank_environ(environ: dict[str, str], rank: int, nproc: int, port: int,
                 errors: str) -> dict[str, str]:
    """What torchrun's agent adds to the environment of rank ``rank`` of ``nproc`` on one
    node (torch.distributed.elastic's LocalElasticAgent), the rendezvous at ``port``."""
    os.makedirs(f"{errors}/{rank}", exist_ok=True)
    return {**environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0",
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                           "1"),
            "TORCHELASTIC_ERROR_FILE": f"{errors}/{rank}/error.json",
            # set in torchrun's own environment (its signal handling), inherited by the ranks
            "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT"}


def _wait(pids: list[int], stderr: int) -> int:
    """Every child's end: the one child's exit status, or for ranks torchrun's: 0 when all
    succeeded, else 1, the others ended (SIGTERM, SIGKILL after :data:`GRACE_S`) as soon as
    one fails, which a line on the launch's ``stderr`` says. Only ``pids`` are reaped."""
    import selectors

    failed, deadline = False, None
    with selectors.DefaultSelector() as sel:
        for pid in pids:
            sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
        while sel.get_map():
            ready = sel.select(None if deadline is None else max(deadline - time.monotonic(), 0))
            if not ready:  # the grace period is over
                _signal_all([key.data for key in sel.get_map().values()], signal.SIGKILL)
                deadline = None
            for key, _ in ready:
                sel.unregister(key.fileobj)
                os.close(key.fileobj)
                code = os.waitstatus_to_exitcode(os.waitpid(key.data, 0)[1])
                if len(pids) == 1:
                    return code
                if code != 0 and not failed:
                    failed = True
                    with contextlib.suppress(OSError):  # the caller may have gone
                        os.write(stderr, f"zygote: rank {pids.index(key.data)} exited "
                                 f"{code}; ending the others\n".encode())
                    _signal_all([k.data for k in sel.get_map().values()], signal.SIGTERM)
                    deadline = time.monotonic() + GRACE_S
    return 1 if failed else 0


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    """``sig`` to the children's process groups (each child leads its own)."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:  # the caller gave up (a timeout ended the child)
        pass


def _become(cwd: str, args: list[str], environ: dict[str, str], fds: list[int],
            conn: socket.socket) -> None:
    """Turn the forked server into the requested process (before ``pretrain`` runs)."""
    conn.close()
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = ["-m", *args]


# ---------------------------------------------------------------------------- the client ----

class Zygote:
    """One server per test process, started at the first request it can take."""

    def __init__(self, environ: dict[str, str]):
        self.environ = stable_environ(environ)
        name = f"siamesenorm-zygote-{os.getpid()}-{time.monotonic_ns()}"
        self.address = "\0" + name
        self.server = subprocess.Popen(
            [sys.executable, __file__, name], cwd=REPO, env=environ,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.ready = self.server.stdout.readline() == READY
        atexit.register(self.close)

    def takes(self, environ: dict[str, str], cwd: Path) -> bool:
        return self.ready and self.server.poll() is None and Path(cwd) == REPO \
            and stable_environ(environ) == self.environ

    def run(self, args: list[str], environ: dict[str, str], timeout: float, nproc: int = 1,
            module: str = "pretrain", log: Path | None = None) -> subprocess.CompletedProcess:
        """As ``subprocess.run([python, -m, MODULE, *args], capture_output=True, text=True,
        timeout=timeout)`` would, or for ``nproc`` > 1 the same through ``torchrun
        --standalone --nproc-per-node=NPROC``. With ``log`` the output goes to that file
        instead (the result holds none), and when the process has ended whatever it left in
        its process group is killed: a helper process that megatron's checkpoint writer
        leaves behind a SIGKILLed trainer (on a cluster the job's cgroup reaps it), which
        would hold captured output open."""
        deadline = time.monotonic() + timeout
        command = [sys.executable, *torchrun(nproc), "-m", module, *args]
        if log is None:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
        else:
            out_w = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            err_w = os.dup(out_w)
        null = os.open(os.devnull, os.O_RDONLY)
        stdout = stderr = b""
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.connect(self.address)
            request = {"args": list(args), "env": environ, "cwd": str(REPO), "nproc": nproc,
                       "module": module}
            socket.send_fds(conn, [json.dumps(request).encode()], [null, out_w, err_w])
            for fd in (null, out_w, err_w):
                os.close(fd)
            pids = json.loads(conn.recv(4096))["pids"]
            try:
                if log is None:
                    stdout, stderr = _read_both(out_r, err_r, deadline)
                conn.settimeout(max(deadline - time.monotonic(), 0.001))
                returncode = json.loads(conn.recv(4096))["returncode"]
            except TimeoutError:  # socket.timeout is TimeoutError
                _signal_all(pids, signal.SIGKILL)
                raise subprocess.TimeoutExpired(command, timeout) from None
            except BaseException:
                _signal_all(pids, signal.SIGKILL)
                raise
        if log is not None:
            _signal_all(pids, signal.SIGKILL)
        return subprocess.CompletedProcess(command, returncode, _text(stdout), _text(stderr))

    def close(self) -> None:
        if self.server.poll() is None:
            self.server.terminate()
            self.server.wait()


def _read_both(out_fd: int, err_fd: int, deadline: float) -> tuple[bytes, bytes]:
    """Both pipes to their end (every writer gone), or TimeoutError at ``deadline``."""
    import selectors

    chunks = {out_fd: [], err_fd: []}
    with selectors.DefaultSelector() as sel:
        for fd in chunks:
            sel.register(fd, selectors.EVENT_READ)
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        sel.unregister(key.fd)
        finally:
            for fd in chunks:
                os.close(fd)
    return b"".join(chunks[out_fd]), b"".join(chunks[err_fd])


def _text(data: bytes) -> str:
    """Decoded as ``text=True`` decodes (universal newlines)."""
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


_zygote: Zygote | None = None


def zygote(environ: dict[str, str]) -> Zygote:
    """This process's server for ``environ``: the running one, or (first call, or another
    environment: a test process may change its own, e.g. an inductor cache folder set by an
    in-process run) a new one in its place."""
    global _zygote
    if _zygote is None or _zygote.environ != stable_environ(environ):
        if _zygote is not None:
            _zygote.close()
        _zygote = Zygote(environ)
    return _zygote


def run_main(module: str) -> None:
    """Run ``module`` as ``__main__`` in a forked child and end the process as the
    interpreter would, minus the teardown of every module: non-daemon threads joined, exit
    handlers run, streams flushed, the exit status of ``sys.exit``, an uncaught exception or
    Ctrl-C. The teardown is skipped as multiprocessing's forked children skip it: it would
    visit (and so copy) the whole preloaded heap, and objects it never frees make nanobind
    (Triton's bindings) report leaks on stderr."""
    import runpy
    import traceback

    code, interrupted = 0, False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as the interpreter ends on an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as ``python -m`` has it, not this file's folder
    run_main(serve(sys.argv[1]))
