# autopar — `make run` and `make test` work on a fresh machine with Python 3.11+.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# CPU build of torch for profiler/executor tests; GPU users install their own CUDA build first.
TORCH_SPEC ?= torch==2.13.0
PORT ?= 8000
STAMP  := $(VENV)/.installed

.PHONY: install run lint test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q --upgrade pip
	@# torch only where none is installed, so a GPU user's own CUDA build is kept
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e '.[dev,frameworks]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	@# migrate the SQLite file autopar.db, load the reference profiles, serve on 127.0.0.1:$(PORT),
	@# post one example plan and print the URLs (Ctrl-C stops; DATABASE_URL=postgresql://... for PostgreSQL;
	@# PORT=8001 where 8000 is taken)
	$(VENV)/bin/autopar serve --host 127.0.0.1 --port $(PORT) --example

lint: install
	$(VENV)/bin/ruff check .

test: install
	$(PY) -m pytest -q -n 2 -p no:cacheprovider tests

bench: install
	$(PY) benchmarks/validate_published.py
	$(PY) benchmarks/memory_check.py
	$(PY) benchmarks/memory_published.py
	$(PY) benchmarks/targets_matrix.py
	$(PY) benchmarks/fallbacks.py
	$(PY) benchmarks/checkpoint_blocking.py
	$(PY) benchmarks/bad_input.py
	$(PY) benchmarks/search.py
	$(PY) benchmarks/api_load.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
