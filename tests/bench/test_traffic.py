"""``bench.traffic``: bytes moved outside the matmuls, counted op by op and launch by launch.

The counting rules are checked by hand on ops whose traffic is obvious (an add of two fp32
[n, h] tensors moves 3 n h 4 bytes, a view none, a matmul is not counted), the fused kernels'
read/write table against the kernels' signatures and one launch's arguments, and the per-layer
figures on a tiny model (fake tensors, so no kernel runs and nothing is computed)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from bench import traffic, traffic_count
from bench.triton_launches import KERNELS
from kernels import triton_kernels, triton_ops
from model.config import ModelConfig

N, H = 6, 16
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=128, vocab_size=128, seq_length=64, attention_backend="sdpa",
            transformer_impl="local", megatron_fusions="off")


def counted(fn) -> tuple[traffic_count.TrafficMode, object]:
    mode = traffic_count.TrafficMode()
    with mode:
        result = fn()
    return mode, result


def moved(mode: traffic_count.TrafficMode) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for (_, op, _, _), (read, written, _) in mode.counts.items():
        r, w = out.get(op, (0, 0))
        out[op] = (r + read, w + written)
    return out


def test_elementwise_add_reads_both_inputs_and_writes_its_output():
    a, b = torch.ones(N, H), torch.ones(N, H)
    mode, _ = counted(lambda: a + b)
    assert moved(mode) == {"aten.add.Tensor": (2 * N * H * 4, N * H * 4)}  # 3 n h 4 B


def test_views_and_allocations_move_nothing():
    a = torch.ones(N, H)
    mode, _ = counted(lambda: (a.view(H, N), a.t(), a[1:], a.unsqueeze(0).expand(3, N, H),
                               a.detach(), a.chunk(2, dim=-1), a.reshape(-1),
                               torch.empty(N, H), torch.empty_like(a)))
    assert moved(mode) == {}


def test_in_place_copy_and_broadcast():
    a, b = torch.ones(N, H), torch.ones(N, H)
    row = torch.ones(H)
    mode, _ = counted(lambda: a.add_(b))
    assert moved(mode) == {"aten.add_.Tensor": (2 * N * H * 4, N * H * 4)}
    mode, _ = counted(lambda: a.copy_(b))  # the destination is written, not read
    assert moved(mode) == {"aten.copy_.default": (N * H * 4, N * H * 4)}
    mode, _ = counted(lambda: a * row.expand(N, H))  # an expanded input spans its row once
    assert moved(mode) == {"aten.mul.Tensor": ((N * H + H) * 4, N * H * 4)}


def test_matmuls_are_not_counted():
    a, w = torch.ones(N, H), torch.ones(8, H)
    mode, _ = counted(lambda: (a @ w.t(), torch.nn.functional.linear(a, w)))
    assert moved(mode) == {}
    assert sum(mode.matmuls.values()) == 2


def test_source_line_is_the_callers():
    a = torch.ones(N, H)
    mode, _ = counted(lambda: triton_ops._rows(a.t()))  # kernels/: a copy of the transpose
    [(phase, op, line, _)] = mode.counts
    assert (phase, op) == ("forward", "aten.clone.default")
    assert re.fullmatch(r"kernels/triton_ops\.py:\d+ _rows", line), line


def test_kernel_roles_name_every_pointer_of_every_kernel():
    """A kernel that gains or renames a tensor argument must be described here too."""
    assert set(traffic_count.KERNEL_ROLES) == set(KERNELS)
    for name, roles in traffic_count.KERNEL_ROLES.items():
        args = getattr(triton_kernels, name).arg_names
        described = [role.split()[0] for role in roles]
        assert sorted(described) == sorted(a for a in args if a.endswith("_ptr")), name
        for role in roles:
            assert role.split()[1] in "rw"
            assert {flag.lstrip("!") for flag in role.split()[2:]} <= set(args), role


def test_fused_launch_counts_its_arguments_by_hand():
    """add_norm forward and backward (N(alpha x + r)): each launch reads and writes the
    tensors it is given, the placeholders for absent ones not at all; the weight-gradient
    partials count at the grid given (one program), in the launch and in the sum that reads
    them."""
    x, r, g = (torch.ones(N, H, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    w = torch.ones(H, dtype=torch.bfloat16, requires_grad=True)
    mode = traffic_count.TrafficMode(grid=lambda kernel, n_rows, constexprs: 1)
    with mode.counting_kernels(), mode:
        out = triton_ops.add_norm(x, r, 2.0, w, None, 1e-5, True)
        mode.phase = "backward"
        out.backward(g)
    rows, row, stats = N * H * 2, H * 2, N * 2 * 4
    # one program: one fp32 row of H (RMSNorm: no bias slot)
    partials = 1 * 1 * H * 4
    got = moved(mode)
    assert got["triton.norm_fwd"] == (2 * rows + row, rows + stats)  # x, r, w -> out, stats
    # x, r, w, stats, grad -> dx, dr, partials
    assert got["triton.norm_bwd"] == (3 * rows + row + stats, 2 * rows + partials)
    assert got["aten.sum.dim_IntList"] == (partials, H * 4)  # summed over programs
    # a plain norm passes x in r's place: not read
    mode = traffic_count.TrafficMode()
    with mode.counting_kernels():
        triton_ops.norm(x, w, None, 1e-5, True)
    assert moved(mode)["triton.norm_fwd"] == (rows + row, rows + stats)


def sixteen_rows_each(kernel: str, n_rows: int, constexprs: dict) -> int:
    """A backward grid of 16 rows a program (the floor of the ops' rule, as on a GPU with SMs
    to spare): partials in proportion to the rows."""
    return -(-n_rows // 16)


def layer(scheme: str, backend: str, seq: int = 64, batch: int = 1) -> tuple[int, int]:
    config = ModelConfig(residual_scheme=scheme, **TINY)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return traffic.phase_totals(traffic.layer_traffic(config, backend, batch, seq,
                                                          grid=sixteen_rows_each))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scheme_table_has_pre_at_zero_and_siamese_above(single_rank, backend):
    config = ModelConfig(residual_scheme="pre", **TINY)
    results = {s: traffic.layer_traffic(ModelConfig(**{**TINY, "residual_scheme": s}), backend,
                                        1, 64)
               for s in ("pre", "siamese")}
    assert all(traffic.phase_totals(r)[0] > 0 and traffic.phase_totals(r)[1] > 0
               for r in results.values())
    pass_bytes = 64 * config.hidden_size * 2
    table = traffic.scheme_table(results, pass_bytes).splitlines()
    pre, siamese = (line.split("|")[-2].strip() for line in table[2:])
    extra = sum(traffic.phase_totals(results["siamese"])) - sum(
        traffic.phase_totals(results["pre"]))
    assert pre == "+0.0"
    assert float(siamese) == round(extra / pass_bytes, 1) > 0


def test_layer_bytes_are_linear_in_tokens(single_rank):
    """Outside the matmuls and attention scores every op of a layer is per token (RoPE's
    tables per position, the same at batch 1) or per parameter (norm weights read, their
    gradients summed): each doubling of the sequence adds twice what the one before added."""
    b32, b64, b128 = (layer("siamese", "triton", seq=s) for s in (32, 64, 128))
    for phase in (0, 1):
        assert b128[phase] - b64[phase] == 2 * (b64[phase] - b32[phase]) > 0
        per_parameter = 2 * b32[phase] - b64[phase]
        assert 0 <= per_parameter < 0.01 * b64[phase]


def test_command_prints_the_tables(single_rank, tmp_path):
    preset = tmp_path / "tiny.toml"
    model = {k: v for k, v in TINY.items() if k not in ("num_layers",)}
    preset.write_text("[model]\n" + "".join(
        f"{k} = {v!r}\n".replace("'", '"') for k, v in model.items())
        + "num_layers = 2\n[data]\nmicro_batch_size = 2\n")
    printed: list[str] = []
    args = traffic.parse_args(["--preset", str(preset), "--schemes", "pre,siamese",
                               "--backend", "triton", "--top", "3", "--sms", "0"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = traffic.run(args, printed.append)
    text = "\n".join(printed)
    assert "2 x 64 tokens" in text and "| scheme | forward MiB |" in text
    assert "siamese, triton: by op" in text and "`kernels/triton_ops.py:" in text
    assert set(results["triton"]) == {"pre", "siamese"}
