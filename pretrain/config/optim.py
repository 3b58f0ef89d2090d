"""[optim]: AdamW or Muon and the learning-rate schedule, and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from model.backends import TransformerImpl
from model.config import coerce_choices
from runtime.errors import Findings

if TYPE_CHECKING:
    from pretrain.config import Config


FP32_MAX = 3.4028234663852886e38


class DecayStyle(StrEnum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"
    WSD = "wsd"  # warm-up, stable, decay


class WsdDecayShape(StrEnum):
    LINEAR = "linear"
    COSINE = "cosine"
    MINUS_SQRT = "minus_sqrt"


class OptimName(StrEnum):
    ADAMW = "adamw"
    MUON = "muon"  # Muon for the blocks' linear weights, AdamW for every other parameter


class MuonAdjustLr(StrEnum):
    """torch.optim.Muon's ``adjust_lr_fn``: how a matrix's shape scales its learning rate."""

    MATCH_RMS_ADAMW = "match_rms_adamw"  # 0.2 sqrt(max(rows, cols)): AdamW's update RMS
    ORIGINAL = "original"  # sqrt(max(1, rows / cols)), Keller Jordan's


@dataclass
class OptimConfig:
    """AdamW (or Muon for the blocks' linear weights) with linear warm-up from 0 to ``lr``,
    then a decay to ``min_lr`` at run.steps."""

    name: OptimName = OptimName.ADAMW
    """The optimizer: adamw for every parameter, or muon: torch.optim.Muon for the blocks'
    attention and MLP linear weights and AdamW (this section's other fields) for the rest
    (embeddings, output layer, norms, biases, gates, scalars, a scheme's own matrices);
    docs/training.md#muon."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of the warm-up."""
    min_lr: float = 3e-5
    """Learning rate at run.steps, the end of the decay (constant decay_style: unused)."""
    warmup_steps: int = 10
    """Steps of the linear warm-up from 0 to lr."""
    decay_style: DecayStyle = DecayStyle.COSINE
    """How the learning rate falls from lr to min_lr between the warm-up and run.steps:
    cosine, linear, constant (stays at lr), or wsd (warm-up, stable at lr, then a decay over
    the last wsd_decay_steps steps)."""
    wsd_decay_steps: int = 0
    """decay_style wsd: the steps of the final decay to min_lr, ending at run.steps (> 0 and
    at most run.steps - warmup_steps). A run that may be extended keeps its stable phase:
    resume with more run.steps before the decay begins."""
    wsd_decay_shape: WsdDecayShape = WsdDecayShape.LINEAR
    """decay_style wsd: the shape of the final decay: linear, cosine, or minus_sqrt
    (1 - sqrt(fraction of the decay done))."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, constant over the run, on weight matrices only (linear
    layers, embeddings, a scheme's projections): norms, biases, gates, learned scalars and
    mixing coefficients get none (each parameter's role, model/decay.py)."""
    beta1: float = 0.9
    """Adam's decay rate of the gradient's running mean (first moment)."""
    beta2: float = 0.95
    """Adam's decay rate of the squared gradient's running mean (second moment)."""
    eps: float = 1e-8
    """Added to the square root of the second moment in Adam's denominator."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    fused: bool = True
    """Without TE or apex: step with torch's fused AdamW kernel and multi-tensor gradient
    norm/clip/copy (pretrain/optim.py); false keeps megatron's torch fallback as it is. With
    TE or apex megatron uses their fused Adam either way."""
    override_schedule: bool = False
    """On resume, follow this config's schedule (lr, min_lr, warmup_steps, decay_style, the
    wsd fields, weight_decay, muon_lr, muon_weight_decay, run.steps) where it differs from the
    checkpoint's, keeping the optimizer's moments; otherwise a difference is an error naming
    the field."""
    muon_lr: float = 0.0
    """name muon: the Muon matrices' peak learning rate (0: lr). It follows the same warm-up
    and decay, ending at muon_lr x min_lr / lr. With muon_adjust_lr_fn match_rms_adamw the
    default (AdamW's lr) is the intended one."""
    muon_weight_decay: float = 0.1
    """name muon: the Muon matrices' decoupled weight decay (torch.optim.Muon multiplies a
    weight by 1 - lr x weight_decay each step), constant over the run."""
    muon_momentum: float = 0.95
    """name muon: the decay rate of Muon's momentum buffer, in [0, 1)."""
    muon_nesterov: bool = True
    """name muon: orthogonalise the Nesterov look-ahead of the momentum instead of the momentum
    itself."""
    muon_ns_steps: int = 5
    """name muon: Newton-Schulz iterations that orthogonalise each update, in [1, 99]."""
    muon_adjust_lr_fn: MuonAdjustLr = MuonAdjustLr.MATCH_RMS_ADAMW
    """name muon: torch.optim.Muon's learning-rate adjustment by a matrix's shape (rows x
    cols). match_rms_adamw (0.2 sqrt(max(rows, cols)), from "Muon is Scalable for LLM
    Training") gives the orthogonalised update the RMS of a typical AdamW update, so AdamW's
    learning rate and weight decay carry over: the default, since this framework's presets are
    tuned for AdamW and muon_lr defaults to lr. original (sqrt(max(1, rows / cols)), Keller
    Jordan's) wants a learning rate some 10-50x AdamW's."""

    def __post_init__(self) -> None:
        coerce_choices("optim", self)


def validate_optim(o: OptimConfig, steps: int | None, found: Findings) -> None:
    """The optimizer's and the schedule's rules; the schedule's only with a valid run.steps
    (``steps``), min_lr only with a valid lr, the first step's size only with both lr and
    beta1 valid."""
    lr = found.require(o.lr > 0, f"optim.lr ({o.lr}) must be > 0")
    if lr:
        found.require(0 <= o.min_lr <= o.lr,
                      f"optim.min_lr ({o.min_lr}) must be in [0, optim.lr]")
    if steps is not None and found.require(
            0 <= o.warmup_steps < steps, f"optim.warmup_steps ({o.warmup_steps}) must be >= 0 "
            f"and < run.steps ({steps})"):
        if o.decay_style is DecayStyle.WSD:
            decaying = steps - o.warmup_steps
            found.require(0 < o.wsd_decay_steps <= decaying, f"optim.wsd_decay_steps "
                          f"({o.wsd_decay_steps}) must be in [1, run.steps - "
                          f"optim.warmup_steps = {decaying}] with optim.decay_style wsd")
    if o.decay_style is not DecayStyle.WSD:
        found.require(o.wsd_decay_steps == 0, f"optim.wsd_decay_steps ({o.wsd_decay_steps}) "
                      f"applies only to optim.decay_style wsd, not {o.decay_style}; set it to 0")
    found.require(o.clip_grad >= 0, f"optim.clip_grad ({o.clip_grad}) must be >= 0")
    found.require(o.weight_decay >= 0, f"optim.weight_decay ({o.weight_decay}) must be >= 0")
    found.require(o.eps > 0, f"optim.eps ({o.eps}) must be > 0")
    betas = [found.require(0 <= getattr(o, name) < 1,
                           f"optim.{name} ({getattr(o, name)}) must be in [0, 1)")
             for name in ("beta1", "beta2")]
    if lr and betas[0]:
        first_step = o.lr / (1 - o.beta1)  # Adam's bias-corrected step size at step 1
        found.require(first_step < FP32_MAX, f"optim.lr ({o.lr}) / (1 - optim.beta1) must be "
                      f"< {FP32_MAX:.3g} (the largest fp32 number; the optimizer's first step)")
    validate_muon(o, found)


MUON_FIELDS = ("muon_lr", "muon_weight_decay", "muon_momentum", "muon_nesterov",
               "muon_ns_steps", "muon_adjust_lr_fn")
"""The optim fields that apply only to optim.name muon."""


def validate_muon(o: OptimConfig, found: Findings) -> None:
    """Muon's ranges with optim.name muon; with adamw, a Muon field set away from its default
    (it would be silently ignored)."""
    if o.name is not OptimName.MUON:
        defaults = OptimConfig()
        for name in MUON_FIELDS:
            value = getattr(o, name)
            found.require(value == getattr(defaults, name),
                          f"optim.{name} ({value}) applies only to optim.name muon, not "
                          f"{o.name}; set --optim.name=muon or remove it")
        return
    found.require(o.muon_lr >= 0, f"optim.muon_lr ({o.muon_lr}) must be >= 0 (0: optim.lr)")
    found.require(o.muon_weight_decay >= 0,
                  f"optim.muon_weight_decay ({o.muon_weight_decay}) must be >= 0")
    found.require(0 <= o.muon_momentum < 1,
                  f"optim.muon_momentum ({o.muon_momentum}) must be in [0, 1)")
    found.require(1 <= o.muon_ns_steps < 100,
                  f"optim.muon_ns_steps ({o.muon_ns_steps}) must be in [1, 99]")


def validate_muon_layout(config: Config, found: Findings) -> None:
    """What Muon does not support yet (docs/limits.md): routed experts on Transformer Engine's
    grouped GEMM, whose per-expert weights are not the block linears Muon steps (they would
    silently stay with AdamW). With ``auto`` the build refuses them where TE is chosen."""
    if config.optim.name is not OptimName.MUON or not config.model.num_experts:
        return
    found.require(config.model.transformer_impl is not TransformerImpl.TE,
                  "optim.name muon does not step the routed experts of "
                  "model.transformer_impl te (Transformer Engine's grouped GEMM) yet: set "
                  "--model.transformer_impl=local")
