# Two commands set everything up on a fresh Debian machine:
#   make demo   installs what is missing, builds, installs the package, runs an estimate
#   make test   the same set-up, then every test (C++, CLI, Python API, tracker, accuracy gate,
#               sanitizers, a short fuzz run)
# .ci/run calls `make test`.
#
# `make test` runs its stages as one dependency graph with two make jobs (TEST_JOBS), so a
# stage that keeps one core busy (pytest, the CLI runs, the fuzzers) or none (pip downloading)
# overlaps with a compile; -O prints each stage's output in one piece when it ends.
# docs/development.md has the timings.

VENV       ?= .venv
PY         := $(VENV)/bin/python
PIP        := $(VENV)/bin/pip
BUILD      ?= build
JOBS       ?= $(shell nproc)
TEST_JOBS  ?= 2
TORCH      ?= torch==2.13.0
APT_PACKAGES := g++ cmake ninja-build python3-venv python3-dev nlohmann-json3-dev libcli11-dev \
                libgtest-dev libgmock-dev libbenchmark-dev

.PHONY: deps venv build install demo test test-all test-cpp test-python bench clean

# Debian packages, installed only when one is missing (needs root, as on our machines).
deps:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# deps is order-only: the venv needs python3-venv, but a phony prerequisite would redo it each time.
$(VENV)/.ready: pyproject.toml | deps
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q scikit-build-core nanobind pytest hypothesis
	touch $@

venv: deps $(VENV)/.ready

# The measuring side needs torch; the CPU build is installed first so that nothing pulls a CUDA one
# (peft, for LoRA recipes, bitsandbytes, for 8-bit AdamW and 4-bit bases, and deepspeed, for ZeRO
# measurements, depend on torch, so they come after it).
$(VENV)/.measure: $(VENV)/.ready
	$(PIP) install -q $(TORCH)
	$(PIP) install -q "transformers>=4.46" safetensors numpy
	$(PIP) install -q "peft>=0.14"
	$(PIP) install -q "bitsandbytes>=0.45"
	$(PIP) install -q "deepspeed>=0.16"
	touch $@

build: deps
	cmake -S . -B $(BUILD) -G Ninja -DTRAINMEM_BUILD_TESTS=ON >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

# The wheel is built in $(BUILD) itself (scikit-build-core's build-dir, tests kept on so the
# configuration matches `make build`): only the binding is compiled, the engine objects are the
# ones `make build` made. --no-build-isolation uses the venv's scikit-build-core and nanobind
# (.ready) instead of downloading them into a fresh temporary environment, whose changing path
# would also make nanobind's own sources compile again each time.
install: venv build
	$(PY) -m pip install -q --no-build-isolation -C build-dir=$(BUILD) \
	  -C cmake.define.TRAINMEM_BUILD_TESTS=ON .

demo: build install
	$(VENV)/bin/trainmem models
	$(VENV)/bin/trainmem estimate qwen3-4b --batch 16 --seq 512 --precision bf16-master --optimizer adamw

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-python: install $(VENV)/.measure
	TRAINMEM_BIN=$(abspath $(BUILD))/trainmem $(PY) -m pytest -q --durations=15 tests/python

# Sanitizers and a short fuzz run are part of every test run (mk/hardening.mk).
test:
	$(MAKE) --no-print-directory -j $(TEST_JOBS) -O test-all

test-all: test-cpp test-python test-sanitize fuzz-smoke

# Under `make -j`, pip reconfigures $(BUILD) only once ctest is done with it.
install: | $(if $(filter test test-all,$(MAKECMDGOALS)),test-cpp)

bench: deps
	cmake -S . -B $(BUILD)-bench -G Ninja -DTRAINMEM_BUILD_BENCH=ON -DTRAINMEM_BUILD_TESTS=OFF >/dev/null
	cmake --build $(BUILD)-bench -j $(JOBS)
	$(BUILD)-bench/bench/trainmem_bench

clean:
	rm -rf $(BUILD) $(BUILD)-bench build/py-*

include mk/hardening.mk
