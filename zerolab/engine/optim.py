"""The optimizer over this rank's flat fp32 shard, gradient clipping and LR schedules (chapters 3-4).

``ShardedOptimizer`` updates a list of fp32 tensors (one per unit: the rank's
shard in stages 1-3, the whole unit in stage 0) with flat tensor ops, unit by
unit — a handful of vectorised kernels per unit, never a loop over parameters,
and no temporary larger than one unit (what a full-shard ``foreach`` would
allocate for sqrt(v) is Ψ/N x 4 bytes on top of the estimate). Its
state (Adam's m and v, SGD's momentum) is allocated at construction in
contiguous shard-space buffers, so ``engine.memory()`` is complete before the
first step. The maths is torch.optim's, term for term:

    Adam   g += wd*p;          m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
           p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
    AdamW  p *= 1 - lr*wd, then Adam without the g += wd*p
    SGD    g += wd*p;  buf = g (first step) or momentum*buf + (1-dampening)*g;
           g = g + momentum*buf (nesterov) or buf;  p -= lr*g

Adam and AdamW run torch's fused kernel (``torch._fused_adam_`` / ``_fused_adamw_``, what
``torch.optim.Adam(fused=True)`` calls: one pass over p, g, m and v per unit, on CPU or
CUDA) when every tensor is fp32 on one device, else the flat ops above. Same maths; the
fused kernel orders its float operations differently, so results differ from the
``foreach`` torch.optim in the last bit and equal ``fused=True`` bit for bit.
Its step counter is one transient fp32 scalar per distinct step count.

A parameter that got no gradient on any rank in a step sits the step out, as
torch.optim skips a parameter whose ``.grad`` is None (and DDP with
``find_unused_parameters=True`` agrees): its moments and weight decay are left
alone and its own step count t falls one behind (``skip_now``, ``skipped``;
the engine decides which, ``unused.py``). A parameter used on some ranks only
is stepped with the mean over all ranks, the others counting zero, as in DDP.

Our "adam" is torch.optim.Adam (L2 weight decay, default 0). A config's
"Adam" is DeepSpeed's: AdamW unless ``adam_w_mode: false``; the config reader
maps it to "adamw" and says so in ``Config.notes``.

Clipping uses the global norm over all ranks' shards: each rank sums the
squares of its shard and one all-reduce adds them (``clip_coefficient``).
Schedulers follow DeepSpeed's WarmupLR / WarmupDecayLR: ``lr(t)`` for
optimizer step t = 0, 1, ...; the engine advances t only when a step is taken.
"""
from __future__ import annotations

import math

import torch

from zerolab.config.optimizer import OPTIMIZER_DEFAULTS

# torch's fused Adam kernels (torch.optim.Adam/AdamW(fused=True)); None where this torch lacks them
FUSED_ADAM = {"adam": getattr(torch, "_fused_adam_", None), "adamw": getattr(torch, "_fused_adamw_", None)}
FUSED_DEVICES = ("cpu", "cuda")


class Hyper:
    """One parameter group's hyper-parameters (torch.optim's names), validated for ``kind``."""

    def __init__(self, kind: str, params: dict):
        p = dict(params)
        unsupported = [k for k in ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable")
                       if p.pop(k, False)]
        if unsupported:
            raise ValueError(f"optimizer.params {unsupported} are not supported by zerolab's optimizer")
        d = OPTIMIZER_DEFAULTS[kind]   # DeepSpeed's defaults (config/defaults.py's table)
        self.lr = float(p.pop("lr", d["lr"]))
        self.weight_decay = float(p.pop("weight_decay", d["weight_decay"]))
        if kind in ("adam", "adamw"):
            self.betas = tuple(float(b) for b in p.pop("betas", d["betas"]))
            self.eps = float(p.pop("eps", d["eps"]))
        else:
            self.momentum = float(p.pop("momentum", d["momentum"]))
            self.dampening = float(p.pop("dampening", d["dampening"]))
            self.nesterov = bool(p.pop("nesterov", d["nesterov"]))
            if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
                raise ValueError("SGD nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
        if p:
            raise ValueError(f"unknown optimizer.params for {kind}: {sorted(p)}")


class ShardedOptimizer:
    def __init__(self, kind: str, params: dict, targets: list[torch.Tensor], groups: list[dict] | None = None,
                 segments: list[list[tuple[int, int, int]]] | None = None):
        """kind: "adam" | "adamw" | "sgd"; params: torch.optim names (lr, betas, eps,
        weight_decay, momentum, dampening, nesterov); targets: fp32 tensors to update.
        Parameter groups: ``groups[k]`` overrides ``params`` for group k and ``segments[i]``
        cuts target i into runs ``(start, end, k)`` (default: one group, whole targets)."""
        if kind not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer.type {kind!r} is not supported; use Adam, AdamW or SGD")
        self.kind, self.targets = kind, targets
        default = Hyper(kind, params)
        self.hypers = [Hyper(kind, {**params, **g}) for g in groups] if groups else [default]
        self.segments = segments
        self.__dict__.update(vars(default))   # lr, weight_decay, betas/eps or momentum/...: the config's
        n = sum(t.numel() for t in targets)
        dev = targets[0].device if targets else "cpu"
        if kind in ("adam", "adamw"):
            self.exp_avg = torch.zeros(n, dtype=torch.float32, device=dev)      # m: fp32, shard numel
            self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=dev)   # v: fp32, shard numel
            self.state = [self.exp_avg, self.exp_avg_sq]
        else:
            momentum = any(h.momentum for h in self.hypers)
            # momentum buffer: fp32, shard numel (none without momentum)
            self.momentum_buf = torch.zeros(n if momentum else 0, dtype=torch.float32, device=dev)
            self.state = [self.momentum_buf]
        self.step_count = 0
        self.lr_source, self.same_scheduled_lr = None, False   # group_lrs: a client scheduler; DeepSpeed's rule
        # parameters without a gradient on any rank are not stepped, as in torch (engine/unused.py):
        self.param_spans = None   # per target: (start, end, parameter name), set by the engine
        self.skip_now = set()     # names to leave alone in this step
        self.skipped = {}         # name -> steps it sat out (its own t is step_count minus that)

    def runs(self, i: int, a: int, b: int, lr: float):
        """The runs of elements [a, b) of target i: ``(start, end, hyper, lr, t)`` relative to a, one per
        parameter group (and, once a parameter has sat out a step, per parameter: its own step count t).
        ``lr`` is the scheduled learning rate of the config's group; each group's is ``group_lrs(lr)``."""
        lrs = self.group_lrs(lr)
        groups = [(0, b - a, self.hypers[0], lrs[0])] if self.segments is None else [
            (max(s, a) - a, min(e, b) - a, self.hypers[k], lrs[k])
            for s, e, k in self.segments[i] if max(s, a) < min(e, b)]
        if not (self.skip_now or self.skipped) or self.param_spans is None:
            for g in groups:
                yield (*g, self.step_count)
            return
        for gs, ge, h, lr_k in groups:
            for ps, pe, name in self.param_spans[i]:
                s, e = max(gs, ps - a), min(ge, pe - a)
                if s < e and name not in self.skip_now:
                    yield s, e, h, lr_k, self.step_count - self.skipped.get(name, 0)

    def group_lrs(self, lr: float) -> list[float]:
        """Each parameter group's learning rate for a step whose scheduled rate is ``lr``: a client
        scheduler's, read from its torch optimizer (``lr_source``); with ``same_scheduled_lr`` (DeepSpeed's
        schedules write one lr into every group) ``lr`` for all; else each group's own lr scaled by the
        schedule (lr / the config's lr)."""
        if self.lr_source is not None:
            return [float(x) for x in self.lr_source()]
        if self.same_scheduled_lr:
            return [lr] * len(self.hypers)
        return [h.lr if lr == self.lr else lr * h.lr / self.lr if self.lr else lr for h in self.hypers]

    def begin_step(self) -> None:
        """Count the step; parameters sitting it out keep their own count (torch's per-parameter ``step``)."""
        self.step_count += 1
        for name in self.skip_now:
            self.skipped[name] = self.skipped.get(name, 0) + 1

    def _views(self, buf):
        out, off = [], 0
        for t in self.targets:
            out.append(buf[off: off + t.numel()])
            off += t.numel()
        return out

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.state)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float, scale: float = 1.0, after=None) -> None:
        """One update of ``self.targets`` with ``scale * grads`` (same shapes, any float dtype;
        fp32 grads are scaled in place). Unit by unit, so a temporary is one unit's size;
        ``after(i)``, if given, runs as soon as unit ``i`` is updated (stage 1 starts its all-gather)."""
        self.begin_step()
        views = [self._views(s) for s in self.state if s.numel()]
        step_ts = {}   # the fused kernel reads t from a tensor: one fp32 scalar per distinct t, transient
        for i, (p, g) in enumerate(zip(self.targets, grads)):
            if g.dtype != torch.float32:
                g = g.float()                       # fp32 copy of a 16-bit gradient: one unit, transient
            if scale != 1.0:
                g.mul_(scale)   # pre-scaled (exact as torch's g * (1/N) * clip); grad_scale divides: last bits differ
            for a, b, h, lr_k, t in self.runs(i, 0, p.numel(), lr):   # one run per parameter group
                pk, gk = p[a:b], g[a:b]
                if self.kind == "sgd":
                    self._sgd(pk, gk, views[0][i][a:b] if views else None, lr_k, h, t)
                elif self.fusable(pk, gk, views[0][i]):
                    if t not in step_ts:
                        step_ts[t] = torch.full((), float(t), dtype=torch.float32, device=p.device)
                    self.fused_adam(pk, gk, views[0][i][a:b], views[1][i][a:b], lr_k, step_ts[t], h)
                else:
                    self._adam(pk, gk, views[0][i][a:b], views[1][i][a:b], lr_k, h, t)
            if after is not None:
                after(i)

    def fusable(self, p, g, m) -> bool:
        """Whether torch's fused kernel can take this unit: fp32 everywhere, one CPU/CUDA device."""
        return (FUSED_ADAM.get(self.kind) is not None and p.device.type in FUSED_DEVICES
                and p.dtype == g.dtype == m.dtype == torch.float32 and p.device == g.device == m.device)

    def fused_adam(self, p, g, m, v, lr, step_t, h=None):
        """One Adam/AdamW update of p (and m, v) in one fused pass; ``step_t``: t as an fp32
        scalar tensor on p's device (the kernel reads t, it does not advance it)."""
        h = h or self.hypers[0]
        FUSED_ADAM[self.kind]([p], [g], [m], [v], [], [step_t], lr=lr, beta1=h.betas[0], beta2=h.betas[1],
                              weight_decay=h.weight_decay, eps=h.eps, amsgrad=False, maximize=False)

    def _adam(self, p, g, m, v, lr, h=None, t=None):
        h, t = h or self.hypers[0], t or self.step_count
        b1, b2, wd = h.betas[0], h.betas[1], h.weight_decay
        if wd and self.kind == "adamw":
            p.mul_(1 - lr * wd)
        elif wd:
            g = g.add(p, alpha=wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(h.eps)
        p.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))

    def _sgd(self, p, g, buf, lr, h=None, t=None):
        h, t = h or self.hypers[0], t or self.step_count
        if h.weight_decay:
            g = g.add(p, alpha=h.weight_decay)
        if buf is not None and h.momentum:
            if t == 1:
                buf.copy_(g)
            else:
                buf.mul_(h.momentum).add_(g, alpha=1 - h.dampening)
            g = g.add(buf, alpha=h.momentum) if h.nesterov else buf
        p.add_(g, alpha=-lr)


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ g² over this rank's gradient tensors, as an fp32 scalar tensor (norms taken in fp32)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = [torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensors]  # no fp32 copy of t
    return torch.stack(norms).pow(2).sum()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)); max_norm 0: 1 (no clipping)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


# --- learning-rate schedules (DeepSpeed semantics) ---------------------------------
class WarmupLR:
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then stays."""

    def __init__(self, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000, warmup_type="log",
                 last_batch_iteration=-1):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.min_lr, self.max_lr = float(warmup_min_lr), float(warmup_max_lr)
        self.warmup_num_steps = max(2, int(warmup_num_steps))
        self.warmup_type = warmup_type

    def gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            if self.warmup_type == "log":
                return math.log(t + 1) / math.log(self.warmup_num_steps)
            return t / self.warmup_num_steps
        return 1.0

    def lr(self, t: int) -> float:
        """The learning rate of the optimizer step taken after ``t`` steps, as DeepSpeed's engine applies
        it: its scheduler starts at ``last_batch_iteration`` -1 (min lr for the first step) and advances
        after each step, so step t + 1 runs at iteration t - 1."""
        it = t - 1
        return self.min_lr if it < 0 else self.min_lr + (self.max_lr - self.min_lr) * self.gamma(it)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        super().__init__(warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
        self.total_num_steps = int(total_num_steps)

    def gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return super().gamma(t)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR}


def make_scheduler(sched_cfg):
    if sched_cfg is None:
        return None
    try:
        cls = SCHEDULERS[sched_cfg.type]
    except KeyError:
        raise ValueError(f"scheduler.type {sched_cfg.type!r} is not supported; use one of {sorted(SCHEDULERS)}") \
            from None
    return cls(**sched_cfg.params)
