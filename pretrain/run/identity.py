"""What a checkpoint is: its model, its tokenizer, its data and its data position, compared
before loading.

Every checkpoint records (in ``complete.json``) the model fields that decide which function its
tensors compute, the tokenizer that gives its token ids their meaning, the identity of the data
it was trained on and how far into that data it got. A resume, ``eval``, ``generate``,
``lm-eval``, ``export-hf`` or ``run.init_from`` compares them with the config at hand *before*
megatron reads a tensor, so a different vocabulary or hidden size is refused naming the field
and both values instead of loading part of the checkpoint, and another tokenizer of the same
size (whose scores would look plausible and mean nothing) is refused naming both files. A
data, batch or seed change on resume is refused unless ``run.allow_data_change``; then the data
position (samples and tokens consumed) carries on from the checkpoint's, so consumed tokens
never go backwards and no sample index is reused by accident. A resume also keeps the
optimizer state's layout (``parallel.distributed_optimizer``, and with experts whether their
state is kept apart: :func:`experts_apart`), which megatron cannot convert.

Datasets are identified by a fingerprint of their files, not by path, so moving a corpus to
another file system keeps a run resumable.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from model.config import MOE_FIELDS, ModelConfig
from pretrain.config import Config
from pretrain.data.record import fingerprint
from pretrain.data.tokenizer import open_tokenizer
from runtime.errors import CheckpointError

log = logging.getLogger("pretrain")

# Model fields that may change between a checkpoint and the run loading it: how the same
# function is computed (kernels, attention), regularisation, and initialisation (unused when
# weights are loaded). Every other model field shapes a tensor or changes the function.
CHANGEABLE_MODEL_FIELDS = frozenset({
    "attention_backend", "transformer_impl", "megatron_fusions", "hidden_dropout",
    "attention_dropout", "init_method_std", "init",
})
# What HybridNorm*'s block 0 was before model.hybrid_first_block: a gated attention input with
# its own input norm and no MLP norm on x. No version builds it now; its checkpoints are
# refused by name rather than loaded into another function.
RETIRED_GATED_FIRST_BLOCK = "gated (HybridNorm* of earlier versions, no longer built)"
_DENSE = {field.name: getattr(field.default, "value", field.default)
          for field in dataclasses.fields(ModelConfig)
          if field.name in ("num_experts", *MOE_FIELDS)}
"""A dense model's mixture-of-experts fields, as an identity records them."""


def model_identity(config: Config) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict()["model"].items()
            if k not in CHANGEABLE_MODEL_FIELDS}


def data_identity(config: Config) -> dict[str, Any]:
    """The inputs that decide which sample a step reads. The validation sets are not among
    them (data.valid_samples, the default set's size, and data.valid_sets, the further sets):
    megatron builds the training split's samples from the training count alone, and a
    further set is a dataset of its own, so a resume may change, add or drop them freely."""
    d = config.data
    weights = d.weights or [1.0] * len(d.prefixes)
    return {
        "datasets": [{"prefix": p, "fingerprint": fingerprint(p), "weight": w}
                     for p, w in zip(d.prefixes, weights, strict=True)],
        "split": d.split, "seed": config.run.seed,
        "global_batch_size": d.global_batch_size, "seq_length": config.seq_length,
    }


def tokenizer_identity(config: Config) -> dict[str, str]:
    """The tokenizer by content (sentencepiece model or tokenizer.json; moving the file keeps
    it) and, for messages, by the path it had."""
    tokenizer = open_tokenizer(config.data.tokenizer)
    return {"path": config.data.tokenizer,
            "sha256": tokenizer.unique_identifiers["model_sha256"]}


def run_identity(config: Config) -> dict[str, Any]:
    """What a checkpoint of this config records: {"model", "tokenizer", "data"}."""
    return {"model": model_identity(config), "tokenizer": tokenizer_identity(config),
            "data": data_identity(config)}


def upgraded(saved: dict[str, Any]) -> dict[str, Any]:
    """A model identity recorded by an earlier version, in today's fields: a field added since
    takes the value the model then had implicitly, so an unchanged model still matches and a
    changed one is named. LayerNorms had a bias until ``model.norm_bias``; the boolean
    ``hybrid_prenorm_first_block`` became ``hybrid_first_block``; every model was dense until
    ``model.num_experts`` (0, and each MoE field at its default), so experts asked of such a
    checkpoint are named here rather than missed by megatron's load."""
    saved = dict(saved)
    saved.setdefault("norm_bias", saved.get("normalization") == "layernorm")
    for name, default in _DENSE.items():
        saved.setdefault(name, default)
    if "hybrid_prenorm_first_block" in saved:
        gated = saved.pop("hybrid_prenorm_first_block")
        saved["hybrid_first_block"] = RETIRED_GATED_FIRST_BLOCK if gated else "hybrid"
    return saved


def model_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    return [f"model.{k} ({_show(saved[k])} in the checkpoint, {_show(current[k])} here)"
            for k in current if k in saved and saved[k] != current[k]]


def check_model(saved: dict[str, Any] | None, current: dict[str, Any], checkpoint: str) -> None:
    """Refuse a checkpoint whose model differs from ``current`` (:func:`model_identity`),
    naming every differing field. ``saved`` is None for checkpoints written before identities
    were recorded: their tensor shapes are still checked when they load."""
    differences = model_differences(upgraded(saved), current) if saved else []
    if differences:
        raise CheckpointError(f"checkpoint '{checkpoint}' holds another model: "
                          f"{'; '.join(differences)}")


def check_tokenizer(saved: dict[str, str] | None, config: Config, checkpoint: str) -> None:
    """Refuse a checkpoint trained with another tokenizer than ``config``'s: its token ids
    would stand for other text. No override: a tokenizer is never changed under a model.
    ``saved`` is None for checkpoints written before tokenizers were recorded."""
    if saved is None:
        return
    current = tokenizer_identity(config)
    if saved["sha256"] != current["sha256"]:
        raise CheckpointError(
            f"checkpoint '{checkpoint}' was trained with another tokenizer: "
            f"'{saved['path']}' #{saved['sha256'][:8]} in the checkpoint, data.tokenizer "
            f"'{current['path']}' #{current['sha256'][:8]} here; leave out --config to use "
            f"the run folder's config.toml, or set --data.tokenizer={saved['path']}")


def data_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    found = []
    old, new = saved["datasets"], current["datasets"]
    if [(s["fingerprint"], s["weight"]) for s in old] != [(s["fingerprint"], s["weight"])
                                                          for s in new]:
        found.append(f"data.prefixes/weights ({_datasets(old)} in the checkpoint, "
                     f"{_datasets(new)} here)")
    names = {"split": "data.split", "seed": "run.seed",
             "global_batch_size": "data.global_batch_size", "seq_length": "data.seq_length"}
    found += [f"{name} ({_show(saved[k])} in the checkpoint, {_show(current[k])} here)"
              for k, name in names.items() if saved[k] != current[k]]
    return found


def check_data(saved: dict[str, Any] | None, current: dict[str, Any], allow_change: bool,
               checkpoint: str) -> None:
    """Refuse a resume on other data, batch or seed (``current``: :func:`data_identity`)
    unless ``allow_change`` (run.allow_data_change)."""
    differences = data_differences(saved, current) if saved else []
    if not differences:
        return
    if not allow_change:
        raise CheckpointError(f"checkpoint '{checkpoint}' was trained on other data: "
                          f"{'; '.join(differences)}; resume with --run.allow_data_change=true "
                          "to continue on the new data from the checkpoint's position")
    log.warning("data changed on resume (run.allow_data_change): %s", "; ".join(differences))


def check_optimizer_layout(settings: dict[str, dict] | None, config: Config,
                           checkpoint: str) -> None:
    """Refuse a resume whose optimizer state is laid out otherwise than the checkpoint's:
    megatron's distributed optimizer shards its state into per-rank buffers, the replicated
    one keeps it per parameter, and neither loads the other's (megatron fails deep in the
    load, on a parameter-group key). ``settings`` is the checkpoint's recorded config (None
    for checkpoints written before settings were recorded: megatron's own error then)."""
    saved = (settings or {}).get("parallel", {}).get("distributed_optimizer")
    current = config.parallel.distributed_optimizer
    if saved is not None and saved != current:
        raise CheckpointError(
            f"checkpoint '{checkpoint}' holds the optimizer state of "
            f"parallel.distributed_optimizer={str(saved).lower()}, and this start has "
            f"{str(current).lower()}: the two lay the state out differently; resume with "
            f"--parallel.distributed_optimizer={str(saved).lower()}, or start a new run from "
            "its weights with --run.init_from")
    _check_experts_apart(settings, config, checkpoint)


def experts_apart(parallel: dict, model: dict) -> bool:
    """Whether megatron keeps the routed experts' optimizer state apart from the rest's: with
    experts that are expert-parallel (``ep`` > 1) or tensor-parallel otherwise than the rest
    (``etp`` other than ``tp``), it marks them as expert parameters (megatron's
    ``allreduce`` False) and builds them an optimizer of their own, chained after the
    other's; otherwise they are ordinary parameters of the one optimizer. ``parallel`` and
    ``model``: the config's sections as recorded (``Config.to_dict``)."""
    if not model.get("num_experts"):
        return False
    tp = parallel.get("tp", 1)
    etp = tp if parallel.get("etp") is None else parallel["etp"]
    return parallel.get("ep", 1) > 1 or etp != tp


def _check_experts_apart(settings: dict[str, dict] | None, config: Config,
                         checkpoint: str) -> None:
    """Refuse a resume across :func:`experts_apart`: megatron's checkpoint of a chained
    optimizer (its states numbered, the experts' parameter groups marked expert-parallel) and
    of a single one are laid out differently, and megatron loads neither as the other (it
    fails deep in the load on a missing key). Layouts on the same side reshard."""
    if settings is None or "parallel" not in settings:
        return
    current = config.to_dict()
    apart = experts_apart(current["parallel"], current["model"])
    if experts_apart(settings["parallel"], settings.get("model", {})) == apart:
        return

    def layout(ep, etp, tp) -> str:
        return f"parallel.ep {ep}, parallel.etp {tp if etp is None else etp}, parallel.tp {tp}"

    p = settings["parallel"]
    saved = layout(p.get("ep", 1), p.get("etp"), p.get("tp", 1))
    here = layout(config.parallel.ep, config.parallel.etp, config.parallel.tp)
    where = {True: "in an optimizer of their own", False: "with the other parameters'"}
    fix = {True: "parallel.ep > 1 or parallel.etp other than parallel.tp",
           False: "parallel.ep 1 and parallel.etp = parallel.tp"}
    raise CheckpointError(
        f"checkpoint '{checkpoint}' holds the routed experts' optimizer state "
        f"{where[not apart]} ({saved}), and this start keeps it {where[apart]} ({here}): "
        f"megatron lays the two out differently and converts neither; resume with "
        f"{fix[not apart]}, or start a new run from its weights with --run.init_from")


DOCUMENT_FIELDS = ("document_attention", "reset_position_ids", "eod_mask_loss")
"""How a packed sequence is trained (data.*): what a token sees, where positions restart, which
tokens carry loss. Not part of the data's identity (the same samples are read), but a change
trains another function, so no resume may make one."""


def check_documents(settings: dict[str, dict] | None, config: Config, checkpoint: str) -> None:
    """Refuse a resume that changes a DOCUMENT_FIELDS setting. ``settings`` is the
    checkpoint's recorded config; a checkpoint from before these settings existed was trained
    with all of them off."""
    if settings is None:
        return
    saved = settings.get("data", {})
    changed = [f"data.{name} ({str(saved.get(name, False)).lower()} in the checkpoint, "
               f"{str(getattr(config.data, name)).lower()} here)"
               for name in DOCUMENT_FIELDS if saved.get(name, False) != getattr(config.data, name)]
    if changed:
        raise CheckpointError(
            f"checkpoint '{checkpoint}' was trained with other document settings: "
            f"{'; '.join(changed)}; a resume keeps them (they change what is trained), a new "
            "run may start from its weights with --run.init_from")


def _datasets(entries: list[dict]) -> str:
    return "[" + ", ".join(f"{e['prefix']} x{e['weight']:g} #{e['fingerprint'][:8]}"
                           for e in entries) + "]"


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)
