# A/B of DSA attention read through the top-k (gathered keys) against the mask over every prompt key: the commit
# before (a worktree at /tmp/before) and after, interleaved, benchmarks/long_prompt_point.py (capture of a P-token
# prompt, scoring of G = 4 members of R = 64 tokens, one replay with its backward), one thread, fp32, detach mode.
# The model has GLM-5's ratio of MLA attention to indexer work per (query, key) pair (16 heads x (256 + 32 latent
# + 256 value) = 8.7K multiply-adds against 8 index heads x 64 = 512; GLM-5: 64 x 1,088 = 69.6K against 4,096) and
# top-256 (GLM-5: top-2,048, so P = 8,192 here has the P / k of 64K positions there).
cd /work/main
dir=benchmarks/results/cpu-2core-dsa-sparse-attention
: > $dir/results.txt
for repeat in 1 2; do for P in 4096 8192; do for tree in /tmp/before /work/main; do
  OMP_NUM_THREADS=1 PYTHONPATH=$tree .venv/bin/python benchmarks/long_prompt_point.py \
    --model-config $dir/dsa-glm5-proportions.json --prompt-lengths $P --completion-length 64 --group-size 4 \
    --prefill-chunk-size 1024 --attention-chunk-size 1024 --prompt-state-dtype auto --out /tmp/dsa.json > /dev/null 2>&1
  echo "$tree $(python3 -c 'import json; print(json.dumps(json.load(open("/tmp/dsa.json"))["points"][0]))')" >> $dir/results.txt
done; done; done
