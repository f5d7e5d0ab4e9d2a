# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs the project into it when missing or out of date.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The main job: train the default model (a tiny encoder-decoder on the built-in
# toy_translation data; 4 minutes on 2 CPU cores), exports it, then translates with it.
# Running it again resumes from runs/default's last checkpoint.
demo: $(STAMP)
	$(PY) -m train --workdir runs/default
	$(PY) -m decode --model runs/default/model "the door met a warm goat ." \
		"my cold farmer ran ." "this dog sells a door often ."
	$(PY) -m decode --model runs/default/model --strategy beam --beam-size 4 \
		"a fox did not push a cruel wet bird ."
	$(PY) -m decode --model runs/default/model --strategy sample --temperature 0.7 --top-p 0.9 \
		"my cakes jump suddenly ."

test: $(STAMP)
	$(PY) -m pytest

# ruff: lint and import order (configured in pyproject.toml); CI runs it before the tests.
lint: $(STAMP)
	$(PY) -m ruff check .

# The benchmarks behind the README's tables (about 80 minutes on 2 CPU cores);
# bench.speculative also needs the default run and its draft (see the README).
bench: $(STAMP)
	$(PY) -m bench.train
	$(PY) -m bench.data
	$(PY) -m bench.decode
	$(PY) -m bench.load
	$(PY) -m bench.memory --looped
	$(PY) -m bench.compile_cache
	$(PY) -m bench.lora
	$(PY) -m bench.moe
	$(PY) -m bench.whisper
	$(PY) -m bench.translate
	$(PY) -m bench.serve
	$(PY) -m bench.quantize

clean:
	rm -rf $(VENV) runs .pytest_cache
