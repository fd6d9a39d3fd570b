#!/usr/bin/env bash
# The GPU check, one command for a lent GPU machine (an H200 here), nothing installed, under 8 minutes in all:
#   OUT=/path/to/results bash benchmarks/gpu_check.sh
# 1. CUDA correctness (<= 40 s for the attention kernels' tests, then <= 120 s): tests/test_gpu.py (capture + score vs a full forward, exact gradients vs a full
#    backward, state unmutated, pinned host state, rollouts vs generate, the fused CUDA attention kernels against
#    plain torch, bf16 under autocast) for every family of the support table, and the MoE load-balancing loss's
#    exact gradients (qwen3_moe, qwen3_5_moe, gpt_oss); then (<= 50 s, its own step so that a
#    slow spawn cannot cost the rest) context parallelism with 2 ranks sharing the GPU over gloo (dense,
#    GatedDeltaNet, MLA + DSA; rollouts) against one process. (NCCL needs a GPU per rank: not on a one-GPU machine.)
# 2. The update sweep at GPU scale in bf16 (<= 130 s): the Qwen3.5/3.6-27B layer geometry at full width (preset
#    hybrid-qwen35-gpu: 3 GatedDeltaNet + 1 full-attention layer), LongStraw detach / exact, stock serialized /
#    batched, P up to 128K (the sweep writes each finished configuration, so a timeout keeps what ran).
# 3. Context parallelism's cp = 2 point at GPU scale (<= 40 s): benchmarks/context_parallel.py on the same preset,
#    bf16, exact mode, P = 16K, both ranks on the one GPU over gloo: the step attention, the split replays and the
#    recurrent hand-offs at full width, per-rank max_memory_allocated and the counted communication against its
#    formulas (the ranks share the device, so its times say nothing of scaling).
# 4. The long-prompt point in fp8 (<= 70 s): the same preset, prompt_state_dtype float8_e4m3fn, detach mode, P =
#    128K, 256K, 512K, 1M, 2M while its 55 s budget allows (benchmarks/long_prompt_point.py: capture, score of
#    G = 8 members, one replay of R = 512 with its backward; per-phase time and max_memory_allocated), TF32 on for
#    the fp32 attention tiles.
# 5. The simulation beside the measurements (<= 20 s; JSON only, no torch): benchmarks/gpu_predictions.py --compare
#    reads what steps 2-4 wrote and prints, per LongStraw point, the measured peak allocated GiB beside the simulator's
#    predicted GiB and the measured seconds beside its H200 roofline (benchmarks/results/gpu-predictions.json, computed
#    without a GPU by `PYTHONPATH=. .venv/bin/python benchmarks/gpu_predictions.py`), with what each benchmark
#    measures and where it differs from the simulated update; printed and saved as predictions.txt, so that one run
#    validates the simulator on real hardware.
# Everything lands in $OUT (default benchmarks/results/gpu-h200): environment, test log and JUnit XML, the sweep's
# results.json/csv, plots and summary.md, long_prompt.json, predictions.txt and each step's log; with ARCHIVE=path.tgz
# also as one archive (the device tool brings back only a few files). PYTHON selects the interpreter that has CUDA torch.
# The packages the lent machine's image lacks or has older (transformers, trl, peft, datasets, fla) travel as wheels:
# `bash benchmarks/gpu_wheels.sh` here fills .whl/, the device call carries it, and this script installs them into
# /tmp/site (beside the image's packages, nothing fetched). On the device tool:
#   run(command="ARCHIVE=$OUT/gpu-h200.tgz OUT=/tmp/gpu bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=560)
# (ARCHIVE first: there $OUT is still the device tool's folder). The archive is rewritten after every step and on
# exit, so a run cut short still brings back what finished.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu-h200}
mkdir -p "$OUT"
archive() { [ -z "${ARCHIVE:-}" ] || tar czf "$ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
trap archive EXIT
[ -d .whl ] || { echo "no .whl/: run 'bash benchmarks/gpu_wheels.sh' here first and carry .whl" | tee "$OUT/environment.txt"; exit 1; }
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# TRITON_F32_DEFAULT=ieee: fla's and TRL's Triton kernels would take TF32 for fp32 inputs (torch's TF32 flags do not
# reach them), and the correctness tests hold fp32 to 1e-4 and tighter
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false TRITON_F32_DEFAULT=ieee
START=$SECONDS
# SIGINT first: pytest still writes its summary and JUnit XML, a sweep its finished configurations
run_for() { timeout -s INT -k 15 "$@"; }

{ nvidia-smi; "$PYTHON" -c "import torch, transformers, trl; print(torch.__version__, torch.version.cuda, transformers.__version__, trl.__version__)"; "$PYTHON" -m pip list 2>/dev/null | grep -i -E "^(accelerate|peft|datasets|pyarrow|huggingface.hub|tokenizers|triton) "; "$PYTHON" -c "import triton, fla; print('triton', triton.__version__, 'fla', fla.__version__)" || echo "no triton/fla: torch GatedDeltaNet fallback"; } > "$OUT/environment.txt" 2>&1
"$PYTHON" -c "import torch, transformers, trl, datasets; assert torch.cuda.is_available(), 'no CUDA device'" \
    >> "$OUT/environment.txt" 2>&1 || exit 1

# The attention kernels' tests first (seconds): fla's first GatedDeltaNet forward autotunes its kernels for a minute
KERNELS="fused or sync or glm5 or autocast"
run_for 40 "$PYTHON" -m pytest tests/test_gpu.py -q -p no:cacheprovider -k "$KERNELS" \
    --junitxml="$OUT/gpu-kernel-tests.xml" > "$OUT/gpu-kernel-tests.txt" 2>&1
echo "gpu kernel tests exit status: $? after $((SECONDS - START)) s" | tee -a "$OUT/gpu-kernel-tests.txt"; archive
run_for 120 "$PYTHON" -m pytest tests/test_gpu.py -q -p no:cacheprovider --durations=25 \
    -k "not context_parallel and not ($KERNELS)" --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.txt" 2>&1
echo "gpu tests exit status: $? after $((SECONDS - START)) s" | tee -a "$OUT/gpu-tests.txt"; archive
run_for 50 "$PYTHON" -m pytest tests/test_gpu.py -q -p no:cacheprovider -k context_parallel \
    --junitxml="$OUT/gpu-cp-tests.xml" > "$OUT/gpu-cp-tests.txt" 2>&1
echo "gpu context-parallel tests exit status: $? after $((SECONDS - START)) s" | tee -a "$OUT/gpu-cp-tests.txt"; archive

# LongStraw's modes first: each configuration is a fresh process (imports and a full-width model, ~20 s)
run_for 130 "$PYTHON" benchmarks/sweep.py --model-preset hybrid-qwen35-gpu --device cuda --dtype bfloat16 \
    --longstraw-ref worktree --modes longstraw-detach,longstraw-exact,stock-serialized,stock-batched \
    --prompt-lengths 8192,32768,131072 --group-sizes 8 --grid longstraw-detach:32768:2 --completion-length 512 \
    --prefill-chunk-size 16384 --attention-chunk-size 16384 --time-cap-s 45 --budget-gib 100 --threads 8 \
    --reference-p 32768 --out "$OUT" > "$OUT/sweep.log" 2>&1
echo "sweep exit status: $? after $((SECONDS - START)) s" | tee -a "$OUT/sweep.log"; archive

run_for 40 "$PYTHON" benchmarks/context_parallel.py --model-preset hybrid-qwen35-gpu --device cuda --dtype bfloat16 \
    --prompt-length 16384 --members 4 --completion-length 256 --prefill-chunk-size 4096 --attention-chunk-size 4096 \
    --mode exact --cps 1,2 --out "$OUT/context_parallel" > "$OUT/context_parallel.log" 2>&1
echo "context-parallel point exit status: $? after $((SECONDS - START)) s" | tee -a "$OUT/context_parallel.log"; archive

run_for 70 "$PYTHON" benchmarks/long_prompt_point.py --preset hybrid-qwen35-gpu --device cuda --dtype bfloat16 \
    --prompt-state-dtype float8_e4m3fn --prompt-lengths 131072,262144,524288,1048576,2097152 --group-size 8 \
    --completion-length 512 --prefill-chunk-size 8192 --attention-chunk-size 8192 --allow-tf32 --budget-s 55 \
    --out "$OUT/long_prompt.json" > "$OUT/long_prompt.log" 2>&1
echo "long-prompt point exit status: $? after $((SECONDS - START)) s" | tee -a "$OUT/long_prompt.log"; archive

run_for 20 "$PYTHON" benchmarks/gpu_predictions.py --compare "$OUT" > "$OUT/predictions.txt" 2>&1
echo "predictions comparison exit status: $? after $((SECONDS - START)) s" >> "$OUT/predictions.txt"
cat "$OUT/predictions.txt"
exit 0  # the EXIT trap writes the archive
