# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
# Both create .venv when missing and install the exact development stack pinned in requirements-dev.lock: the
# runtime lock (requirements.lock, what a training image installs) plus the test, lint, docs and report tools.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# JOBS=N: test files spread over N pytest processes (pytest-xdist; tests/support/parallel_runs.py); JOBS= runs serially.
# 3 by default: the suite is CPU-bound on 2 cores; a third process fills the waits of one launch with another's work,
# a fourth only adds contention (docs/testing.md has the measurements).
JOBS ?= 3

.PHONY: install demo ops test test-fast lint format configs docs lock clean

install: $(STAMP)

# DS_BUILD_OPS=0: DeepSpeed installs as pure Python and JIT-builds the ops it needs on first use.
$(STAMP): requirements-dev.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install --quiet -r requirements-dev.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-dist-recipes demo

# The suite's processes find DeepSpeed's op builds in one folder of the checkout (CI sets its own); `make ops` builds
# them before the tests, so that no test waits on another's JIT build (tests/support/build_ops.py has the numbers).
# The stamp lives with the builds: a wiped folder builds again, and so does a reinstalled stack.
OPS_DIR := $(or $(TORCH_EXTENSIONS_DIR),$(CURDIR)/.cache/torch_extensions)
OPS_STAMP := $(OPS_DIR)/.hf-dist-recipes-ops-stamp

$(OPS_STAMP): $(STAMP)
	TORCH_EXTENSIONS_DIR=$(OPS_DIR) $(BIN)/python -m tests.support.build_ops
	touch $(OPS_STAMP)

ops: $(OPS_STAMP)

test: export TORCH_EXTENSIONS_DIR := $(OPS_DIR)
test: $(STAMP) $(OPS_STAMP)
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

# Re-pin after changing pyproject.toml's ranges: installs from the ranges into a scratch venv, freezes the runtime
# (the package's own requirements: requirements.lock), then adds the extras and freezes again (requirements-dev.lock).
# The runtime pins come first, so the development lock holds them unchanged (tests/unit/test_lock.py checks).
LOCK_NOTE = \# torch is pinned without a local tag: the CPU wheel on a CPU host, PyPI's CUDA 13.0 build (NCCL 2.29.7) on a GPU host.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	DS_BUILD_OPS=0 .venv-lock/bin/python -m pip install --quiet torch==2.13.0 -e .
	{ echo "# The runtime lock (generated: make lock): hf-dist-recipes' requirements and theirs, exactly; no test, lint"; \
	  echo "# or docs tool. A training image installs it: pip install -r requirements.lock hf-dist-recipes"; \
	  echo "$(LOCK_NOTE)"; \
	  .venv-lock/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > requirements.lock.new
	DS_BUILD_OPS=0 .venv-lock/bin/python -m pip install --quiet -e '.[dev,docs,report,trl]'
	{ echo "# The development lock (generated: make lock): requirements.lock plus the extras dev, docs, report and trl;"; \
	  echo "# what make installs into .venv. tests/unit/test_lock.py checks both locks against pyproject.toml."; \
	  echo "$(LOCK_NOTE)"; \
	  .venv-lock/bin/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > requirements-dev.lock.new
	mv requirements.lock.new requirements.lock && mv requirements-dev.lock.new requirements-dev.lock
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) runs .pytest_cache site
