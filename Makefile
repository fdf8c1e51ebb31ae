# Quick start: `make demo` and `make test` do all the set-up on a fresh machine.
#
# Two lanes, each in its own virtualenv made from what the machine has (PATH, pyenv):
#   .venv         the newest supported stack: Python 3.12 (Google's Pathways images), else
#                 3.13, with the newest jax; the demo, the benchmarks and the whole suite.
#   .venv-oldest  the oldest supported pair (Python 3.11, tests/oldest-constraints.txt):
#                 the fast lane (`make test-oldest`, part of `make test`).
PYTHON ?= $(or $(shell scripts/find_python.sh 3.12 3.13),python3)
PYTHON_OLDEST ?= $(shell scripts/find_python.sh 3.11)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OLD := .venv-oldest
OLD_STAMP := $(OLD)/.installed
# Tests that start processes carry this marker (tests/conftest.py); the fast lane skips them.
FAST := -m "not process"

.PHONY: all venv venv-oldest demo demo-crash cluster-up cluster-down test test-fast test-oldest lint \
	typecheck test-process test-process-1 test-process-2 test-durations proto bench bench-goodput \
	bench-device \
	fuzz chaos clean

all: test

# scripts/venv_install.sh installs the packages (uv, else pip), byte-compiling
# none: a module is compiled the first time it is imported, so only what runs is
# compiled, once. That needs Python to write its byte code: with
# PYTHONDONTWRITEBYTECODE set every process would compile jax again.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: no Python 3.12 or 3.13 found (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	scripts/venv_install.sh $(VENV) -e '.[dev]'
	touch $(STAMP)

$(OLD_STAMP): pyproject.toml tests/oldest-constraints.txt
	$(PYTHON_OLDEST) -m venv $(OLD)
	scripts/venv_install.sh $(OLD) -e '.[dev]' -c tests/oldest-constraints.txt
	touch $(OLD_STAMP)

venv: $(STAMP)

# The oldest lane's virtualenv, where this machine has Python 3.11 (test-oldest says
# so where it has not).
venv-oldest:
	@if [ -n "$(PYTHON_OLDEST)" ]; then $(MAKE) --no-print-directory $(OLD_STAMP); fi

demo: $(STAMP)
	$(PY) -m mtc.trainer.elastic_demo --out out/demo $(ARGS)

demo-crash: $(STAMP)
	$(PY) -m mtc.trainer.demo --out out/demo-crash

cluster-up: $(STAMP)
	$(PY) -m mtc.trainer.cluster up

cluster-down: $(STAMP)
	$(PY) -m mtc.trainer.cluster down

# The whole suite on the newest stack and the fast lane on the oldest pair. Both
# virtualenvs are made side by side first (a minute, not two, on a fresh machine);
# then every lane, two at a time, with no barrier between them: both fast lanes, the
# checks, and the two parts of the tests that start processes (test-process), each
# part starting as soon as a slot is free. The parts take files as they go (the
# longest first), so a part that starts late takes fewer and both end within a file
# of each other: no core waits for the slower fast lane before the process lane starts.
test:
	$(MAKE) --no-print-directory -j2 venv venv-oldest
	claims=$$(mktemp -d -t mtc-claims.XXXXXX) && trap 'rm -rf "$$claims"' EXIT && \
	$(MAKE) --no-print-directory -j2 --output-sync=target LANE_CLAIMS="$$claims" \
	  test-fast test-oldest lint typecheck test-process-1 test-process-2

# The tests that start processes, in two parts at once: most of such a test's time is
# waiting on its processes, so two parts take about two thirds of the time of one
# lane. The parts take whole files as they go, the longest first (by
# tests/process_durations.json), each claiming the next file no part has claimed in a
# folder made for this run (--claims: see tests/lane_parts.py), so a file that ran
# long leaves the other part the rest. `make test-process-1` alone (no LANE_CLAIMS) runs
# part 1 of the fixed deal instead (--shard 1/2). `make test-durations` runs them one
# after the other and records what each file took.
test-process: $(STAMP)
	claims=$$(mktemp -d -t mtc-claims.XXXXXX) && trap 'rm -rf "$$claims"' EXIT && \
	$(MAKE) --no-print-directory -j2 --output-sync=target LANE_CLAIMS="$$claims" \
	  test-process-1 test-process-2

test-process-1 test-process-2: test-process-%: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m process \
	  $(if $(LANE_CLAIMS),--claims=$(LANE_CLAIMS),--shard $*/2) --durations=10

test-durations: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m process --durations-out tests/process_durations.json

# Pure and in-process tests only: about a minute.
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider $(FAST)

# Without Python 3.11 here the lane is reported as not run (CI sets MTC_REQUIRE_OLDEST=1).
test-oldest:
	@if [ -z "$(PYTHON_OLDEST)" ]; then \
	  echo "make: the oldest lane did NOT run: no Python 3.11 on this machine"; \
	  test -z "$$MTC_REQUIRE_OLDEST"; \
	else $(MAKE) --no-print-directory $(OLD_STAMP) \
	  && $(OLD)/bin/python -m pytest -q -p no:cacheprovider $(FAST); fi

lint: $(STAMP)
	$(VENV)/bin/ruff check mtc sidecar trainer bench tests scripts deploy

typecheck: $(STAMP)
	$(PY) scripts/typecheck.py

# The only way generated protobuf code is made; tests/test_proto_current.py checks it.
proto: $(STAMP)
	PYTHON=$(PY) scripts/gen_proto.sh

# Each benchmark prints one JSON object; out/bench/ keeps the last run's figures.
bench: $(STAMP)
	mkdir -p out/bench
	$(PY) bench/save_restore.py | tee out/bench/save_restore.json
	$(PY) bench/save_stall.py | tee out/bench/save_stall.json
	$(PY) bench/restore_hosts.py | tee out/bench/restore_hosts.json
	$(PY) bench/replicator.py | tee out/bench/replicator.json
	$(PY) bench/dedup.py | tee out/bench/dedup.json
	$(PY) bench/backup.py | tee out/bench/backup.json
	$(PY) bench/recovery.py | tee out/bench/recovery.json
	$(PY) bench/control_plane.py | tee out/bench/control_plane.json
	$(PY) bench/snapshot.py | tee out/bench/snapshot.json

# The accelerator's figures come from the accelerator (bench/accelerator.py, one
# process on JAX's default backend; docs/hosts.md keeps the latest run's table).
# This prints how to run it on a host with one (it runs nothing here: `--smoke`
# is what CI runs on CPU).
bench-device:
	@echo "On this machine (a wheelhouse for the accelerator host's Python, 3.11 on TPU VMs):"
	@echo "  make venv-oldest && .venv-oldest/bin/python scripts/device_wheels.py .tpu-wheels"
	@echo "On the accelerator host, from a copy of this checkout with .tpu-wheels in it:"
	@echo "  python3 -m pip install --isolated --no-index --no-deps --target /tmp/site .tpu-wheels/*.whl"
	@echo "  PYTHONPATH=\$$PYTHONPATH:/tmp/site python3 bench/accelerator.py > accelerator.json"
	@echo "(on CPU, as CI does: $(PY) bench/accelerator.py --smoke)"

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
	$(PY) -m mtc.trainer.chaos --cycles 200 --seconds 600 | tee out/chaos.json

clean:
	rm -rf $(VENV) $(OLD) out .pytest_cache .mypy_cache .ruff_cache
