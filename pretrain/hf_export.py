"""``export-hf``: a ``pre`` checkpoint as a Hugging Face Llama folder.

A ``pre`` model with RMSNorm, SwiGLU, RoPE and no linear biases is a Llama: the checkpoint
(any parallel layout) is loaded whole into one process, its tensors are laid out as Llama's
(the inverse of ``pretrain.hf_llama``: fused Q/K/V split per K/V group, fc1 split into gate
and up, the vocabulary padding dropped) and written with ``safetensors`` (shards of at most
``SHARD_BYTES`` with an index, as ``transformers`` writes them), next to ``config.json``,
``generation_config.json`` and the tokenizer: a Hugging Face tokenizer's files are copied; a
sentencepiece model is copied as ``tokenizer.model``. The folder loads with
``AutoModelForCausalLM.from_pretrained`` and no code of this project.

Other schemes have no ``transformers`` class; their export needs the remote-code modeling
files that are not written yet, and is refused in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from model.config import ModelConfig
from model.init import local_tensors
from pretrain import hf_llama
from pretrain.config import Config
from pretrain.hf_tokenizer import is_hf_tokenizer
from pretrain.paths import require_creatable
from pretrain.whole_model import load_whole, single_process
from runtime.errors import ConfigError

SHARD_BYTES = 5 * 2**30


def llama_config(model: ModelConfig, dtype: torch.dtype, eod: int) -> dict:
    """config.json of the Llama that ``model`` is (after :func:`hf_llama.check` holds)."""
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


def llama_tensors(chunk, model: ModelConfig) -> dict[str, torch.Tensor]:
    """The unsharded model's tensors under Llama's names (the inverse of
    :func:`hf_llama.megatron_tensor`)."""
    heads, groups = model.num_attention_heads, model.kv_heads
    head_dim, per_group = model.hidden_size // heads, heads // groups
    out: dict[str, torch.Tensor] = {}
    for tensor in local_tensors(chunk):
        key, data = tensor.key, tensor.data.detach().cpu()
        layer = tensor.global_offset[0] if tensor.prepend_axis_num else None
        block = f"model.layers.{layer}."
        if key == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = data[:model.vocab_size]
        elif key == "output_layer.weight":
            out["lm_head.weight"] = data[:model.vocab_size]
        elif key == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = data
        elif key.endswith("self_attention.linear_qkv.layer_norm_weight"):
            out[block + "input_layernorm.weight"] = data
        elif key.endswith("mlp.linear_fc1.layer_norm_weight"):
            out[block + "post_attention_layernorm.weight"] = data
        elif key.endswith("self_attention.linear_qkv.weight"):
            qkv = data.view(groups, per_group + 2, head_dim, -1)
            out[block + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, data.shape[1])
            out[block + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(-1, data.shape[1])
            out[block + "self_attn.v_proj.weight"] = qkv[:, -1].reshape(-1, data.shape[1])
        elif key.endswith("self_attention.linear_proj.weight"):
            out[block + "self_attn.o_proj.weight"] = data
        elif key.endswith("mlp.linear_fc1.weight"):
            # SwiGLU's factory hands fc1 over as its two halves, gate first
            name = "gate_proj" if tensor.global_offset[-2] == 0 else "up_proj"
            out[block + f"mlp.{name}.weight"] = data
        elif key.endswith("mlp.linear_fc2.weight"):
            out[block + "mlp.down_proj.weight"] = data
        else:
            raise ConfigError(f"export-hf: no Llama tensor for {key}")
    if not model.untie_embeddings_and_output_weights:
        out.pop("lm_head.weight", None)
    return {name: t.contiguous() for name, t in out.items()}


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
        save_file(shards[0], str(output / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(output / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (output / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def copy_tokenizer(path: str, output: Path) -> None:
    source = Path(path)
    if is_hf_tokenizer(path):
        folder = source if source.is_dir() else source.parent
        names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
        for name in names:
            if (folder / name).is_file():
                shutil.copy(folder / name, output / name)
        if not source.is_dir():
            shutil.copy(source, output / "tokenizer.json")
    else:
        shutil.copy(source, output / "tokenizer.model")


def export_hf(config: Config, checkpoint: str, output: str) -> dict:
    """Write the Llama folder ``output`` from ``checkpoint`` of the config's ``pre`` model."""
    target = Path(output)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(f"export-hf --output '{output}' exists and is not an empty folder; "
                          "choose a new folder")
    require_creatable(output, "export-hf --output")
    model = config.model
    hf_llama.require_llama_shape(model, "export-hf")
    single_process(config, "export-hf")
    chunk, tokenizer, found = load_whole(config, checkpoint)
    module = getattr(chunk, "module", chunk)
    tensors = llama_tensors(getattr(module, "module", module), model)
    dtype = next(iter(tensors.values())).dtype
    target.mkdir(parents=True, exist_ok=True)
    save_sharded(tensors, target)
    (target / "config.json").write_text(json.dumps(
        llama_config(model, dtype, tokenizer.eod), indent=2))
    (target / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tokenizer.eod, "pad_token_id": tokenizer.pad
         if tokenizer.pad >= 0 else None}, indent=2))
    copy_tokenizer(config.data.tokenizer, target)
    return {"checkpoint": str(found), "output": str(target), "tensors": len(tensors)}
