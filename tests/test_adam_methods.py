"""The Adam frontier's anchors (lags_hvd.experiments.adam_methods) against numpy references of
their papers' updates at P = 2: one step and several, and their traffic against a hand count."""

import json
import math

import numpy as np
import pytest
import torch
from launch import TORCH, horovodrun

from lags_hvd.experiments import adam_frontier, adam_study
from lags_hvd.experiments.adam_methods import AdamState, parse_method
from lags_hvd.experiments.compressors import Chunks, dct_basis, onebit_, orthogonalize_, smaller_divisor

SETTINGS = adam_study.Settings(eps=1e-3)
SHAPES = [(12, 16), (16,)]
WORKERS = 2


def gradients(steps: int, seed: int = 0) -> list[list[list[np.ndarray]]]:
    """``[step][worker][tensor]`` gradients, float32."""
    rng = np.random.default_rng(seed)
    return [
        [[rng.standard_normal(shape).astype(np.float32) for shape in SHAPES] for _ in range(WORKERS)]
        for _ in range(steps)
    ]


def start_model(seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) * 0.1 for shape in SHAPES]


def simulate(spec: str, grads, lrs):
    """The method's workers' models after each step: ``[step][worker][tensor]``, and its words."""
    params = [[torch.nn.Parameter(torch.from_numpy(x.copy())) for x in start_model()] for _ in range(WORKERS)]
    cls, options = parse_method(spec)
    method = cls(params, SETTINGS, options)
    models = []
    for step, (step_grads, lr) in enumerate(zip(grads, lrs)):
        for worker, worker_grads in zip(params, step_grads):
            for x, g in zip(worker, worker_grads):
                x.grad = torch.from_numpy(g.copy())
        method.step(step, lr)
        models.append([[x.detach().numpy().copy() for x in worker] for worker in params])
    return models, method.words


def assert_models(simulated, expected, rtol=2e-4, atol=2e-6):
    for step, (got, want) in enumerate(zip(simulated, expected)):
        for p in range(WORKERS):
            for i in range(len(SHAPES)):
                np.testing.assert_allclose(
                    got[p][i], want[p][i], rtol=rtol, atol=atol, err_msg=f"step {step} worker {p}"
                )


# ---------------------------------------------------------------- numpy references


class NumpyAdam:
    def __init__(self, shape, variance_updates_only=False):
        self.m, self.v, self.t, self.tv = np.zeros(shape), np.zeros(shape), 0, 0

    def moments(self, g, variance=True):
        b1, b2 = SETTINGS.betas
        self.t += 1
        self.m = b1 * self.m + (1 - b1) * g
        if variance:
            self.tv += 1
            self.v = b2 * self.v + (1 - b2) * g * g

    def denominator(self):
        return np.sqrt(self.v / (1 - SETTINGS.betas[1] ** self.tv)) + SETTINGS.eps

    def adamw(self, x, lr):
        return (
            x * (1 - lr * SETTINGS.weight_decay) - lr * self.m / (1 - SETTINGS.betas[0] ** self.t) / self.denominator()
        )


def np_onebit(z):
    scale = np.linalg.norm(z) / math.sqrt(z.size)
    return np.where(z >= 0, scale, -scale)


def np_dct(n):
    return np.array(
        [
            [math.sqrt((1 if k else 0.5) * 2 / n) * math.cos(math.pi * (2 * i + 1) * k / (2 * n)) for i in range(n)]
            for k in range(n)
        ]
    )


def np_blocks(x, side, basis):
    """Blocks of ``x`` (rows of ``side[0]`` x ``side[1]``, or runs of ``side[0]``) in ``basis``;
    returns a list of (slice, coefficients) and a function back."""
    out = []
    if x.ndim == 1:
        for s in range(0, x.size, side[0]):
            out.append(
                ((slice(s, s + side[0]),), basis[0] @ x[s : s + side[0]] if basis else x[s : s + side[0]].copy())
            )
        return out
    for r in range(0, x.shape[0], side[0]):
        for c in range(0, x.shape[1], side[1]):
            block = x[r : r + side[0], c : c + side[1]]
            out.append(
                (
                    (slice(r, r + side[0]), slice(c, c + side[1])),
                    basis[0] @ block @ basis[1].T if basis else block.copy(),
                )
            )
    return out


def np_inverse(block, basis):
    if not basis:
        return block
    return basis[0].T @ block if block.ndim == 1 else basis[0].T @ block @ basis[1]


def np_top(block, k):
    flat = block.ravel()
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out = np.zeros_like(flat)
    out[keep] = flat[keep]
    return out.reshape(block.shape), keep


# ---------------------------------------------------------------- the compressors


def test_dct_basis_is_orthonormal_and_the_textbook_dct():
    for n in (1, 4, 13, 64):
        basis = dct_basis(n, torch.float64).numpy()
        np.testing.assert_allclose(basis @ basis.T, np.eye(n), atol=1e-12)
        np.testing.assert_allclose(basis, np_dct(n), atol=1e-12)


@pytest.mark.parametrize("shape", [(12, 16), (65, 128), (16,), (6, 2, 4)])
@pytest.mark.parametrize("dct", [False, True])
def test_chunks_round_trip(shape, dct):
    x = torch.randn(shape, dtype=torch.float64)
    chunks = Chunks(torch.Size(shape), 8, dct=dct, dtype=torch.float64)
    blocks = chunks.encode(x)
    assert blocks.shape[0] * blocks.shape[1] == x.numel()
    torch.testing.assert_close(chunks.decode(blocks), x)


def test_block_sides_are_demos_largest_divisor_not_above_the_target():
    assert [smaller_divisor(n, 64) for n in (128, 65, 384, 7, 64)] == [64, 13, 64, 7, 64]
    assert Chunks(torch.Size((65, 128)), 64).sides == (13, 64)


def test_onebit_sends_scale_times_sign_and_keeps_the_rest():
    x, error = torch.tensor([0.5, -2.0, 0.0, 1.0]), torch.tensor([0.1, 0.0, 0.0, -1.0])
    sent = onebit_(x, error)
    z = np.array([0.6, -2.0, 0.0, 0.0])
    np.testing.assert_allclose(sent.numpy(), np_onebit(z), rtol=1e-6)
    np.testing.assert_allclose(error.numpy(), z - np_onebit(z), rtol=1e-6, atol=1e-7)


def test_orthogonalize_is_qr_with_a_positive_diagonal():
    m = torch.randn(9, 3, dtype=torch.float64)
    q, r = np.linalg.qr(m.numpy())
    np.testing.assert_allclose(orthogonalize_(m.clone()).numpy(), q * np.sign(np.diag(r)), atol=1e-10)


# ---------------------------------------------------------------- the methods


def test_zero_one_adam_is_the_papers_two_phases():
    """variance_scaler 2, freeze after step 5, local intervals 1, 1, 2 (doubling every 2 steps):
    dense variance steps at t = 1, 2, 4 (the interval doubles after 2 of them), 1-bit steps at
    3 and 5, then local steps synced at t = 6, 7, 8 and 12 (intervals 1, 1, 2, 4)."""
    steps, lrs = 12, [0.01 + 0.001 * t for t in range(12)]
    grads = gradients(steps)
    spec = "zero-one:variance_scaler=2,freeze=5,local_scaler=2,local_max=4"
    simulated, words = simulate(spec, grads, lrs)
    b1, wd = SETTINGS.betas[0], SETTINGS.weight_decay
    x = start_model()
    adam = [NumpyAdam(s) for s in SHAPES]
    werr = [[np.zeros(s) for s in SHAPES] for _ in range(WORKERS)]
    serr = [np.zeros(s) for s in SHAPES]
    expected, hand = [], 0.0
    interval, count = 1, 0
    dense_steps = []
    for t in range(1, 6):
        g_all = grads[t - 1]
        dense = t % interval == 0
        for i, shape in enumerate(SHAPES):
            n = math.prod(shape)
            if dense:
                g, hand = (g_all[0][i] + g_all[1][i]) / 2, hand + n
            else:
                sent = []
                for p in range(WORKERS):
                    z = g_all[p][i] + werr[p][i]
                    sent.append(np_onebit(z))
                    werr[p][i] = z - sent[-1]
                z = (sent[0] + sent[1]) / 2 + serr[i]
                g, serr[i] = np_onebit(z), z - np_onebit(z)
                hand += n / 32 + 2
            adam[i].moments(g, variance=dense)
            x[i] = adam[i].adamw(x[i], lrs[t - 1])
        if dense:
            dense_steps.append(t)
            count += 1
            if count == 2:
                count, interval = 0, 2 * interval
        expected.append([[a.copy() for a in x] for _ in range(WORKERS)])
    assert dense_steps == [1, 2, 4]
    xs = [[a.copy() for a in x] for _ in range(WORKERS)]
    m = [[adam[i].m.copy() for i in range(len(SHAPES))] for _ in range(WORKERS)]
    acc = [[np.zeros(s) for s in SHAPES] for _ in range(WORKERS)]
    werr = [[np.zeros(s) for s in SHAPES] for _ in range(WORKERS)]
    serr = [np.zeros(s) for s in SHAPES]
    local, count, lrs_sum, syncs = 1, 0, 0.0, []
    for t in range(6, 13):
        lr = lrs[t - 1]
        lrs_sum += lr
        c1 = 1 - b1**t
        for i in range(len(SHAPES)):
            den = adam[i].denominator()
            for p in range(WORKERS):
                m[p][i] = b1 * m[p][i] + (1 - b1) * grads[t - 1][p][i]
                update = lr * (m[p][i] / c1 / den + wd * xs[p][i])
                xs[p][i] = xs[p][i] - update
                acc[p][i] = acc[p][i] + update
        if t % local == 0:
            syncs.append(t)
            for i, shape in enumerate(SHAPES):
                den = adam[i].denominator()
                synced = xs[0][i] + acc[0][i]
                sent = []
                for p in range(WORKERS):
                    z = acc[p][i] * den + werr[p][i]
                    sent.append(np_onebit(z))
                    werr[p][i] = z - sent[-1]
                z = (sent[0] + sent[1]) / 2 + serr[i]
                mean, serr[i] = np_onebit(z), z - np_onebit(z)
                hand += math.prod(shape) / 32 + 2
                for p in range(WORKERS):
                    xs[p][i] = synced - mean / den
                    m[p][i] = mean * c1 / lrs_sum
                    acc[p][i] = np.zeros(shape)
            lrs_sum = 0.0
        count += 1
        if count == 2:
            count, local = 0, min(4, 2 * local)
        expected.append([[a.copy() for a in w] for w in xs])
    assert syncs == [6, 7, 8, 12]
    assert_models(simulated, expected)
    assert words == pytest.approx(hand)
    assert any(not np.array_equal(a, b) for a, b in zip(*simulated[9]))  # t = 10 is local: the workers differ


def test_demo_is_the_papers_step():
    """chunk 4 (blocks 4 x 4 of the matrix, runs of 4 of the vector), 3 coefficients each."""
    steps, lrs, k = 4, [0.01, 0.02, 0.015, 0.01], 3
    grads = gradients(steps)
    simulated, words = simulate(f"demo:topk={k},chunk=4,decay=0.9", grads, lrs)
    x = start_model()
    delta = [[np.zeros(s) for s in SHAPES] for _ in range(WORKERS)]
    sides = [(4, 4), (4,)]
    bases = [[np_dct(n) for n in side] for side in sides]
    expected, hand = [], 0
    for step, lr in enumerate(lrs):
        for i in range(len(SHAPES)):
            sums, counts = np.zeros(SHAPES[i]), np.zeros(SHAPES[i])
            sent_blocks = []
            for p in range(WORKERS):
                delta[p][i] = 0.9 * delta[p][i] + lr * grads[step][p][i]
                transmitted = np.zeros(SHAPES[i])
                mine = []
                for where, coefficients in np_blocks(delta[p][i], sides[i], bases[i]):
                    top, keep = np_top(coefficients, k)
                    transmitted[where] = np_inverse(top, bases[i])
                    mine.append((where, top, keep))
                delta[p][i] = delta[p][i] - transmitted
                sent_blocks.append(mine)
                hand += 2 * k * len(mine) if p == 0 else 0
            merged = np.zeros(SHAPES[i])
            for b in range(len(sent_blocks[0])):
                where = sent_blocks[0][b][0]
                total = np.zeros(sent_blocks[0][b][1].size)
                count = np.zeros(sent_blocks[0][b][1].size)
                for p in range(WORKERS):
                    _, top, keep = sent_blocks[p][b]
                    total[keep] += top.ravel()[keep]
                    count[keep] += 1
                mean = np.where(count > 0, total / np.maximum(count, 1), 0.0).reshape(sent_blocks[0][b][1].shape)
                merged[where] = np_inverse(mean, bases[i])
            del sums, counts
            x[i] = x[i] * (1 - lr * SETTINGS.weight_decay) - lr * np.sign(merged)
        expected.append([[a.copy() for a in x] for _ in range(WORKERS)])
    assert_models(simulated, expected, rtol=1e-5, atol=1e-6)
    assert words == hand == steps * 2 * k * (12 + 4)


@pytest.mark.parametrize("spec", ["diloco:every=3", "sparseloco:every=3,topk=2,chunk=4,ef_decay=0.5"])
def test_diloco_and_sparseloco_are_inner_adamw_and_an_outer_step(spec):
    steps, lrs = 7, [0.01 * (1 + t % 3) for t in range(7)]
    grads = gradients(steps)
    simulated, words = simulate(spec, grads, lrs)
    _, options = parse_method(spec)
    outer = start_model()
    xs = [[a.copy() for a in outer] for _ in range(WORKERS)]
    adam = [[NumpyAdam(s) for s in SHAPES] for _ in range(WORKERS)]
    buffer = [np.zeros(s) for s in SHAPES]
    error = [[np.zeros(s) for s in SHAPES] for _ in range(WORKERS)]
    sides = [(4, 4), (4,)]
    expected, hand = [], 0
    for step, lr in enumerate(lrs):
        for p in range(WORKERS):
            for i in range(len(SHAPES)):
                adam[p][i].moments(grads[step][p][i])
                xs[p][i] = adam[p][i].adamw(xs[p][i], lr)
        if (step + 1) % 3 == 0:
            for i, shape in enumerate(SHAPES):
                pseudo = [outer[i] - xs[p][i] for p in range(WORKERS)]
                if options.topk:
                    sent = []
                    for p in range(WORKERS):
                        error[p][i] = options.ef_decay * error[p][i] + pseudo[p]
                        c = np.zeros(shape)
                        blocks = np_blocks(error[p][i], sides[i], None)
                        for where, block in blocks:
                            c[where] = np_top(block, options.topk)[0]
                        error[p][i] = error[p][i] - c
                        sent.append(c)
                        hand += 2 * options.topk * len(blocks) if p == 0 else 0
                    mean = (sent[0] + sent[1]) / 2
                    outer[i] = outer[i] - mean
                else:
                    mean = (pseudo[0] + pseudo[1]) / 2
                    hand += math.prod(shape)
                    buffer[i] = 0.9 * buffer[i] + mean
                    outer[i] = outer[i] - 0.7 * (mean + 0.9 * buffer[i])
                for p in range(WORKERS):
                    xs[p][i] = outer[i].copy()
        expected.append([[a.copy() for a in w] for w in xs])
    assert_models(simulated, expected)
    assert words == hand
    assert any(not np.array_equal(a, b) for a, b in zip(*simulated[3]))  # mid-round: each its own model


def test_powersgd_is_the_hooks_compression_with_adamw_on_its_output():
    """rank 2 from step 2: steps 0 and 1 allreduce everything; the vector is always whole
    (rank 1 of a 16 x 1 matrix saves nothing); P = orth(sum M_p Q), Q = mean M_p^T P."""
    steps, lrs, r = 5, [0.01] * 5, 2
    grads = gradients(steps)
    simulated, words = simulate(f"powersgd:rank={r},start=2", grads, lrs)
    x = start_model()
    adam = [NumpyAdam(s) for s in SHAPES]
    error = [np.zeros(SHAPES[0]) for _ in range(WORKERS)]
    q0 = torch.randn(16, r, generator=torch.Generator().manual_seed(0), dtype=torch.float32).numpy().astype(np.float64)

    def orth(m):
        q, rr = np.linalg.qr(m)
        return q * np.sign(np.diag(rr))

    q, expected, hand = orth(q0), [], 0
    for step, lr in enumerate(lrs):
        for i, shape in enumerate(SHAPES):
            if i == 1 or step < 2:
                g = (grads[step][0][i] + grads[step][1][i]) / 2
                hand += math.prod(shape)
            else:
                ms = [grads[step][p][0] + error[p] for p in range(WORKERS)]
                q = orth(q)
                p_sum = orth(sum(m @ q for m in ms))
                q = sum(m.T @ p_sum for m in ms) / WORKERS
                g = p_sum @ q.T
                error = [m - g for m in ms]
                hand += (12 + 16) * r
            adam[i].moments(g)
            x[i] = adam[i].adamw(x[i], lr)
        expected.append([[a.copy() for a in x] for _ in range(WORKERS)])
    assert_models(simulated, expected, rtol=1e-4, atol=1e-5)
    assert words == hand


def test_adam_state_is_torchs_adamw():
    x = torch.randn(5, dtype=torch.float64)
    reference = torch.nn.Parameter(x.clone())
    adamw = torch.optim.AdamW([reference], lr=0.01, betas=SETTINGS.betas, eps=SETTINGS.eps, weight_decay=0.1)
    state = AdamState(x, SETTINGS.betas, SETTINGS.eps)
    for step in range(4):
        g = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        reference.grad = g.clone()
        adamw.step()
        state.moments_(g)
        state.step_(x, 0.01, 0.1)
    torch.testing.assert_close(x, reference.detach())


def test_method_specs_are_checked_before_anything_runs():
    cls, options = parse_method("sparseloco:every=5,ef_decay=0.5")
    assert (cls.__name__, options.every, options.ef_decay, options.outer_lr) == ("SparseLoCo", 5, 0.5, 1.0)
    assert parse_method("lags:echo=true")[1].echo is True
    with pytest.raises(ValueError, match="unknown method 'adam'"):
        parse_method("adam")
    with pytest.raises(ValueError, match="demo has no option 'density'; it has topk, chunk, decay"):
        parse_method("demo:density=0.1")
    with pytest.raises(ValueError, match="demo has no option"):
        adam_study.main(["--methods", "dense", "demo:density=0.1", "--steps", "1"])
    with pytest.raises(ValueError, match="lags rule must be"):
        simulate("lags:rule=mean", gradients(1), [0.01])


def test_every_frontier_spec_parses():
    for spec in adam_frontier.FRONTIER:
        parse_method(spec)


def test_the_frontier_counts_differences_within_a_standard_deviation_as_level():
    def point(spec, traffic, *perplexities):
        runs = [
            {"settings": {"seed": 42 + i}, "perplexity": p, "words_vs_dense": traffic}
            for i, p in enumerate(perplexities)
        ]
        return adam_frontier.Point(spec, runs)

    cheap_good = point("a", 0.01, 5.0, 5.2)  # 5.1 ± 0.14
    dear_bad = point("b", 0.02, 5.5, 5.7)  # beaten by a: cheaper and 0.4 lower
    dear_level = point("c", 0.03, 5.15, 5.25)  # 0.1 worse: within a's deviation
    cheaper_worse = point("d", 0.005, 6.0)  # cheaper than all: nothing beats it on traffic
    everyone = [cheap_good, dear_bad, dear_level, cheaper_worse]
    assert adam_frontier.dominated(dear_bad, everyone) is cheap_good
    assert adam_frontier.dominated(dear_level, everyone) is None
    assert adam_frontier.dominated(cheaper_worse, everyone) is None
    assert adam_frontier.dominated(cheap_good, everyone) is None


def test_the_frontier_report_rewrites_its_block_from_the_runs(tmp_path):
    import json

    results, doc = tmp_path / "results", tmp_path / "docs" / "adam.md"
    (results / "1200").mkdir(parents=True)
    doc.parent.mkdir()
    doc.write_text("before\n<!-- frontier 1200 -->\nold\n<!-- end frontier 1200 -->\nafter\n")
    doc.write_text(doc.read_text() + "<!-- processes -->\n<!-- end processes -->\n")
    runs = [("dense", 42, 5.0, 1.0), ("dense", 43, 5.2, 1.0), ("lags", 42, 5.5, 0.04)]
    runs += [("demo", 42, 6.0, 0.08), ("demo", 44, 9.0, 0.08)]  # against dense at seed 42 alone: +20%
    for spec, seed, perplexity, traffic in runs:
        run = {"settings": {"method": spec, "seed": seed}, "perplexity": perplexity, "words_vs_dense": traffic}
        (results / "1200" / f"{spec}.seed{seed}.json").write_text(json.dumps([run]))
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "shakespeare-gpt.dense.seed42.csv").write_text("epoch,validation_perplexity\n1,9.0\n2,5.05\n")
    adam_frontier.report(1200, results, doc, suite)
    text = doc.read_text()
    assert text.startswith("before\n<!-- frontier 1200 -->\n") and "<!-- end frontier 1200 -->\nafter\n" in text
    assert "| `dense` | 1.0000 | 5.000 | 1.0000 | 5.050 | +1.00% |\n<!-- end processes -->" in text
    assert "old" not in text
    assert (
        "| `lags` | the first recipe: density 0.001 after DGC's 200-step warm-up from 0.25 | 42 | 0.0400 | 5.500 "
        "| +10.0% | **yes** |" in text
    )
    assert (
        "| `dense` | AdamW on the mean gradient: the reference | 42,43 | 1.0000 | 5.100 ± 0.141 |  | **yes** |" in text
    )
    assert "| `demo` |  | 42,44 | 0.0800 | 7.500 ± 2.121 | +20.0% | **yes** |" in text
    assert (doc.parent / "img" / "adam-frontier-1200.png").stat().st_size > 0
    doc.write_text("no block\n")
    with pytest.raises(ValueError, match="has no <!-- frontier 1200 -->"):
        adam_frontier.report(1200, results, doc, suite)


@pytest.mark.parametrize("world,controller", [(2, "gloo"), (3, "mpi"), (2, TORCH)])
def test_every_method_in_processes_matches_the_one_process_simulation(world, controller, tmp_path):
    """Each method of the frontier run by P processes (``groups.Collective``: this rank's worker,
    its launcher's collectives) ends where the simulation of all P workers in one process
    (``groups.Simulated``, the study's and the numpy references' above) ends for that rank's
    worker, and counts the same words: so the suite's processes and the study run one method."""
    horovodrun(world, controller, "adam_methods_worker.py", "--out", str(tmp_path), timeout=120)
    for rank in range(world):
        for spec, result in json.loads((tmp_path / f"{rank}.json").read_text()).items():
            assert result["difference"] <= 1e-5, (rank, spec, result)
            assert result["words"][0] == result["words"][1] > 0, (rank, spec, result)


def test_the_processes_table_sets_the_suites_runs_beside_the_studys(tmp_path):
    """Per method run by the suite: the study's traffic and perplexity at seed 42 beside the
    processes' last row (its words_vs_dense; dense's is 1); methods either lacks are left out."""
    doc, suite = tmp_path / "adam.md", tmp_path / "suite"
    suite.mkdir()
    doc.write_text("<!-- processes -->\nold\n<!-- end processes -->\n")
    rows = "epoch,validation_perplexity,words_vs_dense\n1,9.0,0.1\n6,6.30,0.0203\n"
    (suite / "shakespeare-gpt.adam-demo32.seed42.csv").write_text(rows)
    (suite / "shakespeare-gpt.adam-diloco20.seed42.csv").write_text(rows)  # not in the study: left out
    runs = [{"settings": {"seed": s}, "perplexity": p, "words_vs_dense": 0.02} for s, p in ((42, 6.0), (43, 7.0))]
    study = {"demo:topk=32": adam_frontier.Point("demo:topk=32", runs)}
    adam_frontier.processes_report(study, suite, doc)
    text = doc.read_text()
    assert "| `demo:topk=32` | 0.0200 | 6.000 | 0.0203 | 6.300 | +5.00% |\n<!-- end processes -->" in text
    assert "old" not in text and "diloco" not in text


def test_a_method_as_an_optimizer_starts_from_the_model_at_its_first_step():
    """MethodOptimizer builds its method at the first step: a model overwritten after the
    optimizer was made (the ranks' broadcast) is where LAGS's consensus starts, so the step
    equals the method's own step from the new model. One param group, gradients required,
    no resume."""
    from lags_hvd.experiments.adam_methods import MethodOptimizer
    from lags_hvd.experiments.groups import Simulated

    spec = "lags:density=0.5,density_warmup=0"
    model = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(3))]
    optimizer = MethodOptimizer(model, spec, Simulated(1), lr=0.1, weight_decay=0.01)
    broadcast = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    broadcast[1] = broadcast[1][0, :3]
    for x, new in zip(model, broadcast):
        x.data.copy_(new)
        x.grad = torch.ones_like(x)
    optimizer.step()
    reference = [torch.nn.Parameter(x.clone()) for x in broadcast]
    for x in reference:
        x.grad = torch.ones_like(x)
    cls, options = parse_method(spec)
    cls([reference], adam_study.Settings(weight_decay=0.01), options).step(0, 0.1)
    for x, expected in zip(model, reference):
        assert torch.equal(x, expected)
    assert optimizer.words_vs_dense() == pytest.approx((2 * 6 + 3) / 15)  # k = 6 of 12, the vector whole
    with pytest.raises(ValueError, match="one param group"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match="one group"):
        MethodOptimizer([{"params": model}], spec, Simulated(1), lr=0.1, weight_decay=0.0)
    model[1].grad = None
    with pytest.raises(ValueError, match=r"parameters \[1\] have no gradient"):
        optimizer.step()
    with pytest.raises(ValueError, match="cannot resume"):
        optimizer.load_state_dict(optimizer.state_dict())
