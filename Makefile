# make run: generate 32 tokens with the tiny config. make test: the whole test suite.
# Both create .venv on first use (and again when pyproject.toml changes).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test

run: $(VENV)/.installed
	$(BIN)/dsv41c run --config configs/tiny.json --prompt "The quick brown fox" --max-new-tokens 32

# two worker processes (pytest-xdist), each test file on one of them (module fixtures built once);
# the 25 slowest tests listed at the end
test: $(VENV)/.installed
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m pytest -q -n $${PYTEST_WORKERS:-2} --dist loadfile --durations=25

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -e ".[test]"
	touch $@
