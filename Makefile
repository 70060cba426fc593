# One command each for a newcomer: `make demo` and `make test` (both create .venv and install the pinned set).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LATEST := .venv-latest
# The packages every environment here installs: the project with its dev, offline and lmeval extras, then
# DeepSpeed (an sdist that needs torch at build time; DS_BUILD_OPS=0 compiles nothing).
EXTRAS := '.[dev,offline,lmeval]'

.PHONY: venv demo test test-latest pins bench bench-gpu gpu-wheels gpu-check-dry-run lint clean

# Exactly the tested versions (constraints.txt), checked after the install: an unpinned or different package fails it.
$(STAMP): pyproject.toml constraints.txt
	rm -rf $(VENV)
	$(PY) -m venv $(VENV)
	# CPU build of torch first (a file of it is on disk here; any other torch pulls several GB of CUDA packages).
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e $(EXTRAS)
	DS_BUILD_OPS=0 $(BIN)/pip install -q -c constraints.txt --no-build-isolation deepspeed
	$(BIN)/python scripts/pins.py check constraints.txt
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	PYTHON=$(BIN)/python scripts/demo.sh

# As root (as CI runs), the 2-node Slurm of the tests marked slurm comes up around the suite and goes down after it
# (scripts/slurm_local.sh, which installs slurm-wlm and munge when absent); --dist loadgroup puts those tests (one
# xdist group) on one worker and that cluster. Without a cluster they skip with the reason, except under CI=true,
# where they fail.
test: $(STAMP)
	if [ "$$(id -u)" = 0 ]; then trap 'scripts/slurm_local.sh down' EXIT; scripts/slurm_local.sh up || exit 1; fi; \
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

# The suite against the newest releases inside pyproject's ranges (no constraints; torch stays the CPU build),
# in a fresh $(LATEST). If it passes, `make pins` makes that set the tested one; if not, fix the code or lower
# the range's upper bound in pyproject.toml, with a line in docs/install.md on why.
test-latest:
	rm -rf $(LATEST)
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q torch==2.13.0
	$(LATEST)/bin/pip install -q -e $(EXTRAS)
	DS_BUILD_OPS=0 $(LATEST)/bin/pip install -q --no-build-isolation deepspeed
	$(LATEST)/bin/python -c 'import transformers, accelerate, datasets; print("newest:", "transformers", transformers.__version__, "accelerate", accelerate.__version__, "datasets", datasets.__version__)'
	$(LATEST)/bin/python -m pytest -n 2 --dist loadgroup -q

# constraints.txt from the environment `make test-latest` built and passed.
pins:
	test -x $(LATEST)/bin/python || { echo "no $(LATEST): run make test-latest first" >&2; exit 1; }
	$(LATEST)/bin/python scripts/pins.py write constraints.txt

# Speed and memory, side by side in one run each (the numbers are ratios, never asserted in tests).
bench: $(STAMP)
	$(BIN)/python bench/bench_train_step.py --threads 2 --rounds 12 --profile
	$(BIN)/python bench/bench_train_step.py --threads 2 --rounds 10 --compile --variants swiglu+softmax isogmlp+softmax iso_ln+softmax
	$(BIN)/python bench/bench_attention.py --threads 2
	$(BIN)/python bench/bench_generate.py --threads 2
	# document masking (packed documents against one document per row) and activation checkpointing: rows of the step
	$(BIN)/python bench/bench_train_step.py --threads 2 --seq 1024 --batch 4 --qwen3 --variants swiglu+softmax swiglu+iso_tanh \
	    --extra-row "swiglu+softmax packed" swiglu+softmax packed_docs=400 --extra-row "swiglu+iso_tanh packed" swiglu+iso_tanh packed_docs=400 \
	    --extra-row causal_mean swiglu+softmax ffn=isogmlp isogmlp_gate=causal_mean ffn_param_match=true \
	    --extra-row "causal_mean packed" causal_mean packed_docs=400
	$(BIN)/python bench/bench_train_step.py --threads 2 --preset 134m --seq 1024 --batch 1 --rounds 6 --qwen3 --variants swiglu+softmax \
	    --extra-row every_2 swiglu+softmax activation_checkpointing=2 --extra-row full swiglu+softmax activation_checkpointing=1
	$(BIN)/python bench/bench_data.py
	$(BIN)/python bench/bench_footers.py

# The pins without torch and triton, for an environment that keeps its CUDA build of torch (docs/install.md, Tested versions).
gpu-constraints.txt: constraints.txt
	grep -vE '^(torch|triton)==' constraints.txt > $@

# On a CUDA machine, in an environment with CUDA torch and `pip install -c gpu-constraints.txt -e '.[dev,gpu]'` (not .venv, whose
# torch is the CPU build): the GPU tests, then the GPU figures of docs/performance.md (bf16, torch.compile, MFU, fla).
bench-gpu:
	$(PY) -m pytest -q -m gpu
	$(PY) bench/bench_train_step.py --device cuda --dtype bf16 --compile --preset 134m --seq 2048 --batch 8 --rounds 10 --variants swiglu+softmax isogmlp+softmax iso_ln+softmax swiglu+iso_tanh isogmlp+iso_tanh iso_ln+iso_tanh
	$(PY) bench/bench_attention.py --device cuda --dtype bf16 --impls sdpa,chunked,fla --lengths 1024,2048,4096,8192,16384

# For a lent GPU machine that reaches no registry: the wheels its image lacks and the FineWeb sample, in .whl/
# (git-ignored; carry it). There: scripts/gpu_check.sh --part 1 ... 5, each writing report.md (docs/performance.md).
gpu-wheels: $(STAMP)
	scripts/gpu_wheels.sh $(BIN)/python

# The same check at tiny size on this CPU (what tests/launch/test_gpu_check.py runs).
gpu-check-dry-run: $(STAMP)
	PYTHON=$(BIN)/python scripts/gpu_check.sh --dry-run runs/gpu-check-dry-run

lint: $(STAMP)
	$(BIN)/ruff check llm tests bench launch scripts train.py eval.py

clean:
	rm -rf $(VENV) $(LATEST) runs data_cache
