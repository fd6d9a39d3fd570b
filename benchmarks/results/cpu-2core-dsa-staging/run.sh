# Entries moved per DSA attention call from host-resident pages (counted on CPU with the staging forced; see
# benchmarks/dsa_staging.py): the DSA benchmark's model (GLM-5's attention-to-indexer ratio, top-256), G = 4, R = 64.
cd "$(dirname "$0")/../../.."
OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python benchmarks/dsa_staging.py --prompt-lengths 4096,8192 \
    > benchmarks/results/cpu-2core-dsa-staging/results.jsonl
