"""Hugging Face Llama checkpoints as ``run.init_from`` of a ``pre`` model.

A Llama-architecture folder (``config.json`` with ``model_type`` llama and ``*.safetensors``)
is a Pre-Norm transformer with RMSNorm, SwiGLU and RoPE (rotate-half, as megatron's), so it
is exactly this framework's ``pre`` scheme with those choices and no linear biases. Its
tensors are renamed and re-laid-out into megatron's (Q, K and V fused per K/V group, gate and
up fused as fc1, the vocabulary padded with zero rows) and copied into the model under any
parallel layout through the same global-name machinery as the initialisation
(:func:`model.init.fill`): each rank takes its slice of each global tensor.

The config is compared first, field by field; a model that does not match is refused in one
line naming every difference, before a tensor is read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from model.config import ModelConfig
from model.init import fill
from model.schemes import Activation, Normalization, PositionEmbedding, ResidualScheme
from runtime.errors import CheckpointError

log = logging.getLogger("pretrain")


def is_hf_folder(path: str) -> bool:
    """Whether ``path`` is a Hugging Face model folder (rather than a megatron checkpoint)."""
    return (Path(path) / "config.json").is_file()


def _hf_config(folder: str) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise CheckpointError(f"'{folder}/config.json' is not a readable JSON file") from None


# What makes a model of this framework a Llama. A Llama has no experts: a ``pre`` model with
# experts is exported with the remote code, as every other scheme.
LLAMA_CHOICES = {"residual_scheme": ResidualScheme.PRE, "normalization": Normalization.RMSNORM,
                 "activation": Activation.SWIGLU, "position_embedding": PositionEmbedding.ROPE,
                 "add_bias_linear": False, "num_experts": 0}


def is_llama(model: ModelConfig) -> bool:
    """Whether ``model`` is exactly a Llama (``transformers`` has the class)."""
    return all(getattr(model, name) == value for name, value in LLAMA_CHOICES.items())


def check(folder: str, model: ModelConfig) -> None:
    """Refuse, in one line naming every difference, a folder that is not this model."""
    hf = _hf_config(folder)
    if hf.get("model_type") != "llama":
        raise CheckpointError(f"'{folder}' holds a {hf.get('model_type')!r} model; "
                              "run.init_from reads Hugging Face llama models only")
    ours = {  # model field -> (our value, theirs)
        "residual_scheme": (model.residual_scheme, ResidualScheme.PRE),
        "normalization": (model.normalization, Normalization.RMSNORM),
        "activation": (model.activation, Activation.SWIGLU if hf.get("hidden_act") == "silu"
                       else hf.get("hidden_act")),
        "position_embedding": (model.position_embedding, PositionEmbedding.ROPE),
        "add_bias_linear": (model.add_bias_linear,
                            bool(hf.get("attention_bias") or hf.get("mlp_bias"))),
        "num_experts": (model.num_experts, 0),  # a Llama's every MLP is dense
        "num_layers": (model.num_layers, hf.get("num_hidden_layers")),
        "hidden_size": (model.hidden_size, hf.get("hidden_size")),
        "num_attention_heads": (model.num_attention_heads, hf.get("num_attention_heads")),
        "num_query_groups": (model.kv_heads, hf.get("num_key_value_heads")
                             or hf.get("num_attention_heads")),
        "ffn_hidden_size": (model.ffn_size, hf.get("intermediate_size")),
        "vocab_size": (model.vocab_size, hf.get("vocab_size")),
        "norm_eps": (model.norm_eps, hf.get("rms_norm_eps")),
        "rotary_base": (model.rotary_base, _rope_theta(hf)),
        "untie_embeddings_and_output_weights": (
            model.untie_embeddings_and_output_weights, not hf.get("tie_word_embeddings", False)),
    }
    differences = [f"model.{name} ({mine} here, {theirs} there)"
                   for name, (mine, theirs) in ours.items() if mine != theirs]
    head_dim = hf.get("head_dim")
    if head_dim not in (None, model.hidden_size // model.num_attention_heads):
        differences.append(f"head_dim ({model.hidden_size // model.num_attention_heads} here, "
                           f"{head_dim} there)")
    scaling = (hf.get("rope_parameters") or {}).get("rope_type") or (
        hf.get("rope_scaling") or {}).get("rope_type")
    if scaling not in (None, "default"):
        differences.append(f"RoPE scaling ({scaling!r} there; none here)")
    if differences:
        raise CheckpointError(f"'{folder}' holds another model: {'; '.join(differences)}")


def _rope_theta(hf: dict) -> float | None:
    """rope_theta, at the top level (transformers 4) or in rope_parameters (transformers 5)."""
    return (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))


def read_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (one file, or the shards of an index)."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"'{folder}' has no .safetensors weights")
    tensors = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _padded(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary padded to megatron's multiple with zero rows (never a target)."""
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


def megatron_tensor(key: str, layer: int | None, hf: dict[str, torch.Tensor],
                    model: ModelConfig) -> torch.Tensor:
    """The global megatron tensor ``key`` (of block ``layer``) from Llama's tensors."""
    block = f"model.layers.{layer}."
    heads, groups = model.num_attention_heads, model.kv_heads
    head_dim = model.hidden_size // heads

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise CheckpointError(f"the Llama weights have no tensor {name} (for {key})")
        return hf[name].float()

    def qkv() -> torch.Tensor:
        q = get(block + "self_attn.q_proj.weight").view(groups, heads // groups * head_dim, -1)
        k = get(block + "self_attn.k_proj.weight").view(groups, head_dim, -1)
        v = get(block + "self_attn.v_proj.weight").view(groups, head_dim, -1)
        return torch.cat([q, k, v], dim=1).reshape(-1, model.hidden_size)

    rows = model.padded_vocab_size
    embedding = "model.embed_tokens.weight"
    makers = {
        "embedding.word_embeddings.weight": lambda: _padded(get(embedding), rows),
        "output_layer.weight": lambda: _padded(
            get("lm_head.weight" if "lm_head.weight" in hf else embedding), rows),
        "decoder.final_layernorm.weight": lambda: get("model.norm.weight"),
        "self_attention.linear_qkv.layer_norm_weight":
            lambda: get(block + "input_layernorm.weight"),
        "mlp.linear_fc1.layer_norm_weight":
            lambda: get(block + "post_attention_layernorm.weight"),
        "self_attention.linear_qkv.weight": qkv,
        "self_attention.linear_proj.weight": lambda: get(block + "self_attn.o_proj.weight"),
        "mlp.linear_fc1.weight": lambda: torch.cat([get(block + "mlp.gate_proj.weight"),
                                                    get(block + "mlp.up_proj.weight")]),
        "mlp.linear_fc2.weight": lambda: get(block + "mlp.down_proj.weight"),
    }
    for suffix, make in makers.items():
        if key.endswith(suffix):
            return make()
    raise CheckpointError(f"no Llama tensor maps to {key}")


def load(chunks: list, folder: str, model: ModelConfig) -> None:
    """The Llama weights of ``folder`` into the chunks of ``model`` (checked with
    :func:`check` first), under any parallel layout."""
    check(folder, model)
    if model.padded_vocab_size != model.vocab_size:
        log.warning("the vocabulary is padded from %d to %d ids with zero rows: their logits "
                    "are 0, which changes the softmax a little; a model.make_vocab_size_"
                    "divisible_by that divides %d keeps the Llama's loss exactly",
                    model.vocab_size, model.padded_vocab_size, model.vocab_size)
    hf = read_tensors(folder)

    def source(tensor: ShardedTensor, _name: str) -> torch.Tensor:
        layer = tensor.global_offset[0] if tensor.prepend_axis_num else _layer_of(tensor.key)
        full = megatron_tensor(tensor.key, layer, hf, model)
        want = tuple(tensor.global_shape[tensor.prepend_axis_num:])
        if tuple(full.shape) != want:
            raise CheckpointError(f"Llama tensor for {tensor.key} is {list(full.shape)}, "
                                  f"the model's is {list(want)}")
        return full

    fill([getattr(c, "module", c) for c in chunks], source)


def _layer_of(key: str) -> int | None:
    """The block index in a per-block key ``decoder.layers.<i>.``, else None."""
    parts = key.split(".")
    if parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None
