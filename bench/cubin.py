"""Registers and local memory of a kernel, read from the cubin that Triton built for it.

Triton builds a kernel's cubin with ptxas and its own flags (3.9:
``-lineinfo -v --regAllocOptLevel=2 --gpu-name=sm_90a``, ``--fmad=false`` where FP fusion is
off), and the flags change the answer: the same PTX assembled with ptxas' defaults takes other
registers and spills. So what a kernel uses is read from the binary Triton made, the way the
driver reads it when it loads the module: the ELF's ``.nv.info`` section holds, per kernel,
its register count (``EIATTR_REGCOUNT``) and its stack frame (``EIATTR_FRAME_SIZE``: the
local memory a thread uses, where spilled registers go: the driver's
``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES``, which Triton divides by 4 into ``n_spills``).

Each ``.nv.info`` entry is one byte of format, one of attribute, then a value: 2 bytes
inline for formats 1-3, or (format 4) a 2-byte size and that many bytes; a kernel's
register count and frame are format 4, 8 bytes: the kernel's symbol index and the value,
little-endian 32-bit each. :func:`cuobjdump_resources` reads the same numbers with NVIDIA's
``cuobjdump``, and :func:`local_accesses` counts the spill instructions ``nvdisasm`` finds
(Triton ships both), as checks on this parse where the tools exist.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile
from typing import NamedTuple

REGCOUNT, FRAME_SIZE = 0x2F, 0x11  # EIATTR_ codes of .nv.info entries
SIZED = 0x04  # EIFMT_SVAL: a 2-byte size and that many bytes follow


class CubinResources(NamedTuple):
    """What one thread of a kernel takes, as its cubin records it."""

    registers: int
    local: int  # bytes of local memory (the stack frame spilled registers live in)


def _sections(cubin: bytes) -> dict[str, bytes]:
    """The named sections of a 64-bit little-endian ELF file."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("cubin: not a 64-bit little-endian ELF file")
    offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, offset + i * entry_size)
               for i in range(count)]
    names = headers[names_index]
    strings = cubin[names[4]:names[4] + names[5]]
    return {strings[h[0]:strings.index(b"\0", h[0])].decode(): cubin[h[4]:h[4] + h[5]]
            for h in headers}


def _symbol_index(sections: dict[str, bytes], name: str) -> int:
    """Index of symbol ``name`` in the ELF's symbol table."""
    table, strings = sections[".symtab"], sections[".strtab"]
    for index in range(len(table) // 24):
        start, = struct.unpack_from("<I", table, index * 24)
        if strings[start:strings.index(b"\0", start)].decode() == name:
            return index
    raise ValueError(f"cubin: no symbol {name!r}")


def _kernel_attributes(info: bytes, symbol: int) -> dict[int, int]:
    """The per-kernel values of ``.nv.info`` entries (format 4, 8 bytes: symbol, value) that
    name ``symbol``, by attribute code."""
    found, at = {}, 0
    while at + 4 <= len(info):
        kind, attribute, size = struct.unpack_from("<BBH", info, at)
        at += 4
        if kind != SIZED:
            continue  # the 2 bytes read as a size were the inline value
        if size == 8:
            owner, value = struct.unpack_from("<II", info, at)
            if owner == symbol:
                found[attribute] = value
        at += size
    return found


def cubin_resources(cubin: bytes, kernel: str) -> CubinResources:
    """Registers per thread and local memory bytes per thread of ``kernel`` in ``cubin``."""
    sections = _sections(cubin)
    values = _kernel_attributes(sections.get(".nv.info", b""), _symbol_index(sections, kernel))
    if REGCOUNT not in values:
        raise ValueError(f"cubin: no register count for {kernel!r} in .nv.info")
    return CubinResources(values[REGCOUNT], values.get(FRAME_SIZE, 0))


def nvidia_tool(name: str) -> str | None:
    """Path of NVIDIA's ``name`` (``cuobjdump``, ``nvdisasm``): the one Triton ships (or its
    ``TRITON_<NAME>_PATH``), else one on PATH; None where there is none."""
    try:
        from triton import knobs
        return getattr(knobs.nvidia, name).path
    except Exception:  # a Triton without NVIDIA tools (its lookup raises when none runs)
        return shutil.which(name)


def _dump(tool: str, options: list[str], cubin: bytes) -> str:
    """What ``tool options... cubin`` prints about ``cubin`` (written to a scratch file)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, *options, path], capture_output=True, text=True,
                              check=True).stdout


def cuobjdump_resources(cubin: bytes, kernel: str, tool: str) -> CubinResources:
    """:class:`CubinResources` of ``kernel`` as ``cuobjdump --dump-resource-usage`` (``tool``)
    reports them: its ``REG`` and ``STACK`` figures (its ``LOCAL`` figure stays 0 for a
    kernel whose frame holds only spills)."""
    report = _dump(tool, ["--dump-resource-usage"], cubin)
    line = re.search(rf"Function {re.escape(kernel)}:\s*\n\s*(.*)", report)
    if line is None:
        raise ValueError(f"cuobjdump: no function {kernel!r} in: {report[-300:]}")
    fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line.group(1)))
    return CubinResources(int(fields["REG"]), int(fields["STACK"]))


def local_accesses(cubin: bytes, tool: str) -> tuple[int, int]:
    """Local-memory stores and loads (``STL``, ``LDL`` instructions) in the SASS that
    ``nvdisasm`` (``tool``) reads from ``cubin``: in a Triton kernel, which declares no local
    arrays, they are its spills and their reloads."""
    sass = _dump(tool, [], cubin)
    return (len(re.findall(r"\bSTL(?:\.[A-Z0-9]+)*\s", sass)),
            len(re.findall(r"\bLDL(?:\.[A-Z0-9]+)*\s", sass)))
