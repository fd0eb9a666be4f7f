# Everything a fresh clone needs: `make demo` and `make test` create .venv and install first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch first and pinned: a bare `torch` would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,hf]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/attnzero demo

test: $(STAMP)
	# one pytest worker per core (pytest-xdist): the suite is mostly small single-threaded calls
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -n auto
	# the backend and fuzz tests again without the compiled CPU kernel: flash.py, as where it cannot be built
	ATTNZERO_NO_BUILD=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider \
		tests/test_backends.py tests/test_fuzz.py tests/test_flash.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy src

check: test lint

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
