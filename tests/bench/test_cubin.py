"""``bench.cubin``: a kernel's registers and local memory read from a cubin's ``.nv.info``, on
ELF files written here byte by byte (the layout cuobjdump -elf shows of a Triton cubin), so
the parse is tested on every machine, with or without NVIDIA's tools. Real cubins, against
cuobjdump and nvdisasm: tests/bench/test_kernel_resources.py."""

import struct

import pytest

from bench.cubin import cubin_resources


def _entry(attribute: int, symbol: int, value: int) -> bytes:
    """A sized (format 4) .nv.info entry of 8 bytes: symbol index and value."""
    return struct.pack("<BBHII", 4, attribute, 8, symbol, value)


def _inline(attribute: int, value: int) -> bytes:
    """A format 2 .nv.info entry: its value inline in the 2 bytes after the attribute."""
    return struct.pack("<BBH", 2, attribute, value)


def _elf(sections: dict[str, bytes]) -> bytes:
    """A 64-bit little-endian ELF holding ``sections`` (after the null section), its section
    names in ``.shstrtab``."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    bodies = [*sections.values(), names]
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    data, offsets = b"", []
    for body in bodies:
        offsets.append(64 + len(data))
        data += body
    table_at = 64 + len(data)
    struct.pack_into("<Q", header, 0x28, table_at)
    struct.pack_into("<HHH", header, 0x3A, 64, len(bodies) + 1, len(bodies))
    table = bytes(64)  # the null section
    name_at = 1
    for name, body, offset in zip([*sections, ".shstrtab"], bodies, offsets, strict=True):
        table += struct.pack("<IIQQQQ", name_at, 0, 0, 0, offset, len(body)) + bytes(24)
        name_at += len(name) + 1
    return bytes(header) + data + table


def _symbols(*names: str) -> tuple[bytes, bytes]:
    """.symtab (24-byte entries, the first null) and .strtab for ``names``, at indices 1..n."""
    strings, table = b"\0", bytes(24)
    for name in names:
        table += struct.pack("<IBBHQQ", len(strings), 0x12, 0, 0, 0, 0)
        strings += name.encode() + b"\0"
    return table, strings


def _cubin(info: bytes, *names: str) -> bytes:
    table, strings = _symbols(*names)
    return _elf({".strtab": strings, ".symtab": table, ".nv.info": info})


def test_registers_and_frame_of_the_named_kernel():
    """Two kernels' entries interleaved, an inline entry between them: each kernel gets its
    own register count (0x2f) and frame (0x11); the minimum stack size (0x12) is not read."""
    info = (_entry(0x2F, 1, 72) + _inline(0x09, 1) + _entry(0x2F, 2, 128)
            + _entry(0x11, 2, 392) + _entry(0x11, 1, 0) + _entry(0x12, 2, 999))
    cubin = _cubin(info, "norm_bwd", "entry_bwd")
    assert cubin_resources(cubin, "norm_bwd") == (72, 0)
    assert cubin_resources(cubin, "entry_bwd") == (128, 392)


def test_a_kernel_without_a_frame_entry_uses_no_local_memory():
    assert cubin_resources(_cubin(_entry(0x2F, 1, 40), "norm_fwd"), "norm_fwd") == (40, 0)


@pytest.mark.parametrize("cubin,kernel,message", [
    (b"\x7fELF\x01\x01" + bytes(58), "k", "not a 64-bit little-endian ELF file"),
    (_cubin(_entry(0x2F, 1, 40), "norm_fwd"), "norm_bwd", "no symbol 'norm_bwd'"),
    (_cubin(_entry(0x11, 1, 8), "norm_fwd"), "norm_fwd", "no register count for 'norm_fwd'"),
])
def test_what_is_not_a_kernel_in_a_cubin_is_one_line(cubin, kernel, message):
    with pytest.raises(ValueError, match=message):
        cubin_resources(cubin, kernel)
