"""Ctrl-C during prepare-data with worker processes, as a terminal sends it: SIGINT to the
whole process group. The workers leave it to the parent, which kills them and stops in one
line, exit 130, leaving no output file and no process behind, whatever the moment of the press.

The command once in a while did not stop at all: ``multiprocessing.Pool.terminate`` stopped
reading results before it stopped the workers, and a worker then sending a result bigger than
a pipe holds blocked with the result queue's lock held, which terminate waited for forever.
The moments that can go wrong are pinned below with hooks that run in the command's own
processes (a child forked from this one, so what a test patches holds there and in the workers
it forks); each test waits with a bound and, past it, fails with every process's stacks."""

import faulthandler
import json
import multiprocessing
import multiprocessing.util
import os
import pydoc_data.topics
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from pretrain.__main__ import main as pretrain_main
from pretrain.data import prepare
from tests.pretrain_fixtures import REPO, env, wait_for

pytestmark = pytest.mark.slow

INTERRUPTED = 130  # 128 + SIGINT, what a shell expects of an interrupted command
ONE_LINE = ["error: interrupted by Ctrl-C: prepare-data stopped; nothing half-written is left"]


def _running(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited. A zombie has: it only waits for
    its parent, or init, to collect its status."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited meanwhile
            continue
        state, _parent, group = text[text.rindex(")") + 2:].split()[:3]
        if int(group) == pgid and state != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_stopped(pgid: int, exit_code, log: Path, timeout: float) -> int:
    """The exit status of group leader ``pgid`` (``exit_code()``: None while it runs), once it
    and every process of its group have stopped. Past ``timeout`` each one left gets SIGABRT,
    so that faulthandler writes its Python stacks into ``log``, then the group SIGKILL, and
    the test fails showing the log: a hang says where it hung."""
    deadline = time.monotonic() + timeout
    code = None
    while time.monotonic() < deadline:
        code = exit_code() if code is None else code
        if code is not None and not _running(pgid):
            return code
        time.sleep(0.05)
    left = _running(pgid)
    for pid in left:
        try:
            os.kill(pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
    time.sleep(3)
    _kill_group(pgid)
    pytest.fail(f"prepare-data had not stopped {timeout:g} s after Ctrl-C (exit code {code}, "
                f"processes {left} left); its output and their stacks:\n"
                f"{log.read_text(errors='replace')[-12000:]}")


def test_ctrl_c_stops_prepare_data_and_its_workers_in_one_line(data, tmp_path):
    corpus = tmp_path / "big.jsonl"
    texts = list(pydoc_data.topics.topics.values())
    with corpus.open("w") as f:  # ~25 MB: tens of seconds of tokenising on 2 workers
        for copy in range(50):
            for text in texts:
                f.write(json.dumps({"text": f"{copy} {text}"}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "prepare.log"
    with log.open("w") as sink:  # -X faulthandler: SIGABRT prints the stacks of a hang
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "pretrain", "prepare-data", str(corpus),
             "--tokenizer", data["tokenizer"], "--output", str(out / "big"), "--workers", "2"],
            cwd=REPO, env=env(), stdout=sink, stderr=sink, start_new_session=True)
    try:
        def writing() -> bool:  # the workers' first chunks reached the temporary .bin
            return proc.poll() is not None or any(
                p.stat().st_size > 0 for p in out.glob("big.bin.tmp*"))

        wait_for(writing, "tokenised chunks", 240)
        assert proc.poll() is None, log.read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        code = _wait_stopped(proc.pid, proc.poll, log, 60)
    finally:
        _kill_group(proc.pid)
        proc.wait()
    output = log.read_text()
    assert code == INTERRUPTED, output[-3000:]
    assert "Traceback" not in output and "Error" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines == ONE_LINE, output[-3000:]
    assert sorted(p.name for p in out.iterdir()) == []  # no .bin, .idx, record or temporary


# --- the moments, one by one -------------------------------------------------------------

CHUNK = 4  # documents per chunk: the corpus below is 10 chunks
TEXT = pydoc_data.topics.topics["if"]


@pytest.fixture
def command(data, tmp_path, monkeypatch):
    """prepare-data with 2 workers on 40 documents ("doc N: ..."), in a child process forked
    from this one and in a session of its own (so that SIGINT to its group is a terminal's
    Ctrl-C), after ``setup()`` ran there; returns the exit status and the output, once every
    process of the session has stopped."""
    if multiprocessing.get_context().get_start_method() != "fork":
        pytest.skip("the hooks reach the workers through fork")
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i}: {TEXT}"}) + "\n" for i in range(40)))
    monkeypatch.setattr(prepare, "CHUNK_DOCUMENTS", CHUNK)
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "prepare.log"
    argv = ["prepare-data", str(corpus), "--tokenizer", data["tokenizer"], "--output",
            str(out / "small"), "--workers", "2"]

    def run(setup=lambda: None) -> tuple[int, str]:
        pid = os.fork()
        if pid == 0:
            _child(argv, log, setup)
        reaped: list[int] = []

        def leader_exit_code() -> int | None:
            if not reaped:
                done, wait_status = os.waitpid(pid, os.WNOHANG)
                if done:
                    reaped.append(os.waitstatus_to_exitcode(wait_status))
            return reaped[0] if reaped else None

        try:
            code = _wait_stopped(pid, leader_exit_code, log, 30)
        finally:
            _kill_group(pid)
            if not reaped:
                os.waitpid(pid, 0)
        assert sorted(p.name for p in out.iterdir()) == []  # nothing written, nothing temporary
        return code, log.read_text(errors="replace")

    return run


def _child(argv: list[str], log: Path, setup) -> None:
    """The forked command: its own session, output into ``log``, and then ``os._exit``, never
    back into this test run. It exits without the interpreter's shutdown, so a worker still
    running at the end is one prepare-data left behind, not one that shutdown would reap."""
    code = 1
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        faulthandler.enable(sys.stderr, all_threads=True)  # SIGABRT: the stacks, in the log
        signal.signal(signal.SIGINT, signal.default_int_handler)
        setup()
        code = pretrain_main(argv)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def test_ctrl_c_while_the_workers_start(command, tmp_path):
    """The press reaches a worker before it has set SIGINT aside (an after-fork hook of
    multiprocessing sends it, from the first worker, to the whole group). A pool's worker
    then printed its own traceback, and the pool started another in its place, left running
    after the command's exit."""
    pressed = tmp_path / "pressed"

    def press_once(_):
        try:  # one press, from whichever worker gets here first
            os.close(os.open(pressed, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        os.killpg(0, signal.SIGINT)

    code, output = command(lambda: multiprocessing.util.register_after_fork(press_once,
                                                                            press_once))
    assert pressed.exists()
    assert code == INTERRUPTED, output
    assert output.splitlines() == ONE_LINE, output


def test_ctrl_c_while_a_worker_is_sending_its_result(command, tmp_path, monkeypatch):
    """The press lands while the parent waits for the first chunk and the second chunk's
    worker is part-way through sending a result far bigger than a pipe holds: the moment
    at which a pool's terminate left a lock held and a message half-sent."""
    sending = tmp_path / "sending"
    encode = prepare._encode_chunk

    def slow_first_big_second(tokenizer, texts):
        ids, lengths = encode(tokenizer, texts)
        if texts[0].startswith("doc 4:"):  # 16 MiB: the pipe takes a few hundred KiB
            sending.touch()
            return np.zeros(len(texts) << 20, np.int32), np.full(len(texts), 1 << 20)
        if texts[0].startswith("doc 0:"):
            wait_for(sending.exists, "the second chunk's result", 20)
            time.sleep(0.2)  # the send under way
            os.killpg(0, signal.SIGINT)
        return ids, lengths

    monkeypatch.setattr(prepare, "_encode_chunk", slow_first_big_second)
    code, output = command()
    assert sending.exists()
    assert code == INTERRUPTED, output
    assert output.splitlines() == ONE_LINE, output


def test_a_worker_killed_with_a_chunk_in_hand_stops_prepare_data(command, monkeypatch):
    """A worker killed (the kernel's out-of-memory killer) takes its chunk along: said in one
    error naming it, where a pool replaced the worker and waited for the lost result forever."""
    encode = prepare._encode_chunk

    def killed_on_the_second_chunk(tokenizer, texts):
        if texts[0].startswith("doc 4:"):
            os.kill(os.getpid(), signal.SIGKILL)
        return encode(tokenizer, texts)

    monkeypatch.setattr(prepare, "_encode_chunk", killed_on_the_second_chunk)
    code, output = command()
    assert code == 1, output
    assert "ended with a chunk in hand (exit code -9;" in output, output


def test_a_worker_error_is_raised_in_the_parent_with_the_workers_traceback(data, tmp_path,
                                                                          monkeypatch):
    """What fails in a worker is raised where prepare-data was called, naming where it
    happened, and the workers are gone before it is."""
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i}: {TEXT}"}) + "\n" for i in range(40)))
    monkeypatch.setattr(prepare, "CHUNK_DOCUMENTS", CHUNK)
    encode = prepare._encode_chunk

    def failing_on_the_third_chunk(tokenizer, texts):
        if texts[0].startswith("doc 8:"):
            raise ValueError("cannot encode doc 8")
        return encode(tokenizer, texts)

    monkeypatch.setattr(prepare, "_encode_chunk", failing_on_the_third_chunk)
    with pytest.raises(ValueError, match="cannot encode doc 8") as info:
        prepare.prepare_data([str(corpus)], data["tokenizer"], str(tmp_path / "out"), workers=2)
    assert "in a prepare-data worker:" in info.value.__notes__[0]
    assert "failing_on_the_third_chunk" in info.value.__notes__[0]
    assert not [p for p in multiprocessing.active_children()
                if p.name.startswith("prepare-data-worker")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.jsonl"]
