# Two commands do all the set-up: `make demo` and `make test`. Both create and reuse .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test lint clean browser gpu-bundle

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch first: 2.13.0 is a local CPU wheel on our CPU machines (a CUDA wheel on GPU machines),
# so nothing later pulls a multi-GB CUDA build where there is no GPU.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==2.13.0
	touch $@

# llama-cpp-python (the gguf extra, in the test extra) builds from source: portable flags (AVX2,
# FMA, F16C; no AVX-512 or AMX, whose tile instructions this sandbox's kernel refuses: SIGILL),
# ggml's own thread pool beside torch's OpenMP. Its converter comes from the same sdist.
LLAMA_CPP_CMAKE := -DLLAVA_BUILD=OFF -DGGML_OPENMP=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON \
	-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PIP) install --quiet -e '.[test]'
	$(VENV)/bin/quantdask gguf-setup
	cuda=$$($(PY) -c "import torch; print((torch.version.cuda or '').split('.')[0] if torch.cuda.is_available() else '')"); \
	if [ -n "$$cuda" ]; then $(PIP) install --quiet -e ".[gpu-cu$$cuda]"; fi
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/quantdask demo

# The report tests open the HTML reports in a real headless browser: Debian's chromium.
CHROMIUM := $(shell command -v chromium || command -v chromium-browser)
browser:
ifeq ($(CHROMIUM),)
	@if [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	else \
		echo "chromium is missing: sudo apt-get install chromium (the browser tests skip without it)"; \
	fi
endif

# Two pytest processes, a whole test file to each at a time (module-scoped clusters stay in one
# process), the longest files first (tests/conftest.py): 277-303 s on one otherwise idle
# 2-core machine late on 2026-12-04; 405-466 s on 2026-12-06, after the GGUF and GPTQ
# searches' end-to-end tests (over the 5-minute bar: RESULTS.md 16.2). The suite is CPU-bound
# (-n 3: no faster; 12 minutes with -n 4).
# scripts/suite_cpu.py says which tests and processes spend the CPU, and which wait
# (benchmarks/RESULTS.md section 16).
test: $(VENV)/.installed browser
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# ruff, the types (mypy, configured in pyproject.toml: every attribute and call of our own code
# checked; libraries without type information taken as Any), the import contract (pyproject.toml:
# imports point one way, docs/architecture.md), then no import cycle inside a package either and
# no module past ~400 lines (tests/test_architecture.py, which `make test` runs too).
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check quantdask tests benchmarks scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider tests/test_architecture.py

# The carry for the lent GPU machine (scripts/gpu_bundle.py; benchmarks/RESULTS.md section 4):
# downloads cp312 wheels, writes .gpu-bundle/site.tar.xz and scripts/gpu_bundle.lock.json.
gpu-bundle: $(VENV)/.installed
	$(PY) scripts/gpu_bundle.py

clean:
	rm -rf runs .pytest_cache
