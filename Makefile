# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv when missing and install the exact stack pinned in requirements.lock.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# JOBS=N: test files spread over N pytest processes (pytest-xdist; tests/support/parallel_runs.py); JOBS= runs serially.
# 4 by default: the suite is CPU-bound on 2 cores, and 4 processes fill the waits of one launch with another's work.
JOBS ?= 4

.PHONY: install demo test test-fast lint format configs docs lock clean

install: $(STAMP)

# DS_BUILD_OPS=0: DeepSpeed installs as pure Python and JIT-builds the ops it needs on first use.
$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-dist-recipes demo

test: $(STAMP)
	$(BIN)/python -m pytest $(if $(JOBS),-n $(JOBS)) $(PYTEST_ARGS)

# The unit tests only: seconds, no process launched.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not distributed and not notebook and not slow" $(PYTEST_ARGS)

# ruff (settings in pyproject.toml): lint and format check, as .ci/run does before the tests; `make format` fixes.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Regenerate accelerate_configs/ from its manifest (tests/unit/test_shipped_configs.py checks they match).
configs: $(STAMP)
	$(BIN)/python -m hf_dist_recipes.planning.shipped

# The documentation site (mkdocs.yml, docs/) into site/, every warning an error (a broken link or anchor, a missing
# page, an API name that moved). The CLI reference and the error index are generated during the build (docs/hooks/).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Re-pin after changing pyproject.toml's ranges: installs from the ranges, then freezes what was installed.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	DS_BUILD_OPS=0 .venv-lock/bin/python -m pip install --quiet torch==2.13.0 -e '.[dev,docs]'
	{ sed -n '1,3p' requirements.lock; .venv-lock/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > requirements.lock.new
	mv requirements.lock.new requirements.lock && rm -rf .venv-lock

clean:
	rm -rf $(VENV) runs .pytest_cache site
