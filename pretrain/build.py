"""The checks and the set-up every command that runs a model shares: training, ``eval`` and
the unsharded tools (generate, lm-eval, export-hf).

:func:`preflight` checks what needs no process group or model (the tokenizer, the data;
the config itself was validated when it was loaded), so a mistake fails in seconds, and
returns what it read for the steps after it;
:func:`setup` then builds the process groups and the DDP-wrapped model chunks.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import NamedTuple

import torch
from megatron.core.transformer.module import Float16Module

from model import compiled, decay
from model.backends import AttentionBackend
from model.builder import build_model, wrap_ddp
from model.config import ModelConfig
from pretrain.config import Config, OptimName, ParamsDtype
from pretrain.data.checks import Data, check_data
from pretrain.data.tokenizer import Tokenizer, open_tokenizer
from pretrain.report import console
from runtime import device, parallel
from runtime.errors import ConfigError

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


class Inputs(NamedTuple):
    """What :func:`preflight` checked: the tokenizer, and the data as its checks read it
    (each dataset once: the run's identity takes the data's fingerprints from it)."""

    tokenizer: Tokenizer
    data: Data


def preflight(config: Config, training: bool = True) -> Inputs:
    """Every check that needs no process group or model, beyond the config's own (validated
    when it was loaded, with the launch's world size): the tokenizer against the model, the
    data (``training``: with what a training run reads of it, and whether its datasets allow
    a tokenizer that loses text); so a mistake fails in seconds."""
    tokenizer = tokenizer_for(config)
    return Inputs(tokenizer, check_data(config, tokenizer, training))


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
    whole = decay.muon_matrix if config.optim.name is OptimName.MUON else None
    return wrap_ddp(chunks, config.parallel, whole)
