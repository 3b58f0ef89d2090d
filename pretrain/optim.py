"""megatron-core's optimizer (AdamW, optionally sharded across DP) and its LR schedule."""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from pretrain.config import Config


def build_optimizer(config: Config, chunks: list, params_dtype: torch.dtype):
    """AdamW with linear warm-up from 0 to ``optim.lr`` then cosine decay to ``optim.min_lr``
    at ``run.steps``. Returns (optimizer, scheduler)."""
    o = config.optim
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
            bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
            use_distributed_optimizer=config.parallel.distributed_optimizer,
        ),
        chunks,
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps, lr_decay_steps=config.run.steps,
        lr_decay_style="cosine", start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=config.run.steps, wd_incr_style="constant",
    )
    return optimizer, scheduler


def untie_adam_steps(optimizer) -> None:
    """After a checkpoint load every parameter's Adam ``step`` is the same tensor object;
    an in-place increment would then advance all of them once per parameter and skew bias
    correction. Give each parameter its own copy."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:
            continue
        for state in torch_optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
