# One-command set-up: every target creates or refreshes the virtual environment in .venv first.
#   make demo   tiny model on CPU: export + gradient parity check at PP2 x VPP2 on 2 ranks
#   make test   the test suite (GPU tests are skipped without GPUs)
#   make lint   ruff

SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR := .demo
NPROC ?= 2

.PHONY: venv test demo lint clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt constraints.txt pyproject.toml
	@python=$$(scripts/find_python312.sh) && echo "using $$python" && \
	  { [ -x $(BIN)/python ] || "$$python" -m venv $(VENV); }
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt -c constraints.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

test: venv
	$(BIN)/python -m pytest tests -q

demo: venv
	$(BIN)/python recipes/make_tiny_model.py $(DEMO_DIR)/tiny-llama --layers 8
	$(BIN)/torchrun --nproc-per-node $(NPROC) recipes/verify_export.py \
	  --hf-path $(DEMO_DIR)/tiny-llama --pp 2 --vpp 2

lint: venv
	$(BIN)/ruff check mcore_refit recipes tests

clean:
	rm -rf $(VENV) $(DEMO_DIR)
