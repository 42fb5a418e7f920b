# Everything starts from a fresh machine with only Python 3.11 and pip.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo run test test-fast lint typecheck wheel bench examples docs clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,cli,examples]"
	touch $@

venv: $(VENV)/.installed

# Two pytest workers, each running whole test files (tests share compiled programs through
# module fixtures); WORKERS=0 runs in one process.
WORKERS ?= 2
PYTEST_ARGS ?=
test: venv
	$(PY) -m pytest tests -n $(WORKERS) --dist loadfile $(PYTEST_ARGS)

# The inner loop (a few minutes): layering, the README, placement and phases, wire-byte parsing.
test-fast: venv
	$(PY) -m pytest -q -x tests/test_package.py tests/docs/test_readme.py \
		tests/train/test_train_step.py tests/inspect/test_hlo.py tests/train/test_donation.py \
		tests/compressors/test_powersgd.py tests/runtime/test_overlap.py

# Compiles a bucketed OneBit mean for TPU v5e with libtpu's compiler (no TPU needed), in a venv
# of its own (jax[tpu] adds libtpu, about 0.7 GB); fails, not skips, without libtpu.
TPU_VENV ?= $(VENV)/tpu
$(TPU_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install -q "jax[tpu]==0.10.2" pytest -e .
	touch $@

test-aot: $(TPU_VENV)/.installed
	JAXCOMM_REQUIRE_TPU_COMPILE=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1 \
		$(TPU_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integration/test_aot_tpu.py

lint: venv
	$(VENV)/bin/ruff check jaxcomm tests benchmarks examples .ci

typecheck: venv
	$(VENV)/bin/mypy

# The sdist and wheel as pip builds them, their metadata checked (twine; .ci/check_wheel.py).
wheel: venv
	rm -rf dist
	$(PY) -m build --outdir dist .
	$(VENV)/bin/twine check --strict dist/*
	$(PY) .ci/check_wheel.py dist/*.whl

demo: venv
	$(VENV)/bin/jaxcomm demo

run: venv
	$(VENV)/bin/jaxcomm bench

bench: venv
	$(PY) benchmarks/compressors_1gbit.py

# The documentation site (site/), warnings as errors; the API pages come from the docstrings.
docs: venv
	$(PY) -m pip install -q -e ".[docs]"
	$(VENV)/bin/mkdocs build --strict

# Every runnable file in examples/, with the venv's interpreter (each well under a minute).
examples: venv
	@set -e; for f in examples/*.py; do echo "== $$f"; $(PY) $$f; done

clean:
	rm -rf $(VENV) .pytest_cache site
