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
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from model import decay
from pretrain import muon
from pretrain.config import Config, DecayStyle, OptimName
from runtime.errors import ConfigError
from runtime.multi_tensor import foreach_kernels


def build_optimizer(config: Config, chunks: list, params_dtype: torch.dtype):
    """AdamW (``optim.name`` muon: chained with Muon for the blocks' linear weights,
    :mod:`pretrain.muon`) with linear warm-up from 0 to ``optim.lr``, then
    ``optim.decay_style`` down to ``optim.min_lr`` at ``run.steps``. Returns (optimizer,
    scheduler)."""
    o = config.optim
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.beta1, adam_beta2=o.beta2, adam_eps=o.eps, clip_grad=o.clip_grad,
        bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
        use_distributed_optimizer=config.parallel.distributed_optimizer,
    )
    if o.name is OptimName.MUON:
        optimizer = muon.build(config, chunks, optimizer_config, decay_overrides())
    else:
        optimizer = get_megatron_optimizer(optimizer_config, chunks,
                                           config_overrides=decay_overrides())
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps, lr_decay_steps=config.run.steps,
        lr_decay_style=_DECAY_STYLES[o.decay_style],
        start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=config.run.steps, wd_incr_style="constant",
        override_opt_param_scheduler=o.override_schedule,
        use_checkpoint_opt_param_scheduler=False,
        wsd_decay_steps=o.wsd_decay_steps or None, lr_wsd_decay_style=str(o.wsd_decay_shape),
    )
    # what a checkpoint records beside megatron's schedule (schedule_state)
    scheduler.optimizer_name = str(o.name)
    if o.name is OptimName.MUON:
        scheduler.muon_max_lr, scheduler.muon_min_lr = muon.peak_and_final_lr(o)
        scheduler.muon_lr, scheduler.muon_wd = o.muon_lr, o.muon_weight_decay
    if o.fused:
        use_fused_kernels(optimizer)
    return optimizer, scheduler


def step_lrs(optimizer) -> dict[str, float]:
    """The learning rates this step applies, as the metrics name them: AdamW's ("lr") and,
    with Muon, its matrices' ("muon_lr"; it differs from lr where optim.muon_lr is set)."""
    groups = optimizer.param_groups
    rates = {"lr": next(g["lr"] for g in groups if g.get("optimizer") != muon.MARK["optimizer"])}
    matrices = [g["lr"] for g in groups if g.get("optimizer") == muon.MARK["optimizer"]]
    if matrices:
        rates["muon_lr"] = matrices[0]
    return rates


def decay_overrides() -> dict:
    """megatron's parameter-group overrides: weight decay only where a parameter's role says
    so (``model.decay``: weight matrices), instead of megatron's shape rule, which decays a
    learned scalar or an n x n mixing matrix and exempts whatever is one-dimensional."""
    exempt = ParamPredicate(name="not_decayed", fn=lambda param: not decay.decayed(param))
    return {ParamKey(predicate=exempt): {"wd_mult": 0.0}}


# megatron's name of each decay style.
_DECAY_STYLES = {DecayStyle.COSINE: "cosine", DecayStyle.LINEAR: "linear",
                 DecayStyle.CONSTANT: "constant", DecayStyle.WSD: "WSD"}


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


# The schedule a checkpoint records (megatron's scheduler state plus the WSD fields it leaves
# out), the config field that sets each, and how the config writes its value.
_SCHEDULE_FIELDS = {
    "max_lr": "optim.lr", "min_lr": "optim.min_lr", "lr_warmup_steps": "optim.warmup_steps",
    "lr_decay_style": "optim.decay_style", "wsd_decay_steps": "optim.wsd_decay_steps",
    "lr_wsd_decay_style": "optim.wsd_decay_shape", "lr_decay_steps": "run.steps",
    "start_wd": "optim.weight_decay", "muon_lr": "optim.muon_lr",
    "muon_wd": "optim.muon_weight_decay",
}
SCHEDULE_SETTINGS = frozenset(_SCHEDULE_FIELDS.values())
"""The config fields that set the learning-rate and weight-decay schedule."""
_CONFIG_VALUE = {"lr_decay_style": {v: k.value for k, v in _DECAY_STYLES.items()},
                 "wsd_decay_steps": {None: 0}}


# The Muon groups' schedule values a checkpoint records (optim.name muon), and the parameter
# group keys megatron's scheduler reads each from.
_MUON_SCHEDULE = {"muon_max_lr": ("max_lr",), "muon_min_lr": ("min_lr",),
                  "muon_wd": ("start_wd", "end_wd")}


def schedule_state(scheduler) -> dict:
    """What a checkpoint stores of the schedule: megatron's scheduler state, the WSD
    fields, which megatron's state omits (so a change of them is seen on resume), the
    optimizer's name and, with Muon, its groups' peak and final LR and weight decay."""
    muon_lrs = {key: getattr(scheduler, key) for key in ("muon_lr", *_MUON_SCHEDULE)
                if hasattr(scheduler, key)}
    return {**scheduler.state_dict(), "wsd_decay_steps": scheduler.wsd_decay_steps,
            "lr_wsd_decay_style": scheduler.lr_wsd_decay_style,
            "optimizer": getattr(scheduler, "optimizer_name", "adamw"), **muon_lrs}


def _shown(key: str, value):
    return _CONFIG_VALUE.get(key, {}).get(value, value)


def schedule_changes(scheduler, saved: dict) -> dict[str, tuple]:
    """Each schedule field whose value differs from the checkpoint's: {config field: (saved,
    current)}, in the config's spelling. A checkpoint of an older version lacks some fields:
    those are not compared."""
    current = schedule_state(scheduler)
    return {field: (_shown(key, saved[key]), _shown(key, current[key]))
            for key, field in _SCHEDULE_FIELDS.items()
            if key in saved and _shown(key, saved[key]) != _shown(key, current[key])}


def check_schedule(scheduler, saved: dict) -> None:
    """A resumed run must say which schedule it follows when it differs from the checkpoint's.

    megatron's default silently keeps the checkpoint's values, so extending ``run.steps`` would
    leave the decay ending at the old step; its other mode asserts. Either surprise is
    replaced by one line naming the field and the remedy (``optim.override_schedule``)."""
    if scheduler.override_opt_param_scheduler:  # optim.override_schedule
        return
    for field_name, (old, new) in schedule_changes(scheduler, saved).items():
        raise ConfigError(
            f"{field_name} ({new}) differs from the checkpoint's ({old}); "
            "set --optim.override_schedule=true to resume on the new schedule")


def load_schedule(scheduler, saved: dict) -> None:
    """Put the schedule saved in a checkpoint into ``scheduler``, whatever steps it took.

    megatron's ``load_state_dict`` advances the scheduler by the saved step count rather than
    setting it: right for a fresh scheduler only. A guard rollback reloads into the live one,
    which would then run as many steps ahead as the run had taken (its LR at ``min_lr`` long
    before ``run.steps``), and every later checkpoint would carry that count. With
    ``optim.override_schedule`` megatron keeps the scheduler's own (this config's) values."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(saved)


def adopt_schedule(optimizer_state: dict, saved_schedule: dict, scheduler) -> None:
    """Give the saved optimizer's parameter groups this run's peak and final LR (and, with
    Muon, its groups' own and their weight decay).

    megatron stores ``max_lr``/``min_lr`` in every parameter group, matches saved groups to
    the live ones by them (a new ``optim.lr`` on resume: ``KeyError`` in the distributed
    optimizer, "Could not find parameter group" in the other), and then steps with the
    saved values, which the scheduler reads before its own. A saved group that carried the
    checkpoint's schedule value carries this run's instead; the Adam moments are untouched.
    Without ``optim.override_schedule`` the values are equal (:func:`check_schedule`)."""
    def replacing(group_keys: dict) -> list[tuple]:
        return [(group_key, saved_schedule[key], getattr(scheduler, key))
                for key, keys in group_keys.items()
                if key in saved_schedule and hasattr(scheduler, key) for group_key in keys]

    adam = replacing({"max_lr": ("max_lr",), "min_lr": ("min_lr",)})
    matrices = replacing(_MUON_SCHEDULE)  # Muon's groups (their values may equal AdamW's)
    for groups in _param_group_lists(optimizer_state):
        for group in groups:
            is_muon = group.get("optimizer") == muon.MARK["optimizer"]
            for key, old, new in matrices if is_muon else adam:
                if group.get(key) == old:
                    group[key] = new


def _param_group_lists(state) -> list[list[dict]]:
    """Every ``param_groups`` list in a (possibly chained, possibly nested) megatron
    optimizer state: under "optimizer" for the mixed-precision and distributed optimizers,
    at the top for the fp32 one, one state per index for a chain."""
    if not isinstance(state, dict):
        return []
    found = [state["param_groups"]] if isinstance(state.get("param_groups"), list) else []
    for key, value in state.items():
        if key != "param_groups" and isinstance(value, dict):
            found += _param_group_lists(value)
    return found


def _torch_optimizers(optimizer):
    """Each megatron optimizer wrapping a torch one, and that torch optimizer, through chains
    within chains (Muon's layer-wise distributed optimizer is a chain inside the chain)."""
    chain = getattr(optimizer, "chained_optimizers", None)
    if chain is None:
        if getattr(optimizer, "optimizer", None) is not None:
            yield optimizer, optimizer.optimizer
        return
    for inner in chain:
        yield from _torch_optimizers(inner)


def prime_state(optimizer) -> None:
    """Give every parameter an (all-zero) Adam state before a checkpoint load.

    megatron derives the optimizer's load template from its current state, which is empty
    until the first step, and it asserts that all parameters share one ``step`` value."""
    for inner, torch_optimizer in _torch_optimizers(optimizer):
        inner.init_state_fn(torch_optimizer, inner.config)
        if not isinstance(torch_optimizer, torch.optim.Adam):  # Muon: a momentum, no step
            continue
        for state in torch_optimizer.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))
        _place_steps(torch_optimizer)


def _holds_parameters(inner) -> bool:
    return any(group["params"] for group in inner.optimizer.param_groups)


def _with_empty_links(optimizer) -> list | None:
    """The chain of ``optimizer`` when one of its optimizers holds no parameter, else None.

    With experts, megatron chains an experts' optimizer on every pipeline stage, also on one
    whose blocks are all dense (``model.moe_layer_freq``), where it holds none; on the
    torch-Adam path (no apex or TE) its state cannot be taken (one ``step`` asserted among
    no parameters). It has no state to keep, so a checkpoint leaves it out: the others keep
    their ``chained_N.`` keys, the same at every pipeline layout."""
    chain = getattr(optimizer, "chained_optimizers", None)
    if chain is None or len(chain) < 2 or all(_holds_parameters(inner) for inner in chain):
        return None
    return chain


def sharded_optimizer_state(optimizer, model_state: dict, loading: bool, metadata: dict) -> dict:
    """megatron's sharded optimizer state (to save, or the template a load fills), keyed as
    megatron keys a chain's (``chained_N.``: ``metadata`` is the fully reshardable format),
    without the optimizers that hold no parameter (:func:`_with_empty_links`)."""
    chain = _with_empty_links(optimizer)
    if chain is None:
        return optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=metadata)
    optimizer._synchronize_steps()
    state = {}
    for index, inner in enumerate(chain):
        if _holds_parameters(inner):
            state[index] = inner.sharded_state_dict(model_state, loading, metadata=metadata)
            add_prefix_for_sharding(state[index], f"chained_{index}.")
    return state


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
        chain = _with_empty_links(optimizer)
        if chain is None:
            optimizer.load_state_dict(state_dict)
        else:  # as megatron's chain loads, those without parameters left out
            for index, inner in enumerate(chain):
                if _holds_parameters(inner):
                    inner.load_state_dict(state_dict[index])
            optimizer._synchronize_steps()
    finally:
        for inner in patched:
            del inner.load_parameter_state_from_fully_reshardable
    for torch_optimizer, fused in chosen:
        _fuse_groups(torch_optimizer, fused)
