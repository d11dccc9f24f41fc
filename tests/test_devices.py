"""The torch.distributed front-end and the DDP hook in one process (P = 1), on every device
present: the CPU here, CUDA too where a GPU is (``scripts/gpu_check.sh`` runs this file there).
Against the numpy oracles (SGD, both Adam rules, the hook), with no more tensor values read
into Python than on the CPU, and on CUDA with no device synchronisation in backward at all."""

import collections
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import graph_stand_in
import models
import pytest
import test_ddp
import torch
from test_distributed import assert_matches, reference_for
from test_engine import host_reads_by_depth
from test_updates import assert_matches_the_adam_oracle
from workers.ddp_worker import BUCKET_MB, mlp, mlp_batch
from workers.lags_worker import FIDELITY

import lags_hvd.distributed as lags
from lags_hvd import capture, selection
from lags_hvd.aggregation.allgather import Allgather
from lags_hvd.aggregation.base import Packer
from lags_hvd.arena import ArenaLayout
from lags_hvd.ddp import LAGSHookState, lags_hook
from lags_hvd.experiments import device_timing
from lags_hvd.experiments import models as experiment_models
from lags_hvd.layout import build_units
from lags_hvd.residual import ResidualMemory

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
STEPS = 6


def tiny_run(device: str, options: dict, steps: int = STEPS, set_to_none: bool = True):
    """TinyNet on ``device`` under the front-end, rank 0's batches (aux sometimes unused);
    ``set_to_none``: ``zero_grad``'s (False: autograd adds into the same gradients)."""
    model = models.make_model().to(device)
    base = torch.optim.SGD(model.parameters(), lr=models.LR, momentum=models.MOMENTUM, weight_decay=models.WEIGHT_DECAY)
    options = {"density": models.DENSITY, "layer_densities": models.LAYER_DENSITIES, "recipe": "paper", **options}
    optimizer = lags.DistributedOptimizer(base, model.named_parameters(), **options)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=set_to_none)
        x, y = models.batch(0, step)
        use_aux = models.uses_aux(0, step, sometimes=True)
        torch.nn.functional.mse_loss(model(x.to(device), use_aux=use_aux), y.to(device)).backward()
        optimizer.step()
    return {
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "residuals": {n: r.cpu() for n, r in optimizer.lags_state.residuals.state_dict().items()},
        "graphs": optimizer.cuda_graphs,
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "options",
    [{}, {"aggregation": "reduce_scatter"}, FIDELITY["recipe"]],
    ids=["paper", "reduce-scatter", "recipe"],
)
def test_one_rank_matches_the_oracle(torch_group, device, options):
    params, eps, _ = reference_for(1, STEPS, options)
    assert_matches(tiny_run(device, options), params, eps[0], device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "options", [dict(density=0.05), dict(density=0.05, momentum_correction=True), dict(density=1.0)]
)
def test_hooks_read_nothing_to_the_host_and_synchronize_a_constant(torch_group, monkeypatch, device, options):
    """As tests/test_engine.py's test of the same name, through the torch front-end: nothing
    read in backward, and a count in synchronize() that does not grow with the layers."""
    reads = host_reads_by_depth(
        monkeypatch,
        lambda model: lags.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(),
            recipe="paper",
            **options,
        ),
        device,
    )
    assert reads[1][0] == reads[12][0] == 0
    assert reads[1][1] == reads[12][1] <= 4, reads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("local", [False, True], ids=["adam-correction", "local-residual"])
@pytest.mark.parametrize("graphs", [False, True], ids=["", "cuda-graphs"])
def test_both_adam_rules_match_the_oracle(torch_group, monkeypatch, device, local, graphs):
    """With ``cuda_graphs=True`` too: the graph starts from the rule's step (off CUDA, the
    stand-in of the graph tests below)."""
    if graphs and device == "cpu":
        graph_stand_in.install(monkeypatch.setattr)
    wrap = functools.partial(lags.DistributedOptimizer, cuda_graphs=graphs)
    assert_matches_the_adam_oracle(wrap, decoupled=True, local=local, device=device)


def graphs_made_by(stand_in, made: list):
    """``capture.cuda_graph`` on CUDA, ``stand_in`` elsewhere, each capture's inputs' count in ``made``."""

    def graph(run, inputs, where):
        made.append(len(inputs))
        return (capture.cuda_graph if where.type == "cuda" else stand_in)(run, inputs, where)

    return graph


def shifted_in_place(*grads):
    """A rule's work as a graph's prologue, in place on its inputs (as weight decay is):
    ``g += 1``, then accumulated at f = 0.5. Run twice for one call, it would shift twice."""
    for g in grads:
        g.add_(1.0)
    return grads, 0.5


def message_packer(k: int, device) -> Packer:
    """A packer of k entries into a message of its own: float16 values, int32 indices."""
    message = (torch.empty(k, dtype=torch.float16, device=device), torch.empty(k, dtype=torch.int32, device=device))

    def pack(values, indices):
        message[0].copy_(values)
        message[1].copy_(indices)

    return Packer(pack, message)


SIZES = [(5000, torch.float32), (5000, torch.float64)]  # the composite key; 64-bit keys: the k-th and its ties
if torch.cuda.is_available():
    SIZES.append((selection.COMPOSITE_MAX + 5, torch.float32))  # the k-th and its ties, on a large bucket


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,dtype", SIZES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("settled", [True, False], ids=["settled", "moving"])
def test_bucket_graphs_are_accumulate_select_at_every_address_and_k(device, n, dtype, settled):
    """``BucketGraphs`` against ``accumulate_select`` with ``select_torch`` on a twin memory,
    a bucket of two members, new gradients each step (ties, NaN, Inf) shifted in place by the
    prologue (once per call), at f = 0.5 and r = 0.9: the same acc, selection and staged
    residual, and the values times the loss scale (4) packed into a message of float16 values
    and int32 indices. Gradients written in place (``settled``): a graph of the whole per
    staging buffer and k, and a new k drops the old ones. Gradients at new addresses every
    step (``moving``): at most ``GRAPHS_PER_BUCKET`` graphs of the whole at a k, then the
    selection's alone."""
    made: list = []
    graphs = capture.BucketGraphs(graphs_made_by(graph_stand_in.replayed_in_place, made))
    params = [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True) for shape in ((n - 7,), (7,))]
    units = build_units([{"params": params}], {p: f"p{i}" for i, p in enumerate(params)}, groups=[params])
    memory, twin = (ResidualMemory(ArenaLayout(units, params)) for _ in range(2))
    name = units[0].name
    memory.register(name)
    twin.register(name)
    generator, kept, packer = torch.Generator().manual_seed(3), [], None
    grads = [torch.empty(p.shape, dtype=dtype, device=device) for p in units[0].params]
    for step in range(12):
        k = 40 if step < 6 else 1
        if not settled:
            kept.append(grads)  # alive: the next ones cannot take their addresses
            grads = [torch.empty_like(g) for g in grads]
        for g in grads:
            g.copy_(torch.randn(g.shape, generator=generator, dtype=dtype).round())  # many ties
        grads[0][step * 7] = (float("nan"), float("inf"), -float("inf"))[step % 3]
        if packer is None or len(packer.packed[0]) != k:
            packer = message_packer(k, device)
        twin_grads = [g + 1.0 for g in grads]
        acc, values, indices, sent = graphs(memory, name, grads, shifted_in_place, 0.5, k, 0.9, 4.0, packer)
        want_acc, want_values, want_indices = selection.accumulate_select(
            twin, name, twin_grads, k, 0.5, 0.9, selection.select_torch
        )
        assert all(torch.equal(g.nan_to_num(7), want.nan_to_num(7)) for g, want in zip(grads, twin_grads)), step
        assert torch.equal(indices, want_indices), step
        assert torch.equal(values.nan_to_num(7), want_values.nan_to_num(7)), step
        assert torch.equal(acc.nan_to_num(7), want_acc.nan_to_num(7)), step
        assert torch.equal(sent.nan_to_num(7), (want_values * 4.0).nan_to_num(7)), step
        assert torch.equal(packer.packed[0].nan_to_num(7), (want_values * 4.0).half().nan_to_num(7)), step
        assert torch.equal(packer.packed[1], want_indices.int()), step
        for m in (memory, twin):
            m.retain(name, indices)
            m.commit()
        assert torch.equal(memory.residual(name).nan_to_num(7), twin.residual(name).nan_to_num(7)), step
        if settled:
            assert graphs.accumulates and len(graphs) == min(step + 1 if step < 6 else step - 5, 2), step
    if settled:
        assert made == [2] * 4  # two buffers at k = 40, two at k = 1
    else:  # at each k: four graphs of the accumulate, then one of the selection per buffer
        assert made == 2 * ([2] * capture.GRAPHS_PER_BUCKET + [1, 1])
        assert not graphs.accumulates
    graphs.reset()
    assert len(graphs) == 0 and graphs.accumulates


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "options",
    [{}, FIDELITY["recipe"], {"aggregation": "reduce_scatter"}, FIDELITY["clip-feedback"]],
    ids=["paper", "recipe", "reduce-scatter", "clip-feedback"],
)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads-anew", "grads-in-place"])
def test_buckets_replayed_from_cuda_graphs_change_nothing(torch_group, monkeypatch, device, options, set_to_none):
    """``cuda_graphs=True``: the same parameters and residuals bit for bit as the default
    selector's, through the k of each stage of the density warm-up ("recipe"), under
    reduce_scatter and under the merged clip's give-back (which reads the selected values
    after the merge); every selection replayed from a graph. Where autograd adds into the
    same gradients, every graph includes the accumulate, one per staging buffer and k (and
    member without a gradient); where it allocates them anew, the graphs stay within the
    bound. On the CPU a stand-in replays into the same outputs, as a graph's replay does, and
    checks that the inputs lie where the capture's did; on CUDA the graphs are real."""
    if device == "cpu":
        graph_stand_in.install(monkeypatch.setattr)
    counts, make_graph = collections.Counter(), capture.cuda_graph

    def counted(run, inputs, device):
        counts["captured"] += 1
        counts["with the accumulate"] += "accumulate" in run.__qualname__
        replay, outputs = make_graph(run, inputs, device)

        def counted_replay(*inputs):
            counts["replayed"] += 1
            return replay(*inputs)

        return counted_replay, outputs

    monkeypatch.setattr(capture, "cuda_graph", counted)
    steps = 12
    eager = tiny_run(device, options, steps, set_to_none)
    assert not counts
    replayed = tiny_run(device, {**options, "cuda_graphs": True}, steps, set_to_none)
    for part in ("params", "residuals"):
        assert eager[part].keys() == replayed[part].keys()
        for name, value in eager[part].items():
            assert torch.equal(replayed[part][name], value), (part, name)
    sparse_units = len(eager["residuals"])
    stages = 5 if "density_warmup" in options else 1  # the warm-up's four densities and the final one
    assert counts["replayed"] + counts["captured"] == steps * sparse_units  # every selection, a graph's
    if set_to_none:
        assert 2 * sparse_units <= counts["captured"] <= (capture.GRAPHS_PER_BUCKET + 2) * stages * sparse_units
    else:
        assert counts["with the accumulate"] == counts["captured"], counts
        assert 2 * sparse_units <= counts["captured"] <= capture.GRAPHS_PER_BUCKET * stages * sparse_units
        assert replayed["graphs"] == dict.fromkeys(eager["residuals"], "accumulate and select")
    assert not eager["graphs"] and len(replayed["graphs"]) == sparse_units


def test_replays_on_another_stream_wait_for_the_last_one():
    """The graphs of a device share one pool, so their replays run one after another: each on
    the stream current in its hook, one on a stream other than the last replay's after that
    replay (``capture._InTurn``); on one stream nothing waits."""

    class Stream:
        def __init__(self, name):
            self.name, self.waited = name, []

        def wait_stream(self, other):
            self.waited.append(other.name)

    turns, backward, side = capture._InTurn(), Stream("backward"), Stream("side")
    for stream in (backward, backward, side, side, backward):
        turns.take(stream)
    assert backward.waited == ["side"] and side.waited == ["backward"]


@pytest.mark.parametrize("device", DEVICES)
def test_graphs_pack_the_message_as_the_eager_path_does(torch_group, monkeypatch, device):
    """With a GradScaler (the values sent times its scale), Horovod's fp16 compression and
    ``gradient_predivide_factor=2`` (times 1/2 before the wire under Average), each sparse
    bucket's graph packs the message the eager path packs: the same parameters and residuals
    bit for bit, every sparse message written by a graph and only launched by the engine."""
    compression = pytest.importorskip("horovod.torch").Compression.fp16
    if device == "cpu":
        graph_stand_in.install(monkeypatch.setattr)
    sent = collections.Counter()
    for method in ("start", "send"):
        original = getattr(Allgather, method)
        monkeypatch.setattr(
            Allgather, method, lambda self, *a, _o=original, _m=method: sent.update([_m]) or _o(self, *a)
        )

    def run(graphs: bool) -> dict:
        model = models.make_model().to(device)
        base = torch.optim.SGD(model.parameters(), lr=models.LR, momentum=models.MOMENTUM)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10)
        optimizer = lags.DistributedOptimizer(
            base,
            model.named_parameters(),
            density=models.DENSITY,
            recipe="paper",
            grad_scaler=scaler,
            compression=compression,
            gradient_predivide_factor=2.0,
            cuda_graphs=graphs,
        )
        for step in range(STEPS):
            optimizer.zero_grad()
            x, y = models.batch(0, step)
            scaler.scale(torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))).backward()
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        return {
            "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
            "residuals": {n: r.cpu() for n, r in optimizer.lags_state.residuals.state_dict().items()},
        }

    eager = run(False)
    launched = sent["start"]
    assert sent == {"start": launched, "send": launched} and launched > 0  # start packs, then sends
    sent.clear()
    replayed = run(True)
    assert sent == {"send": launched}  # every message written by a graph
    for part in ("params", "residuals"):
        for name, value in eager[part].items():
            assert torch.equal(replayed[part][name], value), (part, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graphs", [False, True], ids=["", "cuda-graphs"])
def test_the_ddp_hook_matches_the_oracle(torch_group, monkeypatch, device, graphs):
    """DDP (a bucket cap of about 100 entries) with ``lags_hook`` at P = 1, SGD with momentum and
    weight decay; with ``cuda_graphs=True`` too (off CUDA, the stand-in of the test above)."""
    if graphs and device == "cpu":
        graph_stand_in.install(monkeypatch.setattr)
    model = mlp().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=BUCKET_MB, device_ids=[0] if device == "cuda" else None
    )
    optimizer = torch.optim.SGD(
        model.parameters(), lr=models.LR, momentum=models.MOMENTUM, weight_decay=models.WEIGHT_DECAY
    )
    state = LAGSHookState(
        named_parameters=model.named_parameters(),
        optimizer=optimizer,
        density=test_ddp.DENSITY,
        recipe="paper",
        cuda_graphs=graphs,
    )
    ddp.register_comm_hook(state, lags_hook)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = (t.to(device) for t in mlp_batch(0, step))
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    params, eps = test_ddp.reference(1, STEPS, mlp, test_ddp.mlp_gradients)
    result = {
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "residuals": {n: r.cpu() for n, r in state.state_dict()["residuals"].items()},
    }
    test_ddp.assert_matches(result, params, eps[0], device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "options",
    [dict(recipe="paper"), dict(density_warmup=4, bucket_warmup=2), dict(recipe="paper", cuda_graphs=True)],
    ids=["paper", "default", "paper-graphs"],
)
@pytest.mark.parametrize("adam", [False, True], ids=["sgd", "adamw"])
def test_backward_never_synchronizes_the_device(torch_group, options, adam):
    """CUDA's sync debug mode turned to errors for every backward pass after the first
    iteration: the hooks (accumulate, select, launch the allgather) never wait for the GPU,
    under the paper's recipe and the default one (all four stages of a short density warm-up,
    the buckets planned at iteration 6 and the passes after, momentum or local-residual Adam
    correction). With the selections replayed from CUDA graphs, after the first two
    iterations (a graph's capture synchronises once, for each staging buffer).
    reduce_scatter is not here: its alltoall takes each bucket's counts on the host, one
    read per bucket by design; nor a grad_scaler, whose scale the first hook reads."""
    model = models.make_model().cuda()
    if adam:
        base = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        base = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=0.1)
    optimizer = lags.DistributedOptimizer(base, model.named_parameters(), density=0.1, **options)
    train_with_backward_unsynchronized(model, optimizer, 10, first=2 if options.get("cuda_graphs") else 1)
    assert optimizer.buckets_settled and optimizer.bucket_history == ([] if "recipe" in options else [mock.ANY])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backward_over_a_group_without_a_cpu_backend_never_synchronizes_the_device(torch_group):
    """Over a plain "nccl" group the step check's rows, made on the CPU in the first hook, reach
    the GPU through pinned memory (before: a blocking copy, which waited there for the forward
    pass and the backward so far, once an iteration)."""
    nccl_only = torch.distributed.new_group(backend="nccl")
    model = models.make_model().cuda()
    base = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    optimizer = lags.DistributedOptimizer(
        base, model.named_parameters(), density=0.1, recipe="paper", process_group=nccl_only
    )
    assert torch.distributed.get_backend(nccl_only) == "nccl"
    train_with_backward_unsynchronized(model, optimizer, 5, first=1)


def train_with_backward_unsynchronized(model, optimizer, steps: int, first: int) -> None:
    """``steps`` iterations, CUDA's sync debug mode set to errors around every backward pass
    from iteration ``first`` on: a hook that waits for the GPU raises."""
    for step in range(steps):
        optimizer.zero_grad()
        loss = models.loss_of(model, 0, step)
        if step >= first:
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole check")
def test_the_gpu_check_says_clearly_that_there_is_no_gpu_and_succeeds():
    root = Path(__file__).parent.parent
    done = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh")],
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU usable by torch" in done.stdout and "untested" in done.stdout


def test_the_device_timing_measures_every_phase(torch_group, tmp_path):
    """What the GPU check prints, here on the CPU: both recipes, every phase timed, the ratio
    consistent, the default's buckets planned (fewer than the paper's one per layer), the file
    written, and docs/gpu.md's table made from it (``--report``: a row per run, the rest of
    the page kept)."""
    out = tmp_path / "timing.json"
    result = device_timing.main(["--device", "cpu", "--rounds", "1", "--recipe", "paper", "default", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    paper, default = result["runs"]
    for run in (paper, default):
        for key in ("backward", "lags_backward", "lags_synchronize", "iteration", "lags_iteration"):
            assert run[key] > 0, key
        assert run["lags_over_plain"] == pytest.approx(run["lags_iteration"] / run["iteration"])
    assert (paper["recipe"], default["recipe"]) == ("paper", "default")
    resnet20, _, _ = experiment_models.build("resnet20", 2, seed=0)
    assert paper["buckets"] == len(list(resnet20.parameters())) > default["buckets"]
    doc = tmp_path / "gpu.md"
    doc.write_text("before\n<!-- device timing -->\nold table\n<!-- end device timing -->\nafter\n")
    device_timing.report(out, doc)
    text = doc.read_text()
    assert text.startswith("before\n<!-- device timing -->\n`timing.json`: cpu, torch ") and text.endswith("after\n")
    assert "old table" not in text and f"| ResNet-20 ({paper['batch']}) | paper | {paper['buckets']} |" in text
    assert f"|  | default | {default['buckets']} |" in text and f"**{default['lags_over_plain']:.2f}x** |" in text
    graphs = {**paper, "recipe": "paper-graphs", "graphs": {"accumulate and select": 60, "select": 5}}
    out.write_text(json.dumps({**result, "runs": [graphs]}))
    assert f"| paper-graphs (60 whole, 5 selection) | {paper['buckets']} |" in device_timing.report(out, doc)
