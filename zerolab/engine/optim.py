"""The optimizer over this rank's flat fp32 shard, gradient clipping and LR schedules (chapters 3-4).

``ShardedOptimizer`` updates a list of fp32 tensors (one per unit: the rank's
shard in stages 1-3, the whole unit in stage 0) with ``torch._foreach_*`` ops,
so a step is a handful of vectorised kernels, not a loop over parameters. Its
state (Adam's m and v, SGD's momentum) is allocated at construction in
contiguous shard-space buffers, so ``engine.memory()`` is complete before the
first step. The maths is torch.optim's, term for term:

    Adam   g += wd*p;          m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g*g
           p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
    AdamW  p *= 1 - lr*wd, then Adam without the g += wd*p
    SGD    g += wd*p;  buf = g (first step) or momentum*buf + (1-dampening)*g;
           g = g + momentum*buf (nesterov) or buf;  p -= lr*g

Our "adam" is torch.optim.Adam (L2 weight decay, default 0). DeepSpeed's
"Adam" is AdamW with weight decay unless ``adam_w_mode: false``; the config
maps ``adam_w_mode: true`` to "adamw" and says so in ``Config.notes``.

Clipping uses the global norm over all ranks' shards: each rank sums the
squares of its shard and one all-reduce adds them (``clip_coefficient``).
Schedulers follow DeepSpeed's WarmupLR / WarmupDecayLR: ``lr(t)`` for
optimizer step t = 0, 1, ...; the engine advances t only when a step is taken.
"""
from __future__ import annotations

import math

import torch


class ShardedOptimizer:
    def __init__(self, kind: str, params: dict, targets: list[torch.Tensor]):
        """kind: "adam" | "adamw" | "sgd"; params: torch.optim names (lr, betas, eps,
        weight_decay, momentum, dampening, nesterov); targets: fp32 tensors to update."""
        if kind not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer.type {kind!r} is not supported; use Adam, AdamW or SGD")
        p = dict(params)
        unsupported = [k for k in ("amsgrad", "maximize", "foreach", "fused", "capturable", "differentiable")
                       if p.pop(k, False)]
        if unsupported:
            raise ValueError(f"optimizer.params {unsupported} are not supported by zerolab's optimizer")
        self.kind, self.targets = kind, targets
        self.lr = float(p.pop("lr", 1e-3))
        self.weight_decay = float(p.pop("weight_decay", 0.01 if kind == "adamw" else 0.0))
        n = sum(t.numel() for t in targets)
        dev = targets[0].device if targets else "cpu"
        if kind in ("adam", "adamw"):
            self.betas = tuple(float(b) for b in p.pop("betas", (0.9, 0.999)))
            self.eps = float(p.pop("eps", 1e-8))
            self.exp_avg = torch.zeros(n, dtype=torch.float32, device=dev)      # m: fp32, shard numel
            self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=dev)   # v: fp32, shard numel
            self.state = [self.exp_avg, self.exp_avg_sq]
        else:
            self.momentum = float(p.pop("momentum", 0.0))
            self.dampening = float(p.pop("dampening", 0.0))
            self.nesterov = bool(p.pop("nesterov", False))
            if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
                raise ValueError("SGD nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
            # momentum buffer: fp32, shard numel (none without momentum)
            self.momentum_buf = torch.zeros(n if self.momentum else 0, dtype=torch.float32, device=dev)
            self.state = [self.momentum_buf]
        if p:
            raise ValueError(f"unknown optimizer.params for {kind}: {sorted(p)}")
        self.step_count = 0

    def _views(self, buf):
        out, off = [], 0
        for t in self.targets:
            out.append(buf[off: off + t.numel()])
            off += t.numel()
        return out

    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.state)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        """One update of ``self.targets`` with fp32 ``grads`` (same shapes; may be modified)."""
        self.step_count += 1
        params, wd = self.targets, self.weight_decay
        if self.kind == "sgd":
            return self._sgd(params, grads, lr, wd)
        b1, b2 = self.betas
        if wd and self.kind == "adamw":
            torch._foreach_mul_(params, 1 - lr * wd)
        elif wd:
            grads = torch._foreach_add(grads, params, alpha=wd)
        m, v = self._views(self.exp_avg), self._views(self.exp_avg_sq)
        torch._foreach_lerp_(m, grads, 1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, 1 - b2)
        t = self.step_count
        step_size = lr / (1 - b1 ** t)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - b2 ** t))
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, m, denom, -step_size)

    def _sgd(self, params, grads, lr, wd):
        if wd:
            grads = torch._foreach_add(grads, params, alpha=wd)
        if self.momentum:
            buf = self._views(self.momentum_buf)
            if self.step_count == 1:
                torch._foreach_copy_(buf, grads)
            else:
                torch._foreach_mul_(buf, self.momentum)
                torch._foreach_add_(buf, grads, alpha=1 - self.dampening)
            if self.nesterov:
                grads = torch._foreach_add(grads, buf, alpha=self.momentum)
            else:
                grads = buf
        torch._foreach_add_(params, grads, alpha=-lr)


def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Σ g² over this rank's gradient tensors, as an fp32 scalar tensor."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    norms = torch._foreach_norm(tensors)
    return torch.stack(norms).float().pow(2).sum()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
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
        return self.min_lr + (self.max_lr - self.min_lr) * self.gamma(t)


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
