"""Bad input to `python -m pretrain` exits 2 with one `error:` line naming the field or file,
the rule and the value, prints no traceback, and leaves every file that existed before
byte-identical.

CASES run the CLI in a child process each. EARLY_CASES are mistakes found before a process
group or model exists (config, data, tokenizer, checkpoint identity): they run the same
``main(argv)`` in this process, seconds faster each, with the model set-up replaced by a
failure so that a case the checks let through cannot start training here.
"""

import contextlib
import hashlib
import logging
import re
import shutil
import signal
import warnings
from pathlib import Path

import pytest

from pretrain.run import stop
from tests.pretrain_fixtures import REPO, cli, make_corpus, train_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    data = make_corpus(root / "data")
    cli("train-tokenizer", data["corpus"], "--output", str(root / "data" / "small"),
        "--vocab-size", "400")
    cli("prepare-data", data["corpus"], "--tokenizer", str(root / "data" / "small.model"),
        "--output", str(root / "data" / "small-topics"))
    run = root / "finished"
    cli(*train_args(data, run, "--run.steps=3"))
    corrupt = root / "corrupt-run"
    shutil.copytree(run, corrupt)
    shard = next((corrupt / "checkpoints" / "step_00000003").glob("*.distcp"))
    shard.write_bytes(b"\x00garbage" * 64)
    (root / "bad.toml").write_text("[model\nnum_layers = 2\n")
    (root / "empty.txt").write_text("")
    (root / "notext.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    (root / "garbage.model").write_bytes(b"not a sentencepiece model")
    (root / "a-file").write_text("x")
    lines = Path(data["corpus"]).read_text().splitlines()[:20]
    (root / "part.jsonl").write_text("\n".join(lines) + "\n")
    cli("prepare-data", str(root / "part.jsonl"), "--tokenizer", data["tokenizer"],
        "--output", str(root / "data" / "part"))
    moved = (run / "config.toml").read_text().replace(data["tokenizer"], str(root / "gone.model"))
    assert moved != (run / "config.toml").read_text()
    (root / "other-run.toml").write_text(moved)
    _damaged_copies(root, run)
    _damaged_data(root, data)
    _bad_tomls(root)
    return {"root": root, "data": data, "run": run, "corrupt": corrupt}


def _checkpoint(run: Path) -> Path:
    return run / "checkpoints" / "step_00000003"


def _damaged_copies(root: Path, run: Path) -> None:
    """Copies of the finished run, each damaged in one way."""
    damage = {
        "empty-complete": lambda c: (c / "complete.json").write_text(""),
        "no-rng": lambda c: shutil.rmtree(c / "rng"),
        "no-metadata": lambda c: (c / ".metadata").unlink(),
        "no-step": lambda c: (c / "complete.json").write_text('{"world_size": 1}'),
    }
    for name, hurt in damage.items():
        shutil.copytree(run, root / name)
        hurt(_checkpoint(root / name))
    edited = root / "edited"
    shutil.copytree(run, edited)
    text = (edited / "config.toml").read_text()
    (edited / "config.toml").write_text(text.replace("keep_last = 2", "keep_last = 3"))


def _damaged_data(root: Path, data: dict) -> None:
    """Datasets whose .idx is truncated, text, or whose .bin is short."""
    prefix = Path(data["prefix"])
    idx, bins = prefix.with_suffix(".idx").read_bytes(), prefix.with_suffix(".bin").read_bytes()
    for name, new_idx, new_bin in (("short-idx", idx[:len(idx) // 2], bins),
                                   ("text-idx", b"documents: 12\n", bins),
                                   ("short-bin", idx, bins[:len(bins) // 2])):
        (root / "data" / f"{name}.idx").write_bytes(new_idx)
        (root / "data" / f"{name}.bin").write_bytes(new_bin)
    # the same size, 64 bytes of 0xff inside the arrays, its record copied along (what a
    # user met: the record saw new contents and rescanned; the first step failed)
    damaged = bytearray(idx)
    damaged[200:264] = b"\xff" * 64
    (root / "data" / "ff-idx.idx").write_bytes(bytes(damaged))
    (root / "data" / "ff-idx.bin").write_bytes(bins)
    shutil.copy(prefix.with_name(prefix.name + ".record.json"),
                root / "data" / "ff-idx.record.json")
    (root / "a-folder").mkdir()
    (root / "a-folder.bin").mkdir()
    (root / "a-folder.idx").mkdir()


def _bad_tomls(root: Path) -> None:
    tomls = {
        "section-is-number": "run = 5\n",
        "section-is-list": "model = [1, 2]\n",
        "base-is-number": "base = 5\n",
        "base-is-folder": 'base = "a-folder"\n',
        "steps-as-string": '[run]\nsteps = "ten"\n',
        "key-outside-section": "steps = 10\n",
    }
    for name, text in tomls.items():
        (root / f"{name}.toml").write_text(text)


def _train(c, *extra):
    return train_args(c["data"], c["root"] / "new-run", *extra)


CASES = {
    "unknown key": (lambda c: _train(c, "--model.foo=1"), ["model.foo", "unknown"]),
    "wrong type": (lambda c: _train(c, "--optim.lr=fast"), ["optim.lr", "'fast'", "float"]),
    "unknown section": (lambda c: _train(c, "--bogus.x=1"), ["[bogus]"]),
    "override syntax": (lambda c: _train(c, "--model.num_layers"), ["--model.num_layers"]),
    "missing config": (lambda c: ["train", "--config", str(c["root"] / "nope.toml")],
                       ["nope.toml", "does not exist"]),
    "invalid toml": (lambda c: ["train", "--config", str(c["root"] / "bad.toml")],
                     ["bad.toml", "not valid TOML"]),
    "missing data": (lambda c: _train(c, '--data.prefixes=["/nonexistent/corpus"]'),
                     ["/nonexistent/corpus.bin", "does not exist"]),
    "empty data file": (lambda c: ["prepare-data", str(c["root"] / "empty.txt"), "--tokenizer",
                                   c["data"]["tokenizer"], "--output", str(c["root"] / "e")],
                        ["empty.txt", "is empty"]),
    "jsonl without text": (lambda c: ["prepare-data", str(c["root"] / "notext.jsonl"),
                                      "--tokenizer", c["data"]["tokenizer"],
                                      "--output", str(c["root"] / "n")],
                           ["notext.jsonl", "line 2", "\"text\""]),
    "data of another tokenizer": (
        lambda c: _train(c, f"--data.tokenizer={c['root'] / 'data' / 'small.model'}"),
        ["was made with another tokenizer", "small.model' #", "(400 pieces)"]),
    "model vocab below tokenizer": (lambda c: _train(c, "--model.vocab_size=256"),
                                    ["model.vocab_size (256)", "(512"]),
    "sequence longer than model": (lambda c: _train(c, "--data.seq_length=64"),
                                   ["data.seq_length (64)", "model.seq_length (32)"]),
    "global batch vs micro x dp": (lambda c: _train(c, "--data.global_batch_size=10",
                                                    "--data.valid_samples=20"),
                                   ["data.global_batch_size (10)", "(4 x 1)"]),
    "layout vs world size": (lambda c: _train(c, "--parallel.pp=2"),
                             ["world size (1)", "parallel.tp x parallel.pp (2)"]),
    "missing tokenizer": (lambda c: _train(c, "--data.tokenizer=/nonexistent/tok.model"),
                          ["/nonexistent/tok.model", "does not exist"]),
    "corrupt tokenizer": (lambda c: _train(c, f"--data.tokenizer={c['root'] / 'garbage.model'}"),
                          ["garbage.model", "not a sentencepiece model"]),
    "run folder under a file": (lambda c: _train(c, f"--run.dir={c['root'] / 'a-file' / 'run'}"),
                                ["run.dir", "a-file/run", "is a file"]),
    "missing checkpoint folder": (
        lambda c: ["eval", "--config", str(c["run"] / "config.toml"),
                   "--checkpoint", str(c["root"] / "no-such-ckpt")],
        ["no-such-ckpt", "does not exist"]),
    "corrupt checkpoint": (
        lambda c: train_args(c["data"], c["corrupt"], "--run.steps=5", "--data.valid_samples=0",
                             "--optim.override_schedule=true"),  # past the schedule check
        ["step_00000003", "could not be loaded"]),
    "missing init checkpoint": (lambda c: _train(c, "--run.init_from=/nonexistent/ckpt"),
                                ["/nonexistent/ckpt", "does not exist"]),
    "existing prepare output": (
        lambda c: ["prepare-data", c["data"]["corpus"], "--tokenizer", c["data"]["tokenizer"],
                   "--output", c["data"]["prefix"]],
        ["topics.bin", "already exists"]),
    "existing tokenizer output": (
        lambda c: ["train-tokenizer", c["data"]["corpus"], "--output",
                   c["data"]["tokenizer"][:-len(".model")], "--vocab-size", "512"],
        ["tok.model", "already exists"]),
    "unknown command": (lambda c: ["fly"], ["command line", "fly"]),
    # a dry run refuses what the start it plans would refuse, after printing the plan
    "dry run of a start with too large a validation set": (
        lambda c: [*_train(c, "--data.valid_samples=8000"), "--dry-run"],
        ["data.valid_samples (8000)", "the largest data.valid_samples that fits is"]),
    "dry run without the data": (
        lambda c: [*_train(c, f"--data.prefixes={_in(c, 'data', 'nothing')}"), "--dry-run"],
        ["nothing.bin", "does not exist"]),
    "dry run of a start with too large a further validation set": (
        lambda c: [*_train(c, _part_set(c, ":8000")), "--dry-run"],
        ["data.valid_sets 'part'", "8000 validation sequences", "the largest SAMPLES that fits"]),
    "negative peak TFLOP/s": (lambda c: _train(c, "--logging.peak_tflops=-989"),
                              ["logging.peak_tflops (-989.0)", ">= 0"]),
    "no validation share": (lambda c: _train(c, "--data.split=100,0,0"),
                            ["data.split ('100,0,0')", "valid split", "topics'"]),
    # 2% of 20 documents rounds to none: megatron would loop forever looking for tokens.
    "blended prefix too small to split": (
        lambda c: _train(c, f'--data.prefixes=["{c["data"]["prefix"]}", '
                            f'"{c["root"] / "data" / "part"}"]'),
        ["data.split ('98,2,0')", "valid split", "part'", "20 documents"]),
}


def _in(c, *parts: str) -> str:
    return str(c["root"].joinpath(*parts))


def _resume(c, run: str, *extra):
    return train_args(c["data"], c["root"] / run, "--run.steps=3", "--data.valid_samples=0", *extra)


def _eval(c, run: str = "finished", *extra):
    return ["eval", "--config", str(c["run"] / "config.toml"), "--checkpoint",
            _in(c, run, "checkpoints"), *extra]


def _small_tokenizer(c) -> list[str]:
    return [f"--data.tokenizer={_in(c, 'data', 'small.model')}",
            f"--data.prefixes={_in(c, 'data', 'small-topics')}"]


def _part_set(c, samples: str = "") -> str:
    """data.valid_sets naming the 20-document dataset ``part`` (``samples``: ":N" or none)."""
    return f"--data.valid_sets=part={_in(c, 'data', 'part')}{samples}"


def _data(c, name: str):
    return _train(c, f"--data.prefixes={_in(c, 'data', name)}")


def _toml(c, name: str):
    return ["train", "--config", _in(c, f"{name}.toml")]


# Found before any process group exists: run in this process (see the module docstring).
EARLY_CASES = {
    # context parallelism: the world, the sequence's chunks, the attention that takes it
    "context parallel vs world size": (lambda c: _train(c, "--parallel.cp=2"),
                                       ["world size (1)",
                                        "parallel.tp x parallel.cp x parallel.pp (2)"]),
    "sequence vs context chunks": (lambda c: _train(c, "--parallel.cp=3"),
                                   ["model.seq_length (32)", "2 x parallel.cp (6)"]),
    "context parallel with local attention": (
        lambda c: _train(c, "--parallel.cp=2", "--model.attention_backend=local",
                         "--kernels.compile=false"),
        ["parallel.cp (2)", "model.attention_backend sdpa", "--model.attention_backend=sdpa"]),
    # optimizer and run ranges
    "beta2 above 1": (lambda c: _train(c, "--optim.beta2=1.5"), ["optim.beta2 (1.5)", "[0, 1)"]),
    "negative beta1": (lambda c: _train(c, "--optim.beta1=-0.1"), ["optim.beta1 (-0.1)"]),
    "negative weight decay": (lambda c: _train(c, "--optim.weight_decay=-0.1"),
                              ["optim.weight_decay (-0.1)", ">= 0"]),
    "negative eps": (lambda c: _train(c, "--optim.eps=-1"), ["optim.eps (-1.0)", "> 0"]),
    "zero eps": (lambda c: _train(c, "--optim.eps=0"), ["optim.eps (0.0)", "> 0"]),
    "negative clip": (lambda c: _train(c, "--optim.clip_grad=-1"), ["optim.clip_grad (-1.0)"]),
    "infinite lr": (lambda c: _train(c, "--optim.lr=inf"), ["optim.lr (inf)", "finite"]),
    "nan lr": (lambda c: _train(c, "--optim.lr=nan"), ["optim.lr (nan)", "finite"]),
    "lr beyond fp32": (lambda c: _train(c, "--optim.lr=1e39"),
                       ["optim.lr (1e+39) / (1 - optim.beta1)", "fp32"]),
    "infinite min lr": (lambda c: _train(c, "--optim.min_lr=inf"), ["optim.min_lr (inf)"]),
    "min lr above lr": (lambda c: _train(c, "--optim.min_lr=1"), ["optim.min_lr (1.0)"]),
    "unknown decay style": (lambda c: _train(c, "--optim.decay_style=step"),
                            ["optim.decay_style ('step')", "cosine, linear, constant, wsd"]),
    "wsd without its decay steps": (lambda c: _train(c, "--optim.decay_style=wsd"),
                                    ["optim.wsd_decay_steps (0)", "with optim.decay_style wsd"]),
    "wsd decay longer than the run": (
        lambda c: _train(c, "--optim.decay_style=wsd", "--optim.wsd_decay_steps=1000"),
        ["optim.wsd_decay_steps (1000)", "run.steps - optim.warmup_steps"]),
    "wsd decay steps without wsd": (lambda c: _train(c, "--optim.wsd_decay_steps=5"),
                                    ["optim.wsd_decay_steps (5)", "not cosine"]),
    "nan norm eps": (lambda c: _train(c, "--model.norm_eps=nan"), ["model.norm_eps (nan)"]),
    "shared expert with linear biases": (
        lambda c: _train(c, "--model.num_experts=4", "--model.add_bias_linear=true",
                         "--model.moe_shared_expert_intermediate_size=64"),
        ["model.moe_shared_expert_intermediate_size (64) needs model.add_bias_linear false "
         "(megatron's shared expert has no linear biases; got true)"]),
    "infinite spike factor": (lambda c: _train(c, "--diagnostics.spike_factor=inf"),
                              ["diagnostics.spike_factor (inf)"]),
    "infinite peak TFLOP/s": (lambda c: _train(c, "--logging.peak_tflops=inf"),
                              ["logging.peak_tflops (inf)"]),
    "negative seed": (lambda c: _train(c, "--run.seed=-1"), ["run.seed (-1)", "[0, 2**31)"]),
    "seed too large": (lambda c: _train(c, "--run.seed=4294967296"), ["run.seed (4294967296)"]),
    "zero steps": (lambda c: _train(c, "--run.steps=0"), ["run.steps (0)", ">= 1"]),
    "negative warm-up": (lambda c: _train(c, "--optim.warmup_steps=-1"),
                         ["optim.warmup_steps (-1)"]),
    "zero eval interval": (lambda c: _train(c, "--run.eval_interval=0"),
                           ["run.eval_interval (0)"]),
    "zero keep_last": (lambda c: _train(c, "--run.keep_last=0"), ["run.keep_last (0)"]),
    "guard warm-up above its window": (
        lambda c: _train(c, "--guard.window=8", "--guard.warmup=16"),
        ["guard.warmup (16) must be in [2, guard.window (8)]"]),
    "zero guard sigma": (lambda c: _train(c, "--guard.sigma=0"), ["guard.sigma (0.0) must be > 0"]),
    "unknown guard action": (lambda c: _train(c, "--guard.action=retry"),
                             ["guard.action ('retry') must be one of: stop, rollback"]),
    # in-loop downstream tasks: known, in a folder that exists, scored by log-likelihood
    "unknown downstream task": (
        lambda c: _train(c, "--eval.downstream_tasks=no_such_task",
                         "--eval.include_path=tests/fixtures/tasks"),
        ["eval.downstream_tasks: unknown lm-eval task(s) no_such_task",
         "eval.include_path 'tests/fixtures/tasks'"]),
    "missing local task folder": (
        lambda c: _train(c, "--eval.downstream_tasks=tiny_choice",
                         "--eval.include_path=tests/fixtures/no-tasks"),
        ["eval.include_path 'tests/fixtures/no-tasks' does not exist"]),
    "generation task in the loop": (
        lambda c: _train(c, "--eval.downstream_tasks=tiny_generate",
                         "--eval.include_path=tests/fixtures/tasks"),
        ["lm-eval task tiny_generate (generate_until) cannot be scored here",
         "python -m pretrain lm-eval"]),
    "negative downstream limit": (lambda c: _train(c, "--eval.downstream_limit=-1"),
                                  ["eval.downstream_limit (-1) must be >= 0"]),
    "zero micro-batch": (lambda c: _train(c, "--data.micro_batch_size=0"),
                         ["data.micro_batch_size (0)"]),
    "absurd run length": (lambda c: _train(c, "--run.steps=1000000000000000"),
                          ["run.steps (1,000,000,000,000,000)", "index", "memory"]),
    # the validation set: whole batches, never negative, held by the validation split
    "validation set of part of a batch": (
        lambda c: _train(c, "--data.valid_samples=12"),
        ["data.valid_samples (12)", "multiple of data.global_batch_size (8)"]),
    "negative validation set": (lambda c: _train(c, "--data.valid_samples=-8"),
                                ["data.valid_samples (-8)", ">= 0"]),
    "validation set larger than its split": (
        lambda c: _train(c, "--data.valid_samples=8000"),
        ["data.valid_samples (8000)", "topics'", "8000 validation sequences of 32 tokens",
         "data.split '98,2,0'", "holds"]),
    # further validation sets (data.valid_sets), each checked as the default set is
    "malformed further validation set": (
        lambda c: _train(c, f"--data.valid_sets={_in(c, 'data', 'part')}"),
        ["data.valid_sets entry", "must look like NAME=PREFIX[:SAMPLES]"]),
    "further validation set named twice": (
        lambda c: _train(c, f"{_part_set(c)},{_part_set(c, ':8').split('=', 1)[1]}"),
        ["data.valid_sets names 'part' twice"]),
    "further validation set of part of a batch": (
        lambda c: _train(c, _part_set(c, ":12")),
        ["data.valid_sets entry 'part=", "SAMPLES (12) must be a multiple of "
         "data.global_batch_size (8)"]),
    "missing further validation set": (
        lambda c: _train(c, f"--data.valid_sets=wiki={_in(c, 'data', 'wiki')}"),
        ["data.valid_sets 'wiki': data file", "wiki.bin' does not exist"]),
    "further validation set of another tokenizer": (
        lambda c: _train(c, *_small_tokenizer(c), f"--data.valid_sets=big={c['data']['prefix']}"),
        ["data.valid_sets 'big'", "was made with another tokenizer", "(400 pieces)"]),
    "further validation set larger than its data": (
        lambda c: _train(c, _part_set(c, ":8000")),
        ["data.valid_sets 'part' asks", "part' for 8000 validation sequences of 32 tokens",
         "its 20 documents hold", "the largest SAMPLES that fits is"]),
    "retired eval_iters": (lambda c: _train(c, "--run.eval_iters=4"),
                           ["run.eval_iters (4) is no longer a setting", "data.valid_samples"]),
    "retired HybridNorm* switch": (
        lambda c: _train(c, "--model.hybrid_prenorm_first_block=true"),
        ["model.hybrid_prenorm_first_block (True) is no longer a setting",
         "model.hybrid_first_block"]),
    "expert layout vs world size": (
        lambda c: _train(c, "--model.num_experts=4", "--parallel.ep=2"),
        ["world size (1)", "parallel.etp x parallel.ep x parallel.pp (1 x 2 x 1 = 2)"]),
    # choices and structure
    "unknown wandb mode": (lambda c: _train(c, "--logging.wandb_mode=loud"),
                           ["logging.wandb_mode ('loud')"]),
    "unknown dtype": (lambda c: _train(c, "--run.params_dtype=fp8"), ["run.params_dtype"]),
    "unknown norm backend": (lambda c: _train(c, "--kernels.norm_backend=cuda"),
                             ["kernels.norm_backend ('cuda')"]),
    "unknown scheme": (lambda c: _train(c, "--model.residual_scheme=sandwich"),
                       ["model.residual_scheme ('sandwich')"]),
    "split not numbers": (lambda c: _train(c, "--data.split=a,b,c"), ["data.split ('a,b,c')"]),
    "weights per prefix": (lambda c: _train(c, "--data.weights=0.5,0.5"),
                           ["data.weights has 2 entries", "data.prefixes has 1"]),
    "section is a number": (lambda c: _toml(c, "section-is-number"), ["[run]", "table", "5"]),
    "section is a list": (lambda c: _toml(c, "section-is-list"), ["[model]", "table"]),
    "base is a number": (lambda c: _toml(c, "base-is-number"), ["base (5)", "file name"]),
    "base is a folder": (lambda c: _toml(c, "base-is-folder"), ["a-folder", "is a folder"]),
    "string for an integer": (lambda c: _toml(c, "steps-as-string"), ["run.steps ('ten')"]),
    "key outside a section": (lambda c: _toml(c, "key-outside-section"), ["[steps]"]),
    "config is a folder": (lambda c: ["train", "--config", _in(c, "a-folder")],
                           ["a-folder", "is a folder, not a file"]),
    # paths
    "cache dir is a file": (lambda c: _train(c, f"--data.cache_dir={_in(c, 'a-file')}"),
                            ["data.cache_dir", "a-file", "is a file"]),
    "tokenizer is a folder": (lambda c: _train(c, f"--data.tokenizer={_in(c, 'a-folder')}"),
                              ["tokenizer", "a-folder", "is a folder without a tokenizer.json"]),
    "no data prefixes": (lambda c: _train(c, "--data.prefixes=[]"), ["data.prefixes is empty"]),
    "data prefix of folders": (lambda c: _data(c, "../a-folder"), ["a-folder.bin", "folder"]),
    "truncated idx": (lambda c: _data(c, "short-idx"), ["short-idx.idx", "truncated"]),
    "text idx": (lambda c: _data(c, "text-idx"), ["text-idx.idx", "not a Megatron index"]),
    "short bin": (lambda c: _data(c, "short-bin"), ["short-bin.bin", "bytes"]),
    "idx overwritten, same size": (lambda c: _data(c, "ff-idx"),
                                   ["ff-idx.idx' is damaged: sequence 41 has length -"]),
    "prepare output under a file": (
        lambda c: ["prepare-data", c["data"]["corpus"], "--tokenizer", c["data"]["tokenizer"],
                   "--output", _in(c, "a-file", "out")],
        ["prepare-data --output", "a-file", "is a file"]),
    "tokenizer output under a file": (
        lambda c: ["train-tokenizer", c["data"]["corpus"], "--output", _in(c, "a-file", "tok")],
        ["train-tokenizer --output", "a-file", "is a file"]),
    # checkpoints: identity and integrity, before any tensor is read
    "resume with other vocabulary": (lambda c: _resume(c, "finished", "--model.vocab_size=1024"),
                                     ["model.vocab_size (512 in the checkpoint, 1024 here)"]),
    "resume with other width": (lambda c: _resume(c, "finished", "--model.hidden_size=128"),
                                ["model.hidden_size (64 in the checkpoint, 128 here)",
                                 "for a new run choose another --run.dir"]),
    "resume with other scheme": (lambda c: _resume(c, "finished", "--model.residual_scheme=pre"),
                                 ["model.residual_scheme ('siamese' in the checkpoint"]),
    "resume a dense run with experts": (
        lambda c: _resume(c, "finished", "--model.num_experts=4"),
        ["holds another model: model.num_experts (0 in the checkpoint, 4 here)",
         "for a new run choose another --run.dir"]),
    "resume with other batch": (
        lambda c: _resume(c, "finished", "--data.global_batch_size=16"),
        ["data.global_batch_size (8 in the checkpoint, 16 here)", "allow_data_change"]),
    "resume with other seed": (lambda c: _resume(c, "finished", "--run.seed=7"),
                               ["run.seed (1234 in the checkpoint, 7 here)"]),
    "resume with the other optimizer layout": (
        lambda c: _resume(c, "finished", "--parallel.distributed_optimizer=false"),
        ["parallel.distributed_optimizer=true", "this start has false",
         "--parallel.distributed_optimizer=true", "--run.init_from"]),
    "resume on other data": (lambda c: _resume(c, "finished",
                                               f"--data.prefixes={_in(c, 'data', 'part')}"),
                             ["data.prefixes/weights", "part"]),
    "resume ignoring an edited config": (lambda c: _resume(c, "edited"),
                                         ["edited/config.toml", "was edited", "--run.dir="]),
    "resume from empty complete.json": (lambda c: _resume(c, "empty-complete"),
                                        ["step_00000003", "complete.json", "not readable JSON"]),
    "resume without rng files": (lambda c: _resume(c, "no-rng"), ["rng/rank0.pt", "missing"]),
    "resume without tensor index": (lambda c: _resume(c, "no-metadata"), [".metadata"]),
    "resume from record without step": (lambda c: _resume(c, "no-step"),
                                        ["complete.json lacks its step"]),
    "init from other model": (lambda c: _train(c, f"--run.init_from={_in(c, 'finished')}/"
                                                  "checkpoints", "--model.num_layers=4"),
                              ["model.num_layers (2 in the checkpoint, 4 here)"]),
    # data made with another tokenizer the model's vocabulary holds (400 pieces < 512): its
    # token ids mean other text, refused for every command that reads the checkpoint
    "eval with another tokenizer": (
        lambda c: _eval(c, "finished", *_small_tokenizer(c)),
        ["another tokenizer", "small.model", "tok.model", "leave out --config"]),
    "generate with another tokenizer": (
        lambda c: ["generate", "--config", str(c["run"] / "config.toml"), "--checkpoint",
                   _in(c, "finished", "checkpoints"), "--prompt", "a", *_small_tokenizer(c)],
        ["another tokenizer", "small.model"]),
    "resume with another tokenizer": (
        lambda c: _resume(c, "finished", *_small_tokenizer(c)),
        ["another tokenizer", "small.model"]),
    "init from another tokenizer's model": (
        lambda c: _train(c, f"--run.init_from={_in(c, 'finished')}/checkpoints",
                         *_small_tokenizer(c)),
        ["another tokenizer", "small.model"]),
    # natural slips: each message names the fix
    "config file without --config": (lambda c: ["train", "configs/demo-cpu.toml"],
                                     ["'configs/demo-cpu.toml'", "--config configs/demo-cpu.toml"]),
    "override value after a space": (lambda c: [*_train(c), "--optim.lr", "1e-3"],
                                     ["'--optim.lr'", "--optim.lr=1e-3"]),
    "override without its section": (lambda c: [*_train(c), "--lr=1e-3"],
                                     ["'--lr=1e-3'", "did you mean --optim.lr=1e-3"]),
    "tokenizer without .model": (
        lambda c: ["prepare-data", c["data"]["corpus"], "--tokenizer",
                   c["data"]["tokenizer"][:-len(".model")], "--output", _in(c, "new-data")],
        ["does not exist", "did you mean", "tok.model'"]),
    "demo config before the demo ran": (
        lambda c: _train(c, "--data.tokenizer=runs/demo-data/never-made.model"),
        ["never-made.model", "does not exist", "make demo"]),
    "eval with another run's config": (
        lambda c: ["eval", "--config", _in(c, "other-run.toml"), "--checkpoint",
                   _in(c, "finished", "checkpoints")],
        ["gone.model", "does not exist", "finished/config.toml", "leave out --config"]),
    "eval of other vocabulary": (lambda c: _eval(c, "finished", "--model.vocab_size=1024"),
                                 ["model.vocab_size (512 in the checkpoint, 1024 here)"]),
    "eval without a validation set": (lambda c: _eval(c, "finished", "--data.valid_samples=0"),
                                      ["eval has nothing to evaluate",
                                       "data.valid_samples is 0",
                                       "give --data.valid_samples=8"]),
    "eval of too large a further validation set": (
        lambda c: _eval(c, "finished", _part_set(c, ":8000")),
        ["data.valid_sets 'part'", "the largest SAMPLES that fits is"]),
    "eval of a missing further validation set": (
        lambda c: _eval(c, "finished", f"--data.valid_sets=wiki={_in(c, 'data', 'wiki')}"),
        ["data.valid_sets 'wiki': data file", "does not exist"]),
    "eval of a file": (lambda c: ["eval", "--config", str(c["run"] / "config.toml"),
                                  "--checkpoint", _in(c, "a-file")], ["a-file", "is a file"]),
    "eval of empty complete.json": (lambda c: _eval(c, "empty-complete"), ["not readable JSON"]),
    "online W&B without credentials": (lambda c: _train(c, "--logging.wandb_mode=online"),
                                       ["W&B mode online (logging.wandb_mode)",
                                        "WANDB_API_KEY"]),
}


def _snapshot(root: Path) -> dict[str, str]:
    """Every file (by content) and folder under ``root``: a refused command may neither change
    nor create anything."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
            for p in root.rglob("*")}


def _damage(before: dict[str, str], root: Path) -> list[str]:
    after = _snapshot(root)
    changed = [p for p, digest in before.items() if after.get(p) != digest]
    return changed + [f"{p} (created)" for p in after.keys() - before.keys()]


def _check(stderr: str, code: int, fragments: list[str], before: dict, root: Path) -> None:
    assert code == 2, (code, stderr[-2000:])
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and stderr.strip().endswith(errors[0]), stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    damage = _damage(before, root)
    assert not damage, damage


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_damages_nothing(ctx, case):
    make_args, fragments = CASES[case]
    before = _snapshot(ctx["root"])
    done = cli(*make_args(ctx), check=False)
    _check(done.stderr, done.returncode, fragments, before, ctx["root"])


@contextlib.contextmanager
def _isolated(monkeypatch, tmp_path):
    """The CLI's process-wide settings (logging, warning filters, signal handlers) put back
    afterwards; no W&B credentials; no model or process group can be built or torn down."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    signals = {s: signal.getsignal(s) for s in stop.SIGNALS}
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(REPO)

    def no_setup(*_args, **_kwargs):
        raise AssertionError("the checks let this case through to the model set-up")

    monkeypatch.setattr("pretrain.train.loop.setup", no_setup)
    monkeypatch.setattr("pretrain.train.evaluate.setup", no_setup)
    monkeypatch.setattr("pretrain.unsharded.whole_model.setup", no_setup)
    # main() tears process groups down at exit; here they are the test session's
    monkeypatch.setattr("runtime.parallel.destroy", lambda: None)
    try:
        with warnings.catch_warnings():
            yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for sig, handler in signals.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("case", list(EARLY_CASES))
def test_early_bad_input_is_one_line_and_damages_nothing(ctx, case, capfd, monkeypatch,
                                                         tmp_path):
    from pretrain.__main__ import main

    make_args, fragments = EARLY_CASES[case]
    before = _snapshot(ctx["root"])
    capfd.readouterr()
    with _isolated(monkeypatch, tmp_path):
        code = main(make_args(ctx))
    _check(capfd.readouterr().err, code, fragments, before, ctx["root"])



def test_the_validation_size_named_is_the_largest_that_works(ctx):
    """The refusal of too large a validation set names a value; a dry run (every start check)
    accepts that value and refuses the next multiple of the global batch."""
    done = cli(*_train(ctx, "--data.valid_samples=8000"), "--dry-run", check=False)
    largest = int(re.search(r"the largest data.valid_samples that fits is (\d+)",
                            done.stderr).group(1))
    assert largest > 0 and largest % 8 == 0, done.stderr
    fits = cli(*_train(ctx, f"--data.valid_samples={largest}"), "--dry-run", check=False)
    assert fits.returncode == 0, fits.stderr[-2000:]
    over = cli(*_train(ctx, f"--data.valid_samples={largest + 8}"), "--dry-run", check=False)
    assert over.returncode == 2 and f"is {largest} " in over.stderr, over.stderr[-2000:]


def test_the_damage_check_sees_changed_and_created_files_and_folders(tmp_path):
    """The control for every case above: what a refused command could leave behind."""
    (tmp_path / "kept").write_text("x")
    before = _snapshot(tmp_path)
    assert _damage(before, tmp_path) == []
    (tmp_path / "kept").write_text("y")
    (tmp_path / "new-run").mkdir()
    (tmp_path / "new-run" / "config.toml").write_text("")
    assert sorted(_damage(before, tmp_path)) == [
        str(tmp_path / "kept"), f"{tmp_path / 'new-run'} (created)",
        f"{tmp_path / 'new-run' / 'config.toml'} (created)"]
