# basertd: the two commands a fresh clone needs are `make demo` and `make test` (README.md).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# One portable llama.cpp build for every x86-64 box (no -march=native, no multimodal library).
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

NATIVE_SRC := $(wildcard native/*.c native/*.h native/*.py native/ref_engine/*.c native/ref_engine/*.h)

.PHONY: all demo test lint native bytecode bench memcheck clean

all: $(VENV)/.stamp-native

# Dependencies (including the llamacpp extra, which compiles llama.cpp once; pip caches the wheel).
$(VENV)/.stamp-deps: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=24" "setuptools>=77" wheel "cffi>=1.16"
	$(PIP) install --quiet -e '.[dev,llamacpp]'
	touch $@

# The C parts (ring atomics, reference engine), rebuilt in place whenever their sources change.
$(VENV)/.stamp-native: $(VENV)/.stamp-deps $(NATIVE_SRC)
	$(PY) setup.py --quiet build_ext --inplace
	touch $@

native: $(VENV)/.stamp-native

# Byte-compile the package ahead (only what changed since). With PYTHONDONTWRITEBYTECODE set, as
# on some boxes, nothing else writes __pycache__, and every daemon, worker and basertctl process
# would compile its ~200 modules from source: about 0.4 s of each start on a 2-core box.
bytecode: $(VENV)/.stamp-native
	$(PY) -m compileall -q -j 0 basertd schema shm worker native >/dev/null

lint: $(VENV)/.stamp-native
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@# import-linter scans one directory tree, so check the package as it is laid out when installed.
	rm -rf build/lint && $(PY) setup.py --quiet build_py --build-lib build/lint >/dev/null
	cd build/lint && ../../$(VENV)/bin/lint-imports ../../pyproject.toml

test: lint bytecode
	$(VENV)/bin/pytest -q --durations=15

demo: bytecode
	$(PY) -m basertd.demo

# Memory safety of the C reference engine (issue 4 part 5): the conformance suite's reference-engine
# runs (other engines' parameters deselected) against an ASan+UBSan build of libbasert_ref.so,
# loaded into an uninstrumented Python with LD_PRELOAD (the engine is preloaded too, so it stays
# mapped and symbolized when LeakSanitizer runs at exit).
# Any sanitizer error, and any leak whose allocation stack passes through the engine, fails the
# target (CPython's and the C compiler's own leftovers at exit are not the engine's). The sanitizer
# build goes to build/memcheck/lib and is selected with $$BASERT_REF_ENGINE, so the normal in-place
# library is never replaced (tests running meanwhile are not disturbed). Reports: build/memcheck/.
MEMCHECK_DIR    := build/memcheck
MEMCHECK_LIB    := $(CURDIR)/$(MEMCHECK_DIR)/lib/basertd/native/libbasert_ref.so
MEMCHECK_CFLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g -O1
MEMCHECK_ENV    := BASERT_REF_ENGINE=$(MEMCHECK_LIB) \
	LD_PRELOAD="$(shell gcc -print-file-name=libasan.so) $(MEMCHECK_LIB)" PYTHONMALLOC=malloc \
	ASAN_OPTIONS=detect_leaks=1:exitcode=0:halt_on_error=1:detect_stack_use_after_return=1:log_path=$(CURDIR)/$(MEMCHECK_DIR)/reports/asan \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$(CURDIR)/$(MEMCHECK_DIR)/reports/ubsan

memcheck: $(VENV)/.stamp-native
	rm -rf $(MEMCHECK_DIR) && mkdir -p $(MEMCHECK_DIR)/reports
	BASERT_REF_CFLAGS="$(MEMCHECK_CFLAGS)" BASERT_REF_LDFLAGS="-fsanitize=address,undefined" \
		$(PY) setup.py --quiet build_ext --build-lib $(MEMCHECK_DIR)/lib --build-temp $(MEMCHECK_DIR)/tmp --force
	@status=0; \
	$(MEMCHECK_ENV) $(VENV)/bin/pytest tests/conformance -q -p no:cacheprovider -k "not llamacpp and not libbasert" \
		|| status=$$?; \
	if grep -l "ERROR: AddressSanitizer\|runtime error:" $(MEMCHECK_DIR)/reports/* 2>/dev/null; then \
		echo "memcheck: sanitizer errors, see the files above"; status=1; fi; \
	if ! awk 'BEGIN { RS = "" } /leak of/ && /libbasert_ref|native\/ref_engine\// { print; n++ } \
		END { exit n > 0 }' /dev/null $(MEMCHECK_DIR)/reports/*; then \
		echo "memcheck: the reference engine leaked (blocks above)"; status=1; fi; \
	ls $(MEMCHECK_DIR)/reports/asan.* >/dev/null 2>&1 || { echo "memcheck: no ASan report: was the sanitizer build loaded?"; status=1; }; \
	test $$status -eq 0 && echo "memcheck: clean (ASan+UBSan, engine-scoped leak check; reports in $(MEMCHECK_DIR)/reports)"; \
	exit $$status

bench: bytecode
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf build native/*.so native/_ringc.c native/_ffi_*.py $(VENV)/.stamp-native
