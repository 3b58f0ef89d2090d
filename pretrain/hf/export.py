"""``export-hf``: a checkpoint of any scheme and parallel layout as a Hugging Face model folder.

The checkpoint is loaded whole into one process (``pretrain.unsharded.whole_model``) and
every tensor is assembled under its global name (:func:`global_tensors`; each routed expert
of an MoE block under its own). Then:

- a ``pre`` model with RMSNorm, SwiGLU, RoPE, no linear biases and no experts is a Llama:
  its tensors are laid out as Llama's (fused Q/K/V split per K/V group, fc1 split into gate
  and up) and the folder loads with ``AutoModelForCausalLM`` and no code at all;
- every other model gets the remote-code files of ``pretrain/hf/remote`` (one modeling file
  written from the schemes' equations, with a KV cache for generation) and keeps the
  checkpoint's own parameter names, prefixed ``model.``; it loads with
  ``trust_remote_code=True``.

Either way the vocabulary padding is dropped, weights go to ``safetensors`` (shards of at most
``SHARD_BYTES`` with an index, as ``transformers`` writes them), next to ``config.json``,
``generation_config.json``, the tokenizer (``pretrain.hf.tokenizer_export``) and a README.md
saying how to load them (``pretrain.hf.readme``).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from enum import StrEnum
from pathlib import Path

import torch

from model.config import ModelConfig
from model.init import local_tensors
from model.schemes import SCHEME_FIELDS
from model.sizes import ParameterCount
from pretrain.config import Config
from pretrain.data.tokenizer import Tokenizer
from pretrain.hf import llama as hf_llama
from pretrain.hf.readme import write_readme
from pretrain.hf.tokenizer_export import write_tokenizer
from pretrain.paths import require_writable
from pretrain.unsharded.whole_model import load_whole, single_process
from runtime.errors import ConfigError

SHARD_BYTES = 5 * 2**30
REMOTE_CODE = Path(__file__).parent / "remote"
REMOTE_FILES = ("configuration_siamesenorm.py", "modeling_siamesenorm.py")
# megatron names Pre-Norm blocks' norms after the projection they are fused into
_PRE_NORM_NAMES = ((".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
                   (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."))
_EXPERTS = ".experts.experts."  # megatron's checkpoint key of an MoE block's routed experts


def global_name(tensor) -> str:
    """The global name of a checkpoint tensor: its key with the indices of the axes the
    checkpoint stacks it along put back, the block after ``decoder.layers.`` (for blocks the
    checkpoint stacks) and megatron's expert index (each MoE block's experts are one tensor
    per weight, ``mlp.experts.experts.*``; the name is the module's own,
    ``mlp.experts.local_experts.<e>.*``, the expert's number in the whole model)."""
    key, axes = tensor.key, list(tensor.global_offset[:tensor.prepend_axis_num])
    if axes and re.match(r"decoder\.layers\.\D", key):
        key = key.replace("decoder.layers.", f"decoder.layers.{axes.pop(0)}.", 1)
    if axes and _EXPERTS in key:
        key = key.replace(_EXPERTS, f".experts.local_experts.{axes.pop(0)}.", 1)
    if axes:
        raise RuntimeError(f"export-hf: {tensor.key} is stacked along an axis this export "
                           "does not know")
    return key


def global_tensors(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the unsharded model ``chunk`` by :func:`global_name`."""
    out: dict[str, torch.Tensor] = {}
    for tensor in local_tensors(chunk):
        blocks, key = tensor.prepend_axis_num, global_name(tensor)
        shape, offset = tensor.global_shape[blocks:], tensor.global_offset[blocks:]
        full = out.setdefault(key, torch.empty(shape, dtype=tensor.data.dtype))
        where = tuple(slice(o, o + n) for o, n in zip(offset, tensor.data.shape, strict=True))
        full[where] = tensor.data.detach().cpu()
    return out


def remote_tensors(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The remote-code model's tensors: the global names prefixed ``model.`` (the output layer
    is ``lm_head``), Pre-Norm norms by their own names, the vocabulary unpadded."""
    out = {}
    for key, tensor in tensors.items():
        if key == "output_layer.weight":
            out["lm_head.weight"] = tensor[:model.vocab_size]
            continue
        for fused, own in _PRE_NORM_NAMES:
            key = key.replace(fused, own)
        if key == "embedding.word_embeddings.weight":
            tensor = tensor[:model.vocab_size]
        out["model." + key] = tensor
    return {name: t.contiguous() for name, t in out.items()}


def _json_value(value):
    """A config value as config.json writes it (a choice by its string)."""
    return value.value if isinstance(value, StrEnum) else value


def remote_config(model: ModelConfig, dtype: torch.dtype, eod: int, gated: bool = False) -> dict:
    """config.json of the remote-code model (``SiameseNormConfig``)."""
    return {
        "architectures": ["SiameseNormForCausalLM"], "model_type": "siamesenorm",
        "auto_map": {"AutoConfig": "configuration_siamesenorm.SiameseNormConfig",
                     "AutoModelForCausalLM": "modeling_siamesenorm.SiameseNormForCausalLM"},
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_size, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.kv_heads, "max_position_embeddings": model.seq_length,
        "residual_scheme": model.residual_scheme.value,
        "normalization": model.normalization.value, "norm_eps": model.norm_eps,
        "norm_bias": model.norm_bias, "activation": model.activation.value,
        "position_embedding": model.position_embedding.value,
        "rope_theta": float(model.rotary_base), "add_bias_linear": model.add_bias_linear,
        # every scheme-only field (model.schemes.SCHEME_FIELDS), so a new one reaches the
        # remote config without a line here
        **{name: _json_value(getattr(model, name)) for name in sorted(SCHEME_FIELDS)},
        "initializer_range": model.init_method_std,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "bos_token_id": None, "eos_token_id": eod,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **(experts_config(model, gated) if model.num_experts else {}),
    }


class ExpertField(StrEnum):
    """What the export does with a mixture-of-experts field of the model (``MOE_FIELDS``)."""

    CARRIED = "carried"
    """In config.json, and computed by the remote code as megatron computes it."""
    TRAINING = "training"
    """Nothing the exported model computes: a training loss, the expert bias's update, or a
    detail of token dropping (which is refused itself)."""
    REFUSED = "refused"
    """The remote code does not compute it: a model that sets it is refused
    (:data:`REFUSALS`)."""


EXPERT_FIELDS = {
    "moe_layer_freq": ExpertField.CARRIED,
    "moe_router_topk": ExpertField.CARRIED,
    "moe_ffn_hidden_size": ExpertField.CARRIED,
    "moe_shared_expert_intermediate_size": ExpertField.CARRIED,
    "moe_router_score_function": ExpertField.CARRIED,
    "moe_router_pre_softmax": ExpertField.CARRIED,
    "moe_router_enable_expert_bias": ExpertField.CARRIED,
    "moe_router_load_balancing_type": ExpertField.TRAINING,
    "moe_aux_loss_coeff": ExpertField.TRAINING,
    "moe_z_loss_coeff": ExpertField.TRAINING,
    "moe_router_bias_update_rate": ExpertField.TRAINING,
    "moe_expert_capacity_factor": ExpertField.REFUSED,
    # which tokens to drop, and padding to the capacity: acting only with a capacity factor,
    # refused itself (model.config refuses padding without one)
    "moe_token_drop_policy": ExpertField.TRAINING,
    "moe_pad_expert_input_to_capacity": ExpertField.TRAINING,
}
"""Every field of ``model.config.MOE_FIELDS`` and what the export does with it; a new MoE
field fails ``tests/pretrain/hf/test_hf_remote.py`` until it is classified here."""

REFUSALS = {
    "moe_expert_capacity_factor": lambda value: value is not None and (
        f"export-hf: model.moe_expert_capacity_factor ({value}) drops tokens by the load of "
        "the whole forward, so a token's output depends on later tokens, which a Hugging Face "
        "model generating token by token cannot compute; only a model without token dropping "
        "exports"),
}
"""Per :attr:`ExpertField.REFUSED` field: its value -> the one-line refusal, or a false value
where that value exports."""


def experts_config(model: ModelConfig, gated: bool) -> dict:
    """The mixture-of-experts fields of config.json: what routes a token and what computes
    it (the :attr:`ExpertField.CARRIED` fields); the training-only ones stay behind.
    ``gated``: the shared expert has megatron's sigmoid gate (its ``gate_weight``)."""
    carried = {name: _json_value(getattr(model, name)) for name, use in EXPERT_FIELDS.items()
               if use is ExpertField.CARRIED}
    return {"num_experts": model.num_experts, **carried,
            "moe_ffn_hidden_size": model.moe_expert_ffn_size, "moe_shared_expert_gate": gated}


def llama_config(model: ModelConfig, dtype: torch.dtype, eod: int) -> dict:
    """config.json of the Llama that ``model`` is (:func:`hf_llama.is_llama`)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_size, "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.hidden_size // model.num_attention_heads,
        "hidden_act": "silu", "max_position_embeddings": model.seq_length,
        "rms_norm_eps": model.norm_eps, "rope_theta": float(model.rotary_base),
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "bos_token_id": None, "eos_token_id": eod, "torch_dtype": str(dtype).removeprefix(
            "torch."),
    }


_LLAMA_NAMES = {"input_layernorm.weight": "input_layernorm.weight",
                "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
                "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                "mlp.linear_fc2.weight": "mlp.down_proj.weight"}


def llama_tensors(remote: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The remote-code tensors of a Llama-shaped model under Llama's names (the inverse of
    :func:`hf_llama.megatron_tensor`)."""
    heads, groups = model.num_attention_heads, model.kv_heads
    head_dim, per_group = model.hidden_size // heads, heads // groups
    out: dict[str, torch.Tensor] = {}
    for name, data in remote.items():
        if name == "model.embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = data
        elif name == "model.decoder.final_layernorm.weight":
            out["model.norm.weight"] = data
        elif name == "lm_head.weight":
            out[name] = data
        elif name.startswith("model.decoder.layers."):
            layer, part = name.removeprefix("model.decoder.layers.").split(".", 1)
            block = f"model.layers.{layer}."
            if part == "self_attention.linear_qkv.weight":
                qkv = data.view(groups, per_group + 2, head_dim, -1)
                for proj, rows in (("q", qkv[:, :per_group]), ("k", qkv[:, per_group]),
                                   ("v", qkv[:, -1])):
                    out[block + f"self_attn.{proj}_proj.weight"] = rows.reshape(-1, data.shape[1])
            elif part == "mlp.linear_fc1.weight":
                gate, up = data.chunk(2)  # SwiGLU's fc1 holds [gate | up]
                out[block + "mlp.gate_proj.weight"], out[block + "mlp.up_proj.weight"] = gate, up
            elif part in _LLAMA_NAMES:
                out[block + _LLAMA_NAMES[part]] = data
            else:
                raise ConfigError(f"export-hf: no Llama tensor for {name}")
        else:
            raise ConfigError(f"export-hf: no Llama tensor for {name}")
    return {name: t.contiguous() for name, t in out.items()}


def _save(save_file, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One safetensors file, with the mode any new file gets here (0666 less the umask):
    safetensors creates its files readable by their owner only, which hides an export from
    the group it was made for."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def save_sharded(tensors: dict[str, torch.Tensor], output: Path) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors shards plus their index."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        _save(save_file, shards[0], output / "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save(save_file, shard, output / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (output / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def remote_schemes() -> tuple[str, ...]:
    """The schemes the remote code builds: ``SCHEMES`` of its configuration file, read from the
    file (importing it needs ``transformers``, which writing a folder does not)."""
    tree = ast.parse((REMOTE_CODE / "configuration_siamesenorm.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SCHEMES"
                                                for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("pretrain/hf/remote/configuration_siamesenorm.py defines no SCHEMES")


def require_exportable(model: ModelConfig) -> None:
    """A one-line error for a scheme the remote code cannot build (a Llama needs none), and
    for an MoE field the remote code does not compute (:data:`REFUSALS`): token dropping,
    since megatron's router drops what exceeds an expert's capacity in every forward,
    evaluation too, by the load of all the tokens of that forward, so a token's output
    depends on the tokens after it, which a model that generates from a KV cache (and any
    causal model) cannot compute."""
    scheme = model.residual_scheme.value
    if not hf_llama.is_llama(model) and scheme not in remote_schemes():
        raise ConfigError(f"export-hf: model.residual_scheme ({scheme}) has no Hugging Face "
                          f"remote code; it builds {', '.join(remote_schemes())}")
    if not model.num_experts:
        return
    for name, refusal in REFUSALS.items():
        message = refusal(getattr(model, name))
        if message:
            raise ConfigError(message)


def write_folder(model: ModelConfig, chunk: torch.nn.Module, tokenizer_path: str,
                 tokenizer: Tokenizer, output: Path) -> int:
    """Write the Hugging Face folder of the unsharded ``chunk`` into the empty ``output``;
    returns how many tensors it holds."""
    require_exportable(model)
    while hasattr(chunk, "module"):  # DDP / Float16Module wrappers
        chunk = chunk.module
    tensors = remote_tensors(global_tensors(chunk), model)
    if not model.untie_embeddings_and_output_weights:
        tensors.pop("lm_head.weight", None)
    dtype = tensors["model.embedding.word_embeddings.weight"].dtype
    if hf_llama.is_llama(model):
        tensors, config = llama_tensors(tensors, model), llama_config(model, dtype, tokenizer.eod)
    else:
        gated = any(name.endswith(".shared_experts.gate_weight") for name in tensors)
        config = remote_config(model, dtype, tokenizer.eod, gated)
        for name in REMOTE_FILES:
            shutil.copy(REMOTE_CODE / name, output / name)
    save_sharded(tensors, output)
    (output / "config.json").write_text(json.dumps(config, indent=2))
    (output / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tokenizer.eod, "pad_token_id": tokenizer.pad
         if tokenizer.pad >= 0 else None}, indent=2))
    write_tokenizer(tokenizer_path, tokenizer, output)
    sizes = ParameterCount(total=sum(t.numel() for t in tensors.values()),
                           routed=sum(t.numel() for name, t in tensors.items()
                                      if ".experts.local_experts." in name))
    write_readme(model, hf_llama.is_llama(model), sizes, output)
    return len(tensors)


def export_hf(config: Config, checkpoint: str, output: str) -> dict:
    """Write the Hugging Face folder ``output`` from ``checkpoint`` of the config's model."""
    target = Path(output)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"export-hf --output '{output}' exists and is not an empty folder; "
                          "choose a new folder")
    require_writable(output, "export-hf --output")
    single_process(config, "export-hf")
    require_exportable(config.model)
    chunk, tokenizer, found = load_whole(config, checkpoint)
    # written beside the target and renamed into place: an export that stops (Ctrl-C, a full
    # disk) leaves no folder that looks complete
    partial = target.parent / f".{target.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        count = write_folder(config.model, chunk, config.data.tokenizer, tokenizer, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if target.exists():  # the empty folder the command was given
        target.rmdir()
    partial.rename(target)
    kind = "llama" if hf_llama.is_llama(config.model) else "remote code"
    return {"checkpoint": str(found), "output": str(target), "tensors": count, "model": kind}
