# One-command set-up: every target creates or refreshes the virtual environment in .venv first.
#   make demo       the GRPO job on its tiny CPU default: 2 ranks train a tiny Llama at PP2 x VPP2,
#                   each with a colocated inference engine refit every step; writes
#                   .demo/run/metrics.png. --standalone: a free port, so jobs on one host never
#                   collide; OMP_NUM_THREADS=1 is torchrun's default, set so it prints no notice
#   make test       the whole test suite, as CI runs it, on TEST_WORKERS pytest workers (GPU
#                   tests are skipped without GPUs)
#   make test-fast  the fast tier for everyday work: no process-launching (dist), GPU or slow tests
#   make lint       ruff

SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR := .demo
# pytest-xdist workers of `make test`: the suite's launches leave about a third of 2 cores idle
# when run one after another (waits for timeouts, single-process phases).
TEST_WORKERS ?= 2

.PHONY: venv test test-fast demo lint clean

venv: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt requirements-vllm.txt requirements-nodeps.txt \
  constraints.txt pyproject.toml
	@python=$$(tools/find_python312.sh) && echo "using $$python" && \
	  { [ -x $(BIN)/python ] || "$$python" -m venv $(VENV); }
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements.txt \
	  -r requirements-dev.txt -r requirements-vllm.txt -c constraints.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $@

test: venv
	$(BIN)/python -m pytest tests -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-fast: venv
	$(BIN)/python -m pytest tests -q -m "not dist and not gpu and not slow"

demo: venv
	rm -rf $(DEMO_DIR)/tiny-llama $(DEMO_DIR)/run
	$(BIN)/python recipes/make_tiny_model.py $(DEMO_DIR)/tiny-llama --layers 8 --hidden-size 64
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node 2 recipes/grpo.py \
	  --config configs/grpo_tiny_cpu_colocated.yaml run.output_dir=$(DEMO_DIR)/run

lint: venv
	$(BIN)/ruff check mcore_refit recipes tests benchmarks tools

clean:
	rm -rf $(VENV) $(DEMO_DIR)
