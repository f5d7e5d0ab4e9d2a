# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs the project into it when missing or out of date.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m models --config transformer-tiny
	$(PY) -m models --config gpt-tiny

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
