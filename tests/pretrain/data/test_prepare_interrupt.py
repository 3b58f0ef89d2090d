"""Ctrl-C during prepare-data with worker processes, as a terminal sends it: SIGINT to the
whole process group. The workers leave it to the parent, which terminates them and stops in
one line, exit 130, leaving no output file and no process behind."""

import json
import os
import pydoc_data.topics
import signal
import subprocess
import sys

import pytest

from tests.pretrain_fixtures import REPO, env, wait_for

pytestmark = pytest.mark.slow

INTERRUPTED = 130  # 128 + SIGINT, what a shell expects of an interrupted command


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ctrl_c_stops_prepare_data_and_its_workers_in_one_line(data, tmp_path):
    corpus = tmp_path / "big.jsonl"
    texts = list(pydoc_data.topics.topics.values())
    with corpus.open("w") as f:  # ~40 MB: tens of seconds of tokenising on 2 workers
        for copy in range(50):
            for text in texts:
                f.write(json.dumps({"text": f"{copy} {text}"}) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    log = tmp_path / "prepare.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pretrain", "prepare-data", str(corpus), "--tokenizer",
             data["tokenizer"], "--output", str(out / "big"), "--workers", "2"],
            cwd=REPO, env=env(), stdout=sink, stderr=sink, start_new_session=True)
    try:
        def writing() -> bool:  # the workers' first chunks reached the temporary .bin
            return proc.poll() is not None or any(
                p.stat().st_size > 0 for p in out.glob("big.bin.tmp*"))

        wait_for(writing, "tokenised chunks", 240)
        assert proc.poll() is None, log.read_text()[-2000:]
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
        wait_for(lambda: not _group_alive(proc.pid), "the workers to stop", 30)
    finally:
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert code == INTERRUPTED, output[-3000:]
    assert "Traceback" not in output and "Error" not in output, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines == ["error: interrupted by Ctrl-C: prepare-data stopped; nothing "
                     "half-written is left"], output[-3000:]
    assert sorted(p.name for p in out.iterdir()) == []  # no .bin, .idx, record or temporary
