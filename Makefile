VENV := .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: venv test demo bench clean

venv: $(VENV)/.installed

# torch is pinned and installed first: this exact version resolves to the local
# CPU wheel, while an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test,demo,bench]'
	touch $@

# ruff lints but does not reformat: its formatter would turn the aligned continuation lines into
# one argument a line, a quarter more lines for the same code.
# mypy (a minute or more, most of it reading torch's types) runs beside the tests; either failing fails.
test: venv
	$(VENV)/bin/ruff check te_func
	$(VENV)/bin/mypy > .mypy.log 2>&1 & mypy=$$!; \
	$(PY) -m pytest -n 2 --dist worksteal -q --durations=15 tests $(PYTEST_ARGS); status=$$?; \
	wait $$mypy; typed=$$?; cat .mypy.log; [ $$typed -eq 0 ] && exit $$status || exit $$typed

demo: venv
	$(PY) examples/demo.py

# Runs on the GPU machine, whose system python already has a CUDA torch.
bench:
	$(PYTHON) benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
