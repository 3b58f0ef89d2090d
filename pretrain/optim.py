"""megatron-core's optimizer (AdamW, optionally sharded across DP) and its LR schedule.

With Transformer Engine or apex installed megatron steps with their fused Adam and
multi-tensor kernels. Without them it falls back to torch's AdamW (foreach on CUDA) and to
per-tensor loops for the gradient norm, clipping and the main-to-model weight copy; with
``optim.fused`` (the default) that path uses torch's fused AdamW kernel and the multi-tensor
replacements of :mod:`runtime.multi_tensor` instead (the GPU report measured 50 ms for the
fallback step at 1.2B parameters and 29 ms with the fused AdamW alone).
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from pretrain.config import Config
from runtime.errors import ConfigError
from runtime.multi_tensor import foreach_kernels


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
        override_opt_param_scheduler=o.override_schedule,
        use_checkpoint_opt_param_scheduler=False,
    )
    if o.fused:
        use_fused_kernels(optimizer)
    return optimizer, scheduler


def _torch_adams(optimizer):
    """megatron's inner torch AdamW optimizers (its fallback without TE or apex)."""
    return [opt for _, opt in _torch_optimizers(optimizer) if isinstance(opt, torch.optim.Adam)]


def _fuse_groups(torch_optimizer: torch.optim.Optimizer, fused: bool = True) -> None:
    """Step with torch's fused kernel, or (``fused`` false) let torch choose, its default;
    each parameter's ``step`` counter then sits where that kernel wants it."""
    for group in torch_optimizer.param_groups:
        group["foreach"], group["fused"] = (False, True) if fused else (None, None)
    _place_steps(torch_optimizer)


def _place_steps(torch_optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's Adam ``step`` on the device torch's own first step would put it: the
    parameter's for the fused (and capturable) kernels, which refuse a CPU ``step`` next to
    CUDA parameters, else the CPU (the other kernels read it as a number there). A state
    loaded from a checkpoint of the other choice, or primed before a load, arrives on the
    wrong one."""
    for group in torch_optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = torch_optimizer.state.get(param)
            if state and "step" in state:
                where = param.device if on_device else torch.device("cpu")
                state["step"] = state["step"].to(where, torch.float32)


def use_fused_kernels(optimizer) -> None:
    """Step torch's AdamW with its fused kernel, and run every step with megatron's
    multi-tensor fallbacks replaced (:func:`runtime.multi_tensor.foreach_kernels`). The
    kernels change the order of floating-point operations only (a test holds a run to the
    unfused one's losses within fp32 tolerance)."""
    for torch_optimizer in _torch_adams(optimizer):
        _fuse_groups(torch_optimizer)
    step = optimizer.step

    def fused_step(*args, **kwargs):
        with foreach_kernels():
            return step(*args, **kwargs)

    optimizer.step = fused_step


# The scheduler's checkpointed fields and the config field that sets each.
_SCHEDULE_FIELDS = {
    "max_lr": "optim.lr", "min_lr": "optim.min_lr", "lr_warmup_steps": "optim.warmup_steps",
    "lr_decay_steps": "run.steps", "start_wd": "optim.weight_decay",
}


def check_schedule(scheduler, saved: dict) -> None:
    """A resumed run must say which schedule it follows when it differs from the checkpoint's.

    megatron's default silently keeps the checkpoint's values, so extending ``run.steps`` would
    leave the cosine decay ending at the old step; its other mode asserts. Either surprise is
    replaced by one line naming the field and the remedy (``optim.override_schedule``)."""
    if scheduler.override_opt_param_scheduler:  # optim.override_schedule
        return
    current = scheduler.state_dict()
    for key, field_name in _SCHEDULE_FIELDS.items():
        if key in saved and saved[key] != current[key]:
            raise ConfigError(
                f"{field_name} ({current[key]}) differs from the checkpoint's ({saved[key]}); "
                "set --optim.override_schedule=true to resume on the new schedule")


def load_schedule(scheduler, saved: dict) -> None:
    """Put the schedule saved in a checkpoint into ``scheduler``, whatever steps it took.

    megatron's ``load_state_dict`` advances the scheduler by the saved step count rather than
    setting it: right for a fresh scheduler only. A guard rollback reloads into the live one,
    which would then run as many steps ahead as the run had taken (its LR at ``min_lr`` long
    before ``run.steps``), and every later checkpoint would carry that count."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(saved)


def _torch_optimizers(optimizer):
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(inner, "optimizer", None) is not None:
            yield inner, inner.optimizer


def prime_state(optimizer) -> None:
    """Give every parameter an (all-zero) Adam state before a checkpoint load.

    megatron derives the optimizer's load template from its current state, which is empty
    until the first step, and it asserts that all parameters share one ``step`` value."""
    for inner, torch_optimizer in _torch_optimizers(optimizer):
        inner.init_state_fn(torch_optimizer, inner.config)
        for state in torch_optimizer.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
        _place_steps(torch_optimizer)


def load_state(optimizer, state_dict: dict) -> None:
    """Load an optimizer state saved in the fully reshardable format.

    Two megatron 0.19 quirks on the torch-Adam path (no apex/TE): the per-parameter copy also
    visits torch Adam's ``step``, which this format stores once per param group, not per
    parameter (KeyError); and afterwards every parameter's ``step`` is the same tensor, so an
    in-place increment would advance it once per parameter. ``step`` is set aside during the
    copy and given back to each parameter as its own tensor."""
    patched = []
    for inner, _ in _torch_optimizers(optimizer):
        load_params = getattr(inner, "load_parameter_state_from_fully_reshardable", None)
        if load_params is None:
            continue

        def without_steps(param_state, load_params=load_params, inner=inner):
            state = inner.optimizer.state  # replaced by the load that precedes this call
            steps = {p: s.pop("step") for p, s in state.items() if "step" in s}
            try:
                load_params(param_state)
            finally:
                for param, step in steps.items():
                    state[param]["step"] = step.detach().clone()

        inner.load_parameter_state_from_fully_reshardable = without_steps
        patched.append(inner)
    # torch's load takes each param group's flags from the checkpoint; which kernel steps is
    # this run's choice (optim.fused), not the saved run's
    chosen = [(opt, any(group.get("fused") for group in opt.param_groups))
              for opt in _torch_adams(optimizer)]
    try:
        optimizer.load_state_dict(state_dict)
    finally:
        for inner in patched:
            del inner.load_parameter_state_from_fully_reshardable
    for torch_optimizer, fused in chosen:
        _fuse_groups(torch_optimizer, fused)
