"""Validation: the loss over each whole validation set (in the loop, every
``run.eval_interval`` steps), and the ``eval`` command, which scores a checkpoint on the
config's datasets. The default set (the validation split of data.prefixes) keeps the keys
``val_loss``, ``val_ppl`` and ``val_samples``; each set of data.valid_sets adds
``val/<name>/loss``, ``val/<name>/ppl`` and ``val/<name>/samples``, measured by the same
:func:`evaluate`."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from pretrain.build import preflight, setup
from pretrain.config import Config
from pretrain.data.batches import (
    build_datasets,
    build_valid_sets,
    microbatches_per_step,
    step_microbatches,
)
from pretrain.report import console
from pretrain.report.metrics import is_logging_rank, strict_json
from pretrain.run.checkpoint import run_folder, weights_source
from runtime import device, weights
from runtime.errors import ConfigError
from runtime.schedule import POSITION_PARTS, validation_losses

log = logging.getLogger("pretrain")


def evaluate_checkpoint(config: Config, path: str) -> dict:
    """The checkpoint's model and tokenizer must be the config's (checked before loading); the
    data may be any, so a checkpoint can be scored on other validation data. The result is
    appended to ``eval.jsonl`` of the checkpoint's run folder, next to what it describes, with
    the tokenizer file it used (the checkpoint accepts any with its content, at any path)."""
    require_validation(config)
    tokenizer = preflight(config, training=False).tokenizer
    found = weights_source(path, config)
    chunks = setup(config)
    console.quiet_other_ranks(is_logging_rank())
    weights.load(chunks, found)
    _, valid = build_datasets(config, tokenizer)
    further = build_valid_sets(config, tokenizer)
    result = {"checkpoint": str(found), "tokenizer": config.data.tokenizer,
              **evaluate_sets(config, chunks, valid, further)}
    if dist.get_rank() == 0:
        log_to = run_folder(found) / "eval.jsonl"
        try:
            with log_to.open("a") as f:
                f.write(strict_json(result) + "\n")
        except OSError as err:  # a read-only checkpoint is still scored; the result is printed
            log.warning("could not append the result to %s: %s", log_to, err.strerror)
    return result


def require_validation(config: Config) -> None:
    """eval scores validation sets and nothing else: a config without one (a run trained with
    data.valid_samples = 0 and no data.valid_sets) is refused in one line saying how to give
    one, rather than answered with an empty result."""
    if validates(config):
        return
    d = config.data
    if float(d.split.split(",")[1]) > 0:
        fix = (f"give --data.valid_samples={d.global_batch_size} to score that many sequences "
               "of the validation split (any multiple of data.global_batch_size), or name a "
               "held-out dataset in data.valid_sets")
    else:
        fix = (f"data.split ({d.split!r}) keeps no validation split either: name a held-out "
               "dataset in data.valid_sets (NAME=PREFIX[:SAMPLES])")
    raise ConfigError(f"eval has nothing to evaluate: data.valid_samples is 0 and "
                      f"data.valid_sets is empty; {fix}")


def loss_share(losses: list[torch.Tensor]) -> torch.Tensor:
    """This rank's [mean micro-batch loss, weight] towards the batch loss (float64, on the
    compute device): only the logging ranks of the last pipeline stage (first TP rank) hold a
    loss; the others add [0, 0]."""
    share = torch.zeros(2, dtype=torch.float64, device=device.compute_device())
    if losses and parallel_state.get_tensor_model_parallel_rank() == 0:
        share[0], share[1] = torch.stack(losses).double().mean(), 1.0
    return share


def _mean_loss(per_batch: list[list[torch.Tensor]]) -> float:
    """The mean over batches of the batch loss (mean over data-parallel replicas), read back
    once."""
    totals = torch.stack([loss_share(losses) for losses in per_batch])
    dist.all_reduce(totals)
    return float((totals[:, 0] / totals[:, 1]).mean())


def validates(config: Config) -> bool:
    """Whether the run has a validation set: the default one or one of data.valid_sets."""
    return bool(config.data.valid_samples or config.data.valid_sets)


def evaluate_sets(config: Config, chunks, valid, further: list) -> dict:
    """One record of every validation set: the default set ``valid`` (when data.valid_samples
    is not 0) under its own keys, then each (ValidSet, dataset) of ``further`` as
    ``val/<name>/{loss,ppl,samples}``."""
    result = evaluate(config, chunks, valid) if config.data.valid_samples else {}
    for valid_set, dataset in further:
        one = evaluate(config, chunks, dataset, valid_set.samples)
        result.update({f"val/{valid_set.name}/{key.removeprefix('val_')}": value
                       for key, value in one.items()})
    return result


def per_set(result: dict) -> list[tuple[str, float, float]]:
    """(name, loss, perplexity) of each set of an :func:`evaluate_sets` record, the default
    set first, named ""."""
    found = [("", result["val_loss"], result["val_ppl"])] if "val_loss" in result else []
    names = [key[len("val/"):-len("/loss")] for key in result
             if key.startswith("val/") and key.endswith("/loss")]
    return found + [(name, result[f"val/{name}/loss"], result[f"val/{name}/ppl"])
                    for name in names]


def evaluate(config: Config, chunks, dataset, samples: int | None = None) -> dict:
    """Mean validation loss over the whole validation set (its first ``samples`` sequences,
    default data.valid_samples, in full global batches, so the mean of batch means is the
    mean over sequences), its perplexity, and the set's size (logged with them, so a number
    is never read without the set it was measured on)."""
    d = config.data
    samples = d.valid_samples if samples is None else samples
    for chunk in chunks:
        chunk.eval()
    per_batch, by_position = [], None
    with torch.no_grad():
        for i in range(samples // d.global_batch_size):
            batch = step_microbatches(dataset, i * d.global_batch_size, d.global_batch_size,
                                      d.micro_batch_size)
            n = microbatches_per_step(d.global_batch_size, d.micro_batch_size)
            results = validation_losses(chunks, batch, n, config.seq_length,
                                        d.micro_batch_size)
            per_batch.append([r["lm loss"] for r in results])
            for r in results:
                part = r["loss by position"]
                by_position = part if by_position is None else by_position + part
    for chunk in chunks:
        chunk.train()
    loss = _mean_loss(per_batch)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)), "val_samples": samples,
            **_loss_by_position(by_position, config.seq_length)}


def _loss_by_position(sums: torch.Tensor | None, seq_length: int) -> dict[str, float]:
    """``val_loss_at/<first>-<last>``: the mean loss over each equal span of positions
    (:data:`runtime.schedule.POSITION_PARTS`), from the last stage's per-micro-batch sums
    (each sequence counted once: one TP and one context-parallel rank adds it)."""
    counted = (sums is not None and parallel_state.get_tensor_model_parallel_rank() == 0
               and parallel_state.get_context_parallel_rank() == 0)
    total = torch.zeros(POSITION_PARTS, 2, dtype=torch.float64, device=device.compute_device())
    if counted:
        total += sums
    dist.all_reduce(total)
    # part k holds the positions i with k <= i * parts / seq_length < k + 1
    first = [-(-k * seq_length // POSITION_PARTS) for k in range(POSITION_PARTS + 1)]
    return {f"val_loss_at/{first[k]}-{first[k + 1] - 1}": float(s / max(c, 1.0))
            for k, (s, c) in enumerate(total.tolist())}
