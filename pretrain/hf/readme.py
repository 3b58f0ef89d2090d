"""README.md of an exported Hugging Face folder: how to load what is in it.

A folder travels without these docs, so it says itself what its reader needs: whether the
model is remote code (``trust_remote_code=True``) or a native Llama, and how the tokenizer
loads. The tokenizer is a standard class (``PreTrainedTokenizerFast`` over tokenizer.json),
but ``AutoTokenizer`` in transformers >= 5 reads the model's config.json before the
tokenizer's files, and a remote-code config makes it ask whether to run the folder's code;
the README gives both ways that load it without the question. It also says what the model
is: its size and, for a mixture of experts, the experts (how many, the top-k, their width,
which blocks hold them) and the parameters one token uses, which config.json spells only in
field names a reader must know.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from model.config import ModelConfig
from model.sizes import ParameterCount


def lm_eval_args(folder: str, llama: bool) -> str:
    """``--model_args`` of ``lm_eval --model hf`` for the folder: remote code trusted, and the
    model said to be causal (lm-eval guesses that from transformers' own model types, which
    do not list a remote-code one)."""
    return f"pretrained={folder}" if llama else \
        f"pretrained={folder},trust_remote_code=True,backend=causal"


def about(model: ModelConfig, sizes: ParameterCount) -> list[str]:
    """The README's paragraph on what the model is; ``sizes`` counts the folder's weights
    (the vocabulary unpadded, tied embeddings once), its routed experts apart."""
    shape = (f"{model.num_layers} blocks of width {model.hidden_size}, "
             f"{model.num_attention_heads} attention heads")
    if not model.num_experts:
        return [f"The model: {shape}; {sizes.total:,} parameters.", ""]
    blocks = [index for index, moe in enumerate(model.moe_blocks) if moe]
    where = (f"every block ({len(blocks)})" if len(blocks) == model.num_layers else
             "blocks " + ", ".join(map(str, blocks)) + " (counted from 0, as the weights' "
             "names count them; the others have one dense MLP)")
    shared = model.moe_shared_expert_intermediate_size
    return [
        f"The model: {shape}; a mixture of experts: in {where}, a router sends each token "
        f"to {model.moe_router_topk} of {model.num_experts} routed "
        f"experts (top-{model.moe_router_topk}), each an MLP of width "
        f"{model.moe_expert_ffn_size}"
        + (f", and every token also passes through a shared expert of width {shared}"
           if shared else "")
        + f". Parameters: {sizes.total:,} in all, of which {sizes.routed:,} in the routed "
        f"experts; {sizes.active(model):,} active per token (the total less the routed "
        "experts a token is not sent to).",
        "",
    ]


def readme(scheme: str, llama: bool, files: set[str], described: Sequence[str] = ()) -> str:
    """The README text of a folder of a ``scheme`` model holding ``files``; ``described``:
    the paragraph of :func:`about`."""
    remote = "" if llama else ", trust_remote_code=True"
    kind = ("a native Llama: transformers builds it without any code from this folder"
            if llama else
            "remote code: `configuration_siamesenorm.py` and `modeling_siamesenorm.py` in "
            "this folder, importing only torch and transformers")
    lines = [
        f"# A `{scheme}` language model",
        "",
        f"Exported by SiameseNorm pretraining's `export-hf`. The model is {kind}. "
        "`FOLDER` below is this folder's path.",
        "",
        *described,
        "```python",
        "from transformers import AutoModelForCausalLM"
        + (", AutoTokenizer" if "tokenizer.json" in files else ""),
        "",
        f'model = AutoModelForCausalLM.from_pretrained("FOLDER"{remote})',
    ]
    if "tokenizer.json" in files:
        lines += [f'tokenizer = AutoTokenizer.from_pretrained("FOLDER"{remote})', "```", ""]
        if not llama:
            lines += [
                "The tokenizer is no code: `tokenizer.json`, which the standard "
                "`PreTrainedTokenizerFast` reads. But `AutoTokenizer` (transformers >= 5) "
                "reads the model's config.json first, and that config is remote code: "
                "without `trust_remote_code=True` it asks whether to run it. To load the "
                "tokenizer with no remote code at all:",
                "",
                "```python",
                "from transformers import PreTrainedTokenizerFast",
                "",
                'tokenizer = PreTrainedTokenizerFast.from_pretrained("FOLDER")',
                "```",
                "",
            ]
        lines += [
            "To decode what the model adds after a prompt of `n` tokens, decode the whole "
            "sequence and cut off the decoded prompt: decoding the slice `out[0, n:]` alone "
            "can differ (a tokenizer converted from sentencepiece drops the space the "
            "slice's first piece starts with, sentencepiece's rule for the start of a text). "
            "The special tokens' spellings (`<s>`, `</s>`, ...) in text are text, as in "
            "training.",
            "",
            "```python",
            'ids = tokenizer("def f(n):\\n", return_tensors="pt").input_ids',
            "out = model.generate(ids, max_new_tokens=32, do_sample=False)",
            "n = ids.shape[1]",
            "added = tokenizer.decode(out[0])[len(tokenizer.decode(out[0, :n])):]",
            "```",
            "",
        ]
    else:
        lines += ["```", "",
                  "The tokenizer is `tokenizer.model`, a sentencepiece model (not converted to "
                  "tokenizer.json): load it with `sentencepiece.SentencePieceProcessor`.", ""]
    lines += [
        "lm-evaluation-harness scores it with its Hugging Face backend (which needs "
        "`accelerate`):",
        "",
        "```bash",
        f"lm_eval --model hf --model_args {lm_eval_args('FOLDER', llama)} --tasks hellaswag",
        "```",
        "",
    ]
    return "\n".join(lines)


def write_readme(model: ModelConfig, llama: bool, sizes: ParameterCount, output: Path) -> None:
    """README.md into the folder ``output``, after every other file is written."""
    files = {p.name for p in output.iterdir()}
    (output / "README.md").write_text(readme(model.residual_scheme.value, llama, files,
                                             about(model, sizes)))
