"""The checks and the set-up every command that runs a model shares: training, ``eval`` and
the unsharded tools (generate, lm-eval, export-hf).

:func:`preflight` checks what needs no process group or model (the tokenizer, the data;
the config itself was validated when it was loaded), so a mistake fails in seconds;
:func:`setup` then builds the process groups and the DDP-wrapped model chunks.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from megatron.core.transformer.module import Float16Module

from model import compiled
from model.backends import AttentionBackend
from model.builder import build_model, wrap_ddp
from model.config import ModelConfig
from pretrain.config import Config, ParamsDtype, valid_sets
from pretrain.data import record, round_trip
from pretrain.data.checks import check_data
from pretrain.data.tokenizer import Tokenizer, open_tokenizer
from pretrain.report import console
from runtime import device, parallel
from runtime.errors import ConfigError, DataError

log = logging.getLogger("pretrain")


def params_dtype(config: Config) -> torch.dtype:
    choice = config.run.params_dtype
    if choice is ParamsDtype.AUTO:
        return torch.bfloat16 if device.uses_cuda() else torch.float32
    return {ParamsDtype.FP32: torch.float32, ParamsDtype.BF16: torch.bfloat16}[choice]


def model_config(config: Config) -> ModelConfig:
    """The model as built: with data.document_attention an ``auto`` attention backend is SDPA,
    whatever else is installed (TE's attention does not take document ids)."""
    model = config.model
    if config.data.document_attention and model.attention_backend == AttentionBackend.AUTO:
        return dataclasses.replace(model, attention_backend=AttentionBackend.SDPA)
    return model


def tokenizer_for(config: Config) -> Tokenizer:
    """The config's tokenizer, which the model's vocabulary must hold; a vocabulary larger
    than the tokenizer's beyond its padding is said once (rows no token ever reads)."""
    tokenizer = open_tokenizer(config.data.tokenizer)
    m = config.model
    if m.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size ({m.vocab_size}) must be >= the "
                          f"tokenizer's vocabulary ({tokenizer.vocab_size}, "
                          f"{config.data.tokenizer})")
    if m.vocab_size - tokenizer.vocab_size >= m.make_vocab_size_divisible_by:
        unused = m.vocab_size - tokenizer.vocab_size
        log.warning("model.vocab_size (%s) is %.1f x the tokenizer's vocabulary (%s, %s): "
                    "%s embedding rows no token reads (%s parameters each); set "
                    "model.vocab_size=%d", f"{m.vocab_size:,}",
                    m.vocab_size / tokenizer.vocab_size, f"{tokenizer.vocab_size:,}",
                    config.data.tokenizer, f"{unused:,}", f"{m.hidden_size:,}",
                    tokenizer.vocab_size)
    return tokenizer


def check_round_trip(config: Config, tokenizer: Tokenizer) -> None:
    """A tokenizer that does not give back the text it encodes trains only on datasets
    prepared with that allowance (``pretrain.data.round_trip``)."""
    lost = round_trip.loss(tokenizer, round_trip.PROBE)
    if lost is None:
        return
    prefixes = [*config.data.prefixes, *(s.prefix for s in valid_sets(config.data))]
    for prefix in prefixes:
        if not (record.read(prefix) or {}).get("lossy_tokenizer"):
            raise DataError(
                f"data.tokenizer '{config.data.tokenizer}' does not give back the text it "
                f"encodes ({lost}), and '{prefix}' was not prepared with "
                "--allow-lossy-tokenizer: prepare it again with a lossless tokenizer, or "
                "with --allow-lossy-tokenizer to train on this one's ids")
    log.warning("data.tokenizer '%s' loses text (%s); its datasets were prepared with "
                "--allow-lossy-tokenizer", config.data.tokenizer, lost)


def preflight(config: Config, training: bool = True) -> Tokenizer:
    """Every check that needs no process group or model, beyond the config's own (validated
    when it was loaded, with the launch's world size): the tokenizer against the model, the
    data (``training``: with what a training run reads of it); so a mistake fails in seconds.
    Returns the tokenizer."""
    tokenizer = tokenizer_for(config)
    check_data(config, tokenizer, training)
    if training:
        check_round_trip(config, tokenizer)
    return tokenizer


def setup(config: Config) -> list:
    """Process groups and the DDP-wrapped model chunks (after :func:`preflight`)."""
    if config.run.deterministic:  # before NCCL and cuBLAS start
        device.make_deterministic()
    if not device.uses_cuda():
        console.quiet_cpu_notices()
    k = config.kernels
    if k.cuda_graphs:
        compiled.require_cuda_graphs_device()
    parallel.initialize(config.parallel, seed=config.run.seed, graph_safe_rng=k.cuda_graphs)
    dtype = params_dtype(config)
    chunks = build_model(model_config(config), config.parallel, dtype,
                         config.kernels.norm_backend, seed=config.run.seed,
                         positions_per_token=config.data.reset_position_ids)
    if k.compile:  # each block's forward, before any wrapper; compiled in the first step
        compiled.use_cache(k.compile_cache or Path(config.run.dir) / "compile_cache")
        compiled.compile_blocks(chunks, k.compile_backend.value, k.cuda_graphs)
    if dtype == torch.bfloat16:  # bf16 weights, fp32 logits for the loss (as Megatron-LM)
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    return wrap_ddp(chunks, config.parallel)
