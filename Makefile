# Each target sets up its own environment: a fresh clone needs nothing but python3.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ddp-split-installed
DEMO_STAMP := $(VENV)/.ddp-split-demo-installed
BENCH_STAMP := $(VENV)/.ddp-split-bench-installed

# Another supported torch: its own venv in a cache folder outside the clone (.ci/torch/ pins
# each release's extras). make test-torch TORCH=2.15.0 (releases: ls .ci/torch).
TORCH ?= 2.15.0

.PHONY: demo test test-fast test-slow test-torch test-matrix gpu-check bench clean

# The demo imports torch and this package only; the tests also need every extra.
$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) .ci/pip_keeps_torch.py -c constraints.txt -e .
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	$(PY) .ci/pip_keeps_torch.py -c constraints.txt -e '.[test,plot,models,launchers]'
	touch $(STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --steps 200

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m 'not slow and not multiprocess and not fuzz'

# The benchmarks of benchmarks/RESULTS.md, each printing its tables and writing
# benchmarks/results/*.json (about 50 minutes on 2 quiet cores).
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/step_overhead.py
	$(PY) benchmarks/warmup.py
	$(PY) benchmarks/warmup.py --models transformer bn_cnn --modes ddp_split ddp_split_auto one_graph \
		--slow-link-ms 2 --out benchmarks/results/warmup_user_models.json
	$(PY) benchmarks/profile_step.py
	$(PY) benchmarks/compile_time.py --out benchmarks/results/compile_time_reuse.json
	$(PY) benchmarks/compile_time.py --no-reuse --modes ddp_optimizer ddp_split --repeats 1 \
		--out benchmarks/results/compile_time_no_reuse.json
	$(PY) benchmarks/overlap.py --inner inductor --bandwidth 1 --out benchmarks/results/overlap_issue14.json --timeline ''

test-torch:
	.ci/test_torch.sh $(TORCH)

# CI's matrix: each other release runs every test but the slow ones, the hypothesis fuzzing
# and the GPU check's CPU smoke (all three run on the default torch), to keep CI under an hour.
MATRIX_SELECT := -m 'not slow and not fuzz' --deselect tests/test_gpu_check.py
test-matrix:
	status=0; for t in 2.11.0 2.12.1 2.14.1 2.15.0; do \
		start=$$(date +%s); .ci/test_torch.sh $$t $(MATRIX_SELECT) || status=1; \
		echo "torch $$t: $$(( $$(date +%s) - start )) s"; done; exit $$status

# The prepared GPU check, from the working tree with the interpreter given (nothing is
# installed): make gpu-check PYTHON=python3. Without a GPU it runs on the CPU and says so.
gpu-check:
	PYTHONPATH=. $(PYTHON) benchmarks/gpu_check.py

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow --hypothesis-show-statistics

clean:
	rm -rf $(VENV) build *.egg-info
