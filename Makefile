# epguard: the two commands a newcomer needs are `make demo` and `make test`.
# Heavy artefacts (kube-apiserver, etcd, helm, torch environments) are cached under
# $(EPGUARD_CACHE) so later runs and CI on the same machine reuse them.
SHELL := /bin/bash
export EPGUARD_CACHE ?= $(HOME)/.cache/epguard
PY := .venv/bin/python

.PHONY: venv tools test unit lint demo up down bench clean

venv:
	@scripts/venv.sh

# Build or fetch everything the tests need (each step is a no-op when cached).
tools: venv
	@scripts/tools.sh

# mypy's cache is kept under the cache, not in the checkout: a fresh clone's check takes 1 s
# instead of 15 (mypy checks each file's hash, so a changed file is checked again).
MYPY_CACHE ?= $(or $(EPGUARD_CACHE),$(HOME)/.cache/epguard)/mypy

lint: venv
	$(PY) -m ruff check webhook probe tests bench devcluster
	MYPY_CACHE_DIR="$(MYPY_CACHE)" $(PY) -m mypy
	.venv/bin/lint-imports  # .importlinter: the parts' layers, the pure engine, the stdlib probe

# Two phases (scripts/test.sh): every test but the node's, the bulk and the waiting ones on
# two pytest workers, then the tests marked node (the machine's one node) one after another,
# with the bulk ones (CPU-bound, no tight time bound) beside them at the lowest priority and
# the waiting ones (the probe's deadlines, little CPU) at the normal one.
test: tools lint
	@scripts/test.sh

# The fast half (3 minutes on 2 cores, two pytest workers): every test that needs no
# cluster, no node, no image and no real torch/mooncake wheel; only helm and kubectl are
# fetched (3 s).
UNIT := -n 2 -m "not e2e and not realpkg and not gpu" --ignore=tests/e2e --ignore=tests/devcluster
unit: venv
	@bash scripts/tools.d/20-kubectl-helm.sh
	$(PY) -m pytest -q $(UNIT)

demo: tools
	@scripts/demo.sh

up: tools
	@$(PY) -m devcluster up

down: venv
	@$(PY) -m devcluster down

bench: tools
	$(PY) bench/run_all.py

clean:
	rm -rf .venv .run build dist *.egg-info
