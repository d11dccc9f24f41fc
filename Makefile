# lags_hvd: the README's two commands are `make install` and `make test`.
VENV   ?= .venv
PYTHON := $(VENV)/bin/python
HVDRUN := $(VENV)/bin/horovodrun
# the compiled kernels (lags_hvd/_kernels.c: candidate search, streamed zeroing), built in place by pip install -e
KERNEL := lags_hvd/_kernels$(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))" 2>/dev/null)

.PHONY: install test test-pythons lint format test-fast soak demo train train-torch gpu-check convergence convergence-quick convergence-aggregation convergence-aggregation-quick convergence-ddp convergence-ddp-quick convergence-transformer convergence-transformer-quick convergence-transformer-long convergence-transformer-4800 convergence-transformer-adam-methods adam-frontier adam-frontier-4800 convergence-clip bench bench-quick bench-ddp bench-emulated bench-aggregation bench-adaptive bench-engine bench-select bench-traffic bench-checkpoint examples-check simulate profile clean

install:            ## system packages, .venv, torch, Horovod (built), lags_hvd
	bash scripts/install.sh

$(KERNEL): lags_hvd/_kernels.c setup.py   # rebuilt when its source changes (make install builds it;
                                             # every target that runs the package depends on it)
	$(PYTHON) -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .

# the suite's modules run on TEST_WORKERS pytest processes (pytest-xdist), each module on one, so a
# module's shared launches run once; a multi-process test's workers come on top of them
TEST_WORKERS ?= 2

test: $(KERNEL) lint ## the linter, then the whole suite, multi-process tests included
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder

test-pythons:       ## the package under Python 3.12 and 3.13 as pip installs it (no Horovod, torch from PyPI): pure, single-process and torchrun tests
	bash scripts/test_pythons.sh 3.12 3.13

lint:               ## ruff: lint and format check (settings in pyproject.toml); `make format` rewrites
	$(VENV)/bin/ruff check lags_hvd tests scripts examples
	$(VENV)/bin/ruff format --check lags_hvd tests scripts examples

format:             ## ruff format, then the lint's fixable findings
	$(VENV)/bin/ruff format lags_hvd tests scripts examples
	$(VENV)/bin/ruff check --fix lags_hvd tests scripts examples

test-fast: $(KERNEL) ## pure tensor tests and single-process tests only
	$(PYTHON) -m pytest tests/test_selection.py tests/test_sparse.py tests/test_residual.py tests/test_optimizer.py

soak: $(KERNEL) ## 2,000 LAGS-SGD iterations on 2 workers: memory flat, nothing left behind
	$(HVDRUN) -np 2 -H localhost:2 $(PYTHON) scripts/soak.py --iterations 2000 --out runs/soak

demo: $(KERNEL) ## train a small model on 2 workers; the loss falls
	$(HVDRUN) -np 2 -H localhost:2 $(PYTHON) scripts/demo.py

train: $(KERNEL) ## the main job: Fashion-MNIST CNN, LAGS-SGD, 2 workers, 2 epochs (runs/train)
	$(HVDRUN) -np 2 -H localhost:2 $(PYTHON) -m lags_hvd.experiments.train --dataset fashion-mnist --model cnn \
		--method lags --density 0.001 --epochs 2 --out runs/train

train-torch: $(KERNEL) ## the same job under torchrun on torch.distributed (Gloo), no Horovod involved (runs/train-torch)
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 -m lags_hvd.experiments.train --backend torch \
		--dataset fashion-mnist --model cnn --method lags --density 0.001 --epochs 2 --out runs/train-torch

gpu-check: $(KERNEL) ## on a CUDA machine: the device tests on CUDA (oracles over NCCL, sync debug mode), selection and the engine's cost timed (docs/gpu.md)
	bash scripts/gpu_check.sh

examples-check: $(KERNEL) ## every README example, 400 steps on 2 workers, beside plain DDP (runs/examples; minutes)
	rm -rf runs/examples
	$(PYTHON) examples/run.py --steps 400 --seeds 0 --out runs/examples

bench-checkpoint: $(KERNEL) ## gathered_state_dict() against state_dict() on 25M parameters, P=2 (docs/results/checkpoint)
	GLOO_SOCKET_IFNAME=lo $(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 -m lags_hvd.experiments.gather_checkpoint \
		--out docs/results/checkpoint

convergence: $(KERNEL) ## dense vs TopK-SGD vs LAGS (paper, DGC options), 3 seeds, long budget, P=4 (hours; resumable)
	$(PYTHON) scripts/convergence.py --suite full

convergence-aggregation: $(KERNEL) ## lags with allgather vs reduce_scatter, Fashion-MNIST, 3 seeds, 12 epochs, P=4 (hours; resumable)
	$(PYTHON) scripts/convergence.py --suite aggregation

convergence-aggregation-quick: $(KERNEL) ## the same, 2 seeds, 4 epochs (about an hour)
	$(PYTHON) scripts/convergence.py --suite aggregation-quick

convergence-ddp: $(KERNEL) ## DDP dense vs PowerSGD (rank 4) vs the LAGS hook under torchrun, the full suite's budget, 3 seeds (an hour)
	$(PYTHON) scripts/convergence.py --suite ddp

convergence-ddp-quick: $(KERNEL) ## the same, 1 seed, 4 epochs (minutes)
	$(PYTHON) scripts/convergence.py --suite ddp-quick

convergence-transformer: $(KERNEL) ## a small GPT with AdamW on Shakespeare: dense, TopK-SGD, LAGS (paper, default), P=2, 3 seeds (an hour)
	$(PYTHON) scripts/convergence.py --suite transformer

convergence-transformer-quick: $(KERNEL) ## the same, 1 seed, 400 steps (minutes)
	$(PYTHON) scripts/convergence.py --suite transformer-quick

convergence-transformer-long: $(KERNEL) ## dense and the default on the GPT at 2,400 steps, 3 seeds (about 40 min)
	$(PYTHON) scripts/convergence.py --suite transformer-long

convergence-transformer-4800: $(KERNEL) ## dense and the default on the GPT at 4,800 steps, seed 42 (about 30 min)
	$(PYTHON) scripts/convergence.py --suite transformer-4800

convergence-transformer-adam-methods: $(KERNEL) ## the Adam frontier's anchors through the suite's processes, 1,200 steps, seed 42 (about 40 min)
	$(PYTHON) scripts/convergence.py --suite transformer-adam-methods

adam-frontier: ## AdamW on the GPT: LAGS beside 0/1 Adam, DeMo, DiLoCo, SparseLoCo, PowerSGD, 1,200 steps, 3 seeds (hours on 2 cores)
	$(PYTHON) -m lags_hvd.experiments.adam_frontier --steps 1200 --seeds 42 43 44

adam-frontier-4800: ## the frontier at 4,800 steps, seed 42 (hours on 2 cores)
	$(PYTHON) -m lags_hvd.experiments.adam_frontier --steps 4800 --seeds 42

convergence-clip: $(KERNEL) ## Shakespeare with and without clipping the merged gradient, 300 steps, P=4 (about 30 min)
	$(PYTHON) scripts/convergence.py --suite clip

convergence-quick: $(KERNEL) ## the same methods (and adaptive), 1 seed, 4 epochs / 600 steps, P=4 (about an hour)
	$(PYTHON) scripts/convergence.py --suite quick

bench: $(KERNEL) ## the paper's models, all methods, P=2 and 4, emulated slow network (root; hours)
	$(PYTHON) scripts/benchmark.py --suite full

bench-quick: $(KERNEL) ## ResNet-20 and a small LSTM, P=2, emulated slow network (root; minutes)
	$(PYTHON) scripts/benchmark.py --suite quick

bench-ddp: $(KERNEL) ## DDP dense, PowerSGD rank 1 and 4, the LAGS hook and the optimizer side by side, P=2 (root; minutes)
	$(PYTHON) scripts/benchmark.py --suite ddp --out-dir docs/results/ddp --plot-dir docs/results/ddp

bench-emulated: $(KERNEL) ## the paper's models on an emulated 5 TFLOP/s accelerator, 1 and 10 Gbit/s per node, P=2,4,8 (root; hours)
	$(PYTHON) scripts/benchmark.py --suite emulated --resume $(if $(MODELS),--models $(MODELS))
	$(PYTHON) scripts/simulate.py --bench docs/results/emulated.json --validate-only \
		--out docs/results/simulate-emulated.json

bench-adaptive: $(KERNEL) ## fixed density 0.001 vs adaptive, P=2 and 4, emulated slow network (root)
	$(PYTHON) scripts/benchmark.py --suite adaptive

bench-aggregation: $(KERNEL) ## allgather vs reduce_scatter on the shaped link, P=2 and 4, and the simulator checked on it (root)
	$(PYTHON) scripts/benchmark.py --suite aggregation
	$(PYTHON) scripts/simulate.py --bench docs/results/aggregation.json --out docs/results/simulate-aggregation.json --plot docs/img/simulate-aggregation.png

simulate: $(KERNEL) ## predict dense / TopK / LAGS for P=2..256 from make bench's profiles and bench-engine's costs per bucket (by P); validate at P=2, 4
	$(PYTHON) scripts/simulate.py --bench docs/results/full.json

profile: $(KERNEL) ## fit this machine's allgather/allreduce cost models (2 workers) to network.json
	$(HVDRUN) -np 2 -H localhost:2 $(PYTHON) -m lags_hvd.experiments.netprofile --out network.json

bench-engine: $(KERNEL) ## engine cost in one process: cost per bucket, passes over memory, the options, host work by P
	$(PYTHON) scripts/bench_engine.py --out docs/results/engine_cpu.json
	$(PYTHON) scripts/bench_engine.py --options --rounds 30 --out docs/results/options_cost_engine.json
	$(PYTHON) -m lags_hvd.experiments.host_work --out docs/results/host_work.json

bench-traffic: $(KERNEL) ## bytes per worker of allgather vs reduce_scatter at P=2,3,4,8 (loopback; minutes)
	$(PYTHON) scripts/traffic.py --out docs/results/traffic.json --plot docs/img/traffic.png

bench-select: $(KERNEL) ## selection benchmark (CPU, one thread): table, JSON and plot under docs/
	$(PYTHON) scripts/bench_select.py --out docs/results/select_cpu.json --plot docs/img/select_cpu.png

clean:
	rm -rf .build .pytest_cache build *.egg-info
