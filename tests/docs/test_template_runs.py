"""The README's template config is what users copy: every documented training command that
starts from ``configs/demo-cpu.toml`` trains, compiled as the template compiles, and so does the
template with the overrides a user of another corpus gives (another vocabulary, a longer
sequence, document attention, further validation sets).

tests/docs/test_commands.py checks that these commands parse; here they run. Each keeps its own
overrides; the test puts in its corpus (the docs' data paths are the reader's), its run folder,
two steps (a profiling window becomes the second of them) and a validation share the small
corpus holds. Compiled blocks use Dynamo's capture
with the aot_eager backend (where the length and document-attention crash was), and the user's
combination once with inductor, the template's own backend.
"""

from __future__ import annotations

import shlex

import pytest

from tests.docs.test_commands import ASSIGNMENT, DOCS, SHELL_LANGUAGES, read_markdown
from tests.pretrain_fixtures import REPO, cli, train_losses

pytestmark = pytest.mark.slow

TEMPLATE = "configs/demo-cpu.toml"
# What the test sets itself: the docs' data and run paths are placeholders for the reader's.
REPLACED = ("--data.prefixes", "--data.tokenizer", "--run.dir")


def documented_commands() -> list[tuple[str, dict[str, str], list[str]]]:
    """(where, environment, arguments after ``train``) of every ``python -m pretrain train``
    command in the README and docs that starts from the template, joined across line
    continuations; ``NAME=value`` words before the program are its environment."""
    found = []
    for doc in DOCS:
        for block in read_markdown(doc.read_text()).blocks:
            if block.language not in SHELL_LANGUAGES:
                continue
            text = "\n".join(block.lines).replace("\\\n", " ")
            for offset, line in enumerate(text.splitlines()):
                words = shlex.split(line, comments=True)
                if "pretrain" not in words or "train" not in words or TEMPLATE not in words:
                    continue
                args = words[words.index("train") + 1:]
                kept = [a for a in args if a.startswith("--") and not a.startswith(REPLACED)
                        and a != "--config"]
                environ = dict(w.split("=", 1) for w in words[:words.index("pretrain")]
                               if ASSIGNMENT.match(w))
                found.append((f"{doc.name}:{block.line + offset}", environ, kept))
    return found


COMMANDS = documented_commands()


def test_the_docs_hold_template_commands():
    """The extraction finds what the README and the training page show (a parser change
    that found none would make the test below pass on nothing)."""
    places = {where.split(":")[0] for where, _, _ in COMMANDS}
    assert {"README.md", "training.md", "compile.md"} <= places, COMMANDS


def _short(data: dict, run_dir) -> list[str]:
    return [f"--data.prefixes=[\"{data['prefix']}\"]", f"--data.tokenizer={data['tokenizer']}",
            f"--run.dir={run_dir}", "--run.steps=2", "--optim.warmup_steps=1",
            "--data.split=90,10,0", "--data.valid_samples=32", "--run.eval_interval=1",
            "--logging.wandb_mode=disabled"]


def _window(overrides: list[str]) -> list[str]:
    """A documented profiling window moved into the test's two steps: the second alone."""
    if any(a.startswith("--profiling.first_step") for a in overrides):
        return ["--profiling.first_step=2", "--profiling.steps=1"]
    return []


@pytest.mark.parametrize("where, environ, overrides", COMMANDS,
                         ids=[w for w, _, _ in COMMANDS])
def test_documented_template_command_trains(data, tmp_path, where, environ, overrides):
    run = tmp_path / "run"
    done = cli("train", "--config", str(REPO / TEMPLATE), *overrides, *_short(data, run),
               *_window(overrides), "--kernels.compile_backend=aot_eager",
               extra_env=environ or None, timeout=600)
    if "--dry-run" in overrides:
        assert "memory per GPU for activations" in done.stdout, done.stderr[-2000:]
        assert not run.exists()  # a dry run writes nothing
        return
    assert sorted(train_losses(run)) == [1, 2], where
    if any(a.startswith("--profiling.first_step") for a in overrides):
        assert sorted(p.name for p in (run / "profile").iterdir()) == \
            ["rank0-step2.pt.trace.json"], where


def test_template_with_a_users_overrides_trains_compiled(data, tmp_path):
    """A user's own corpus: another vocabulary, 1,024 tokens (above the length from which the
    CPU attends one document at a time when eager), document attention and a further
    validation set, compiled with inductor as the template compiles."""
    run = tmp_path / "run"
    done = cli("train", "--config", str(REPO / TEMPLATE), *_short(data, run),
               "--model.vocab_size=4096", "--model.seq_length=1024",
               "--data.document_attention=true", "--data.reset_position_ids=true",
               "--data.micro_batch_size=2", "--data.global_batch_size=4",
               "--data.valid_samples=4", f"--data.valid_sets=topics={data['prefix']}:4",
               timeout=900)
    output = done.stdout + done.stderr
    assert sorted(train_losses(run)) == [1, 2]
    assert "0 graph breaks" in output, output[-2000:]
    assert "validation topics at step 2" in output, output[-2000:]
