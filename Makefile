# One-command set-up: `make test` and `make demo` create .venv and install everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build on this project's machines; override for CUDA, e.g. TORCH_SPEC="torch==2.13.0 --index-url ..."
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# the suite's processes (pytest-xdist): one per core by default; the tests themselves use one thread each
PYTEST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal

.PHONY: install test test-avx2 test-compile lint typecheck docs demo bench fuzz mutate clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# ruff's lint rules and its formatter (pyproject.toml's [tool.ruff]); `ruff format .` applies the format
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy on et_ode/ and analysis/, the latter under its installed name et_ode.analysis (pyproject.toml's [tool.mypy])
typecheck: $(STAMP)
	$(BIN)/mypy

# the API reference, built from the docstrings into site/; --strict turns every warning into an error
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

test: $(STAMP) lint typecheck
	$(PYTEST) $(PYTEST_ARGS)

# the suite on the AVX2 code paths of oneDNN, MKL and ATen (approximates an AVX2-only CPU on an AVX-512 one)
test-avx2: $(STAMP)
	ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PYTEST) $(PYTEST_ARGS)

# the tests that run torch.compile's compiler (Adaptive(compile=True)): a minute or more on a cold cache, so slow
test-compile: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests/integrators/test_adaptive_loop.py -k compiled_solve_integrates

demo: $(STAMP)
	$(BIN)/et-ode demo --out runs/demo --overwrite

# The fuzz suite's long profile: 1,000 fresh random cases per entry point (the default run tries 30, derandomised)
fuzz: $(STAMP)
	ET_ODE_FUZZ=long $(BIN)/python -m pytest -q tests/project/test_fuzz.py --hypothesis-show-statistics

bench: $(STAMP)
	$(BIN)/python benchmarks/field.py
	$(BIN)/python benchmarks/solvers.py
	$(BIN)/python benchmarks/gradients.py
	$(BIN)/python benchmarks/graph_scale.py
	$(BIN)/python benchmarks/ddp.py

# mutation testing of the core modules (not part of `make test`; ~40 minutes on one core): see docs/development.md
mutate: $(STAMP)
	$(BIN)/python -m pip install -q -e ".[mutate]"
	nice -n 10 $(BIN)/python tools/mutate.py $(MUTATE_ARGS)

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .ruff_cache .mypy_cache
