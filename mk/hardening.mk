# Hardening: fuzzing and sanitizers (included from the Makefile).
#
#   make fuzz-smoke      builds the libFuzzer targets (clang, ASan + UBSan) into build-fuzz/, replays
#                        tests/fuzz/regressions/, fuzzes each target ~20 s from the seeds (4 targets: ~1.5 minutes)
#   make fuzz-long       the same for FUZZ_SECONDS (default 600) per target: tests/fuzz/run_long.sh
#   make test-sanitize   the C++ tests built with -DTRAINMEM_SANITIZE=ON (ASan + UBSan) under ctest,
#                        then the CLI under the sanitizers over a spread of catalog models and
#                        recipes, and the CLI's bad-input tests against that binary
#
# Both use one build, build-fuzz/ (clang-14, RelWithDebInfo, ASan + UBSan everywhere, the engine
# and the CLI also instrumented for libFuzzer's coverage): the tests, the CLI and the fuzz targets
# link the same sanitized engine objects, so the engine is compiled once for both instead of
# once with g++ -O0 for the tests and once with clang for the fuzzers.
#
# tests/fuzz/README.md says what each target covers and what counts as a finding.

FUZZ_BUILD      ?= build-fuzz
FUZZ_CXX        ?= clang++-14
FUZZ_SECONDS    ?= 600
FUZZ_SMOKE_SECONDS ?= 20
ASAN_BUILD      ?= $(FUZZ_BUILD)
ASAN_BUILD_TYPE ?= RelWithDebInfo
# Left out under the sanitizers (they run in the plain build of `make test-cpp`): two planner
# tests that replay hundreds of whole searches, 4-6 minutes of the former Debug + ASan build,
# through the same code the other Fit tests run there.
SANITIZE_SKIP   ?= ^(Fit.FewerReplaysGiveTheSameAnswers|Fit.SeveralGpusSearchTensorParallelism)$$
HARDENING_APT   := clang-14 libclang-rt-14-dev

SANITIZER_ENV := ASAN_OPTIONS=abort_on_error=1:detect_leaks=1:strict_string_checks=1 \
                 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

.PHONY: hardening-deps sanitize-configure fuzz-build sanitize-build fuzz-smoke fuzz-long test-sanitize

# clang and its libFuzzer/sanitizer runtimes, only for the fuzz build.
hardening-deps: deps
	@missing=$$(for p in $(HARDENING_APT); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# One configuration for both (see the top): the tests are configured in but only built by
# sanitize-build, so `make fuzz-build` alone compiles what the fuzzers need.
sanitize-configure: hardening-deps
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_CXX_COMPILER=$(FUZZ_CXX) -DCMAKE_BUILD_TYPE=$(ASAN_BUILD_TYPE) \
	  -DTRAINMEM_SANITIZE=ON -DTRAINMEM_BUILD_FUZZ=ON -DTRAINMEM_BUILD_TESTS=ON >/dev/null

fuzz-build: sanitize-configure
	cmake --build $(FUZZ_BUILD) -j $(JOBS) --target fuzz_config fuzz_safetensors fuzz_recipe fuzz_cli

sanitize-build: sanitize-configure
	cmake --build $(ASAN_BUILD) -j $(JOBS)

# Under `make test` (two make jobs) the fuzzers wait for the whole sanitized build, which
# includes their targets, so two ninja runs never share build-fuzz/.
fuzz-smoke: $(if $(filter test test-all,$(MAKECMDGOALS)),sanitize-build,fuzz-build)
	tests/fuzz/run_long.sh -B -S -t $(FUZZ_SMOKE_SECONDS)

fuzz-long: fuzz-build
	tests/fuzz/run_long.sh -B -t $(FUZZ_SECONDS)

test-sanitize: sanitize-build $(VENV)/.ready
	cd $(ASAN_BUILD) && $(SANITIZER_ENV) ctest --output-on-failure -j $(JOBS) -E '$(SANITIZE_SKIP)'
	$(SANITIZER_ENV) tests/fuzz/sanitize_cli.sh $(ASAN_BUILD)/trainmem
	$(SANITIZER_ENV) TRAINMEM_BIN=$(abspath $(ASAN_BUILD))/trainmem $(PY) -m pytest -q -p no:cacheprovider \
	  tests/python/test_cli.py tests/python/test_bad_input.py
