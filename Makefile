# lags_hvd: the README's two commands are `make install` and `make test`.
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
HVDRUN := $(VENV)/bin/horovodrun

.PHONY: install test test-fast demo bench-select clean

install:            ## system packages, .venv, torch, Horovod (built), lags_hvd
	bash scripts/install.sh

test:               ## the whole suite, multi-process tests included
	$(PYTHON) -m pytest

test-fast:          ## pure tensor tests and single-process tests only
	$(PYTHON) -m pytest tests/test_selection.py tests/test_sparse.py tests/test_residual.py tests/test_optimizer.py

demo:               ## train a small model on 2 workers; the loss falls
	$(HVDRUN) -np 2 -H localhost:2 $(PYTHON) scripts/demo.py

bench-select:       ## selection benchmark (CPU, one thread): table, JSON and plot under docs/
	$(PYTHON) scripts/bench_select.py --out docs/results/select_cpu.json --plot docs/img/select_cpu.png

clean:
	rm -rf .build .pytest_cache build *.egg-info
