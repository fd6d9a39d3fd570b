# Two commands: `make demo` and `make test`. Each sets up .venv from scratch on a fresh clone.
VENV := .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_CONFIG ?= configs/demo_embedded.yaml

.PHONY: install demo test clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	# torch first, pinned: on a CPU-only machine this is the local CPU build; `pip install -e .` then keeps it.
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	WANDB_MODE=offline OMP_NUM_THREADS=2 $(VENV)/bin/accelerate launch --num_processes 1 --num_machines 1 --cpu \
		--mixed_precision no --dynamo_backend no recipes/grpo_longstraw.py --config $(DEMO_CONFIG)

# The suite on TEST_WORKERS processes of one thread each (pytest-xdist), a test module per worker at a time, so that a
# module's fixtures run once; tests/conftest.py deals the longest modules first.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	WANDB_MODE=offline OMP_NUM_THREADS=1 $(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

clean:
	rm -rf $(VENV) outputs wandb .pytest_cache
