"""Token ids are checked where they are read (pretrain/data/batch_ids.py): ids outside the
vocabulary written into a ``.bin`` in place, its modification time kept (``cp -p`` of a
damaged copy, a restored backup), pass the start's check, which trusts the dataset's record;
training used to die at step 1 with ``IndexError: index out of range in self`` in the
embedding (a device-side assert naming no file on a GPU). Now the first micro-batch holding
one is refused in one line naming the prefix, the document and the token, before its
forward, in training and in validation."""

from __future__ import annotations

import os
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from pretrain.data import index, record
from pretrain.data.batch_ids import check_batch
from runtime.errors import DataError
from tests.pretrain.data.datasets import megatron_dataset
from tests.pretrain_fixtures import cli, train_args, train_losses

# The test tokenizer has 512 pieces.
BAD_ID = 600
# Every EVERY-th token of the damaged .bin: every sample (33 tokens) holds at least two.
EVERY = 16


def _copy(data: dict, folder, name: str) -> str:
    """The session's dataset copied with its times, so its record still holds."""
    for suffix in (".bin", ".idx", record.SUFFIX):
        shutil.copy2(data["prefix"] + suffix, folder / (name + suffix))
    return str(folder / name)


def _damage_keeping_time(prefix: str) -> None:
    """BAD_ID written over every EVERY-th token of the .bin, its modification time put back:
    what a ``cp -p`` of a damaged copy leaves."""
    dtype = index.read(prefix + ".idx").dtype
    stat = os.stat(prefix + ".bin")
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r+")
    tokens[::EVERY] = BAD_ID
    tokens.flush()
    del tokens
    os.utime(prefix + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _refusal(done, prefix: str, split: str) -> re.Match:
    """The one error line of a refused start, naming ``prefix``, a document, its token and the
    token of the .bin, which must hold BAD_ID at that document's token."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "IndexError" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    found = re.fullmatch(
        rf"error: data prefix '{re.escape(prefix)}' has token id {BAD_ID} >= tokenizer "
        r"vocab_size 512 in document ([\d,]+) at its token ([\d,]+) \(token ([\d,]+) of "
        rf"'{re.escape(prefix)}\.bin'\), read for the {split} split: the \.bin changed "
        r"after its record was made, keeping its size and time, so the start's check "
        r"passed; prepare the data again", last)
    assert found, last
    document, of_document, of_bin = (int(g.replace(",", "")) for g in found.groups())
    checked = index.read(prefix + ".idx")
    start = int(checked.pointers[checked.documents[document]]) // checked.dtype.itemsize
    assert of_bin == start + of_document
    assert np.fromfile(prefix + ".bin", dtype=checked.dtype)[of_bin] == BAD_ID
    return found


@pytest.mark.slow
def test_a_damaged_bin_in_a_blend_is_refused_at_the_first_training_batch(data, tmp_path):
    clean, damaged = _copy(data, tmp_path, "clean"), _copy(data, tmp_path, "damaged")
    _damage_keeping_time(damaged)
    run = tmp_path / "run"
    done = cli(*train_args(data, run, "--run.steps=3", "--data.valid_samples=0",
                           f'--data.prefixes=["{clean}", "{damaged}"]'), check=False)
    _refusal(done, damaged, "train")
    assert not (run / "metrics.jsonl").exists() or train_losses(run) == {}


@pytest.mark.slow
def test_a_damaged_validation_set_is_refused_before_its_forward(data, tmp_path):
    held = _copy(data, tmp_path, "held")
    _damage_keeping_time(held)
    done = cli(*train_args(data, tmp_path / "run", "--run.steps=3", "--data.valid_samples=0",
                           f"--data.valid_sets=held={held}:8"), check=False)
    _refusal(done, held, "valid")


# Documents of one or more sequences (Megatron-LM's sentence splitting), int32 ids; the .bin
# holds 1, 2, ... 17 in this order.
DOCUMENTS = [[[1, 2, 3, 4, 5]], [[6, 7, 8], [9, 10]], [[11, 12, 13, 14, 15, 16, 17]]]


@pytest.mark.parametrize(("bad", "document", "of_document"), [
    (-7, 1, 1),    # negative: only a signed dtype holds one
    (910, 1, 3),   # in the document's second sequence
    (999, 2, 6),   # the document's last token
])
def test_an_id_out_of_range_is_named_by_document_and_token(tmp_path, bad, document,
                                                           of_document):
    """In process, every mapping a refusal makes: megatron's shuffled samples across
    documents of several sequences, back to the document, its token and the .bin's token."""
    ids = list(range(1, 18))
    of_bin = sum(len(s) for d in DOCUMENTS[:document] for s in d) + of_document
    ids[of_bin] = bad
    it = iter(ids)
    prefix = str(tmp_path / "d")
    megatron_dataset(tmp_path / "d", [[[next(it) for _ in s] for s in d] for d in DOCUMENTS],
                     np.int32)
    tokenizer = SimpleNamespace(vocab_size=100, eod=0, unique_identifiers={"class": "stub"})
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=4, blend_per_split=[([prefix], None), None, None],
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, mid_level_dataset_surplus=0.05)
    [dataset, _, _] = BlendedMegatronDatasetBuilder(GPTDataset, [4, 0, 0], lambda: True,
                                                    config).build()
    samples = list(range(len(dataset)))
    batch = {key: torch.stack([dataset[i][key] for i in samples])
             for key in ("tokens", "labels")}
    rule = "< 0" if bad < 0 else ">= tokenizer vocab_size 100"
    with pytest.raises(DataError) as info:
        check_batch(batch, dataset, samples)
    assert str(info.value).startswith(
        f"data prefix '{prefix}' has token id {bad} {rule} in document {document} at its "
        f"token {of_document} (token {of_bin} of '{prefix}.bin'), read for the train split: ")
    clean = {key: value.clamp(0, 99) for key, value in batch.items()}
    check_batch(clean, dataset, samples)  # in range: nothing said
