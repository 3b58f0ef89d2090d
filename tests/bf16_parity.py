"""bf16 parity of whole models: two bf16 computations of the same model (the fused Triton norms
and the torch composition; one attention backend and another) held to what bf16 rounding
predicts, tensor by tensor, rather than to one observed difference.

How a comparison goes (:func:`measure`):

- The model is trained first, in fp32, with AdamW on a Markov chain over a few dozen or
  hundred token ids (:func:`markov_tokens`) until its loss is half of ln V
  (:func:`train_to_bf16`): at initialisation every model's loss is about ln V, so a loss
  compared there says almost nothing; after training it depends on what the model computes.
- Its weights are rounded to bf16, and every model compared holds exactly those values: the
  fp32 reference (exact products: the test session turns TF32 off) and each bf16 computation.
- Each model computes the loss, the logits and every parameter's gradient of one batch; each
  bf16 computation's error against the fp32 reference is measured per tensor, as
  ``||x - x_fp32|| / ||x_fp32||``.

What holds (:meth:`Parity.violations`), with u = 2^-8, bf16's unit round-off, and L blocks:

- every tensor of every bf16 computation: error <= :func:`tensor_bound` = 2 u sqrt(4 L). A
  rounding is a relative error of at most u, uniform in sign, u / sqrt(3) RMS. On the way from
  the input to a gradient a sublayer rounds about three outputs (its input norm, its
  projection, its residual update): u^2 of variance per sublayer; 2L sublayers forward and as
  many backward: u sqrt(4L). Twice that, because the model leaves out how much a single
  tensor's sum can cancel (a norm weight's gradient sums thousands of terms of either sign).
  This keeps the reference honest: without it a broken fp32 reference would make the next
  bound vacuous.
- the loss: relative error <= :func:`loss_bound` = tensor_bound / sqrt(tokens): the loss is a
  mean over the batch's tokens of errors of random sign, which shrink as their mean does.
- every tensor (the logits and every gradient) of the candidate: error <= the baseline's
  error + :func:`excess_bound`, which is u + 5 e / sqrt(n) for a tensor of n elements whose
  baseline error is e. Both bf16 computations round the same matrix products, attention and
  activations; where they differ, one rounds fewer intermediates (the fused kernels round each
  output once) or the same number in another order, so the candidate may be worse than the
  baseline by about one rounding, u, per tensor, plus chance: two computations that round in
  a different order draw two error vectors from one distribution, and the norm of an
  n-element draw scatters by about e / sqrt(2n), their difference by e / sqrt(n). Five of
  those cover chance (skewed at small n: 1 pair in 900 of Gaussian draws at n = 16). For a
  large tensor they are a small fraction of u; for a small one (a head-dim norm weight's
  gradient: 16 elements, a sum that cancels to a few percent error in either computation)
  they are what matters. With u alone the bound held on one CPU's rounding and
  not on another's: torch's bf16 CPU kernels take other paths under AVX-512, AVX2 and none,
  which moved such a tensor's baseline error between 3.4e-2 and 6.2e-2 and the candidate's
  between 3.5e-2 and 4.9e-2, while the 1%-wrong kernels and the truncating interpreter each
  put some tensor 23 to 780 of those spreads beyond u (numbers in docs/testing.md).

On the CPU, Triton's interpreter converts fp32 to bf16 by truncation where a GPU rounds to
nearest even; :func:`interpreter_rounds_to_nearest` makes it round as a GPU does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

U_BF16 = 2.0 ** -8
"""bf16's unit round-off: 8 significand bits rounded to nearest, a relative error <= u."""


SPREAD_Z = 5.0
"""How many standard deviations of chance (module docstring) a candidate's error may exceed the
baseline's by, on top of u."""


def excess_bound(baseline_error: float, elements: int) -> float:
    """How much further from the reference than the baseline a candidate's tensor of
    ``elements`` values may be (module docstring): one rounding plus chance."""
    return U_BF16 + SPREAD_Z * baseline_error / math.sqrt(elements)


def tensor_bound(num_layers: int) -> float:
    """The largest error a bf16 computation may have in one tensor (module docstring)."""
    return 2 * U_BF16 * math.sqrt(4 * num_layers)


def loss_bound(num_layers: int, tokens: int) -> float:
    """The largest relative error of a bf16 computation's mean loss over ``tokens``."""
    return tensor_bound(num_layers) / math.sqrt(tokens)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||: a whole tensor's relative error."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def markov_tokens(batch: int, seq: int, vocab: int, states: int = 64,
                  seed: int = 1) -> torch.Tensor:
    """[batch, seq + 1] tokens (on the CPU) of a random walk over ``states`` ids of the
    vocabulary, each id followed by one of two fixed successors: a model learns it within a few
    steps, so a trained model's loss lies far below ln V."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab, generator=gen)[:states]
    table = torch.randint(0, states, (states, 2), generator=gen)
    walk = torch.empty(batch, seq + 1, dtype=torch.long)
    walk[:, 0] = torch.randint(0, states, (batch,), generator=gen)
    for i in range(seq):
        walk[:, i + 1] = table[walk[:, i], torch.randint(0, 2, (batch,), generator=gen)]
    return ids[walk]


@dataclass
class Result:
    loss: float
    tensors: dict[str, torch.Tensor]
    """"logits" and each parameter's gradient, by the parameter's (canonical) name."""


def evaluate(model, tokens: torch.Tensor, names: Callable[[str], str] = str) -> Result:
    """Next-token loss (fp32 cross-entropy of the model's logits), the logits and every
    parameter's gradient on ``tokens`` (already on the model's device). ``names`` maps a
    parameter's name to the name it is compared under."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape[0], -1)
    model.zero_grad(set_to_none=True)
    logits = model(inputs, positions, None)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    tensors = {"logits": logits.detach()}
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        tensors[names(name)] = param.grad.detach().clone()
    return Result(loss.item(), tensors)


def perturb_norms(model, seed: int = 3) -> None:
    """Every norm weight and gate away from its init, so that a misplaced one cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "gate" in name:
                param.add_((0.3 * torch.randn(param.shape, generator=gen)).to(param))


TRAINED = 0.5
"""Training stops once the loss is below this fraction of ln V: far from initialisation (where
every model's loss is ln V), yet far from converged, where gradients become small sums of
large terms of either sign and bf16 rounding, relative to them, grows without bound."""


def train_to_bf16(model, tokens: torch.Tensor, vocab: int, lr: float,
                  max_steps: int = 30) -> list[float]:
    """Train the fp32 ``model`` (norms perturbed first) with AdamW on ``tokens`` until its loss
    is below TRAINED x ln V (at most ``max_steps`` steps), then round every weight to bf16 in
    place; returns the losses, the last one that of the weights kept."""
    perturb_norms(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = [evaluate(model, tokens).loss]
    while losses[-1] >= TRAINED * math.log(vocab) and len(losses) <= max_steps:
        optimizer.step()
        losses.append(evaluate(model, tokens).loss)
    del optimizer
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16())
    model.zero_grad(set_to_none=True)
    return losses


def copy_weights(source, target, names: Callable[[str], str] = str) -> None:
    """Every parameter of ``target`` from the ``source`` parameter of the same (mapped) name;
    a parameter without a counterpart is an error, never skipped."""
    have = dict(source.named_parameters())
    with torch.no_grad():
        for name, param in target.named_parameters():
            assert names(name) in have, f"no counterpart of {name} ({names(name)})"
            param.copy_(have[names(name)])


@dataclass
class Parity:
    num_layers: int
    tokens: int
    vocab: int
    trained: list[float]
    """The fp32 model's training losses."""
    results: dict[str, Result]
    """"fp32" (the reference) and each bf16 computation."""

    def errors(self, name: str) -> dict[str, float]:
        """Per tensor: the computation's error against the fp32 reference."""
        want = self.results["fp32"].tensors
        got = self.results[name].tensors
        assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
        return {key: rel_error(got[key], want[key]) for key in want}

    def whole(self, name: str) -> dict[str, float]:
        """The computation's error against the fp32 reference in the logits and in the whole
        gradient (every parameter's, as one vector)."""
        want = self.results["fp32"].tensors
        got = self.results[name].tensors
        keys = [key for key in want if key != "logits"]
        diff = math.sqrt(sum((got[k].double() - want[k].double()).norm().item() ** 2
                             for k in keys))
        norm = math.sqrt(sum(want[k].double().norm().item() ** 2 for k in keys))
        return {"logits": rel_error(got["logits"], want["logits"]), "gradient": diff / norm}

    def loss_error(self, name: str) -> float:
        want = self.results["fp32"].loss
        return abs(self.results[name].loss - want) / abs(want)

    def discriminates(self) -> bool:
        """Whether training reached its target, TRAINED x ln V, within its steps: the loss is
        then informative (see TRAINED); a learning rate that makes training erratic instead
        leaves states whose gradients no bound on rounding describes."""
        return self.trained[-1] < TRAINED * math.log(self.vocab)

    def violations(self, candidate: str, baseline: str) -> list[str]:
        """Every bound (module docstring) ``candidate`` or ``baseline`` breaks; empty when the
        candidate computes the model within bf16 rounding of the baseline."""
        found = []
        whole = tensor_bound(self.num_layers)
        mean = loss_bound(self.num_layers, self.tokens)
        for name in (candidate, baseline):
            if self.loss_error(name) > mean:
                found.append(f"{name}: loss error {self.loss_error(name):.2e} > {mean:.2e}")
            for key, err in self.whole(name).items():
                if err > whole:
                    found.append(f"{name}: {key} error {err:.2e} > {whole:.2e}")
        errors = {name: self.errors(name) for name in (candidate, baseline)}
        for key, err in errors[candidate].items():
            allowed = self.allowed_excess(key, errors[baseline][key])
            if err > errors[baseline][key] + allowed:
                found.append(f"{candidate}: {key} error {err:.2e} > {baseline}'s "
                             f"{errors[baseline][key]:.2e} + {allowed / U_BF16:.2f}u")
        return found

    def allowed_excess(self, key: str, baseline_error: float) -> float:
        """:func:`excess_bound` for the tensor ``key`` (its size read from the reference)."""
        return excess_bound(baseline_error, self.results["fp32"].tensors[key].numel())

    def only_candidate_violates(self, candidate: str, baseline: str) -> bool:
        """For the negative controls: the bounds are broken, by ``candidate`` alone."""
        found = self.violations(candidate, baseline)
        return bool(found) and all(v.startswith(f"{candidate}: ") for v in found)

    def summary(self, candidate: str, baseline: str) -> str:
        """One line: the losses and each computation's worst tensor (for -s output)."""
        words = [f"trained {self.trained[0]:.3f} -> {self.trained[-1]:.3f}, "
                 f"loss fp32 {self.results['fp32'].loss:.5f}"]
        for name in (candidate, baseline):
            errors, whole = self.errors(name), self.whole(name)
            worst = max(errors, key=errors.get)
            words.append(f"{name}: loss {self.loss_error(name):.1e}, logits "
                         f"{whole['logits']:.2e}, gradient {whole['gradient']:.2e}, worst tensor "
                         f"{worst} {errors[worst]:.2e}")
        cand, base = self.errors(candidate), self.errors(baseline)
        share = {k: (cand[k] - base[k]) / self.allowed_excess(k, base[k]) for k in cand}
        excess = max(share, key=share.get)
        over = (cand[excess] - base[excess]) / U_BF16
        words.append(f"largest excess over {baseline} {over:.2f}u, {share[excess]:.2f} of its "
                     f"bound ({excess}); bounds "
                     f"{tensor_bound(self.num_layers):.2e} logits and gradient, "
                     f"{loss_bound(self.num_layers, self.tokens):.2e} loss")
        return "; ".join(words)


def measure(build: Callable[[str], object], names: list[str], tokens: torch.Tensor,
            num_layers: int, vocab: int, lr: float,
            canonical: Callable[[str, str], str] | None = None) -> Parity:
    """``build("fp32")`` is trained (:func:`train_to_bf16`) and is the reference; each of
    ``names`` is ``build(name)``, a bf16 model given the reference's weights, and all are
    evaluated on ``tokens``. ``canonical(name, parameter)`` maps a model's parameter names to
    the reference's (default: the same names)."""
    def mapping(name: str) -> Callable[[str], str]:
        return (lambda p: canonical(name, p)) if canonical else str

    reference = build("fp32")
    device = next(reference.parameters()).device
    tokens = tokens.to(device)
    trained = train_to_bf16(reference, tokens, vocab, lr)
    results = {"fp32": evaluate(reference, tokens)}
    for name in names:
        model = build(name)
        copy_weights(reference, model, mapping(name))
        results[name] = evaluate(model, tokens, mapping(name))
        del model
    return Parity(num_layers, tokens[:, 1:].numel(), vocab, trained, results)


@contextlib.contextmanager
def interpreter_rounds_to_nearest() -> Iterator[None]:
    """Within the block, Triton's CPU interpreter rounds fp32 to bf16 to nearest even, as the
    compiled kernels do on a GPU (its own conversion, triton 3.9's
    ``InterpreterBuilder.cast_impl``, truncates: a bias of -u/2 per rounding that no GPU has)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    truncating = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data).view(np.float32).copy())
            rounded = values.bfloat16().view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(rounded, dst_type.scalar)
        return truncating(self, src, dst_type)

    builder.cast_impl = cast_impl
    try:
        yield
    finally:
        builder.cast_impl = truncating
