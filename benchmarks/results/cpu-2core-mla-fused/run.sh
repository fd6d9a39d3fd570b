# A/B of MLA's prompt chunks and own causal block through the fused kernels with the values (the latents) zero-padded
# to the keys' width (after) against plain-torch tiles (before: a worktree of the commit before at /tmp/before),
# interleaved, two repeats: benchmarks/long_prompt_point.py (capture of P, scoring of G members of R, one replay with
# its backward), one thread, fp32, detach mode, on two DeepSeek-V3 configs: the ladder's tiny MLA (hidden 64, latent
# 16 + rope 8) and a wide one (hidden 1024, 16 heads, latent 512 + rope 64 as GLM-5, 2 dense layers).
cd /work/main
dir=benchmarks/results/cpu-2core-mla-fused
: > $dir/results.txt
for repeat in 1 2; do for model in tiny wide; do for tree in /tmp/before /work/main; do
  if [ $model = tiny ]; then sizes="--prompt-lengths 8192 --completion-length 128 --group-size 8"
  else sizes="--prompt-lengths 4096 --completion-length 64 --group-size 4"; fi
  OMP_NUM_THREADS=1 PYTHONPATH=$tree .venv/bin/python benchmarks/long_prompt_point.py \
    --model-config $dir/deepseek-v3-$model.json $sizes \
    --prefill-chunk-size 1024 --attention-chunk-size 4096 --prompt-state-dtype auto --out /tmp/mla.json \
    > /dev/null 2>&1
  echo "$tree $model $(python3 -c 'import json; print(json.dumps(json.load(open("/tmp/mla.json"))["points"][0]))')" >> $dir/results.txt
done; done; done
for tree in /tmp/before /work/main; do
  echo "$tree mla_absorption.py" >> $dir/results.txt
  PYTHONPATH=$tree .venv/bin/python benchmarks/mla_absorption.py >> $dir/results.txt 2>/dev/null
done
