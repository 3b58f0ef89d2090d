"""The README.md of an exported folder (pretrain.hf.readme): the loading lines its kind of
model and tokenizer need, as code that parses. That they load is tested on real folders in
a process with transformers alone (test_hf_remote.py)."""

import ast
import re

from model.config import ModelConfig
from model.sizes import ParameterCount
from pretrain.hf.readme import about, readme


def _python(text: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    for block in blocks:
        ast.parse(block)
    return blocks


def test_a_remote_code_folder_trusts_its_code_for_the_tokenizer_too():
    text = readme("siamese", llama=False, files={"tokenizer.json", "tokenizer.model"})
    code = "\n".join(_python(text))
    assert 'AutoModelForCausalLM.from_pretrained("FOLDER", trust_remote_code=True)' in code
    assert 'AutoTokenizer.from_pretrained("FOLDER", trust_remote_code=True)' in code
    assert 'PreTrainedTokenizerFast.from_pretrained("FOLDER")' in code  # no remote code
    assert "pretrained=FOLDER,trust_remote_code=True,backend=causal" in text
    assert "accelerate" in text and "# A `siamese` language model" in text


def test_a_llama_folder_needs_no_remote_code():
    text = readme("pre", llama=True, files={"tokenizer.json"})
    assert "trust_remote_code" not in text and "PreTrainedTokenizerFast" not in text
    assert 'AutoTokenizer.from_pretrained("FOLDER")' in "\n".join(_python(text))


def test_a_folder_without_tokenizer_json_names_sentencepiece():
    text = readme("post", llama=False, files={"tokenizer.model"})
    assert "AutoTokenizer" not in text and "SentencePieceProcessor" in text
    _python(text)


def test_an_moe_folder_says_its_experts_and_active_parameters():
    """The experts a user of the folder cannot see in config.json's field names: how many,
    the top-k, their width, which blocks hold them, and the parameters a token uses."""
    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_experts=8,
                        moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=[1, 0, 1, 1],
                        moe_shared_expert_intermediate_size=40)
    sizes = ParameterCount(total=100_000, routed=3 * 8 * 3 * 32 * 24)
    text = readme("siamese", llama=False, files={"tokenizer.json"},
                  described=about(model, sizes))
    for words in ("4 blocks of width 32, 4 attention heads; a mixture of experts",
                  "in blocks 0, 2, 3 (counted from 0", "sends each token to 2 of 8 routed "
                  "experts (top-2), each an MLP of width 24", "a shared expert of width 40",
                  "Parameters: 100,000 in all, of which 55,296 in the routed experts; "
                  f"{100_000 - 55_296 * 6 // 8:,} active per token"):
        assert words in text, (words, text)
    every = about(ModelConfig(num_layers=2, num_experts=4, moe_router_topk=1), sizes)[0]
    assert "in every block (2)" in every and "shared" not in every, every


def test_a_dense_folder_says_its_size_and_no_experts():
    [line, _] = about(ModelConfig(num_layers=2, hidden_size=64), ParameterCount(1234, 0))
    assert line == "The model: 2 blocks of width 64, 4 attention heads; 1,234 parameters."
    assert "expert" not in readme("pre", llama=True, files=set(), described=[line])
