"""Data-parallel methods for Adam on P workers: LAGS and its anchors, in one process or in P.

Every method sees the models of the workers this process holds as ``params[p][i]`` (local
worker p, tensor i) with each worker's gradient in ``.grad``, and moves them by one
``step(step, lr)``; what crosses workers goes through its ``groups.Group`` (all P workers in
one process in the study, one per process in the suite's jobs). ``words`` counts
what one worker puts on the wire over the run, in 4-byte words, from the messages it builds:
a dense allreduce of ``n`` entries counts ``n``, a sparse message its values and indices
(``2 k``), a 1-bit allreduce ``n / 32`` and its scales. It is the traffic of the method's
protocol: in processes a compressed message travels as the float32 tensor it decompresses
to (a 1-bit allreduce as an allreduce of its signs times scales), so the words are counted,
not measured on the wire. The methods, with their papers:

``dense``        AdamW on the mean gradient (data parallelism), moments shared.
``lags``         the default recipe's rule (Adam correction): each worker's Adam step ``u_p``
                 goes through its residual, ``s_p = TopK(eps_p + u_p)``, ``x -= mean_p s_p``,
                 ``x_p = x - c eps_p`` ("local", or ``x_p = x`` "consensus"); 1-D tensors whole.
``zero-one``     0/1 Adam (arXiv 2202.06009, DeepSpeed's ``ZeroOneAdam``): the variance is
                 updated from a dense mean gradient at steps ``t % T_v == 0``, ``T_v`` doubling
                 after every ``variance_scaler`` updates; between them the momentum takes the
                 1-bit allreduced gradient (worker and server error feedback). After
                 ``freeze`` the variance is frozen and each worker takes local steps, synced by
                 a 1-bit allreduce of the accumulated momentum every ``T_u`` steps, ``T_u``
                 doubling every ``local_scaler`` steps up to ``local_max``. Adam's bias
                 corrections are applied (DeepSpeed applies none; ours is AdamW's schedule).
``demo``         DeMo (arXiv 2411.19870): each worker's ``delta_p = decay delta_p + lr g_p``,
                 the top ``topk`` DCT-II coefficients of each ``chunk x chunk`` block sent and
                 subtracted, the gathered coefficients merged (mean where several sent one),
                 ``x -= lr sign(IDCT(merged))``, decoupled weight decay.
``diloco``       DiLoCo (arXiv 2311.08105): ``every`` local AdamW steps per worker, then the
                 mean pseudo-gradient ``mean_p (x_outer - x_p)`` (dense) into Nesterov SGD
                 (lr 0.7, momentum 0.9).
``sparseloco``   SparseLoCo (arXiv 2508.15706): the same inner steps; each worker's error
                 feedback ``e_p = ef_decay e_p + (x_outer - x_p)``, its top ``topk`` per
                 ``chunk x chunk`` block sent and subtracted, ``x_outer -= outer_lr mean_p c_p``.
                 Values are counted as 32-bit words (the paper packs them in 2 bits and its
                 indices in 12: a packing that would shrink every sparse method's messages).
``powersgd``     torch's PowerSGD hook (arXiv 1905.13727) with AdamW on its output: each
                 matrix ``M_p = g_p + e_p`` (``view(shape[0], -1)``), ``P = orth(sum_p M_p Q)``,
                 ``Q = mean_p M_p^T P`` (warm-started, orthogonalized), ``e_p = M_p - P Q^T``;
                 a tensor where rank ``r`` saves less than ``min_compression_rate`` and every
                 tensor before ``start`` is allreduced whole.
"""

from __future__ import annotations

import dataclasses
import types
import typing

import torch

from ..density import k_for_density, warmup_density
from .compressors import Chunks, onebit_, orthogonalize_
from .groups import Group, Simulated

__all__ = ["Method", "METHODS", "parse_method", "AdamState", "MethodOptimizer"]


class AdamState:
    """Adam's moments of one tensor; ``variance_updates`` counts the updates of ``v`` for its
    bias correction (0/1 Adam skips some)."""

    def __init__(self, like: torch.Tensor, betas: tuple[float, float], eps: float):
        self.m, self.v = torch.zeros_like(like), torch.zeros_like(like)
        self.betas, self.eps = betas, eps
        self.steps = self.variance_updates = 0

    def moments_(self, g: torch.Tensor, variance: bool = True) -> None:
        beta1, beta2 = self.betas
        self.steps += 1
        self.m.mul_(beta1).add_(g, alpha=1 - beta1)
        if variance:
            self.variance_updates += 1
            self.v.mul_(beta2).addcmul_(g, g, value=1 - beta2)

    def denominator(self) -> torch.Tensor:
        """``sqrt(v / (1 - b2^updates)) + eps``."""
        return (self.v / (1 - self.betas[1] ** self.variance_updates)).sqrt_().add_(self.eps)

    def step_(self, x: torch.Tensor, lr: float, weight_decay: float) -> None:
        """AdamW: ``x = x (1 - lr wd) - lr m / (1 - b1^t) / denominator``."""
        correction1 = 1 - self.betas[0] ** self.steps
        x.mul_(1 - lr * weight_decay).addcdiv_(self.m, self.denominator(), value=-lr / correction1)


class Method:
    """One data-parallel method over ``params[p][i]``; subclasses declare their ``Options``."""

    @dataclasses.dataclass
    class Options:
        pass

    def __init__(self, params: list[list[torch.Tensor]], settings, options: Options, group: Group | None = None):
        self.params, self.s, self.o = params, settings, options
        self.group = group or Simulated(len(params))
        if self.group.local != len(params):
            raise ValueError(f"{len(params)} local workers' models for a group holding {self.group.local}")
        self.workers = self.group.size
        self.words = 0.0

    def step(self, step: int, lr: float) -> None:
        raise NotImplementedError

    def zeros_per_worker(self) -> list[list[torch.Tensor]]:
        """A zero tensor like each of the model's, for each worker: ``[worker][tensor]``."""
        return [[torch.zeros_like(x) for x in self.params[0]] for _ in self.params]

    def sent(self, *messages: torch.Tensor, bits: int = 32) -> None:
        """Count the messages one worker sends."""
        self.words += sum(m.numel() for m in messages) * bits / 32

    def grads(self, i: int) -> list[torch.Tensor]:
        return [params[i].grad for params in self.params]

    def set_all(self, i: int, x: torch.Tensor) -> None:
        for params in self.params:
            params[i].data.copy_(x)

    def mean_model_(self, i: int) -> torch.Tensor:
        """Tensor ``i`` of every worker set to the workers' mean, which is returned (not counted:
        the callers that send it for training count it)."""
        x = self.group.mean([params[i].detach() for params in self.params])
        self.set_all(i, x)
        return x

    def adam(self, like: torch.Tensor) -> AdamState:
        return AdamState(like, self.s.betas, self.s.eps)

    def dense_adamw_(self, i: int, state: AdamState, lr: float) -> None:
        """Tensor ``i`` sent whole: AdamW on the mean gradient, ``state`` shared."""
        mean = self.group.mean(self.grads(i))
        self.sent(mean)
        x = self.params[0][i].detach()
        state.moments_(mean)
        state.step_(x, lr, self.s.weight_decay)
        self.set_all(i, x)


class Dense(Method):
    def __init__(self, params, settings, options, group=None):
        super().__init__(params, settings, options, group)
        self.state = [self.adam(x) for x in params[0]]

    def step(self, step, lr):
        for i, state in enumerate(self.state):
            self.dense_adamw_(i, state, lr)


class Lags(Method):
    """The default recipe's Adam rule; ``echo`` and ``average_every`` are variants of the study.
    ``density_warmup_start`` is DGC's 0.25, the recipe's until the frontier showed that under
    Adam correction 0.05 loses nothing (the library's default now): name it to get that."""

    @dataclasses.dataclass
    class Options:
        rule: str = "local"
        density: float = 0.001
        density_warmup: int = 200
        density_warmup_start: float = 0.25
        residual_scale: float = 1.0
        average_every: int = 0
        echo: bool = False

    def __init__(self, params, settings, options, group=None):
        super().__init__(params, settings, options, group)
        if options.rule not in ("local", "consensus"):
            raise ValueError(f"lags rule must be 'local' or 'consensus', got {options.rule!r}")
        self.consensus = [x.detach().clone() for x in params[0]]
        self.state = [[self.adam(x) for x in self.consensus] for _ in params]  # [worker][tensor]
        self.residual = self.zeros_per_worker()
        self.shared = [self.adam(x) for x in self.consensus]  # of the tensors sent whole
        self.last_chosen: list[list[torch.Tensor] | None] = [None] * len(self.consensus)

    def step(self, step, lr):
        o = self.o
        density = warmup_density(step, o.density, o.density_warmup_start, o.density_warmup)
        for i, x in enumerate(self.consensus):
            if x.dim() == 1:
                self.dense_adamw_(i, self.shared[i], lr)
                x.copy_(self.params[0][i].detach())
                continue
            k = k_for_density(density, x.numel())
            last = self.last_chosen[i] if o.echo else None
            positions, values, echoed = [], [], []  # per local worker: k positions, their values, echo's
            for j, (p, g) in enumerate(zip(self.group.ranks, self.grads(i))):
                state, eps = self.state[j][i], self.residual[j][i]
                state.moments_(g)
                eps.addcdiv_(state.m, state.denominator(), value=lr / (1 - state.betas[0] ** state.steps))  # eps + u
                chosen = torch.topk(eps.abs().flatten(), k, sorted=False).indices
                positions.append(chosen)
                values.append(eps.flatten()[chosen])
                if j == 0:
                    self.sent(values[-1], chosen)
                if last is not None:  # and values at the others' last positions: everyone knows those
                    others = torch.cat([c for q, c in enumerate(last) if q != p])
                    echoed.append(eps.flatten()[others])
                    if j == 0:
                        self.sent(others)
                    eps.view(-1).index_fill_(0, others, 0.0)
                eps.view(-1).index_fill_(0, chosen, 0.0)
            positions, values = self.group.gather(positions), self.group.gather(values)
            if o.echo:
                self.last_chosen[i] = list(positions)
            if last is not None:  # each worker's union of its own and the others' last positions
                for q, echo in enumerate(self.group.gather(echoed)):
                    union = torch.cat([positions[q], *(c for r, c in enumerate(last) if r != q)])
                    unique, where = torch.unique(union, return_inverse=True)
                    both = torch.cat([values[q], echo])  # a position in both: the same value twice
                    positions[q], values[q] = unique, both.new_empty(len(unique)).scatter_(0, where, both)
            merged = torch.zeros_like(x)
            for chosen, sent in zip(positions, values):
                merged.view(-1).index_add_(0, chosen, sent / self.workers)
            x.mul_(1 - lr * self.s.weight_decay).sub_(merged)
            local = o.residual_scale if o.rule == "local" else 0.0
            for p, params in enumerate(self.params):
                params[i].data.copy_(x - local * self.residual[p][i] if local else x)
        if o.average_every and (step + 1) % o.average_every == 0:
            self.average()

    def average(self) -> None:
        """Every worker on the mean model, the residuals zeroed (``average_models()``, dense)."""
        if self.o.rule != "local":
            return
        for i, x in enumerate(self.consensus):
            x.copy_(self.mean_model_(i))
            self.sent(x)
            for residual in self.residual:
                residual[i].zero_()


class ZeroOneAdam(Method):
    @dataclasses.dataclass
    class Options:
        variance_scaler: int = 16
        freeze: int = 0  # 0: never; else the variance freezes and local steps start after it
        local_scaler: int = 64
        local_max: int = 16

    def __init__(self, params, settings, options, group=None):
        super().__init__(params, settings, options, group)
        self.state = [self.adam(x) for x in params[0]]  # m shared until the freeze, v always
        self.momentum = [[s.m.clone() for s in self.state] for _ in params]  # each worker's, after it
        self.worker_error = self.zeros_per_worker()
        self.server_error = [torch.zeros_like(x) for x in params[0]]
        self.accumulated = self.zeros_per_worker()  # sum of lr * update
        self.variance_interval, self.variance_count = 1, 0
        self.local_interval, self.local_count, self.lrs = 1, 0, 0.0

    def onebit_allreduce(self, xs: list[torch.Tensor], i: int) -> torch.Tensor:
        sent = [onebit_(x, errors[i]) for x, errors in zip(xs, self.worker_error)]
        self.sent(sent[0], bits=1)
        self.words += 2  # the worker's scale, and its server chunk's
        return onebit_(self.group.mean(sent), self.server_error[i])

    def step(self, step, lr):
        t, o = step + 1, self.o
        if o.freeze and t > o.freeze:
            return self.local_step(t, lr)
        dense = t % self.variance_interval == 0
        for i, state in enumerate(self.state):
            grads = self.grads(i)
            if dense:
                mean = self.group.mean(grads)
                self.sent(mean)
            else:
                mean = self.onebit_allreduce(grads, i)
            state.moments_(mean, variance=dense)
            x = self.params[0][i].detach()
            state.step_(x, lr, self.s.weight_decay)
            self.set_all(i, x)
        if dense:
            self.variance_count += 1
            if self.variance_count == o.variance_scaler:
                self.variance_count, self.variance_interval = 0, 2 * self.variance_interval

    def local_step(self, t: int, lr: float) -> None:
        """After the freeze: a local step per worker; every ``local_interval`` steps the
        accumulated steps are replaced by their 1-bit allreduced mean."""
        o, beta1 = self.o, self.s.betas[0]
        if t == o.freeze + 1:
            for i, state in enumerate(self.state):
                for p in range(self.group.local):
                    self.momentum[p][i].copy_(state.m)
                    self.worker_error[p][i].zero_()
                self.server_error[i].zero_()
        self.lrs += lr
        correction1 = 1 - beta1**t
        for i, state in enumerate(self.state):
            denominator = state.denominator()
            for p, g in enumerate(self.grads(i)):
                m, x = self.momentum[p][i].mul_(beta1).add_(g, alpha=1 - beta1), self.params[p][i].detach()
                update = (m / correction1 / denominator).add_(x, alpha=self.s.weight_decay).mul_(lr)
                x.sub_(update)
                self.accumulated[p][i].add_(update)
        if t % self.local_interval == 0:
            for i, state in enumerate(self.state):
                denominator = state.denominator()
                synced = self.params[0][i].detach() + self.accumulated[0][i]
                mean = self.onebit_allreduce([a[i] * denominator for a in self.accumulated], i)
                synced.sub_(mean / denominator)
                self.set_all(i, synced)
                for p in range(self.group.local):
                    self.momentum[p][i].copy_(mean).div_(self.lrs / correction1)
                    self.accumulated[p][i].zero_()
            self.lrs = 0.0
        self.local_count += 1
        if self.local_count == o.local_scaler:
            self.local_count, self.local_interval = 0, min(o.local_max, 2 * self.local_interval)


class DeMo(Method):
    @dataclasses.dataclass
    class Options:
        topk: int = 32
        chunk: int = 64
        decay: float = 0.999

    def __init__(self, params, settings, options, group=None):
        super().__init__(params, settings, options, group)
        self.chunks = [Chunks(x.shape, options.chunk, dct=True, dtype=x.dtype) for x in params[0]]
        self.delta = self.zeros_per_worker()

    def step(self, step, lr):
        for i, chunks in enumerate(self.chunks):
            taken = [  # each worker's top coefficients, out of its delta
                chunks.take_top_(self.delta[p][i].mul_(self.o.decay).add_(g, alpha=lr), self.o.topk)[:2]
                for p, g in enumerate(self.grads(i))
            ]
            indices, values = zip(*taken)
            self.sent(indices[0], values[0])
            indices, values = self.group.gather(list(indices)), self.group.gather(list(values))
            merged = chunks.scatter(torch.cat(indices, 1), torch.cat(values, 1), mean=True)
            x = self.params[0][i].detach()
            x.mul_(1 - lr * self.s.weight_decay).add_(chunks.decode(merged).sign_(), alpha=-lr)
            self.set_all(i, x)


class DiLoCo(Method):
    """``every`` local AdamW steps, then an outer step on the pseudo-gradient; ``topk`` > 0
    sends each worker's top entries per block with error feedback (SparseLoCo)."""

    @dataclasses.dataclass
    class Options:
        every: int = 50
        outer_lr: float = 0.7
        outer_momentum: float = 0.9
        topk: int = 0  # per block; 0: the pseudo-gradient sent whole
        chunk: int = 64
        ef_decay: float = 0.95

    def __init__(self, params, settings, options, group=None):
        super().__init__(params, settings, options, group)
        self.outer = [x.detach().clone() for x in params[0]]
        self.buffer = [torch.zeros_like(x) for x in self.outer]
        self.state = [[self.adam(x) for x in self.outer] for _ in params]
        self.error = self.zeros_per_worker()
        self.chunks = [Chunks(x.shape, options.chunk) for x in self.outer]

    def step(self, step, lr):
        for params, states in zip(self.params, self.state):
            for x, state in zip(params, states):
                state.moments_(x.grad)
                state.step_(x.detach(), lr, self.s.weight_decay)
        if (step + 1) % self.o.every == 0:
            for i, outer in enumerate(self.outer):
                pseudo = [outer - params[i].detach() for params in self.params]
                if self.o.topk:
                    mean = self.compressed_mean(pseudo, i)
                else:
                    mean = self.group.mean(pseudo)
                    self.sent(mean)
                if self.o.outer_momentum:  # torch's SGD with Nesterov momentum
                    self.buffer[i].mul_(self.o.outer_momentum).add_(mean)
                    mean = mean.add(self.buffer[i], alpha=self.o.outer_momentum)
                outer.sub_(mean, alpha=self.o.outer_lr)
                self.set_all(i, outer)

    def compressed_mean(self, pseudo: list[torch.Tensor], i: int) -> torch.Tensor:
        chunks, sent = self.chunks[i], []
        for p, delta in enumerate(pseudo):
            error = self.error[p][i].mul_(self.o.ef_decay).add_(delta)
            index, value, taken = chunks.take_top_(error, self.o.topk)
            sent.append(taken)
            if p == 0:
                self.sent(index, value)
        return self.group.mean(sent)


class SparseLoCo(DiLoCo):
    @dataclasses.dataclass
    class Options(DiLoCo.Options):
        every: int = 20
        outer_lr: float = 1.0
        outer_momentum: float = 0.0
        topk: int = 64


class PowerSGD(Method):
    @dataclasses.dataclass
    class Options:
        rank: int = 1
        start: int = 10
        min_compression_rate: float = 2.0

    def __init__(self, params, settings, options, group=None):
        super().__init__(params, settings, options, group)
        self.state = [self.adam(x) for x in params[0]]
        self.error = self.zeros_per_worker()
        self.q: list[torch.Tensor | None] = []  # None: the tensor is sent whole
        generator = torch.Generator().manual_seed(0)  # the same Q on every worker
        for x in params[0]:
            n, m = x.shape[0], x.numel() // x.shape[0]
            r = min(n, m, options.rank)
            worth = (n + m) * r * options.min_compression_rate < n * m
            self.q.append(orthogonalize_(torch.randn(m, r, generator=generator)).to(x) if worth else None)

    def step(self, step, lr):
        for i, (state, q) in enumerate(zip(self.state, self.q)):
            if q is None or step < self.o.start:
                self.dense_adamw_(i, state, lr)
                continue
            x = self.params[0][i].detach()
            matrices = [(g + e).view(x.shape[0], -1) for g, e in zip(self.grads(i), (e[i] for e in self.error))]
            orthogonalize_(q)
            p_sum = self.group.sum([matrix @ q for matrix in matrices])
            self.sent(p_sum)
            orthogonalize_(p_sum)
            q.copy_(self.group.sum([matrix.T @ p_sum for matrix in matrices]) / self.workers)
            self.sent(q)
            approximation = p_sum @ q.T
            for p, matrix in enumerate(matrices):
                self.error[p][i].copy_((matrix - approximation).view_as(x))
            state.moments_(approximation.view_as(x))
            state.step_(x, lr, self.s.weight_decay)
            self.set_all(i, x)


METHODS: dict[str, type[Method]] = {
    "dense": Dense,
    "lags": Lags,
    "zero-one": ZeroOneAdam,
    "demo": DeMo,
    "diloco": DiLoCo,
    "sparseloco": SparseLoCo,
    "powersgd": PowerSGD,
}


def parse_method(spec: str) -> tuple[type[Method], Method.Options]:
    """``"name"`` or ``"name:key=value,key=value"`` (e.g. ``lags:density=0.004``): the class
    and its options, each value converted to its field's type."""
    name, _, rest = spec.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    cls = METHODS[name]
    fields = typing.get_type_hints(cls.Options)
    values = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise ValueError(f"{name} has no option {key!r}; it has {', '.join(fields) or 'none'}")
        kind = fields[key]
        values[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return cls, cls.Options(**values)


class MethodOptimizer(torch.optim.Optimizer):
    """A method as the optimizer of one process's model in a job of P (the suite's ranks):
    ``step()`` is the method's ``step(t, lr)`` at the param group's lr (torch's schedulers
    drive it), its cross-worker operations over ``group``. AdamW's settings are
    ``torch.optim.AdamW``'s (betas 0.9/0.999, eps 1e-8) with ``weight_decay``. The method is
    built at the first step, from the model as it is then (after the ranks' broadcast): its
    copies of the model (LAGS's consensus, DiLoCo's outer model) start from what every rank
    trains. One param group, every parameter with a gradient at every step. A method's state is
    not checkpointed: ``load_state_dict`` refuses, rather than resume without it."""

    def __init__(self, params, spec: str, group: Group, lr: float, weight_decay: float):
        params = list(params)
        if not params or any(isinstance(x, dict) for x in params):
            raise ValueError("MethodOptimizer takes the model's parameters, one group")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.spec, self.group, self.iteration = spec, group, 0
        self.method_class, self.options = parse_method(spec)
        self.method: Method | None = None

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "spec"):  # after __init__: a method's state covers the tensors it was built on
            raise ValueError(f"{self.spec}: MethodOptimizer keeps one param group; build a new one")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MethodOptimizer.step takes no closure")
        group = self.param_groups[0]
        missing = [i for i, x in enumerate(group["params"]) if x.grad is None]
        if missing:
            raise ValueError(f"{self.spec}: parameters {missing} have no gradient; every parameter must have one")
        if self.method is None:
            settings = types.SimpleNamespace(betas=(0.9, 0.999), eps=1e-8, weight_decay=group["weight_decay"])
            self.method = self.method_class([group["params"]], settings, self.options, self.group)
        self.method.step(self.iteration, group["lr"])
        self.iteration += 1

    @torch.no_grad()
    def average_models(self) -> None:
        """Every rank's model the ranks' mean, to evaluate (the study evaluates the workers' mean
        model); the method's own copies of the model are left as they are."""
        if self.method is not None:
            for i in range(len(self.param_groups[0]["params"])):
                self.method.mean_model_(i)

    def words_vs_dense(self) -> float:
        """The 4-byte words this rank sent so far against dense's (one word per entry and step)."""
        if self.method is None:
            return 0.0
        numel = sum(x.numel() for x in self.param_groups[0]["params"])
        return self.method.words / (numel * self.iteration)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "method": self.spec, "iteration": self.iteration}

    def load_state_dict(self, state_dict) -> None:
        raise ValueError(f"{self.spec}: an Adam method's state is not checkpointed, so its run cannot resume")
