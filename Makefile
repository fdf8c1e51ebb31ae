# Quick start: `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: all venv demo demo-crash cluster-up cluster-down test lint typecheck proto bench bench-goodput fuzz chaos clean

all: test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m mtc_trainer.elastic_demo --out out/demo $(ARGS)

demo-crash: $(STAMP)
	$(PY) -m mtc_trainer.demo --out out/demo-crash

cluster-up: $(STAMP)
	$(PY) -m mtc_trainer.cluster up

cluster-down: $(STAMP)
	$(PY) -m mtc_trainer.cluster down

test: $(STAMP) lint typecheck
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check mtc sidecar trainer bench tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The only way generated protobuf code is made; tests/test_proto_current.py checks it.
proto: $(STAMP)
	PYTHON=$(PY) scripts/gen_proto.sh

# Each benchmark prints one JSON object; out/bench/ keeps the last run's figures.
bench: $(STAMP)
	mkdir -p out/bench
	$(PY) bench/save_restore.py | tee out/bench/save_restore.json
	$(PY) bench/save_stall.py | tee out/bench/save_stall.json
	$(PY) bench/replicator.py | tee out/bench/replicator.json
	$(PY) bench/dedup.py | tee out/bench/dedup.json
	$(PY) bench/backup.py | tee out/bench/backup.json
	$(PY) bench/recovery.py | tee out/bench/recovery.json
	$(PY) bench/control_plane.py | tee out/bench/control_plane.json

# About twenty minutes: 1200 steps of elastic training losing a host every two minutes, then
# the uninterrupted reference run (`bench/goodput.py --quick`: about five minutes, no reference).
bench-goodput: $(STAMP)
	mkdir -p out/bench
	$(PY) bench/goodput.py | tee out/bench/goodput.json

# Long fuzz runs (thousands of examples per test); `make test` runs a short profile.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -q tests/test_fuzz_parsing.py tests/test_fuzz_plan.py tests/test_fuzz_grpc.py

# Random faults over the local cluster for up to 10 minutes or 200 cycles; one JSON line.
chaos: $(STAMP)
	mkdir -p out
	$(PY) -m mtc_trainer.chaos --cycles 200 --seconds 600 | tee out/chaos.json

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache
