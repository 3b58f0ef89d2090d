"""Each scheme's logits and gradients equal a plain-PyTorch transcription of its equations.

The reference below is written from the equations in the SiameseNorm notes (not from the model
code): it reads the model's weights by name and recomputes everything in float64 on the CPU
with explicit attention, RoPE and SwiGLU, whatever device the model runs on (TF32 is off in
tests, so a GPU model computes in true fp32 and meets the same tolerance). Megatron's
fused-QKV layout (per K/V group: the group's query heads, then its key head, then its value
head) and SwiGLU's [gate; up] fc1 are the only facts taken from megatron.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from model.builder import build_model
from model.config import ModelConfig, ParallelConfig
from model.schemes import FinalNorm, ResidualScheme
from tests.helpers import NORMS, norm_fields, perturb_every_parameter, tiny_model

SCHEMES = [
    ("pre", {}),
    ("post", {}),
    ("siamese", {}),
    ("siamese_hybrid", {}),
    ("siamese_hybrid", {"hybrid_first_block": "prenorm"}),
    ("siamese_hybrid", {"hybrid_first_block": "prenorm_literal"}),
    ("deepnorm", {}),
    ("hybridnorm", {}),
    ("hybridnorm", {"hybrid_first_block": "prenorm"}),
    ("mixln", {}),
    ("mixln", {"mixln_post_ratio": 0.75}),
    ("siamese", {"siamese_input_norm": False}),
    ("siamese", {"siamese_depth_constant": False}),
    ("siamese_hybrid", {"siamese_input_norm": False, "siamese_depth_constant": False}),
    ("siamese_hybrid", {"siamese_input_norm": False, "hybrid_first_block": "prenorm"}),
    ("hc", {}),
    ("hc", {"hc_dynamic": False}),
    ("hc", {"hc_rate": 3}),
    ("periln", {}),
    ("olmo2", {}),
    ("mhc", {}),
    ("mhc", {"hc_rate": 3, "mhc_sinkhorn_iterations": 7}),
]


class Reference:
    def __init__(self, cfg, params):
        self.cfg = cfg
        self.p = {k: v.detach().cpu().double().requires_grad_(True) for k, v in params.items()}
        self.eps = cfg.norm_eps

    def norm(self, x, name):
        w = self.p[f"{name}.weight"]
        if self.cfg.normalization == "dyt":  # Zhu et al.: w tanh(alpha x) + b
            return torch.tanh(self.p[f"{name}.alpha"] * x) * w + self.p[f"{name}.bias"]
        if self.cfg.normalization == "rmsnorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        out = (x - mu) / torch.sqrt(var + self.eps) * w
        return out + self.p[f"{name}.bias"] if self.cfg.norm_bias else out

    def rope(self, t):
        s, d = t.shape[1], t.shape[-1]
        inv = 1.0 / (self.cfg.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
        cos = torch.cat([ang, ang], -1).cos()[None, :, None, :]
        sin = torch.cat([ang, ang], -1).sin()[None, :, None, :]
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return t * cos + torch.cat([-t2, t1], -1) * sin

    def attention(self, a, layer, qkv_norm, qk_norm=False):
        cfg, pre = self.cfg, f"decoder.layers.{layer}.self_attention"
        b, s, _ = a.shape
        nh, ng = cfg.num_attention_heads, cfg.kv_heads
        hd, per = cfg.hidden_size // nh, nh // ng
        qkv = (a @ self.p[f"{pre}.linear_qkv.weight"].T).reshape(b, s, ng, (per + 2) * hd)
        q = qkv[..., : per * hd].reshape(b, s, nh, hd)
        k = qkv[..., per * hd: (per + 1) * hd]
        v = qkv[..., (per + 1) * hd:]
        if qkv_norm or qk_norm:
            q = self.norm(q, f"{pre}.q_layernorm")
            k = self.norm(k, f"{pre}.k_layernorm")
        if qkv_norm:
            v = self.norm(v, f"{pre}.v_layernorm")
        q, k = self.rope(q), self.rope(k)
        k, v = k.repeat_interleave(per, dim=2), v.repeat_interleave(per, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * hd)
        return out @ self.p[f"{pre}.linear_proj.weight"].T

    def mlp(self, s, layer):
        pre = f"decoder.layers.{layer}.mlp"
        gate, up = (s @ self.p[f"{pre}.linear_fc1.weight"].T).chunk(2, -1)
        return (torch.nn.functional.silu(gate) * up) @ self.p[f"{pre}.linear_fc2.weight"].T

    def branch(self, k, inp, layer, qkv_norm=False, qk_norm=False):
        if k == "attn":
            return self.attention(inp, layer, qkv_norm, qk_norm)
        return self.mlp(inp, layer)

    def hyper_connection(self, H, hc, norm, k, i):
        """H [b, s, n, d] after one sublayer: h = sum_i Am_i H_i, r = F(N(h)),
        H_k = sum_i Ar_ik H_i + B_k r, with per-token offsets tanh(N_hc(H) W) when dynamic."""
        n = self.cfg.hc_rate
        width, depth, out = (self.p[f"{hc}.{w}"] for w in ("width", "depth", "output"))
        if self.cfg.hc_dynamic:
            offsets = torch.tanh(self.norm(H, f"{hc}.norm") @ self.p[f"{hc}.proj"].T)
            s_a, s_b = self.p[f"{hc}.width_scale"], self.p[f"{hc}.output_scale"]
            width = width + s_a * offsets[..., 0]
            depth = depth + s_a * offsets[..., 1:n + 1]
            out = out + s_b * offsets[..., n + 1]
        h = torch.einsum("...i,...id->...d", width.expand(*H.shape[:-1]), H)
        r = self.branch(k, self.norm(h, norm), i)
        mixed = torch.einsum("...ik,...id->...kd", depth.expand(*H.shape[:-2], n, n), H)
        return mixed + out.expand(*H.shape[:-1]).unsqueeze(-1) * r.unsqueeze(-2)

    def manifold_connection(self, H, conn, norm, k, i):
        """H [b, s, n, d] after one mHC sublayer (Xie et al., eqs. of section 4): the
        mappings from the RMS-normalised flattened streams, H_pre = sigmoid, H_post = 2
        sigmoid, H_res = Sinkhorn-Knopp from exp (rows, then columns, t_max times each);
        r = F(N(sum_i H_pre_i H_i)); H_k = sum_i H_res_ki H_i + H_post_k r."""
        n = self.cfg.hc_rate
        flat = H.flatten(-2)
        normed = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
        mapped = normed @ self.p[f"{conn}.phi"].T
        a_pre, a_post, a_res = self.p[f"{conn}.gates"]
        b = self.p[f"{conn}.static"]
        h_pre = torch.sigmoid(a_pre * mapped[..., :n] + b[:n])
        h_post = 2 * torch.sigmoid(a_post * mapped[..., n:2 * n] + b[n:2 * n])
        m = torch.exp(a_res * mapped[..., 2 * n:] + b[2 * n:]).unflatten(-1, (n, n))
        for _ in range(self.cfg.mhc_sinkhorn_iterations):
            m = m / m.sum(-1, keepdim=True)
            m = m / m.sum(-2, keepdim=True)
        r = self.branch(k, self.norm(torch.einsum("...i,...id->...d", h_pre, H), norm), i)
        return torch.einsum("...ki,...id->...kd", m, H) + h_post.unsqueeze(-1) * r.unsqueeze(-2)

    def start(self, name: str) -> torch.Tensor | None:
        """What the parameter ``name`` starts at by its scheme's equations and paper, in
        float64; None for a random draw (whose distribution model/init.py states and
        test_layout_init.py holds). Refuses a parameter it has no start value for, so a new
        scheme's own parameters fail here until their starts are transcribed."""
        cfg, shape = self.cfg, self.p[name].shape
        module, _, leaf = name.rpartition(".")
        if name.endswith(("word_embeddings.weight", "linear_qkv.weight", "linear_proj.weight",
                          "linear_fc1.weight", "linear_fc2.weight", "output_layer.weight",
                          "_mhc.phi")):
            return None
        if leaf == "bias":  # norms' and linear layers'
            return torch.zeros(shape, dtype=torch.float64)
        if leaf == "alpha" and any("norm" in part for part in module.split(".")[-2:]):
            # DyT's alpha (``attn_norms.post``: a sublayer's Npost)
            return torch.full(shape, self.dyt_alpha(module), dtype=torch.float64)
        if leaf == "weight" and any("norm" in part for part in module.split(".")[-2:]):
            # every norm (``attn_norms.post``: a sublayer's Npost)
            return torch.ones(shape, dtype=torch.float64)
        if module.endswith("attn_gate"):  # siamese_hybrid's g: x enters as it is
            return torch.ones(shape, dtype=torch.float64)
        if module.endswith("_hc"):  # Zhu et al.: every stream alike, as Pre-Norm
            n = cfg.hc_rate
            block = int(name.split(".")[2])
            j = 2 * block + (0 if module.endswith("attn_hc") else 1)  # the sublayer's index
            starts = {"width": torch.eye(n, dtype=torch.float64)[j % n],
                      "depth": torch.eye(n, dtype=torch.float64),
                      "output": torch.ones(n, dtype=torch.float64),
                      "proj": torch.zeros(shape, dtype=torch.float64),
                      "width_scale": torch.tensor(0.01, dtype=torch.float64),
                      "output_scale": torch.tensor(0.01, dtype=torch.float64)}
            if leaf in starts:
                return starts[leaf]
        if module.endswith("_mhc") and leaf in ("static", "gates"):  # Xie et al.: b 0, a 0.01
            return torch.full(shape, 0.0 if leaf == "static" else 0.01, dtype=torch.float64)
        raise NotImplementedError(f"no start value transcribed for {name}")

    def dyt_alpha(self, module: str) -> float:
        """model.dyt_alpha, or with 0 the DyT paper's LLaMA starts (Zhu et al. 2025: 7B, width
        4096: 0.8 for the attention's norms, 0.2 for the others; 13B, 5120: 0.6 and 0.15; 34B
        and 70B, 8192: 0.2 and 0.05): higher in the attention sublayer (its norms and the
        Q/K/V head norms), by the names the model gives them."""
        if self.cfg.dyt_alpha > 0:
            return self.cfg.dyt_alpha
        h = self.cfg.hidden_size
        attention, other = (0.2, 0.05) if h >= 8192 else (0.6, 0.15) if h >= 5120 else (0.8, 0.2)
        parts = module.split(".")
        in_attention = any(p.startswith("attn") or p in ("input_layernorm", "self_attention")
                           for p in parts)
        return attention if in_attention else other

    def logits(self, tokens):
        cfg = self.cfg
        h = self.p["embedding.word_embeddings.weight"][tokens]
        scheme = cfg.residual_scheme
        x, y = h, h.clone()
        H = h.unsqueeze(-2).repeat(1, 1, cfg.hc_rate, 1)  # hyper-connections' n streams
        L = cfg.num_layers
        alpha = (2 * L) ** 0.25  # DeepNorm's skip scale
        post_blocks = int(cfg.mixln_post_ratio * L)  # Mix-LN: the first floor(ratio L) blocks
        for i in range(L):
            def n(name, i=i):
                return f"decoder.layers.{i}.{name}"
            c = math.sqrt(2 * (i + 1)) if cfg.siamese_depth_constant else 1.0
            star = cfg.hybrid_first_block != "hybrid" and i == 0  # HybridNorm*'s block 0

            def n_in(v, name):  # SiameseNorm's Nin; the identity in the ablation without it
                return self.norm(v, name) if cfg.siamese_input_norm else v

            for k in ("attn", "mlp"):
                if (scheme == "pre" or (scheme == "mixln" and i >= post_blocks)
                        or (scheme == "hybridnorm" and star)):
                    norm = n("input_layernorm") if k == "attn" else n("pre_mlp_layernorm")
                    h = h + self.branch(k, self.norm(h, norm), i, qkv_norm=scheme == "hybridnorm")
                elif scheme in ("post", "mixln"):
                    h = self.norm(h + self.branch(k, h, i), n(f"{k}_post_norm"))
                elif scheme == "deepnorm":
                    h = self.norm(alpha * h + self.branch(k, h, i), n(f"{k}_post_norm"))
                elif scheme == "hybridnorm":
                    if k == "mlp":
                        h = self.norm(h, n("mlp_post_norm"))
                    h = h + self.branch(k, h, i, qkv_norm=True)
                elif scheme == "periln":  # Kim et al.: norms around the sublayer
                    h = h + self.norm(self.branch(k, self.norm(h, n(f"{k}_in_norm")), i),
                                      n(f"{k}_out_norm"))
                elif scheme == "olmo2":  # OLMo 2: the sublayer's output normalised, QK-norm
                    h = h + self.norm(self.branch(k, h, i, qk_norm=True), n(f"{k}_out_norm"))
                elif scheme == "hc":  # Zhu et al.'s hyper-connections, sublayer k of block i
                    H = self.hyper_connection(H, n(f"{k}_hc"), n(f"{k}_norm"), k, i)
                elif scheme == "mhc":  # Xie et al.'s manifold-constrained hyper-connections
                    H = self.manifold_connection(H, n(f"{k}_mhc"), n(f"{k}_norm"), k, i)
                elif scheme == "siamese":  # Npost, Npre, Nin of sublayer k: k_norms.*
                    u = self.norm(x, n(f"{k}_norms.post"))
                    r = self.branch(k, n_in(u + self.norm(y, n(f"{k}_norms.pre")),
                                            n(f"{k}_norms.inp")), i)
                    x, y = u + r / c, y + r
                elif star:  # siamese_hybrid's block 0 under HybridNorm*: x is never replaced
                    if k == "attn":
                        a = self.norm(x, n("attn_x_norm")) + self.norm(y, n("attn_pre_norm"))
                        r = self.branch(k, a, i, qkv_norm=True)
                    else:
                        xin = (self.norm(x, n("mlp_x_norm"))
                               if cfg.hybrid_first_block == "prenorm" else x)
                        r = self.branch(k, n_in(xin + self.norm(y, n("mlp_pre_norm")),
                                                n("mlp_in_norm")), i)
                    x, y = x + r / c, y + r
                elif scheme == "siamese_hybrid":
                    if k == "attn":
                        a = x * self.p[n("attn_gate.weight")] + self.norm(y, n("attn_pre_norm"))
                        r = self.branch(k, a, i, qkv_norm=True)
                    else:
                        x = self.norm(x, n("mlp_norms.post"))
                        r = self.branch(k, n_in(x + self.norm(y, n("mlp_norms.pre")),
                                                n("mlp_norms.inp")), i)
                    x, y = x + r / c, y + r
                else:
                    raise NotImplementedError(f"no equations transcribed for scheme {scheme}")
        end = ResidualScheme(scheme).traits.final  # the registry's kind; each written here
        if end is FinalNorm.NORM:
            h = self.norm(h, "decoder.final_layernorm")
        elif end is FinalNorm.SCHEME and scheme in ("hc", "mhc"):  # summed, then the norm
            h = self.norm(H.sum(-2), "decoder.final_layernorm.final_norm")
        elif end is FinalNorm.MERGE:
            f = "decoder.final_layernorm"
            h = self.norm(self.norm(x, f"{f}.x_norm") + self.norm(y, f"{f}.y_norm"),
                          f"{f}.final_norm")
        elif end is not FinalNorm.NONE:  # NONE: every block ends in a norm already
            raise NotImplementedError(f"no decoder end transcribed for scheme {scheme}")
        return h @ self.p["output_layer.weight"].T


def test_every_registered_scheme_has_its_equations():
    """A new scheme fails here until its equations are transcribed and it has a case."""
    assert {scheme for scheme, _ in SCHEMES} == {s.value for s in ResidualScheme}


def test_the_reference_refuses_a_scheme_it_does_not_know():
    cfg = SimpleNamespace(**{**vars(tiny_model("pre")), "residual_scheme": "throwaway"})
    params = {"embedding.word_embeddings.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size)}
    with pytest.raises(NotImplementedError, match="throwaway"):
        Reference(cfg, params).logits(torch.zeros(1, 2, dtype=torch.long))


def test_the_reference_refuses_a_parameter_it_has_no_start_for():
    cfg = tiny_model("pre")
    params = {"decoder.layers.0.attn_gate_bias": torch.zeros(())}
    with pytest.raises(NotImplementedError, match="attn_gate_bias"):
        Reference(cfg, params).start("decoder.layers.0.attn_gate_bias")


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("scheme,extra", SCHEMES, ids=lambda v: str(v) if v else "")
def test_every_parameter_starts_where_its_equations_say(single_rank, scheme, extra,
                                                         normalization):
    """Start values are part of a scheme's equations (a gate's bias at 0 instead of 2 is
    another model), and the logits test above cannot see them: it moves every parameter off
    its start first. Built in bf16 (where a start is stored as the model stores it), with
    linear biases, with every registered normalization (and a norm bias where it is
    optional), every parameter that is not a random draw starts exactly at the reference's
    start value; every random draw is not constant."""
    cfg = tiny_model(scheme, add_bias_linear=True, **norm_fields(normalization), **extra)
    [model] = build_model(cfg, ParallelConfig(), params_dtype=torch.bfloat16, seed=2)
    params = dict(model.named_parameters())
    ref = Reference(cfg, params)
    for name, param in params.items():
        want = ref.start(name)
        got = param.detach().cpu()
        if want is None:
            assert got.float().std() > 0, f"{scheme} {extra}: {name} should be drawn"
            continue
        assert got.shape == want.shape, f"{scheme} {extra}: {name} has shape {got.shape}"
        assert torch.equal(got, want.to(got.dtype)), \
            f"{scheme} {extra}: {name} starts at {got.flatten()[:6].tolist()}, its equations " \
            f"say {want.flatten()[:6].tolist()}"


def rel_err(a, b) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("scheme,extra", SCHEMES, ids=lambda v: str(v) if v else "")
def test_logits_and_grads_match_equations(single_rank, device, scheme, extra, normalization):
    torch.manual_seed(0)
    cfg = tiny_model(scheme, **norm_fields(normalization), **extra)
    [model] = build_model(cfg, ParallelConfig())
    perturb_every_parameter(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    positions = torch.arange(cfg.seq_length).unsqueeze(0).expand(2, -1)
    logits = model(tokens.to(device), positions.to(device), None)
    ref = Reference(cfg, dict(model.named_parameters()))
    expected = ref.logits(tokens)
    where = f"{scheme} {extra or ''} {normalization}"
    assert logits.shape == expected.shape, where
    assert rel_err(logits, expected) <= 1e-5, f"{where}: logits differ from its equations"

    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * probe.to(device)).sum().backward()
    (expected * probe.double()).sum().backward()
    scale = max(ref.p[name].grad.abs().max().item() for name, _ in model.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{where}: {name} gets no gradient"
        err = rel_err(param.grad, ref.p[name].grad)
        if param.dim() == 0 or _head_norm(name) or _connection(name):  # sums that can cancel:
            # then measured on the model's gradient scale (see grad_tolerance)
            err = min(err, (param.grad.double().cpu() - ref.p[name].grad).abs().max().item()
                      / scale)
        assert err <= grad_tolerance(name), f"{where}: the gradient of {name} is {err:.1e} off"


def grad_tolerance(name: str) -> float:
    """Hyper-connection parameters (hc and mhc: a few numbers each, or a norm read by every
    stream) get gradients summed over every token, stream and feature, with heavy
    cancellation: in fp32 their relative error reaches ~1e-4. The per-head Q/K/V norm
    weights (head_dim values, each summed over every token and head) reach 1.7e-5 (olmo2,
    LayerNorm with bias, every parameter moved off its start). With DyT the head norms'
    gradients can cancel to almost nothing (1e-9 for siamese_hybrid's block-0 Q norm against
    1e-3 elsewhere: tanh-bounded queries and keys of an 8-wide head leave the scores nearly
    flat), 1e-2 off relative to themselves; a learned scalar (DyT's alpha) is one sum over
    everything. For both, and for the connection weights (mHC's static mapping with DyT came
    5.6e-4 off itself), the error is taken against the model's largest gradient when that is
    smaller than against their own."""
    if _connection(name):
        return 5e-4
    return 5e-5 if _head_norm(name) else 1e-5


def _connection(name: str) -> bool:
    return "_hc." in name or "_mhc." in name


def _head_norm(name: str) -> bool:
    return "_layernorm." in name and "self_attention" in name


def test_deepnorm_init_scales_branch_weights_by_beta(single_rank):
    """DeepNet's init: fc1, fc2, V and the attention output projection times beta = (8L)^(-1/4),
    Q and K as drawn. Compared with a Post-Norm model built from the same draws, whose output
    projections carry megatron's 1/sqrt(2L) (replaced by beta in DeepNorm)."""
    built = {}
    for scheme in ("post", "deepnorm"):
        torch.manual_seed(3)
        [model] = build_model(tiny_model(scheme), ParallelConfig())
        built[scheme] = dict(model.named_parameters())
    post, deep = built["post"], built["deepnorm"]
    cfg = tiny_model("deepnorm")
    layers, per_group = cfg.num_layers, cfg.num_attention_heads // cfg.kv_heads
    beta, megatron_depth = (8 * layers) ** -0.25, (2 * layers) ** -0.5
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for i in range(layers):
        def w(params, name, i=i):
            return params[f"decoder.layers.{i}.{name}.weight"]
        torch.testing.assert_close(w(deep, "mlp.linear_fc1"), beta * w(post, "mlp.linear_fc1"))
        for name in ("mlp.linear_fc2", "self_attention.linear_proj"):
            torch.testing.assert_close(w(deep, name), beta / megatron_depth * w(post, name))
        qkv_deep, qkv_post = (w(p, "self_attention.linear_qkv").view(
            cfg.kv_heads, per_group + 2, head_dim, -1) for p in (deep, post))
        torch.testing.assert_close(qkv_deep[:, :-1], qkv_post[:, :-1])  # Q and K heads
        torch.testing.assert_close(qkv_deep[:, -1], beta * qkv_post[:, -1])  # V heads


@pytest.mark.parametrize("layers,ratio,post_blocks", [
    (4, 0.25, 1), (12, 0.25, 3), (10, 0.25, 2), (100, 0.29, 29), (6, 0.0, 0), (6, 1.0, 6),
])
def test_mixln_split(layers, ratio, post_blocks):
    """Mix-LN's first floor(ratio * L) blocks are Post-Norm, by global index."""
    from model.spec import scheme_layer

    cfg = ModelConfig(residual_scheme="mixln", num_layers=layers, mixln_post_ratio=ratio)
    assert [scheme_layer(cfg, i) is not None for i in range(layers)] == \
        [i < post_blocks for i in range(layers)]


def test_one_static_hyper_connection_stream_is_pre_norm(single_rank, device):
    """With n = 1 and static weights at their start (Am = Ar = B = 1), hyper-connections are
    h <- h + F(N(h)) with a final norm: the same logits as Pre-Norm from the same seed."""
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(16).expand_as(tokens)
    logits = {}
    for scheme, extra in (("pre", {}), ("hc", {"hc_rate": 1, "hc_dynamic": False})):
        [model] = build_model(tiny_model(scheme, **extra), ParallelConfig(), seed=4)
        logits[scheme] = model(tokens.to(device), positions.to(device), None)
    torch.testing.assert_close(logits["hc"], logits["pre"], rtol=0, atol=0)


def test_sinkhorn_is_doubly_stochastic():
    """mHC's H_res after the default 20 iterations: every entry positive, each column summing
    to 1 within 1e-6 (the iterations end on the columns) and each row within 5e-4 from logits
    of std 1 (the worst of 4096 matrices measured 1.4e-4, the 99th percentile 1.6e-6: finite
    Sinkhorn-Knopp is doubly stochastic only up to its convergence), within 1e-6 from logits
    of std 0.1 (a model's start: its gates are 0.01). Its backward, which runs the iterations
    again, is the gradient of the iterations (float64 gradcheck)."""
    from model.layers.mhc import sinkhorn

    logits = torch.randn(4096, 4, 4, generator=torch.Generator().manual_seed(5))
    for scale, rows in ((1.0, 5e-4), (0.1, 1e-6)):
        m = sinkhorn(scale * logits, 20)
        assert (m > 0).all()
        assert (m.sum(-2) - 1).abs().max() <= 1e-6, scale
        assert (m.sum(-1) - 1).abs().max() <= rows, scale
    small = torch.randn(3, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: sinkhorn(t, 20), (small,))


@pytest.mark.parametrize("scheme", ["siamese", "siamese_hybrid"])
def test_c_l_stays_exact_fp32_through_a_bf16_cast_and_out_of_checkpoints(single_rank, scheme):
    """The tensor c_l the Triton kernels and compiled blocks read (``c_operand``) is
    sqrt(2 l) rounded once to fp32 in every block, also after megatron's Float16Module has
    cast the model to bf16 (which rounds every other floating buffer: sqrt(2) to 1.4140625),
    and it is no part of a checkpoint (it follows from the layer number)."""
    from megatron.core.transformer.module import Float16Module

    [model] = build_model(tiny_model(scheme), ParallelConfig(), params_dtype=torch.bfloat16)
    wrapped = Float16Module(model.config, model)
    layers = [m for m in wrapped.modules() if hasattr(m, "c_tensor")]
    assert len(layers) == tiny_model(scheme).num_layers
    for i, layer in enumerate(layers):
        want = torch.tensor(math.sqrt(2 * (i + 1)), dtype=torch.float32)
        assert layer.c_tensor.dtype == torch.float32 and layer.c_tensor.item() == want.item()
        assert layer.c == math.sqrt(2 * (i + 1))
    assert not any("c_tensor" in k for k in wrapped.state_dict())
