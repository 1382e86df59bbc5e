# autopar — `make run` and `make test` work on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# CPU build of torch for profiler/executor tests; GPU users install their own CUDA build first.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install run test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	@# torch only where none is installed, so a GPU user's own CUDA build is kept
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	@echo "== autopar predict: Llama 3.1 70B on 8 x DGX H100 (TP8 x PP2 x DP4, interleaved 1F1B) =="
	$(VENV)/bin/autopar predict --model llama3.1-70b --cluster dgx-h100 --nodes 8 \
		--global-batch 256 --seq 8192 --tp 8 --pp 2 --dp 4 --sp --zero 1 \
		--schedule interleaved_1f1b --vp 5 --micro-batch 1 --recompute selective
	@echo "== autopar plan: the fastest layout of Llama 3.1 70B on the same 64 GPUs (search) =="
	$(VENV)/bin/autopar plan --model llama3.1-70b --cluster dgx-h100 --nodes 8 --global-batch 256 --seq 8192 --top 3

test: install
	$(PY) -m pytest -q -n 2 tests

bench: install
	$(PY) benchmarks/validate_published.py
	$(PY) benchmarks/search.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
