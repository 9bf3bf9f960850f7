# zerolab: two commands do all set-up.
#   make lab    create .venv if missing, install, open JupyterLab on the book
#   make test   create .venv if missing, run every test (unit, multi-process, notebooks, browser)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zerolab-installed
# torch is pinned to the release whose CPU build lies on this machine's disk;
# any other version (or an open range) would download a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
PORT   ?= 8888
# extra flags for `jupyter lab` (e.g. LAB_ARGS=--no-browser); root needs --allow-root
LAB_ARGS ?=
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: venv lab test test-fast mutants book grade bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[notebook,test]'
	$(PY) -m ipykernel install --sys-prefix --name zerolab --display-name "Python 3 (zerolab)"
	touch $@

venv: $(STAMP)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --port=$(PORT) $(ROOT_FLAG) --ServerApp.root_dir="$(CURDIR)" \
		--LabApp.default_url=/lab/tree/chapters/00_welcome.ipynb $(LAB_ARGS)

# Unit and multi-process tests, every chapter under nbval, exercise grading, the browser test.
test: $(STAMP)
	$(PY) -m pytest tests chapters --nbval-lax -p no:cacheprovider

# Quick loop while editing: no notebooks, no browser.
test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not browser" -p no:cacheprovider

# The mutation suite (tests/mutants): each planted bug on a copy of the package must fail the tests
# named for it. Sequential: 613 s for 52 mutants on the shared 2-core machine (up to twice that when it
# is busy); `make test` only checks the table is valid (tests/test_mutants_table.py).
mutants: $(STAMP)
	$(PY) tests/mutants/run.py

# Execute every chapter and render it to HTML under build/book (ignored by git).
book: $(STAMP)
	mkdir -p build/book
	$(VENV)/bin/jupyter nbconvert --to html --execute --ExecutePreprocessor.timeout=600 \
		--output-dir build/book chapters/*.ipynb
	@echo "open build/book/00_welcome.html"

grade: $(STAMP)
	$(PY) -m zerolab grade exercises/*.ipynb

# DeepSpeed is an optional extra (pip install zerolab[bench]); without it its rows are skipped.
bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m zerolab bench --out build/bench
	$(PY) -m zerolab.bench.offload

# On a machine with CUDA GPUs: the nccl path end to end, one rank per GPU.
gpu-check: $(STAMP)
	$(PY) -m zerolab gpu-check
	$(PY) -m pytest tests -m gpu -p no:cacheprovider

clean:
	rm -rf build artifacts .pytest_cache
