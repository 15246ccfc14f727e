# ringwright developer entry points. Two matter for a newcomer:
#   make demo   local cluster + operator + an elastic training job that survives a failure
#   make test   lint, type-check and every test (unit, cluster, e2e)
#   (then make demo-real: the same demo on real kubelet nodes, the chart's operator, images)
# Expensive things are cached outside the checkout, keyed by version:
#   $(CACHE)/venv/<digest>   Python deps (torch, ...)   digest of pyproject.toml's dependencies + python version
#   $(CACHE)/bin/<name>-<version>-<digest>   control-plane binaries (and the kubelet) built from Go modules
#   $(CACHE)/wheels/         horovod built from source against our torch

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
CACHE ?= $(or $(RINGWRIGHT_CACHE),$(HOME)/.cache/ringwright)
export RINGWRIGHT_CACHE := $(CACHE)
DEPS_DIGEST := $(shell $(PYTHON) scripts/deps_digest.py)
VENV ?= $(CACHE)/venv/$(DEPS_DIGEST)
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
TEST_WORKERS ?= 5
MAKEFLAGS += --jobs=2

.PHONY: help env binaries lint test test-unit demo demo-real down bench crds images clean-cache

help:
	@grep -E '^#' Makefile | head -8

# The venv lives in the cache so a fresh clone reuses it; the editable install is
# re-pointed at this checkout on every run (seconds).
$(VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,runtime]'
	touch $@

env: $(VENV)/.ready
	$(VENV)/bin/pip install -q setuptools wheel  # for the offline builds below and in images
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
	bash scripts/build_horovod.sh $(VENV)

# The Go build needs only the standard library: it runs with the system Python, in
# parallel with the venv install (jobs=2 below), so a cold run overlaps pip's download
# with the compile. -P keeps the checkout's folders off sys.path.
# Also the host packages of the cluster's real nodes (containerd, runc, CNI plugins): installed
# when missing and this is root with apt-get, else named (scripts/install_host_packages.sh).
binaries: build/typecheck/ringwright
	bash scripts/install_host_packages.sh
	PYTHONPATH=build/typecheck $(PYTHON) -P -m ringwright.devcluster.build

# mypy cannot follow the folder -> package mapping (operator/ is ringwright.operator),
# so it checks a tree of symlinks laid out the way the package installs.
build/typecheck/ringwright: $(wildcard src/ringwright/*)
	rm -rf build/typecheck && mkdir -p $@
	for f in src/ringwright/*; do ln -sfn ../../../$$f $@/; done
	for d in operator runtime devcluster; do ln -sfn ../../../$$d $@/$$d; done

lint: env build/typecheck/ringwright
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

crds: env
	$(PY) -m ringwright.operator.api.crdgen

# Most tests wait (on processes, clocks, the cluster) rather than compute, so
# TEST_WORKERS pytest-xdist workers share the machine: one per xdist group (the cluster
# tests, the real-node tests, two lanes of real-process tests, the images), each starting
# at once (tests/README.md). No failure is retried, except in a
# test marked flaky with the reason it is (tests/README.md, "Reruns").
test: binaries lint
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup \
		$(PYTEST_ARGS) tests --ignore=tests/bench

demo: binaries env
	$(PY) -m ringwright.devcluster.demo

# The demo on two real kubelet nodes (root, containerd, runc; docs/real-nodes.md), with
# the images built here (as `make images`) and the operator installed by `helm install`.
demo-real: binaries env
	$(PY) -m ringwright.devcluster.demo_real

down: env
	$(PY) -m ringwright.devcluster down

# The container images, built without Docker or a registry: buildah on a Debian base
# made by mmdebstrap, from this venv's wheels (devcluster/images.py; the tools: apt-get
# install -y buildah mmdebstrap runc podman). TARGET=operator|training|training-horovod.
# Cached under $(CACHE)/images (OCI archives) and buildah's storage, keyed by a digest
# of their inputs: with nothing changed, seconds.
images: env build/typecheck/ringwright
	PYTHONPATH=build/typecheck $(PY) -P -m ringwright.devcluster.images build \
		--target $(or $(TARGET),all)

bench: binaries env
	$(PY) tests/bench/run_all.py

clean-cache:
	rm -rf $(CACHE)
