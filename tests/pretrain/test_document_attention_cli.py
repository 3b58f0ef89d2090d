"""Document attention through the CLI (data.document_attention, data.reset_position_ids,
data.eod_mask_loss): it trains another function than the default, a SIGTERM and resume
reproduce every loss exactly, ``eval`` reproduces the final validation loss, and a resume that
changes a document setting is refused in one line."""

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.pretrain_fixtures import REPO, cli, env, train_args, train_losses, val_losses

STEPS = 12
DOCUMENTS = ("--data.document_attention=true", "--data.reset_position_ids=true",
             "--data.eod_mask_loss=true")


@pytest.fixture(scope="module")
def short(data, tmp_path_factory):
    """The test corpus cut into paragraphs (a few dozen tokens each), so that most of the
    32-token sequences hold an end of document; the test tokenizer."""
    folder = tmp_path_factory.mktemp("paragraphs")
    corpus = folder / "paragraphs.jsonl"
    with open(data["corpus"]) as source, corpus.open("w") as out:
        for line in source:
            for paragraph in json.loads(line)["text"].split("\n\n"):
                if paragraph.strip():
                    out.write(json.dumps({"text": paragraph}) + "\n")
    cli("prepare-data", str(corpus), "--tokenizer", data["tokenizer"],
        "--output", str(folder / "paragraphs"))
    return {**data, "prefix": str(folder / "paragraphs")}


def run_args(data, run, *extra, documents=DOCUMENTS):
    return train_args(data, run, f"--run.steps={STEPS}", "--run.eval_interval=6",
                      "--run.save_interval=6", *documents, *extra)


@pytest.fixture(scope="module")
def documents_run(short, tmp_path_factory):
    run = tmp_path_factory.mktemp("documents") / "run"
    cli(*run_args(short, run))
    return run


def test_document_attention_trains_another_function(short, documents_run, tmp_path):
    plain = tmp_path / "plain"
    cli(*run_args(short, plain, documents=()))
    ours, theirs = train_losses(documents_run), train_losses(plain)
    assert ours.keys() == theirs.keys()
    assert all(ours[s] != theirs[s] for s in ours)  # every step, from the first
    assert val_losses(documents_run)[-1] < val_losses(documents_run)[0]


def test_sigterm_and_resume_reproduce_every_loss(short, documents_run, tmp_path):
    run = tmp_path / "run"
    args = run_args(short, run)
    with (tmp_path / "stopped.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pretrain", *args], cwd=REPO,
                                env=env(), stdout=log, stderr=log)
        while not (run / "metrics.jsonl").is_file() or not train_losses(run):
            assert proc.poll() is None, (tmp_path / "stopped.log").read_text()[-2000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "stopped.log").read_text()[-2000:]
    assert int((run / "checkpoints" / "latest").read_text().split("_")[1]) < STEPS
    cli(*args)
    assert train_losses(run) == train_losses(documents_run)


def test_eval_reproduces_the_final_validation_loss(documents_run):
    done = cli("eval", "--config", str(documents_run / "config.toml"),
               "--checkpoint", str(documents_run / "checkpoints"))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["val_loss"] == pytest.approx(val_losses(documents_run)[-1], rel=1e-6)


@pytest.mark.parametrize("flag", DOCUMENTS)
def test_a_resume_that_changes_a_document_setting_is_refused(short, documents_run, tmp_path,
                                                              flag):
    run = tmp_path / "run"
    cli(*run_args(short, run, "--run.steps=6"))
    changed = flag.replace("=true", "=false")
    done = cli(*run_args(short, run, "--run.steps=6", changed), check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and done.stderr.strip().endswith(errors[0]), done.stderr[-2000:]
    name = flag.split("=")[0].lstrip("-")
    assert f"{name} (true in the checkpoint, false here)" in errors[0]
