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
                libopenmpi-dev openmpi-bin redis-server
PY_PACKAGES  := numpy pytest pyyaml nanobind scikit-build-core cmake ninja
TORCH        := torch==2.13.0

CMAKE_DEFINES := -Ccmake.define.CASCADE_BUILD_TESTS=ON
ifneq ($(CUDA),auto)
CMAKE_DEFINES += -Ccmake.define.CASCADE_WITH_CUDA=$(CUDA)
endif

.PHONY: all setup system-deps venv build test test-cpp test-py bench clean

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

setup: system-deps venv

build: setup
	$(PIP) install -q --no-build-isolation --no-deps $(CMAKE_DEFINES) .

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-py: build
	$(PY) -m pytest -q tests

test: test-cpp test-py

bench: build
	@mkdir -p $(BENCH_OUT)
	$(VENV)/bin/cascade info
	$(VENV)/bin/cascade bench --json $(BENCH_OUT)/bench.json

clean:
	rm -rf build $(VENV) $(BENCH_OUT)
