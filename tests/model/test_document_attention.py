"""Document attention (model/documents.py): a packed sequence of documents computes, for each
document, what that document computes alone from position 0.

The oracle: [A eod B eod C] packed, with document ids as the mask and positions restarting
after each EOD, gives every document's logits of the document run alone (fp32, 1e-5), and the
parameter gradients of a summed loss equal the sum of the separate ones. Negative controls:
the same packed sequence without the mask, or without restarting positions, fails it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import documents
from model.builder import build_model
from model.config import ParallelConfig
from model.sdpa_attention import DocumentKernel, SDPAttention
from tests.helpers import VOCAB, tiny_model

EOD = VOCAB - 1
LENGTHS = (8, 6, 7)  # A and B end with their EOD; C runs to the end of the sequence
TOL = 1e-5
GRAD_TOL = 1e-4
"""Gradients sum every token's term in another order packed than alone, in fp32: a gradient
that cancels to a small value (hyper-connections' width weights: 2e-5 measured) is off by more
than the logits' 1e-5. The negative controls fail by more than ten times either bound."""


def packed_documents(seed: int = 0) -> list[torch.Tensor]:
    """The documents' tokens (no EOD inside one; A and B end with one) and each token's
    label, drawn on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for i, n in enumerate(LENGTHS):
        tokens = torch.randint(0, EOD, (n + 1,), generator=gen)
        if i < len(LENGTHS) - 1:
            tokens[n - 1] = EOD
        docs.append(tokens)  # n inputs and the label of the last one
    return docs


def restarted_positions() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in LENGTHS])


def run(model, tokens, labels, positions, mask, device):
    """Logits [s, V] and the summed cross entropy of one sequence."""
    logits = model(tokens[None].to(device), positions[None].to(device),
                   None if mask is None else mask.to(device))[0].float()
    loss = F.cross_entropy(logits, labels.to(device), reduction="sum")
    return logits, loss


def packed_and_alone(scheme: str, backend: str, device, mask_on=True, reset_positions=True,
                     positions="rope"):
    """(packed logits per document, packed gradients, alone logits, summed alone gradients)."""
    torch.manual_seed(0)
    [model] = build_model(tiny_model(scheme, attention_backend=backend, seq_length=32,
                                     position_embedding=positions),
                          ParallelConfig(), positions_per_token=reset_positions)
    docs = packed_documents()
    inputs = torch.cat([d[:-1] for d in docs])
    labels = torch.cat([d[1:] for d in docs])
    ids = documents.document_ids(inputs, EOD)
    positions = restarted_positions() if reset_positions else torch.arange(len(inputs))
    mask = documents.attention_mask(ids[None]) if mask_on else None
    model.zero_grad()
    logits, loss = run(model, inputs, labels, positions, mask, device)
    loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    packed = list(torch.split(logits.detach(), list(LENGTHS)))

    model.zero_grad()
    alone = []
    for doc in docs:
        logits, loss = run(model, doc[:-1], doc[1:], torch.arange(len(doc) - 1), None, device)
        loss.backward()  # gradients accumulate: the sum over documents
        alone.append(logits.detach())
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return packed, packed_grads, alone, alone_grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_document_ids_put_each_eod_in_the_document_it_ends():
    tokens = torch.tensor([[5, 1, EOD, 7, EOD, EOD, 3]])
    assert documents.document_ids(tokens, EOD).tolist() == [[0, 0, 0, 1, 1, 2, 3]]
    keep = documents.keep_mask(documents.attention_mask(
        documents.document_ids(tokens, EOD)), 7, 7)[0, 0]
    assert keep[3].tolist() == [False, False, False, True, False, False, False]
    assert keep[4].tolist() == [False, False, False, True, True, False, False]
    assert keep[6].tolist() == [False] * 6 + [True]


@pytest.mark.parametrize("backend", ["sdpa", "sdpa-mask", "local"])
@pytest.mark.parametrize("scheme", ["pre", "siamese", "siamese_hybrid", "hc", "mhc"])
def test_packed_documents_compute_what_each_computes_alone(single_rank, device, monkeypatch,
                                                           scheme, backend):
    """``sdpa``: one call per document (flex attention on CUDA); ``sdpa-mask``: SDPA with the
    exact mask (the CPU's path for short sequences); ``local``: megatron's attention."""
    if backend == "sdpa-mask" or not torch.cuda.is_available():
        monkeypatch.setattr(SDPAttention, "document_kernel",
                            DocumentKernel.MASK if backend == "sdpa-mask"
                            else DocumentKernel.SPLIT)
    packed, packed_grads, alone, alone_grads = packed_and_alone(
        scheme, backend.removesuffix("-mask"), device)
    assert_oracle(packed, packed_grads, alone, alone_grads)


def test_learned_positions_restart_too(single_rank, device):
    """With a learned position table the restarted ids reach the embedding."""
    assert_oracle(*packed_and_alone("siamese", "sdpa", device, positions="learned_absolute"))


def test_rotary_angles_follow_the_position_ids(single_rank, device):
    """Within a document RoPE sees only relative positions, so under the mask restarting
    them changes nothing (8e-8 measured). Without the mask a document also sees the earlier
    ones, at distances the position ids decide: restarting them changes its logits, so the
    ids do reach the rotary angles."""
    assert_oracle(*packed_and_alone("siamese", "sdpa", device, reset_positions=False))
    reset, _, alone, _ = packed_and_alone("siamese", "sdpa", device, mask_on=False)
    kept, _, _, _ = packed_and_alone("siamese", "sdpa", device, mask_on=False,
                                     reset_positions=False)
    assert rel(reset[2], kept[2]) > 10 * TOL  # the ids reach the rotary angles


def assert_oracle(packed, packed_grads, alone, alone_grads) -> None:
    for index, (got, want) in enumerate(zip(packed, alone, strict=True)):
        assert rel(got, want) <= TOL, f"document {index}: {rel(got, want):.2e}"
    for name, want in alone_grads.items():
        assert rel(packed_grads[name], want) <= GRAD_TOL, \
            f"{name}: {rel(packed_grads[name], want):.2e}"


@pytest.mark.parametrize("what", ["no mask", "learned positions not reset"])
def test_packing_without_the_mask_or_the_positions_fails_the_oracle(single_rank, device, what):
    """Negative controls: the first document is unaffected either way (it starts at 0 and
    nothing precedes it); every later one differs."""
    learned = what == "learned positions not reset"
    packed, packed_grads, alone, alone_grads = packed_and_alone(
        "siamese", "sdpa", device, mask_on=learned, reset_positions=not learned,
        positions="learned_absolute" if learned else "rope")
    assert rel(packed[0], alone[0]) <= TOL
    for index in (1, 2):
        assert rel(packed[index], alone[index]) > 10 * TOL, index
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert rel(packed_grads[name], alone_grads[name]) > 10 * GRAD_TOL


def test_every_document_kernel_gives_the_exact_masks_forward(single_rank, device, monkeypatch):
    """The CUDA path (flex attention from a block mask of the ids) and the CPU's (one call per
    document) against the exact mask, in the forward pass: on the CPU flex attention runs
    uncompiled and has no backward (forward and backward on the GPU: the test below)."""
    logits = {}
    for kernel in (DocumentKernel.MASK, DocumentKernel.FLEX, DocumentKernel.SPLIT):
        monkeypatch.setattr(SDPAttention, "document_kernel", kernel)
        torch.manual_seed(0)
        [model] = build_model(tiny_model("siamese", attention_backend="sdpa", seq_length=32),
                              ParallelConfig(), positions_per_token=True)
        model.eval()
        docs = packed_documents()
        inputs = torch.cat([d[:-1] for d in docs])
        mask = documents.attention_mask(documents.document_ids(inputs, EOD)[None])
        with torch.no_grad():
            logits[kernel], _ = run(model, inputs, torch.cat([d[1:] for d in docs]),
                                    restarted_positions(), mask, device)
        core = model.decoder.layers[0].self_attention.core_attention
        assert core._document_kernel(len(inputs)) == kernel
    assert rel(logits[DocumentKernel.FLEX], logits[DocumentKernel.MASK]) <= TOL
    assert rel(logits[DocumentKernel.SPLIT], logits[DocumentKernel.MASK]) <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_flex_attention_matches_the_exact_mask_forward_and_backward(single_rank, device,
                                                                        monkeypatch, dtype):
    """On CUDA, compiled flex attention from the ids' block mask against SDPA with the exact
    mask: logits and every parameter's gradient of a packed sequence at seq 512 (fp32: 1e-4 of
    each tensor's largest entry; bf16: 2e-2, a few roundings)."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, EOD, (2, 512), generator=gen)
    tokens[torch.rand(tokens.shape, generator=gen) < 0.02] = EOD
    mask = documents.attention_mask(documents.document_ids(tokens, EOD)).to(device)
    results = {}
    for kernel in (DocumentKernel.MASK, DocumentKernel.FLEX):
        monkeypatch.setattr(SDPAttention, "document_kernel", kernel)
        torch.manual_seed(0)
        [model] = build_model(tiny_model("siamese", attention_backend="sdpa", seq_length=512,
                                         hidden_size=128, num_attention_heads=4),
                              ParallelConfig(), dtype, positions_per_token=True)
        positions = torch.arange(512, device=device).expand(2, -1)
        logits = model(tokens.to(device), positions, mask).float()
        logits.square().mean().backward()
        results[kernel] = {"logits": logits.detach(),
                           **{n: p.grad.float() for n, p in model.named_parameters()}}
    bound = 1e-4 if dtype is torch.float32 else 2e-2
    for name, want in results[DocumentKernel.MASK].items():
        assert rel(results[DocumentKernel.FLEX][name], want) <= bound, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's choice")
def test_the_cpu_attends_one_document_at_a_time_from_split_from_tokens(single_rank):
    """Below SPLIT_FROM the exact mask (the calls' own cost dominates), from it on one call
    per document (bench.document_attention's measurements, model/sdpa_attention.py)."""
    from model import sdpa_attention

    [model] = build_model(tiny_model("pre", attention_backend="sdpa"), ParallelConfig())
    core = model.decoder.layers[0].self_attention.core_attention
    assert core._document_kernel(sdpa_attention.SPLIT_FROM - 1) == DocumentKernel.MASK
    assert core._document_kernel(sdpa_attention.SPLIT_FROM) == DocumentKernel.SPLIT
