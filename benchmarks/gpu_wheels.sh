#!/usr/bin/env bash
# The wheels benchmarks/gpu_check.sh installs on the lent H200 machine, whose image (Python 3.12, torch 2.11 with
# CUDA) lacks trl, datasets and fla and has an older transformers: downloaded here into .whl/ (ignored by git, about
# 17 MB), carried by the device call. The versions are this project's tested ones.
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    transformers==5.24.0 trl==1.16.0 peft==0.21.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    flash-linear-attention==0.6.0 fla-core==0.6.0
du -sh .whl
