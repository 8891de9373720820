# basertd: the two commands a fresh clone needs are `make demo` and `make test` (README.md).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# One portable llama.cpp build for every x86-64 box (no -march=native, no multimodal library).
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

NATIVE_SRC := $(wildcard native/*.c native/*.h native/*.py native/ref_engine/*.c native/ref_engine/*.h)

.PHONY: all demo test lint native bench memcheck clean

all: $(VENV)/.stamp-native

# Dependencies (including the llamacpp extra, which compiles llama.cpp once; pip caches the wheel).
$(VENV)/.stamp-deps: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24" "setuptools>=68" wheel "cffi>=1.16"
	$(PIP) install --quiet -e '.[dev,llamacpp]'
	touch $@

# The C parts (ring atomics, reference engine), rebuilt in place whenever their sources change.
$(VENV)/.stamp-native: $(VENV)/.stamp-deps $(NATIVE_SRC)
	$(PY) setup.py --quiet build_ext --inplace
	touch $@

native: $(VENV)/.stamp-native

lint: $(VENV)/.stamp-native
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@# import-linter scans one directory tree, so check the package as it is laid out when installed.
	rm -rf build/lint && $(PY) setup.py --quiet build_py --build-lib build/lint >/dev/null
	cd build/lint && ../../$(VENV)/bin/lint-imports --config ../../pyproject.toml

test: lint
	$(VENV)/bin/pytest -q

demo: $(VENV)/.stamp-native
	$(PY) -m basertd.demo

bench: $(VENV)/.stamp-native
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf build native/*.so native/_ringc.c $(VENV)/.stamp-native
