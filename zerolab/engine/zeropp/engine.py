"""ZeRO++: ZeRO-3 with less traffic across nodes (chapter 9).

Stage 3 plus three ideas from the ZeRO++ paper (Wang et al. 2023), each a
config key as in DeepSpeed, each changing one collective of stage 3:

    qwZ  zero_quantized_weights      a unit's weight all-gather (forward and backward) sends the
                                     shard block-quantized to int8 with one fp32 scale per group
                                     of ``qwz_group_size`` elements (8,000: DeepSpeed's target);
                                     each rank dequantizes into the compute dtype. The persistent
                                     unit's all-gather after the step stays 16-bit
    hpZ  zero_hpz_partition_size: H  after the forward gather a rank keeps a *secondary* 1/H
                                     shard of the unit's 16-bit weights, shared with the H-1
                                     ranks next to it in its node; a backward gather is an
                                     all-gather of those inside the node. With prefetch on (the
                                     default) units kept gathered from forward to backward need
                                     no backward gather, and the secondary shard is not read
    qgZ  zero_quantized_gradients    the gradient reduce-scatter becomes a hierarchical int4
                                     all-to-all: inside the node, dequantize and sum, then
                                     across nodes, dequantize and sum (``qgz_reduce``)

Nodes come from the communicator (``zl.launch(..., ranks_per_node=K)``): ranks
m*K .. m*K+K-1 are node m. hpZ's secondary shards cost 2Ψ/H bytes on top of
the primary 2Ψ/N (``engine.memory().params``; ``zl.estimate(...,
hpz_partition_size=H)``). What each collective books, intra and inter node,
is what ``zl.comm_breakdown`` predicts (tests/test_zeropp.py).

qgZ's grouping. DeepSpeed quantizes each gradient tensor separately with
max(rows, cols, N) groups (about one group per row of a matrix) and gives
1-D tensors (biases, norms) a plain reduce-scatter. zerolab reduces whole
buckets of flat gradients, so it decides per unit: a unit holding any matrix
goes through qgZ, a unit of vectors only (with the default persistence
threshold, the "persistent" unit of biases and norms) through the plain
reduce-scatter; the group size (``qgz_group_size``; 0 = DeepSpeed's rule)
is the smallest row DeepSpeed would use among the bucket's matrices, so no
group is coarser than DeepSpeed's. Its all-to-alls run synchronously (no overlap).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zerolab.engine import events as ev
from zerolab.engine.whole_buckets import WholeBucketStaging
from zerolab.engine.zeropp.quantize import pack, unpack
from zerolab.engine.stage3 import Stage3Engine
from zerolab.runtime.measure import storage_bytes
from zerolab.engine.accumulate import first_backward_of_step


class Then:
    """A collective's handle plus what to do once it is done (dequantize, keep a secondary shard)."""

    def __init__(self, handle, finish):
        self.handle, self.finish, self.done = handle, finish, False

    def is_completed(self) -> bool:
        return self.done or self.handle.is_completed()

    def wait(self) -> None:
        if not self.done:
            self.handle.wait()
            self.finish()
            self.done = True


def a2a_reduce(comm, rows: torch.Tensor, group: int, tag: str) -> torch.Tensor:
    """rows (P, C, L): rows[j] (C shards of L elements) goes to the group's rank j, each shard int4-quantized
    on its own. Returns (C, L) fp32: the sum of what every rank sent to this one, dequantized."""
    p, c, length = rows.shape
    packed = pack(rows.reshape(p * c, length), 4, group)                # (P*C, B) uint8
    out = torch.empty_like(packed)
    comm.all_to_all(out.view(-1), packed.view(-1), tag=tag)
    return unpack(out, length, 4, group).view(p, c, length).sum(dim=0)


def qgz_reduce(comm, staging: torch.Tensor, group: int, tag: str = "qgz") -> torch.Tensor:
    """qgZ's reduce-scatter of a rank-major (N * R,) buffer (row j: rank j's R elements) -> (R,) fp32.

    Rank r = m*K + l. The rows are reordered ("swizzled") so that the chunk sent to local peer
    l' holds the rows of ranks m'*K + l' for every node m'; after the intra-node all-to-all and
    its sum, rank (m, l) holds its node's partial sums for the ranks (m', l), one row per node,
    and the inter-node all-to-all (among the ranks with local index l) sends row m' to node m'.
    Every row is quantized on its own, so no group mixes two ranks' shards.
    One node, or one rank per node: a single all-to-all."""
    n, k = comm.world_size, comm.ranks_per_node
    rows = staging.view(n, 1, -1)
    if comm.intra is None:                                              # one level
        return a2a_reduce(comm, rows, group, f"{tag}-all")[0]
    m, r = n // k, rows.shape[2]
    swizzled = rows.view(m, k, r).transpose(0, 1)                       # [l', m']: the row of rank m'*K + l'
    node_sum = a2a_reduce(comm.intra, swizzled, group, f"{tag}-intra")  # (M, R) fp32: this node's sums
    return a2a_reduce(comm.inter, node_sum.view(m, 1, r), group, f"{tag}-inter")[0]


def deepspeed_group(shapes: list, world_size: int) -> int:
    """The group size DeepSpeed's qgZ gives the smallest-row matrix among ``shapes`` (0 if none):
    max(rows, cols, N) groups of a (rows, cols...) gradient."""
    sizes = []
    for shape in shapes:
        numel = torch.Size(shape).numel()
        if len(shape) >= 2 and numel:
            sizes.append(-(-numel // max(shape[0], numel // shape[0], world_size)))
    return min(sizes) if sizes else 0


class ZeroPPEngine(WholeBucketStaging, Stage3Engine):
    """ZeRO-3 with qwZ, hpZ and qgZ (any combination)."""

    def __init__(self, model, cfg, communicator=None, **kw):
        z = cfg.zero
        self.qwz, self.qgz, self.hpz = z.zero_quantized_weights, z.zero_quantized_gradients, z.zero_hpz_partition_size
        self.qwz_group = cfg.qwz_group_size
        self._exact = False   # inside gathered(): 16-bit gathers, so reads and edits see the true weights
        super().__init__(model, cfg, communicator, **kw)
        c, units = self.communicator, self.flat.units
        self.hpz_comm = c.node_subgroup(self.hpz) if self.hpz > 1 else None
        # hpZ: per unit (frozen twins too), compute dtype: padded_u / H elements, this rank's slice
        # of its H-rank partition
        self._secondary = {i: torch.zeros(u.padded // self.hpz, dtype=self.param_shard.dtype,
                                          device=self.param_shard.device)
                           for i, u in enumerate(self.units) if self.hpz > 1 and i not in self.persistent}
        self._fresh = set()   # units whose secondary shard holds this step's weights
        # qgZ: per bucket, the units that go quantized (any matrix) and the group size
        shapes = {id(u): [v.shape for _, v in self._views[i]] for i, u in enumerate(units)}  # params are released
        self._qgz_units, self.qgz_groups = [], []
        for b in self.buckets:
            mats = [u for u in b if any(len(s) >= 2 for s in shapes[id(u)])]
            self._qgz_units.append({id(u) for u in mats} if self.qgz else set())
            self.qgz_groups.append(cfg.qgz_group_size or
                                   deepspeed_group([s for u in mats for s in shapes[id(u)]], self.world_size) or 1)

    # ---------------------------------------------------------------- weights: qwZ and hpZ
    def fetch_unit(self, i: int):
        u, buf = self.units[i], self._full[i]
        if self.hpz_comm is not None and self._in_backward and i in self._fresh:   # hpZ: inside the node
            return self.hpz_comm.all_gather(buf, self._secondary[i], async_op=True, tag=f"unit-{i}-hpz")
        shard = self.shard_of(i)
        if not self.qwz or self._exact:
            return Then(super().fetch_unit(i), lambda: self._keep_secondary(i))
        packed = pack(shard.view(1, -1), 8, self.qwz_group)                         # (1, B) uint8
        out = torch.empty(self.world_size * packed.numel(), dtype=torch.uint8, device=buf.device)
        h = self.communicator.all_gather(out, packed.view(-1), async_op=True, tag=f"unit-{i}-qwz")

        def finish():
            rows = unpack(out.view(self.world_size, -1), u.shard, 8, self.qwz_group, buf.dtype)
            buf.copy_(rows.view(-1))
            self._keep_secondary(i)
        return Then(h, finish)

    @contextmanager
    def gathered(self, params, modifier_rank=None):
        """Stage 3's ``zl.gathered_parameters``, with exact 16-bit all-gathers: an edit written back
        into the shards (``modifier_rank``) must start from the true weights, not int8 ones."""
        self._exact = True
        try:
            with super().gathered(params, modifier_rank):
                self._exact = False
                yield
        finally:
            self._exact = False

    def _keep_secondary(self, i: int) -> None:
        """After a forward gather: keep this rank's 1/H slice of the unit for the backward gather."""
        if self.hpz_comm is None or self._in_backward or i not in self._secondary:
            return
        s = self._secondary[i]
        start = self.hpz_comm.rank * s.numel()
        s.copy_(self._full[i][start: start + s.numel()])
        self._fresh.add(i)

    def after_update(self) -> None:
        super().after_update()
        self._fresh.clear()   # the shards changed: the next forward gathers (and keeps) again

    # ---------------------------------------------------------------- gradients: qgZ
    @property
    def stages_buckets_whole(self) -> bool:
        """qgZ's all-to-all reduces a bucket's rank-major staging in one piece (whole_buckets.py)."""
        return self.qgz

    def reduce_scatter_grads(self, i: int) -> None:
        b, quantized = self.buckets[i], self._qgz_units[i]
        if not quantized:
            return super().reduce_scatter_grads(i)
        staging, self._staging[i] = self._staging_buffer(i), None
        dest = self._bucket_shard(i)
        n, cols, col = self.world_size, [], 0
        for u in b:
            cols.append((col, u.shard, id(u) in quantized))
            col += u.shard
        rows = staging.view(n, -1)
        reduced = torch.empty(dest.numel(), dtype=torch.float32, device=dest.device)
        parts = [[c for c in cols if c[2]], [c for c in cols if not c[2]]]
        for k, part in enumerate(parts):
            if not part:
                continue
            x = rows if len(part) == len(cols) else torch.cat([rows[:, a: a + s] for a, s, _ in part], dim=1)
            if k == 0:
                out = qgz_reduce(self.communicator, x.reshape(-1), self.qgz_groups[i], f"grad-bucket-{i}-qgz")
            else:   # vectors only: the plain reduce-scatter, as DeepSpeed does for 1-D tensors
                out = torch.empty(x.shape[1], dtype=x.dtype, device=x.device)
                self.communicator.reduce_scatter(out, x.reshape(-1), tag=f"grad-bucket-{i}-1d")
            if len(part) == len(cols):
                reduced.copy_(out)
            else:
                torch._foreach_copy_([reduced[a: a + s] for a, s, _ in part], list(out.float().split([s for _, s, _ in part])))
        if first_backward_of_step(self):   # the step's first backward writes the shard, later ones add
            dest.copy_(reduced)
        else:
            dest.add_(reduced)
        self.event(ev.REDUCE_DONE, i)

    # ---------------------------------------------------------------- inspection
    def memory(self):
        """Stage 3's report; params add hpZ's secondary shards."""
        r = super().memory()
        r.params += sum(storage_bytes(s) for s in self._secondary.values())
        return r
