# One command each for a newcomer: `make demo` and `make test` (both create .venv and install).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv demo test bench bench-gpu gpu-wheels gpu-check-dry-run lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# CPU build of torch first (a file of it is on disk here); the range in pyproject keeps it.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,offline,lmeval]'
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation 'deepspeed>=0.16'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PYTHON=$(BIN)/python scripts/demo.sh

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 -q

# Speed and memory, side by side in one run each (the numbers are ratios, never asserted in tests).
bench: $(STAMP)
	$(BIN)/python bench/bench_train_step.py --threads 2 --rounds 12 --profile
	$(BIN)/python bench/bench_train_step.py --threads 2 --rounds 10 --compile --ffn swiglu isogmlp iso_ln --attn-scoring softmax
	$(BIN)/python bench/bench_attention.py --threads 2
	$(BIN)/python bench/bench_generate.py --threads 2
	$(BIN)/python bench/bench_data.py

# On a CUDA machine, in an environment with CUDA torch and `pip install -e '.[dev,gpu]'` (not .venv, whose
# torch is the CPU build): the GPU tests, then the GPU figures of docs/performance.md (bf16, torch.compile, MFU, fla).
bench-gpu:
	$(PY) -m pytest -q -m gpu
	$(PY) bench/bench_train_step.py --device cuda --dtype bf16 --compile --preset 134m --seq 2048 --batch 8 --rounds 10 --ffn swiglu isogmlp iso_ln --attn-scoring softmax iso_tanh
	$(PY) bench/bench_attention.py --device cuda --dtype bf16 --impls sdpa,chunked,fla --lengths 1024,2048,4096,8192,16384

# For a lent GPU machine that reaches no registry: the wheels its image lacks and the FineWeb sample, in .whl/
# (git-ignored; carry it). There: scripts/gpu_check.sh, which writes report.md (docs/performance.md).
gpu-wheels: $(STAMP)
	scripts/gpu_wheels.sh $(BIN)/python

# The same check at tiny size on this CPU (what tests/launch/test_gpu_check.py runs).
gpu-check-dry-run: $(STAMP)
	PYTHON=$(BIN)/python scripts/gpu_check.sh --dry-run runs/gpu-check-dry-run

lint: $(STAMP)
	$(BIN)/ruff check llm tests bench launch scripts train.py eval.py

clean:
	rm -rf $(VENV) runs data_cache
