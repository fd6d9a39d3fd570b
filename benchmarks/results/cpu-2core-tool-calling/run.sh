#!/usr/bin/env bash
# Tool-calling GRPO steps (benchmarks/tool_calling.py): stock GRPOTrainer, LongStraw at this commit, and LongStraw
# before tool turns decoded from the prompt state (BEFORE: a checkout of 39f208c with this commit's
# trl_longstraw/embedded.py copied in, which the benchmark's tool-calling model comes from). Run from the repository.
set -euo pipefail
BEFORE=${BEFORE:-/tmp/before}
POINT=(--prompt-length 8192 --group-size 8 --completion-length 128 --steps 3 --call-logit 10)
OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/tool_calling.py --worker --mode stock "${POINT[@]}"
for repeat in 1 2; do
  OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/tool_calling.py --worker --mode longstraw "${POINT[@]}"
  OMP_NUM_THREADS=1 PYTHONPATH="$BEFORE" .venv/bin/python benchmarks/tool_calling.py --worker --mode longstraw "${POINT[@]}"
done
