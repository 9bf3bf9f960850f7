"""Collectives that keep a ledger of their algorithm bytes, intra- and inter-node (chapters 2, 9).

``Communicator`` wraps ``torch.distributed`` for one process group. Every
collective is recorded in a ``CommLedger`` with its *algorithm bytes*: the
bytes this rank sends under the bandwidth-optimal ring algorithm
(``network.ring_bytes``), computed from the real call's tensor size: a model
of the wire, not a capture (gloo emulates reduce-scatter with an all-reduce,
about twice the bytes), with the seconds from issue to completion. Bookkeeping
flags (one byte per parameter, ``engine/unused.py``) go in ``ledger.control``.

Nodes (chapter 9, ``runtime/nodes.py``): with ``ranks_per_node`` K the world
communicator also has ``.intra`` and ``.inter`` communicators (same ledger),
and each record splits its bytes into those that stay in a node and those
that cross (``inter_bytes``); ``ledger.total_bytes(scope="inter")`` sums them.

A *simulated link* (``link="demo"``, ``"infiniband-200g"``, a ``Link``, or
one per tier ``{"intra": ..., "inter": ...}``) makes each collective take at
least as long as it would on that network: a group inside one node runs on
the intra link, a group that spans nodes at the pace of the inter link (its
slowest hop). Each tier is one channel: a collective issued while another is
in flight on the same tier starts when the first ends. ``Handle.wait()``
sleeps until the simulated finish, so work done between issuing an async
collective and waiting for it really does hide the transfer, as on a real
network. On a laptop, where loopback gloo and compute fight for the same
cores, this is how overlap, prefetch and ZeRO++ show what they buy.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from zerolab.runtime import nodes
from zerolab.runtime.group_exit import close_at_exit
from zerolab.runtime.handle import Handle, failed  # Handle re-exported: an issued collective
from zerolab.theory.network import Link, get_link, ring_bytes

__all__ = ["Communicator", "CommLedger", "CommRecord", "Handle"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
# torch 2.13 renamed the tensor forms; older releases only have the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SCOPES = (None, "intra", "inter")


@dataclass
class CommRecord:
    op: str            # "all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"
    bytes: int         # algorithm bytes: what this rank sends under the ring algorithm (a model, not a capture)
    seconds: float     # issue -> completion (the later of the backend's and the simulated link's)
    numel: int         # elements of the full tensor
    dtype: str
    world_size: int    # ranks in the group
    tag: str = ""
    simulated: bool = False
    inter_bytes: int = 0   # the part of ``bytes`` that crosses nodes (module docstring)
    group: str | None = None   # the mesh group it ran in ("dp", "tp", "pp"; runtime/mesh.py), else None

    @property
    def intra_bytes(self) -> int:
        return self.bytes - self.inter_bytes


@dataclass
class CommLedger:
    """Every collective a ``Communicator`` (and its node groups) ran: algorithm bytes and seconds."""
    records: list = field(default_factory=list)
    link: object = None  # the simulated link, if any: a Link or {"intra": Link, "inter": Link}
    busy_until: dict = field(default_factory=dict)  # simulated link tier -> when its channel is idle again
    control: list = field(default_factory=list)  # bookkeeping flags, apart from the algorithm's collectives
    recorder: object = None   # a runtime.trace.TraceRecorder: every issue and wait also goes in the trace

    def _pick(self, op, scope, group=None):
        if scope not in _SCOPES:
            raise ValueError(f"scope must be one of {_SCOPES}, got {scope!r}")
        return [r for r in self.records if (op is None or r.op == op) and (group is None or r.group == group)]

    def total_bytes(self, op: str | None = None, scope: str | None = None, group: str | None = None) -> int:
        """Algorithm bytes this rank sent; ``scope="intra"`` / ``"inter"``: only those that stayed in /
        crossed nodes; ``group="dp"|"tp"|"pp"``: only those of that mesh group."""
        rs = self._pick(op, scope, group)
        if scope == "inter":
            return sum(r.inter_bytes for r in rs)
        if scope == "intra":
            return sum(r.intra_bytes for r in rs)
        return sum(r.bytes for r in rs)

    def total_seconds(self, op: str | None = None) -> float:
        return sum(r.seconds for r in self.records if op is None or r.op == op)

    def count(self, op: str | None = None) -> int:
        return sum(1 for r in self.records if op is None or r.op == op)

    def by_op(self) -> dict:
        return {op: self.total_bytes(op) for op in dict.fromkeys(r.op for r in self.records)}

    def reset(self):
        self.records.clear()
        self.control.clear()

    def summary(self) -> str:
        lines = [f"{'op':<15}{'calls':>7}{'algorithm bytes':>17}{'inter-node':>13}{'seconds':>10}"]
        for op in sorted({r.op for r in self.records}) + [None]:
            lines.append(f"{op or 'total':<15}{self.count(op):>7}{self.total_bytes(op):>17,}"
                         f"{self.total_bytes(op, 'inter'):>13,}{self.total_seconds(op):>10.4f}")
        if self.link is not None:
            link = self.link if isinstance(self.link, Link) else ", ".join(f"{k}: {v}" for k, v in self.link.items())
            lines.append(f"(simulated link: {link})")
        return "\n".join(lines)


class Communicator:
    """Collectives over one process group, recorded in ``self.ledger``; ``.intra`` / ``.inter``:
    the communicators of this rank's node and of its peers on the other nodes (None on one node)."""

    def __init__(self, group=None, link=None, ranks_per_node=None, ledger=None, name=None):
        """The communicator of ``group`` (default: the whole world). Without an
        initialised ``torch.distributed`` it is a one-rank communicator whose
        collectives are local copies, so single-process code runs unchanged.
        ``ranks_per_node`` (default: ``LOCAL_WORLD_SIZE``, else everything on one node).
        ``name``: the mesh group ("dp", "tp", "pp") its records are booked under."""
        self.group, self.name = group, name
        local = not dist.is_initialized()
        if local and group is not None:
            raise ValueError("a process group was given, but torch.distributed is not initialised")
        if not local:
            close_at_exit()   # torch's gloo group, alive at exit, can abort the process (group_exit.py)
        self.rank = 0 if local else dist.get_rank(group)
        self.world_size = 1 if local else dist.get_world_size(group)
        self.backend = "local" if local else dist.get_backend(group)   # "gloo", "nccl", ...
        world = 1 if local else dist.get_world_size()
        if ranks_per_node is None:
            ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if not local else 1
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or world % ranks_per_node:
            raise ValueError(f"ranks_per_node must be an integer >= 1 that divides the world size ({world}), "
                             f"got {ranks_per_node!r}")
        self.ranks_per_node = ranks_per_node
        self.members = list(range(world)) if group is None or local else \
            [dist.get_global_rank(group, i) for i in range(self.world_size)]
        self.node = (0 if local else dist.get_rank()) // ranks_per_node   # this rank's node
        # gloo's reduce_scatter_tensor copies into a temporary and all-reduces; its
        # list form works on views of the input and is faster (15 MB, 4 ranks: 57 vs 75 ms)
        self._rs_list = not local and dist.get_backend(group) == "gloo"
        self.ledger = ledger if ledger is not None else CommLedger(link=link if isinstance(link, dict) else get_link(link))
        self._links = nodes.node_links(self.ledger.link)
        self.spans_nodes = len({g // ranks_per_node for g in self.members}) > 1
        self.intra = self.inter = None
        if group is None and 1 < ranks_per_node < world:
            intra, inter = nodes.node_groups(world, ranks_per_node)
            self.intra = Communicator(intra, ranks_per_node=ranks_per_node, ledger=self.ledger)
            self.inter = Communicator(inter, ranks_per_node=ranks_per_node, ledger=self.ledger)

    def __deepcopy__(self, memo) -> "Communicator":
        """Itself: a copy of a model holding a communicator (a context-parallel attention's) shares the
        process group, which cannot be copied (``tensor_parallel``'s check copies the model)."""
        return self

    def node_subgroup(self, size: int) -> "Communicator":
        """The communicator of the ``size`` consecutive ranks that hold this rank, inside its node
        (ZeRO++'s hpZ partition); its group is built once per process. A collective call."""
        if self.group is not None or size < 1 or self.ranks_per_node % size or self.world_size % size:
            raise ValueError(f"a node subgroup of {size} ranks needs the world communicator and a size dividing "
                             f"the ranks per node ({self.ranks_per_node})")
        if size == self.world_size:
            return self
        if size == self.ranks_per_node:
            return self.intra
        return Communicator(nodes.consecutive_group(self.world_size, size), ranks_per_node=self.ranks_per_node,
                            ledger=self.ledger)

    def inter_fraction(self, op: str, src: int = 0) -> float:
        """The share of this rank's algorithm bytes for ``op`` that crosses nodes (``nodes.inter_fraction``)."""
        return nodes.inter_fraction(op, self.members, self.rank, self.ranks_per_node)

    # -- one place that times, simulates and records ---------------------------------
    def _run(self, op, tensor_for_size, call, async_op, tag, src=0, after=None, control=False):
        nbytes = tensor_for_size.numel() * tensor_for_size.element_size()
        sent = ring_bytes(op, nbytes, self.world_size, self.rank, src)
        t_issue = time.perf_counter()
        t_done = 0.0
        if self._links is not None and not control:   # bookkeeping flags do not occupy the simulated link
            tier = "inter" if self.spans_nodes else "intra"
            start = max(t_issue, self.ledger.busy_until.get(tier, 0.0))
            t_done = start + self._links[tier].time(op, nbytes, self.world_size, self.rank, src)
            self.ledger.busy_until[tier] = t_done
        record = CommRecord(op, sent, 0.0, tensor_for_size.numel(), str(tensor_for_size.dtype).replace("torch.", ""),
                            self.world_size, tag, self._links is not None,
                            inter_bytes=round(sent * self.inter_fraction(op, src)), group=self.name)
        rec = self.ledger.recorder   # a traced run: the issue goes in the trace (runtime/trace.py)
        seq = rec.issued(op, nbytes, self.members, self.name, tag, control) if rec is not None else None
        try:   # (a synchronous backend call, e.g. gloo's list-form reduce-scatter, waits in here)
            work = call(async_op) if self.world_size > 1 else None
        except RuntimeError as e:
            raise failed(record, e) from e
        handle = Handle(work, record, self.ledger, t_issue, t_done, after,
                        book=self.ledger.control if control else None, trace=(rec, seq))
        if not async_op:
            handle.wait()
        return handle

    def _op(self, op):
        try:
            return _OPS[op]
        except KeyError:
            raise ValueError(f"op must be one of {sorted(_OPS) + ['avg']}, got {op!r}") from None

    @staticmethod
    def _check(cond, message):
        if not cond:
            raise ValueError(message)

    # -- the collectives ---------------------------------------------------------------
    def all_reduce(self, tensor, op="sum", async_op=False, tag="", control=False):
        """In place: every rank ends with the reduction of all ranks' ``tensor``. ``control``: a
        bookkeeping flag, recorded in ``ledger.control`` apart from the algorithm's collectives."""
        red = self._op("sum" if op == "avg" else op)
        after = (lambda: tensor.div_(self.world_size)) if op == "avg" else None
        return self._run("all_reduce", tensor,
                         lambda a: dist.all_reduce(tensor, red, group=self.group, async_op=a),
                         async_op, tag, after=after, control=control)

    def reduce_scatter(self, output, input, op="sum", async_op=False, tag=""):
        """``input`` (N*S elements, the full tensor) -> ``output`` (S): rank r gets the
        reduction of every rank's r-th chunk. Pad ``input`` to a multiple of N."""
        self._check(input.numel() == output.numel() * self.world_size,
                    f"reduce_scatter: input has {input.numel()} elements, expected world_size * "
                    f"output = {self.world_size} * {output.numel()}; pad the input to a multiple of N")
        red = self._op("sum" if op == "avg" else op)
        after = (lambda: output.div_(self.world_size)) if op == "avg" else None
        if self.world_size == 1:
            output.copy_(input.view_as(output))
        if self._rs_list:
            call = lambda a: dist.reduce_scatter(output, list(input.chunk(self.world_size)), red,  # noqa: E731
                                                 group=self.group, async_op=a)
        else:
            call = lambda a: _reduce_scatter(output, input, red, group=self.group, async_op=a)  # noqa: E731
        return self._run("reduce_scatter", input, call, async_op, tag, after=after)

    def all_gather(self, output, input, async_op=False, tag=""):
        """Every rank's ``input`` (S elements) -> ``output`` (N*S) in rank order."""
        self._check(output.numel() == input.numel() * self.world_size,
                    f"all_gather: output has {output.numel()} elements, expected world_size * input = "
                    f"{self.world_size} * {input.numel()}; every rank must send the same size (pad shards)")
        if self.world_size == 1:
            output.copy_(input.view_as(output))
        return self._run("all_gather", output,
                         lambda a: _all_gather(output, input, group=self.group, async_op=a),
                         async_op, tag)

    def broadcast(self, tensor, src=0, async_op=False, tag=""):
        """In place: every rank ends with rank ``src``'s ``tensor``."""
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return self._run("broadcast", tensor,
                         lambda a: dist.broadcast(tensor, global_src, group=self.group, async_op=a),
                         async_op, tag, src=src)

    def all_to_all(self, output, input, async_op=False, tag=""):
        """Rank r's j-th chunk of ``input`` becomes rank j's r-th chunk of ``output``."""
        self._check(input.numel() == output.numel() and input.numel() % self.world_size == 0,
                    f"all_to_all: input and output must have the same size, a multiple of "
                    f"{self.world_size}; got {input.numel()} and {output.numel()}")
        if self.world_size == 1:
            output.copy_(input)
        return self._run("all_to_all", input,
                         lambda a: dist.all_to_all_single(output, input, group=self.group, async_op=a),
                         async_op, tag)

    def barrier(self):
        if self.world_size > 1:
            dist.barrier(group=self.group)

