"""CPU training throughput (tokens/s) of the demo model for every residual scheme, as ratios
to ``pre``. Each scheme trains for a few steps through the real entry point; the schemes run
in alternation for several rounds and each reports its median step, so drift hits all alike.

    python -m bench.train_throughput [--steps 12 --rounds 2]   (needs `make demo` data)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from model.schemes import ResidualScheme

CONFIG = "configs/demo-cpu.toml"


def run_once(scheme: str, steps: int, folder: Path) -> list[float]:
    run_dir = folder / scheme
    subprocess.run(
        [sys.executable, "-m", "pretrain", "train", "--config", CONFIG,
         f"--model.residual_scheme={scheme}", f"--run.steps={steps}", "--data.valid_samples=0",
         "--optim.warmup_steps=1", "--run.save_interval=0", "--logging.wandb_mode=disabled",
         # eager, as every table of this benchmark was measured (the demo compiles its
         # blocks; bench.compiled_blocks times eager against compiled)
         "--kernels.compile=false",
         f"--run.dir={run_dir}", f"--data.cache_dir={folder / 'cache'}"],
        check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return rates[2:]  # the first steps include warm-up work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if not Path("runs/demo-data/kjv_text_document.idx").is_file():
        sys.exit("error: the demo dataset is missing; run `make demo` first")
    rates: dict[str, list[float]] = {s.value: [] for s in ResidualScheme}
    for _ in range(args.rounds):
        for scheme in rates:
            with tempfile.TemporaryDirectory() as tmp:
                rates[scheme] += run_once(scheme, args.steps, Path(tmp))
    base = statistics.median(rates["pre"])
    print(f"demo model ({CONFIG}), CPU, fp32; median tokens/s over {args.rounds} rounds of "
          f"{args.steps} steps (first 2 of each dropped)\n")
    print("| scheme | tokens/s | throughput / pre |")
    print("|---|---:|---:|")
    for scheme, values in rates.items():
        median = statistics.median(values)
        print(f"| {scheme} | {median:,.0f} | {median / base:.3f} |")


if __name__ == "__main__":
    main()
