# The two commands of the README: `make demo` and `make test`. Each creates .venv if needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest-xdist workers: one per core of these 2-core machines (the zoo's replays are subprocesses of them);
# --no-loadscope-reorder keeps the start order tests/conftest.py gives (xdist would sort the units by size)
TEST_WORKERS ?= 2

.PHONY: demo test lint typecheck bench bench-large bench-layers fuzz schema zoo clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: the CPU wheel these machines carry; a bare `torch` would pull a CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test,docs,quanto]'
	# quanto compiles its C++ unpacking kernel at first use (minutes on 2 cores): once here, not inside a test
	$(PY) -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/iobundle demo demo-output

test: $(STAMP)
	$(PY) -m ruff check iobundle tests benchmarks tools
	$(PY) -m mypy iobundle
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

lint: $(STAMP)
	$(PY) -m ruff check iobundle tests benchmarks tools

# mypy over iobundle/ ([tool.mypy] in pyproject.toml: strict on the public face); make test runs it too
typecheck: $(STAMP)
	$(PY) -m mypy iobundle

bench: $(STAMP)
	$(PY) benchmarks/run.py

# Real sizes (not CI): a Llama-shaped decoder at 12, 24 and 48 layers (201M to 606M parameters, float32),
# captured, exported and validated from its bundle, one process per stage; writes the large block of BENCHMARKS.md
bench-large: $(STAMP)
	nice $(PY) benchmarks/large.py

# Per-layer scaling (not CI): each export step's time at 6, 12, 24 and 48 layers of a narrow Llama-shaped
# decoder, twice per size, and its growth exponent (1 = linear); writes the layers block of BENCHMARKS.md
bench-layers: $(STAMP)
	nice $(PY) benchmarks/layers.py

# The model zoo (tests/zoo): every family exported and validated from its bundle; the matrix goes into docs/llm.md
zoo: $(STAMP)
	$(PY) tests/zoo/matrix.py

# The documentation site (mkdocs.yml, docs/) into site/; strict: a broken link or a bad docstring fails
.PHONY: docs
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

fuzz: $(STAMP)
	IOBUNDLE_FUZZ_EXAMPLES=5000 $(PY) -m pytest -q tests/replay/test_fuzz.py

schema: $(STAMP)
	$(PY) tools/manifest_schema.py

clean:
	rm -rf $(VENV) demo-output site .pytest_cache .ruff_cache
