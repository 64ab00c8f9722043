# epguard: the two commands a newcomer needs are `make demo` and `make test`.
# Heavy artefacts (kube-apiserver, etcd, helm, torch environments) are cached under
# $(EPGUARD_CACHE) so later runs and CI on the same machine reuse them.
SHELL := /bin/bash
export EPGUARD_CACHE ?= $(HOME)/.cache/epguard
PY := .venv/bin/python

.PHONY: venv tools test lint demo up down bench clean

venv:
	@scripts/venv.sh

# Build or fetch everything the tests need (each step is a no-op when cached).
tools: venv
	@scripts/tools.sh

lint: venv
	$(PY) -m ruff check webhook probe tests bench devcluster
	$(PY) -m mypy
	.venv/bin/lint-imports  # .importlinter: the layers, from probe up to devcluster

test: tools lint
	$(PY) -m pytest

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
