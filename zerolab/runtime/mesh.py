"""The 3-D mesh: data, tensor and pipeline parallelism laid out over the ranks (chapter 10).

``zl.mesh(dp=, tp=, pp=)``, called on every rank (of ``zl.launch`` or
torchrun), numbers the ranks as one grid with TP innermost, then PP, then DP,
as Megatron-LM lays them out::

    rank = dp_rank * (pp * tp) + pp_rank * tp + tp_rank

so a TP group is ``tp`` consecutive ranks — inside one node when ``tp``
divides the ranks per node, which the mesh requires: TP's all-reduces run
every layer and need the node's fast link. A PP group is the ``pp`` ranks
with the same (dp, tp) coordinates, a DP group the ``dp`` ranks with the same
(pp, tp): the ranks that hold the same shard of the same layers and so
average their gradients (ZeRO shards over this group only).

The nodes are the ones of ``nodes.py`` (ranks ``m*K .. m*K+K-1`` form node
``m``, K = ``ranks_per_node``, default torchrun's / ``zl.launch``'s
``LOCAL_WORLD_SIZE``): one model of the topology for the simulated nodes,
ZeRO++'s hpZ groups and the mesh. Every process group is built once per
process and grid (``new_group`` is a collective: the same calls, in the same
order, on every rank). The mesh's communicators share one ledger, and each
record is booked under its group: ``ledger.total_bytes(group="tp")``.

With pp > 1 there is a fourth kind of group, ``"embed"`` (the *embedding group*,
Megatron-LM's name): the first and the last stage of each PP group, i.e. the two
ranks with the same (dp, tp) coordinates at pp_rank 0 and pp - 1. A weight tied
between the first and the last stage (a GPT's embedding and head) lives on both;
their gradients are summed over this group (``zerolab.parallel.pipeline``), booked
under ``group="embed"``. A middle stage belongs to no embedding group.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from zerolab.runtime import nodes
from zerolab.runtime.comm import CommLedger, Communicator
from zerolab.theory.network import get_link

AXES = ("dp", "pp", "tp")   # outermost to innermost


def mesh_layout(dp: int, tp: int, pp: int) -> dict:
    """Every group of each kind, as lists of global ranks in group order:
    ``{"tp": [[0, 1], [2, 3], ...], "pp": [...], "dp": [...]}`` (no process groups)."""
    def rank(d, p, t):
        return (d * pp + p) * tp + t
    return {"tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
            "pp": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
            "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}


def embedding_layout(dp: int, tp: int, pp: int) -> list:
    """The embedding groups: per (dp, tp) coordinates, [first stage's rank, last stage's rank]
    (none when pp == 1: the first stage is the last)."""
    return [[(d * pp) * tp + t, (d * pp + pp - 1) * tp + t] for d in range(dp) for t in range(tp)] if pp > 1 else []


def coordinates(rank: int, dp: int, tp: int, pp: int) -> dict:
    """``{"dp": d, "pp": p, "tp": t}`` of global rank ``rank`` (TP innermost)."""
    if not 0 <= rank < dp * tp * pp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp * tp * pp} ranks")
    return {"dp": rank // (pp * tp), "pp": rank // tp % pp, "tp": rank % tp}


def check_mesh(dp, tp, pp, world_size: int, ranks_per_node: int) -> None:
    """Raise ``ValueError`` naming the problem: sizes that are not integers >= 1, a product that
    is not the world size, a TP group that would cross a node."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"zl.mesh: {name} must be an integer >= 1, got {v!r}")
    if dp * tp * pp != world_size:
        raise ValueError(f"zl.mesh(dp={dp}, tp={tp}, pp={pp}): dp*tp*pp = {dp * tp * pp}, but the world has "
                         f"{world_size} ranks; the product must equal the world size")
    if ranks_per_node % tp:
        raise ValueError(f"zl.mesh: a TP group of tp={tp} consecutive ranks would cross a node of "
                         f"{ranks_per_node} ranks (ranks_per_node={ranks_per_node}); TP all-reduces every "
                         f"layer and must stay inside a node: choose tp dividing {ranks_per_node}")


class Mesh:
    """This rank's place in the (dp, pp, tp) grid: ``dp_rank``, ``pp_rank``, ``tp_rank``, and its
    groups (``group(name)``: the process group; ``ranks(name)``: its global ranks;
    ``communicator(name)``: a ``Communicator`` over it, booking into ``self.ledger``)."""

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, ranks_per_node: int | None = None, link=None):
        local = not dist.is_initialized()
        world = 1 if local else dist.get_world_size()
        if ranks_per_node is None:
            ranks_per_node = world if local else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or world % ranks_per_node:
            raise ValueError(f"ranks_per_node must be an integer >= 1 that divides the world size ({world}), "
                             f"got {ranks_per_node!r}")
        check_mesh(dp, tp, pp, world, ranks_per_node)
        self.sizes = {"dp": dp, "tp": tp, "pp": pp}
        self.dp, self.tp, self.pp = dp, tp, pp
        self.world_size, self.ranks_per_node = world, ranks_per_node
        self.rank = 0 if local else dist.get_rank()
        coords = coordinates(self.rank, dp, tp, pp)
        self.dp_rank, self.pp_rank, self.tp_rank = coords["dp"], coords["pp"], coords["tp"]
        self.node = self.rank // ranks_per_node
        self.layout = mesh_layout(dp, tp, pp)
        self.embed_layout = embedding_layout(dp, tp, pp)
        self._groups = {k: None for k in AXES + ("embed",)} if local else self._build_groups()
        self._link = link
        self.ledger = CommLedger(link=link if isinstance(link, dict) else get_link(link))
        self._comms = {}

    def _build_groups(self) -> dict:
        """One process group per row of each kind, built once per process and grid, in the same
        order on every rank (TP, then PP, then DP, then the embedding groups when pp > 1)."""
        key = ("mesh", self.dp, self.tp, self.pp, id(dist.group.WORLD))
        if key not in nodes._GROUPS:
            built = {}
            for name in ("tp", "pp", "dp"):
                built[name], _ = dist.new_subgroups_by_enumeration(self.layout[name])
            built["embed"] = dist.new_subgroups_by_enumeration(self.embed_layout)[0] if self.embed_layout else None
            nodes._GROUPS[key] = built
        return nodes._GROUPS[key]

    def _axis(self, name: str) -> str:
        if name == "embed":
            if not self.in_embedding_group:
                raise ValueError(f"{self}: only the first and the last pipeline stage (pp > 1) are in an "
                                 f"embedding group ('embed')")
            return name
        if name not in self.sizes:
            raise ValueError(f"a mesh group is one of 'dp', 'tp', 'pp'; got {name!r} (or 'embed', the first and "
                             f"last pipeline stages)")
        return name

    @property
    def in_embedding_group(self) -> bool:
        """Whether this rank is a first or last stage of a pipeline of pp > 1 (module docstring)."""
        return self.pp > 1 and self.pp_rank in (0, self.pp - 1)

    def group(self, name: str):
        """The process group of this rank's ``name`` group ("dp", "tp" or "pp"); None on one process."""
        return self._groups[self._axis(name)]

    def ranks(self, name: str) -> list:
        """The global ranks of this rank's ``name`` group, in group order."""
        rows = self.embed_layout if self._axis(name) == "embed" else self.layout[name]
        return next(g for g in rows if self.rank in g)

    def size(self, name: str) -> int:
        return 2 if self._axis(name) == "embed" else self.sizes[name]

    def coord(self, name: str) -> int:
        """This rank's index in its ``name`` group (``dp_rank``, ``tp_rank`` or ``pp_rank``)."""
        return {"dp": self.dp_rank, "tp": self.tp_rank, "pp": self.pp_rank,
                "embed": int(self.pp_rank > 0)}[self._axis(name)]

    def communicator(self, name: str, link=None) -> Communicator:
        """The ``Communicator`` of this rank's ``name`` group (one per group and mesh), booking its
        collectives under ``name`` in the mesh's shared ledger. ``link``: must be the mesh's own
        (give a simulated link to ``zl.mesh(..., link=)``, so that every group shares it)."""
        self._axis(name)
        if link is not None and link != self._link:
            raise ValueError(f"a simulated link under a mesh is the mesh's: pass link={link!r} to "
                             f"zl.mesh(..., link=) so that every group's collectives share it")
        if name not in self._comms:
            self._comms[name] = Communicator(self._groups[name], ranks_per_node=self.ranks_per_node,
                                             ledger=self.ledger, name=name)
        return self._comms[name]

    def __repr__(self) -> str:
        return (f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}; rank {self.rank} = "
                f"(dp {self.dp_rank}, pp {self.pp_rank}, tp {self.tp_rank}), node {self.node})")


def mesh(dp: int = 1, tp: int = 1, pp: int = 1, ranks_per_node: int | None = None, link=None) -> Mesh:
    """``zl.mesh(dp=2, tp=2, pp=2)``: this rank's place in the 3-D grid and its process groups.
    Call it on every rank, in the same order (it builds process groups: a collective)."""
    return Mesh(dp, tp, pp, ranks_per_node, link)
