"""The README.md of an exported folder (pretrain.hf.readme): the loading lines its kind of
model and tokenizer need, as code that parses. That they load is tested on real folders in
a process with transformers alone (test_hf_remote.py)."""

import ast
import re

from pretrain.hf.readme import readme


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
