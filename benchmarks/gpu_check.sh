#!/usr/bin/env bash
# The GPU check, one command for a lent GPU machine (an H200 here), nothing installed, under 8 minutes:
#   OUT=/path/to/results bash benchmarks/gpu_check.sh
# 1. CUDA correctness: tests/test_gpu.py (capture + score vs a full forward, exact gradients vs a full backward, state
#    unmutated, pinned host state) for every family of the support table (trl_longstraw.embedded.FAMILIES).
# 2. The update sweep at GPU scale in bf16: the Qwen3.5/3.6-27B layer geometry at full width (preset
#    hybrid-qwen35-gpu), stock batched / stock serialized / LongStraw detach / exact, P up to 128K.
# Everything lands in $OUT (default benchmarks/results/gpu-h200): test log and JUnit XML, nvidia-smi, the sweep's
# results.json/csv, plots and summary.md. PYTHON selects the interpreter that has CUDA torch and this project's deps.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu-h200}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false

{ nvidia-smi; "$PYTHON" -c "import torch, transformers, trl; print(torch.__version__, torch.version.cuda, transformers.__version__, trl.__version__)"; "$PYTHON" -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)" || echo "no triton/fla: torch GatedDeltaNet fallback"; } > "$OUT/environment.txt" 2>&1
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1

timeout 180 "$PYTHON" -m pytest tests/test_gpu.py -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" \
    > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests exit status: $?" | tee -a "$OUT/gpu-tests.txt"

timeout 270 "$PYTHON" benchmarks/sweep.py --model-preset hybrid-qwen35-gpu --device cuda --dtype bfloat16 \
    --longstraw-ref worktree --modes stock-batched,stock-serialized,longstraw-detach,longstraw-exact \
    --prompt-lengths 8192,32768,131072 --group-sizes 8 --grid longstraw-detach:32768:2 --completion-length 512 \
    --prefill-chunk-size 16384 --attention-chunk-size 16384 --time-cap-s 60 --budget-gib 100 --threads 8 \
    --reference-p 32768 --out "$OUT" > "$OUT/sweep.log" 2>&1
echo "sweep exit status: $?" | tee -a "$OUT/sweep.log"
