"""``lm-eval``: lm-evaluation-harness tasks scored by this framework's own model.

:class:`FrameworkLM` is an lm-eval language model over a loaded checkpoint of any residual
scheme (no export needed), on the CPU or a GPU: log-likelihoods of continuations (multiple
choice tasks such as hellaswag or arc), rolling log-likelihoods (perplexity tasks) and greedy
generation until a stop string. Requests are scored one sequence at a time, each in a window
of at most ``model.seq_length`` tokens (the most recent kept), which is simple and exact but
does not batch. The tasks are built (their data read or downloaded) before the model loads,
so a task that cannot be had fails in seconds, in one line.

Results are printed, appended to ``eval.jsonl`` of the checkpoint's run folder (with the
checkpoint and tasks; whatever --config says), next to the validation results of ``eval``,
and logged to the run's W&B run (unless ``logging.wandb_mode`` is disabled) as
``lm_eval/<task>/<metric>`` against ``lm_eval/step``, the checkpoint's training step.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from pretrain.config import Config
from pretrain.data.tokenizer import Tokenizer
from pretrain.report.metrics import MetricsLogger, strict_json
from pretrain.run.checkpoint import read_record, run_folder
from pretrain.unsharded.generate import Sampling, completion, continue_tokens
from pretrain.unsharded.whole_model import load_whole, single_process
from runtime import device
from runtime.errors import ConfigError, DataError


class WindowedLM(TemplateLM):
    """What every lm-eval model of this framework shares: token ids from the run's tokenizer,
    each (context, continuation) scored in a window of at most ``seq_length`` tokens (the most
    recent kept), and rolling log-likelihoods as lm-eval's disjoint windows. Subclasses score
    a list of pairs at once (:meth:`score_pairs`), so the live model can batch them."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, seq_length: int):
        super().__init__()
        self.tok, self.vocab_size, self.seq_length = tokenizer, vocab_size, seq_length

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        return self.tok.encode(string)

    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether it is the greedy continuation) of
        each (context ids, continuation ids), the log-probabilities normalised over the
        tokenizer's vocabulary (the model's padded rows left out)."""
        raise NotImplementedError

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return self.score_pairs([(context, continuation)
                                 for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows = []
        for request in requests:
            (text,) = request.args
            windows.append([make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.eot_token_id,
                max_seq_len=self.seq_length, context_len=1)])
        scores = iter(self.score_pairs([pair for doc in windows for pair in doc]))
        return [sum(next(scores)[0] for _ in doc) for doc in windows]


class FrameworkLM(WindowedLM):
    """A whole (unsharded) model in this process, scored one sequence at a time."""

    def __init__(self, model, tokenizer: Tokenizer, vocab_size: int, seq_length: int):
        super().__init__(tokenizer, vocab_size, seq_length)
        self.model = model

    @torch.no_grad()
    def _log_probs(self, tokens: list[int]) -> torch.Tensor:
        """log p(token i+1 | tokens up to i) for the window ``tokens`` ([len - 1, vocab])."""
        where = device.compute_device()
        inputs = torch.tensor([tokens[:-1]], device=where)
        positions = torch.arange(inputs.shape[1], device=where).unsqueeze(0)
        logits = self.model(inputs, positions, None)[0, :, :self.vocab_size].float()
        return logits.log_softmax(-1).cpu()

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        window = (context + continuation)[-(self.seq_length + 1):]
        log_probs = self._log_probs(window)[-len(continuation):]
        target = torch.tensor(continuation)
        picked = log_probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        return float(picked.sum()), bool((log_probs.argmax(-1) == target).all())

    def score_pairs(self, pairs):
        return [self._score(context, continuation) for context, continuation in pairs]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in requests:
            context, options = request.args
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sampling = Sampling(max_tokens=int(options.get("max_gen_toks", 256)))
            ids = self.tok_encode(context)
            new = continue_tokens(self.model, ids, sampling, self.vocab_size, self.seq_length,
                                  self.eot_token_id)
            text = completion(self.tok, ids, new)
            for stop in until:
                text = text.split(stop)[0]
            outputs.append(text)
        return outputs


def finite(value):
    """lm-eval's results as strict JSON: non-finite numbers (a stderr of one sample) -> None."""
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if isinstance(value, str | int | float | bool | None) else str(value)


# What building a task raises when its data is neither on this machine nor downloadable (no
# network, or HF_HUB_OFFLINE): datasets wraps the Hub's failures in a builtin ConnectionError
# (the Hub's OfflineModeIsEnabled is one too); a data file the Hub client cannot fetch and
# has no cached copy of is its LocalEntryNotFoundError.
DOWNLOAD_ERRORS = (ConnectionError, TimeoutError, LocalEntryNotFoundError)


def load_tasks(manager: TaskManager, tasks: list[str], output_types: tuple[str, ...] = (),
               option: str = "--include-path") -> list:
    """The tasks built, their data read or downloaded, before the model is loaded: a task
    whose data cannot be had is then one line naming it, in seconds, not a traceback after
    the model load. ``output_types``: the kinds of task allowed (any when empty); ``option``
    names the local-task setting in messages. Returns what :func:`simple_evaluate` takes
    instead of the names."""
    built = []
    for name in tasks:
        try:
            with _hub_retries_unreported():
                loaded = manager.load(name)
        except DOWNLOAD_ERRORS as err:
            raise DataError(
                f"lm-eval task {name} needs its data from the Hugging Face Hub, which could not "
                f"be reached ({err}); without network, pass a local task with {option} DIR "
                f"(a task YAML over local files, e.g. dataset_path: json)") from None
        for task_name, task in loaded["tasks"].items():
            kind = getattr(task, "OUTPUT_TYPE", None)
            if output_types and kind not in output_types:
                raise ConfigError(f"lm-eval task {task_name} ({kind}) cannot be scored here: "
                                  f"only {', '.join(output_types)} tasks can; score it with "
                                  "`python -m pretrain lm-eval` on a checkpoint")
        built += _top_level(loaded)
    return built


@contextlib.contextmanager
def _hub_retries_unreported():
    """The Hub client's warnings (a line per failed request and per retry, five retries a
    request) held back while a task's data loads: a download that fails in the end is one
    error line of its own, and one that succeeds on a retry needs none."""
    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(level)


def _top_level(loaded: dict) -> list:
    """The groups and tasks of a :meth:`TaskManager.load` result that no group holds (a
    group brings its members itself)."""
    members = {child for children in loaded["group_map"].values() for child in children}
    return [item for name, item in [*loaded["groups"].items(), *loaded["tasks"].items()]
            if name not in members]


def run_lm_eval(config: Config, checkpoint: str, tasks: list[str], include_path: str | None,
                num_fewshot: int | None, limit: int | None) -> dict:
    """Score ``tasks`` with the checkpoint's model; {"checkpoint", "tasks", "results"}."""
    single_process(config, "lm-eval")
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"lm-eval --tasks: unknown task(s) {', '.join(unknown)}"
                          + ("" if include_path else " (local tasks need --include-path)"))
    built = load_tasks(manager, tasks)
    model, tokenizer, found = load_whole(config, checkpoint)
    lm = FrameworkLM(model, tokenizer, tokenizer.vocab_size, config.model.seq_length)
    out = simple_evaluate(model=lm, tasks=built, num_fewshot=num_fewshot, limit=limit,
                          task_manager=manager, log_samples=False)
    result = {"checkpoint": str(found), "tasks": tasks, "results": finite(out["results"])}
    run_dir = run_folder(found)  # results go next to the checkpoint they describe
    with (run_dir / "eval.jsonl").open("a") as f:
        f.write(strict_json(result) + "\n")
    if (run_dir / "config.toml").is_file():  # a run folder: its W&B run gets the scores
        logger = MetricsLogger(config, run_dir, {})
        logger.log_evaluation("lm_eval", read_record(found)["step"],
                              scores(result["results"]))
        logger.finish()
    return result


def scores(results: dict) -> dict[str, float]:
    """lm-eval's {task: {"acc,none": 0.5, "alias": ...}} as flat W&B keys, ``task/acc`` (the
    filter named only when it is not ``none``)."""
    flat = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                metric, _, where = key.partition(",")
                flat[f"{task}/{metric}" + ("" if where in ("", "none") else f"/{where}")] = value
    return flat
