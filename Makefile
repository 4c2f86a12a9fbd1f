# The README's commands. Each sets up .venv if needed, so a fresh clone needs only python3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU build of torch by default (this is what a laptop or CI has); on a GPU
# machine pass e.g. TORCH_SPEC="torch==2.13.0" with the CUDA index you need.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo serve test test-multinode lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) jobs/demo.py

# `serve run` in a Ray of its own (or RAY_ADDRESS's), not the one the last `ray start` here recorded in /tmp/ray.
serve: $(STAMP)
	$(PY) jobs/serve.py deployments/gpt2.yaml

test: $(STAMP)
	$(PY) -m pytest -q tests -m "not multinode"

# Training and serving across nodes, a node lost or joining (issue 39): about three minutes on 2 cores,
# past make test's 15-minute budget. (The batch job's and monitoring's multi-node tests are in make test.)
test-multinode: $(STAMP)
	$(PY) -m pytest -q tests -m multinode

lint: $(STAMP)
	$(VENV)/bin/ruff check platform jobs tools tests
	$(VENV)/bin/ruff format --check platform jobs tools tests
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) jobs/bench_train.py

clean:
	rm -rf runs data/demo .pytest_cache
