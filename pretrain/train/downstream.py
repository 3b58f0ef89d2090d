"""Downstream tasks scored on the live model while it trains (OLMo-core's in-loop evaluators).

Every ``eval.downstream_interval`` steps and at the end, lm-evaluation-harness runs its tasks
(``eval.downstream_tasks``, at most ``eval.downstream_limit`` documents each) against
:class:`LiveLM`: the model as it is sharded for training, every rank taking part. Each
(context, continuation) pair becomes one sequence of the training shape with a loss mask on
the continuation; the sequences go through megatron's schedule forward-only in micro-batches
of ``data.micro_batch_size``, shared across data-parallel ranks; the last pipeline stage
gathers the continuation rows of the logits across tensor-parallel ranks and computes each
pair's log-likelihood and whether it is the greedy continuation, exactly as the ``lm-eval``
command does for a whole model; one all-reduce gives every rank every score, so lm-eval's own
bookkeeping runs identically everywhere. Scores go to the console, metrics.jsonl and W&B as
``downstream/<task>/<metric>`` on the training step axis, with a multiple-choice task's
``chance``: the accuracy of a uniform guess over the documents scored, the level its scores
are read against.

Training continues as if nothing happened: the model is in eval mode (no dropout) and back in
train mode after, no gradient is touched, and every random generator is saved before and
restored after (lm-eval seeds Python's, numpy's and torch's by default). Tasks are built (their
data read) at start-up, before anything is written: an unknown task, a missing local task
folder, a task that generates text (only log-likelihood tasks are scored in the loop; score
generation tasks with ``lm-eval`` on a checkpoint) or data that cannot be downloaded is one
line, before the first step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from pretrain.config import Config
from pretrain.data.batches import microbatches_per_step
from pretrain.run.checkpoint import rng_state, set_rng_state, settable_rng_state
from pretrain.unsharded.lm_eval import WindowedLM, finite, load_tasks, scores
from runtime import context, device
from runtime.errors import ConfigError
from runtime.schedule import run_schedule

log = logging.getLogger("pretrain")

SCORED_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")


def _sequence(context: list[int], continuation: list[int], seq_length: int,
              pad: int) -> tuple[list[int], list[int], list[int]]:
    """(tokens, labels, loss mask) of one pair in the training shape: the most recent
    ``seq_length + 1`` tokens of context + continuation, right-padded (causal attention keeps
    the padding out of every scored position)."""
    window = (context + continuation)[-(seq_length + 1):]
    inputs, labels = window[:-1], window[1:]
    scored = min(len(continuation), len(inputs))
    fill = seq_length - len(inputs)
    mask = [0] * (len(inputs) - scored) + [1] * scored + [0] * fill
    return inputs + [pad] * fill, labels + [pad] * fill, mask


def _score_step(vocab_size: int, data_iterator, model):
    batch = context.split_batch(next(data_iterator))
    logits = model(batch["tokens"], batch["position_ids"], None)
    return logits, partial(_continuation_scores, batch, vocab_size)


def _continuation_scores(batch: dict, vocab_size: int, logits: torch.Tensor):
    """Per sequence: the summed log-probability of its masked (continuation) tokens and
    whether each was the arg-max, from this tensor-parallel rank's vocabulary slice of the
    logits, gathered for the continuation rows only."""
    mask = batch["loss_mask"].bool()
    rows = gather_from_tensor_model_parallel_region(logits[mask].float())[:, :vocab_size]
    log_probs = rows.log_softmax(-1)
    targets = batch["labels"][mask]
    picked = log_probs.gather(-1, targets[:, None]).squeeze(-1).double()
    missed = (log_probs.argmax(-1) != targets).double()
    owner = mask.nonzero()[:, 0]
    sums = torch.zeros(mask.shape[0], dtype=torch.float64, device=logits.device)
    misses = torch.zeros_like(sums)
    sums.index_add_(0, owner, picked)
    misses.index_add_(0, owner, missed)
    # under context parallelism each rank scored its share of every sequence
    scores = context.sequence_sums(torch.stack([sums, misses], -1))
    return torch.zeros((), device=logits.device), {"scores": scores}


class LiveLM(WindowedLM):
    """The training model, sharded as it trains, as an lm-eval model (log-likelihoods)."""

    def __init__(self, config: Config, chunks: list, tokenizer):
        super().__init__(tokenizer, tokenizer.vocab_size, config.seq_length)
        self.config, self.chunks = config, chunks

    def score_pairs(self, pairs):
        d, seq = self.config.data, self.seq_length
        mbs, dp = d.micro_batch_size, parallel_state.get_data_parallel_world_size()
        # every data-parallel rank runs the same number of micro-batches (padded with empty
        # sequences), in schedule calls no larger than a training step's
        per_call = microbatches_per_step(d.global_batch_size, mbs)
        multiple = self.config.parallel.pp if self.config.parallel.vp else 1
        per_rank = math.ceil(max(math.ceil(len(pairs) / mbs), 1) / dp / multiple) * multiple
        total = per_rank * dp * mbs
        padded = [_sequence(c, k, seq, self.eot_token_id) for c, k in pairs]
        padded += [([self.eot_token_id] * seq, [self.eot_token_id] * seq, [0] * seq)] * (
            total - len(pairs))
        first = parallel_state.get_data_parallel_rank() * per_rank * mbs
        mine = padded[first:first + per_rank * mbs]
        out = torch.zeros(total, 2, dtype=torch.float64, device=device.compute_device())
        holder = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                  and parallel_state.get_tensor_model_parallel_rank() == 0
                  and context.rank() == 0)
        for start in range(0, per_rank, per_call):
            count = min(per_call, per_rank - start)
            batches = [_collate(mine[(start + i) * mbs:(start + i + 1) * mbs], seq)
                       for i in range(count)]
            results = run_schedule(self.chunks, batches, count, seq, mbs,
                                   partial(_score_step, self.vocab_size))
            if holder:
                at = first + start * mbs
                out[at:at + count * mbs] = torch.cat([r["scores"] for r in results])
        dist.all_reduce(out)  # each row has one holder: the sum is its value, everywhere
        return [(float(s), m == 0) for s, m in out[:len(pairs)].tolist()]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=True)  # a training console

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise ConfigError("in-loop evaluation scores log-likelihood tasks only")


def _collate(sequences: list[tuple], seq_length: int) -> dict[str, torch.Tensor]:
    where = device.compute_device()
    tokens, labels, mask = (torch.tensor([s[i] for s in sequences], device=where)
                            for i in range(3))
    positions = torch.arange(seq_length, device=where).expand(len(sequences), -1)
    return {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": positions}


class Downstream:
    """The run's downstream tasks, built once at start-up, and when to score them."""

    def __init__(self, config: Config):
        from lm_eval.tasks import TaskManager

        ev = config.eval
        self.config = config
        self.manager = TaskManager(include_path=ev.include_path or None)
        unknown = [t for t in ev.downstream_tasks if t not in self.manager.all_tasks]
        if unknown:
            where = f" or in eval.include_path '{ev.include_path}'" if ev.include_path else \
                " (local tasks need eval.include_path)"
            raise ConfigError(f"eval.downstream_tasks: unknown lm-eval task(s) "
                              f"{', '.join(unknown)}: not in lm-eval's registry{where}")
        self.tasks = load_tasks(self.manager, ev.downstream_tasks, SCORED_TYPES,
                                "eval.include_path")
        self.chance = chance_levels(self.tasks, ev.downstream_limit or None)

    def due(self, step: int, last: bool) -> bool:
        interval = self.config.eval.downstream_interval
        return last or bool(interval and step % interval == 0)

    def score(self, chunks: list, tokenizer) -> dict[str, float]:
        """``downstream/<task>/<metric>`` of the live model; every rank calls it."""
        from lm_eval import simple_evaluate

        ev = self.config.eval
        saved = rng_state()
        for chunk in chunks:
            chunk.eval()
        try:
            with torch.no_grad(), _lm_eval_quiet(), _every_rank_gets_results():
                out = simple_evaluate(
                    model=LiveLM(self.config, chunks, tokenizer), tasks=self.tasks,
                    num_fewshot=ev.num_fewshot, limit=ev.downstream_limit or None,
                    task_manager=self.manager, log_samples=False, bootstrap_iters=0,
                    random_seed=None, numpy_random_seed=None, torch_random_seed=None)
        finally:
            for chunk in chunks:
                chunk.train()
            set_rng_state(settable_rng_state(saved))
        found = {f"downstream/{key}": value
                 for key, value in scores(finite(out["results"])).items()
                 if value is not None and not key.endswith("/sample_len")}
        return found | {f"downstream/{task}/chance": level
                        for task, level in self.chance.items()}


def _leaves(items) -> list:
    """The tasks of :func:`load_tasks`'s list, groups ({group: [members]}) opened."""
    if isinstance(items, dict):
        return [task for members in items.values() for task in _leaves(members)]
    if isinstance(items, list | tuple):
        return [task for item in items for task in _leaves(item)]
    return [items]


def chance_levels(tasks: list, limit: int | None) -> dict[str, float]:
    """Per multiple-choice task, the mean of 1 / (number of choices) over the documents
    scored (the first ``limit``, as lm-eval takes them): what guessing scores in ``acc``."""
    levels = {}
    for task in _leaves(tasks):
        if getattr(task, "OUTPUT_TYPE", None) != "multiple_choice":
            continue
        docs = list(task.eval_docs)[:limit]
        counts = [len(task.doc_to_choice(doc)) for doc in docs]
        if counts and all(counts):
            levels[task.config.task] = sum(1 / n for n in counts) / len(counts)
    return levels


@contextlib.contextmanager
def _lm_eval_quiet():
    """lm-eval's per-call INFO lines and progress bars (requests built, inputs tokenised)
    held back: the run's console shows the scores. tqdm reads TQDM_DISABLE when a bar is
    made, so the run's own progress bar, made earlier, keeps going."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with _environ(TQDM_DISABLE="1"):
            yield
    finally:
        logger.setLevel(level)


def _every_rank_gets_results():
    """lm-eval returns its results only where LOCAL_RANK is 0 (for launchers whose ranks all
    compute the same thing, which is the case here, so that one of them writes files); every
    rank of this run needs them, the logging rank first, which need not be local rank 0."""
    return _environ(LOCAL_RANK="0")


@contextlib.contextmanager
def _environ(**values: str):
    """Environment variables set for a block, then put back as they were."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def prepare(config: Config) -> Downstream | None:
    """The run's downstream tasks, checked and built (None when it has none)."""
    return Downstream(config) if config.eval.downstream_tasks else None
