"""Manifold-constrained hyper-connections (baseline; Xie et al. 2025, "mHC: Manifold-Constrained
Hyper-Connections", arXiv 2512.24880): n residual streams whose mixing is doubly stochastic.

The hidden state is n streams X = (X_1 .. X_n), X_i of width C (n = ``model.hc_rate``), all
starting as the embedding. Each sublayer j (attention and MLP of every block) computes its
three mappings from the streams, per token, then runs Pre-Norm style:

    x'    = vec(X) / RMS(vec(X))                    # the flattened n C vector, normalised
    Hp~   = a_pre  (x' phi_pre)  + b_pre            # [n]
    Hq~   = a_post (x' phi_post) + b_post           # [n]
    Hr~   = a_res  mat(x' phi_res) + b_res          # [n, n]
    H_pre = sigmoid(Hp~),  H_post = 2 sigmoid(Hq~),  H_res = SinkhornKnopp(exp(Hr~))
    r     = F_j( N_j( sum_i H_pre_i X_i ) )
    X_k   = sum_i H_res_ki X_i  +  H_post_k r

SinkhornKnopp alternately divides the rows and the columns by their sums,
``model.mhc_sinkhorn_iterations`` times each (rows first; the paper's t_max = 20), so H_res is
doubly stochastic up to the iterations' convergence: every stream a convex mix, the streams'
sum kept. After the last block the streams are summed, then the final norm, as for ``hc``.

Where implementations differ, this reading: exp before Sinkhorn (the paper's M^(0) =
exp(Hr~); the first exp and row division are one softmax, exactly equal); no epsilon in the
divisions; 2 sigmoid for H_post and a plain sigmoid for H_pre; the RMS normalisation of the
flattened vector has no weight of its own (one would scale phi's columns, nothing else) and is
applied after the product (x' phi = (vec(X) phi) / RMS: the paper's reordering, which keeps no
normalised copy of the streams); the gates a start at 0.01 (the paper's init), b at 0 (so H_pre
= 1/2, H_post = 1 and H_res = 1/n everywhere: with identical streams the model starts as
Pre-Norm), and phi is drawn normal(0, 1/sqrt(n C)) (``init_std``): with phi = b = 0 every
stream would stay identical forever, the model being symmetric under permuting its streams.
The product vec(X) phi is taken in the activation dtype (it keeps the streams themselves for
phi's gradient, not an fp32 copy), the rest of the mappings in fp32, the mixing in the
activation dtype again. H_res multiplies as
the paper writes it, X_k = sum_i H_res_ki X_i (megatron-core applies its transpose).
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
from megatron.core.transformer.spec_utils import ModuleSpec

from kernels.norms import mark_sequence_parallel
from model import streams
from model.config import ModelConfig
from model.decay import Decay, declare
from model.layers.base import BranchInputs, LayerChoice, SchemeLayer
from model.layers.hc import StreamSumNorm

GATE_INIT = 0.01


def _iterate(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """exp(logits) with rows then columns divided by their sums, ``iterations`` times."""
    m = torch.softmax(logits, dim=-1)  # exp, then the first row division
    m = m / m.sum(-2, keepdim=True)
    for _ in range(iterations - 1):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


class _Sinkhorn(torch.autograd.Function):
    """Keeps only the logits for backward and runs the iterations again there: autograd
    through them would keep 2 x iterations n x n matrices per token."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.iterations = iterations
        return _iterate(logits, iterations)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            again = logits.detach().requires_grad_(True)
            out = _iterate(again, ctx.iterations)
            (grad_logits,) = torch.autograd.grad(out, again, grad)
        return grad_logits, None


def sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """The doubly stochastic matrices of ``logits`` [..., n, n] (Sinkhorn-Knopp from
    exp(logits)); differentiable. Inside a compiled block the same recomputation is
    activation checkpointing, which Dynamo traces (its graph breaks on the Function's
    ``torch.autograd.grad``): backward keeps the logits and runs the iterations again."""
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(_iterate, logits, iterations,
                                                 use_reentrant=False)
    return _Sinkhorn.apply(logits, iterations)


class ManifoldConnection(torch.nn.Module):
    """One sublayer's mappings: phi [n^2 + 2n, n C] (rows: pre, post, then H_res row by row),
    the static part b, and the three gates (a_pre, a_post, a_res)."""

    def __init__(self, config, rate: int, iterations: int):
        super().__init__()
        n, dtype = rate, config.params_dtype
        self.rate, self.iterations, self.eps = n, iterations, config.layernorm_epsilon
        outputs = n * n + 2 * n
        self.phi = declare(torch.nn.Parameter(
            torch.zeros(outputs, n * config.hidden_size, dtype=dtype)), Decay.MATRIX)
        self.static = declare(torch.nn.Parameter(torch.zeros(outputs, dtype=dtype)),
                              Decay.MIXING)
        self.gates = declare(torch.nn.Parameter(torch.full((3,), GATE_INIT, dtype=dtype)),
                             Decay.SCALAR)
        for param in self.parameters(recurse=False):
            # Under sequence parallelism each TP rank sees other tokens: partial gradients.
            mark_sequence_parallel(param, config)

    def forward(self, X: torch.Tensor):
        """(H_pre [.., n], H_post [.., n], H_res [.., n, n]) for streams X [s, b, n, C], in
        X's dtype (computed in fp32 from the product, ``Traits.fp32``)."""
        n = self.rate
        flat = X.flatten(-2)
        mean_square = torch.linalg.vector_norm(flat, dim=-1, keepdim=True,
                                               dtype=torch.float32).square() / flat.shape[-1]
        raw = (flat @ self.phi.t()).float() * torch.rsqrt(mean_square + self.eps)
        a_pre, a_post, a_res = self.gates.float()
        gates = torch.cat((a_pre.expand(n), a_post.expand(n), a_res.expand(n * n)))
        logits = raw * gates + self.static.float()
        pre = torch.sigmoid(logits[..., :n])
        post = 2 * torch.sigmoid(logits[..., n:2 * n])
        # reshape, not unflatten (whose Python wrapper breaks a compiled graph: streams.split)
        res = sinkhorn(logits[..., 2 * n:].reshape(*logits.shape[:-1], n, n), self.iterations)
        return pre.to(X.dtype), post.to(X.dtype), res.to(X.dtype)


class ManifoldHyperConnectionLayer(SchemeLayer):
    """A Pre-Norm block whose two sublayers read and write the n streams through their
    manifold-constrained connections."""

    def __init__(self, config, submodules, *args, rate: int = 4, iterations: int = 20,
                 **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.rate = rate
        self.attn_norm = self.build_norm(site="attention")
        self.mlp_norm = self.build_norm()
        self.attn_mhc = ManifoldConnection(self.config, rate, iterations)
        self.mlp_mhc = ManifoldConnection(self.config, rate, iterations)

    def sublayer(self, X: torch.Tensor, mhc: ManifoldConnection, norm, branch) -> torch.Tensor:
        pre, post, res = mhc(X)
        r = branch(norm((pre.unsqueeze(-1) * X).sum(-2)))
        return res @ X + post.unsqueeze(-1) * r.unsqueeze(-2)

    def compute(self, hidden_states: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        if self.reads_embedding:  # the embedding: every stream starts as it
            X = streams.repeat(hidden_states, self.rate)
        else:
            X = streams.split(hidden_states, self.rate)
        X = self.sublayer(X, self.attn_mhc, self.attn_norm,
                          lambda a: self.attention(a, inputs))
        X = self.sublayer(X, self.mlp_mhc, self.mlp_norm,
                          lambda a: self.feed_forward(a, inputs))
        return streams.join(X)


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return ManifoldHyperConnectionLayer, {"rate": model.hc_rate,
                                          "iterations": model.mhc_sinkhorn_iterations}


def final_norm(model: ModelConfig, norm: ModuleSpec) -> ModuleSpec:
    """The streams summed, then the final norm (as hyper-connections end)."""
    return ModuleSpec(module=StreamSumNorm, params={"norm": norm, "rate": model.hc_rate})


def init_std(model: ModelConfig, key: str) -> float | None:
    """phi ~ normal(0, 1/sqrt(n C)): x' phi starts at unit scale, a_* = 0.01 keeps the
    dynamic part near 1e-2 of it."""
    if key.endswith("_mhc.phi"):
        return 1.0 / math.sqrt(model.hc_rate * model.hidden_size)
    return None


START = {"_mhc.static": 0.0, "_mhc.gates": GATE_INIT}
"""b = 0 and a = 0.01 (the paper's; model/init.py): H_pre = 1/2, H_post = 1, H_res = 1/n."""
