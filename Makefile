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
	$(PY) -m decode --config transformer-tiny --max-new-tokens 12 "5 6 7 8" "9 10 11"
	$(PY) -m decode --config gpt-tiny --strategy beam --beam-size 4 --max-new-tokens 12 "5 6 7 8"
	$(PY) -m decode --config llama-tiny --strategy sample --temperature 0.8 --top-p 0.9 --max-new-tokens 12 "5 6 7 8"

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
