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
optimizer state's layout (``parallel.distributed_optimizer``), which megatron cannot convert;
with experts, a checkpoint of an earlier version that held the experts' optimizer state with
the rest is refused the same way (:func:`_check_experts_apart`).

Datasets are identified by a fingerprint of their files, not by path, so moving a corpus to
another file system keeps a run resumable; the fingerprints are those the start's data checks
read (``pretrain.data.checks.Data``), so no data file is read again here.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from model.config import MOE_FIELDS, ModelConfig
from pretrain.config import Config
from pretrain.data.tokenizer import open_tokenizer
from runtime import checkpoint_reader
from runtime.errors import CheckpointError
from runtime.weights import LOAD_ERRORS

log = logging.getLogger("pretrain")

# Model fields that may change between a checkpoint and the run loading it: how the same
# function is computed (kernels, attention), regularisation, the routers' training signals
# (the weights of the balancing and z losses and the step of the loss-free expert bias: each
# steers training and shapes no tensor; a resume is how a run that stays imbalanced gets a
# stronger balancing loss, as Megatron-LM allows), and initialisation (unused when weights are
# loaded). Every other model field shapes a tensor or changes the function. A resume records
# each change with the run's other settings changes (settings_changes.jsonl).
CHANGEABLE_MODEL_FIELDS = frozenset({
    "attention_backend", "transformer_impl", "megatron_fusions", "hidden_dropout",
    "attention_dropout", "init_method_std", "init",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
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


def data_identity(config: Config, fingerprints: list[str]) -> dict[str, Any]:
    """The inputs that decide which sample a step reads (``fingerprints``: each prefix's
    ``pretrain.data.record.fingerprint``, as the data checks read it). The validation sets
    are not among them (data.valid_samples, the default set's size, and data.valid_sets, the
    further sets): megatron builds the training split's samples from the training count
    alone, and a further set is a dataset of its own, so a resume may change, add or drop
    them freely."""
    d = config.data
    weights = d.weights or [1.0] * len(d.prefixes)
    return {
        "datasets": [{"prefix": p, "fingerprint": f, "weight": w}
                     for p, f, w in zip(d.prefixes, fingerprints, weights, strict=True)],
        "split": d.split, "seed": config.run.seed,
        "global_batch_size": d.global_batch_size, "seq_length": config.seq_length,
    }


def tokenizer_identity(config: Config) -> dict[str, str]:
    """The tokenizer by content (sentencepiece model or tokenizer.json; moving the file keeps
    it) and, for messages, by the path it had."""
    tokenizer = open_tokenizer(config.data.tokenizer)
    return {"path": config.data.tokenizer,
            "sha256": tokenizer.unique_identifiers["model_sha256"]}


def run_identity(config: Config, fingerprints: list[str]) -> dict[str, Any]:
    """What a checkpoint of this config records: {"model", "tokenizer", "data"}
    (``fingerprints``: :func:`data_identity`'s)."""
    return {"model": model_identity(config), "tokenizer": tokenizer_identity(config),
            "data": data_identity(config, fingerprints)}


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


CONTEXT_EXTENSION_FIELDS = ("seq_length", "rotary_base")
"""The model fields a new run may change from the weights it starts from (run.init_from) when
positions are rotary: a context extension trains the same weights on longer sequences with a
larger RoPE base (docs/long-context.md). A resume may not: its data position and its RoPE are
the checkpoint's."""


def extension_fields(current: dict[str, Any]) -> tuple[str, ...]:
    """:data:`CONTEXT_EXTENSION_FIELDS` where ``current`` (:func:`model_identity`) has rotary
    positions; none for learned positions, whose table has seq_length rows."""
    return CONTEXT_EXTENSION_FIELDS if current.get("position_embedding") == "rope" else ()


def check_model(saved: dict[str, Any] | None, current: dict[str, Any], checkpoint: str,
                changeable: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint whose model differs from ``current`` (:func:`model_identity`) in
    a field other than ``changeable``, naming every differing field. ``saved`` is None for
    checkpoints written before identities were recorded: their tensor shapes are still
    checked when they load."""
    current = {k: v for k, v in current.items() if k not in changeable}
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
    for checkpoints written before settings were recorded: megatron's own error then). With
    experts, a checkpoint of the earlier layout of their state is refused too
    (:func:`_check_experts_apart`). So is a resume with the other ``optim.name`` (Muon's
    state is a momentum per block matrix, AdamW's two moments per parameter)."""
    saved = (settings or {}).get("parallel", {}).get("distributed_optimizer")
    current = config.parallel.distributed_optimizer
    if saved is not None and saved != current:
        raise CheckpointError(
            f"checkpoint '{checkpoint}' holds the optimizer state of "
            f"parallel.distributed_optimizer={str(saved).lower()}, and this start has "
            f"{str(current).lower()}: the two lay the state out differently; resume with "
            f"--parallel.distributed_optimizer={str(saved).lower()}, or start a new run from "
            "its weights with --run.init_from")
    if settings:  # settings recorded before optim.name existed are an AdamW run's
        name, current = settings.get("optim", {}).get("name", "adamw"), str(config.optim.name)
        if name != current:
            raise CheckpointError(
                f"checkpoint '{checkpoint}' holds the optimizer state of optim.name={name}, and "
                f"this start has {current}: resume with --optim.name={name}, or start a new run "
                "from its weights with --run.init_from (the optimizer state starts anew)")
    _check_experts_apart(config, checkpoint)


EXPERTS_OPTIMIZER = "chained_1."
"""The prefix of the routed experts' optimizer-state tensors in a checkpoint: megatron numbers
the optimizers of a chain, and the experts' comes second, after the other parameters'."""


def _check_experts_apart(config: Config, checkpoint: str) -> None:
    """Refuse a checkpoint with experts whose optimizer state holds them with the other
    parameters. Checkpoints of this version keep the routed experts' state apart, in an
    optimizer of their own (:data:`EXPERTS_OPTIMIZER`), at every layout
    (:func:`model.moe.mark_experts`), so they resume at any ``parallel.ep`` and
    ``parallel.etp``. Earlier versions left that to megatron, which keeps them apart only at
    ``ep`` > 1 or ``etp`` other than ``tp``: a checkpoint those versions wrote at ``ep`` 1 and
    ``etp`` = ``tp`` holds one optimizer's state where this version has two, and megatron
    would fail deep in the load on a missing key. Its weights load as they are."""
    if not config.model.num_experts:
        return
    try:
        keys = checkpoint_reader.tensors_metadata(Path(checkpoint))
    except LOAD_ERRORS:
        return  # a damaged index is named when the checkpoint loads
    if any(key.startswith(EXPERTS_OPTIMIZER) for key in keys):
        return
    raise CheckpointError(
        f"checkpoint '{checkpoint}' holds the routed experts' optimizer state with the other "
        "parameters' (written by an earlier version at parallel.ep 1 and parallel.etp = "
        "parallel.tp), which this version keeps apart at every layout and cannot load; start "
        f"a new run from its weights with --run.init_from={checkpoint}")


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
