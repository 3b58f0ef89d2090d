"""Max relative logit error of our models against the transcription of the official SiameseNorm
code, per scheme, switch and norm: the table in docs/schemes.md.

The numbers are computed by the function ``tests/model/test_official_code.py`` asserts on
(``max_rel_error``: every norm weight, gate and bias moved off its init, the fp32 model against
the float64 transcription over the same weights), for the same cases, so the table and the test
cannot drift apart. Run from the repository root (it imports the test module):

    python -m bench.official_code
"""

from __future__ import annotations

import argparse
import platform

import torch

from bench.common import versions_line
from model.config import ParallelConfig
from runtime import cpu_compat, parallel
from runtime.markdown import markdown_table


def _switches(fields: dict) -> str:
    if not fields:
        return "-"
    shown = {True: "true", False: "false"}
    return ", ".join(f"`{k} = {shown.get(v, repr(v).replace(chr(39), chr(34)))}`"
                     for k, v in fields.items())


def errors() -> tuple[list[list[str]], float]:
    """The table's rows (scheme, switches, one error per norm) and the error of the
    ``prenorm_literal`` reading against the official flag. Needs megatron's parallel state."""
    from tests.model import test_official_code as official

    rows = []
    for scheme, fields, flag in official.CASES:
        rows.append([scheme, _switches(fields),
                     *(f"{official.max_rel_error(scheme, fields, flag, norm):.1e}"
                       for norm in official.NORMS)])
    literal = official.max_rel_error(
        "siamese_hybrid", {"hybrid_first_block": "prenorm_literal"}, official.HYBRIDNORM_STAR,
        "rmsnorm", official_only=("blocks.0.ff_norm.weight",))
    return rows, literal


def report(rows: list[list[str]], literal: float) -> str:
    from tests.model.test_official_code import NORMS

    header = ["scheme", "switches", *(n.replace("+", " + ") for n in NORMS)]
    return (markdown_table(header, rows, right_from=len(header)) + "\n\n"
            f"prenorm_literal against the official flag (rmsnorm): {literal:.1e}")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    with cpu_compat.enabled():
        parallel.initialize(ParallelConfig(), seed=1234)
        try:
            rows, literal = errors()
        finally:
            parallel.destroy()
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    print(f"device: {device}; {versions_line()}")
    print("max relative logit error, fp32 model against the float64 transcription of the "
          "official code\n")
    print(report(rows, literal))


if __name__ == "__main__":
    main()
