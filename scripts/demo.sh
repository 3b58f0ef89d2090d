#!/usr/bin/env bash
# The CPU demo, end to end: corpus -> tokenizer -> Megatron dataset -> training -> evaluation.
# Steps whose outputs exist are skipped, so a second run resumes training where it stopped.
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
data=runs/demo-data
mkdir -p "$data"
[ -f "$data/kjv.jsonl" ] || "$py" scripts/demo_corpus.py "$data/kjv.jsonl"
[ -f "$data/kjv.model" ] || "$py" -m pretrain train-tokenizer "$data/kjv.jsonl" \
    --output "$data/kjv" --vocab-size 2048
[ -f "$data/kjv_text_document.idx" ] || "$py" -m pretrain prepare-data "$data/kjv.jsonl" \
    --tokenizer "$data/kjv.model" --output "$data/kjv_text_document" --workers 2
"$py" -m pretrain train --config configs/demo-cpu.toml "$@"
"$py" -m pretrain eval --config configs/demo-cpu.toml --checkpoint runs/demo/checkpoints "$@"
"$py" - <<'PY'
import json
rows = [json.loads(l) for l in open("runs/demo/metrics.jsonl")]
val = [r for r in rows if "val_loss" in r]
print(f"validation perplexity: step {val[0]['step']}: {val[0]['val_ppl']:.1f} -> "
      f"step {val[-1]['step']}: {val[-1]['val_ppl']:.1f}")
PY
