"""The mesh: data, tensor, pipeline and context parallelism laid out over the ranks (chapters 10, 11).

``zl.mesh(dp=, tp=, pp=, cp=1, ep=1)``, called on every rank (of ``zl.launch`` or
torchrun), numbers the ranks as one grid with TP innermost, then CP, then PP,
then DP, as Megatron-LM lays them out::

    rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank

(with cp = 1: ``dp_rank * (pp * tp) + pp_rank * tp + tp_rank``, the 3-D grid.)

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

**Context parallelism** (``cp``, chapter 11): a ``"cp"`` group is the cp ranks with
the same (dp, pp, tp) coordinates; each holds 1/cp of every sequence
(``zerolab.parallel.context``: Ulysses' all-to-alls, ring attention's sends). They
hold the same parameters and see different tokens, so with cp > 1 the dense
gradients are averaged over the dp·cp ranks with the same (pp, tp): the group
``"dp_cp"``, the engine's data-parallel group (``Mesh.grad_group``; ZeRO shards
over it). With cp = 1 ``grad_group`` is ``"dp"``, the same ranks.

**Expert parallelism** (``ep``, DeepSpeed-MoE's layout) does not multiply the
world: it is carved out of each DP group. An ``"ep"`` group is ep consecutive
members of a DP group (the ranks that split the experts among them); an
``"edp"`` group (expert data parallel) is the DP-group members with the same
index inside their ep group (the ranks holding the same experts, which average
their gradients). ep must divide dp. (With cp > 1 too, the ranks holding the same
experts are an edp group times its cp group: the cp ranks see different tokens.)
"""
from __future__ import annotations

import os

import torch.distributed as dist

from zerolab.runtime import nodes
from zerolab.runtime.comm import CommLedger, Communicator
from zerolab.theory.network import get_link

AXES = ("dp", "pp", "tp")   # outermost to innermost (the 3-D grid; cp sits between pp and tp)
GROUPS = ("tp", "pp", "dp", "cp", "dp_cp", "ep", "edp")   # every kind of group a Mesh has, in build order


def all_groups(dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict:
    """Every group of every kind (``GROUPS``), as lists of global ranks in group order."""
    def rank(d, p, c, t):
        return ((d * pp + p) * cp + c) * tp + t
    out = {"tp": [[rank(d, p, c, t) for t in range(tp)] for d in range(dp) for p in range(pp) for c in range(cp)],
           "pp": [[rank(d, p, c, t) for p in range(pp)] for d in range(dp) for c in range(cp) for t in range(tp)],
           "dp": [[rank(d, p, c, t) for d in range(dp)] for p in range(pp) for c in range(cp) for t in range(tp)],
           "cp": [[rank(d, p, c, t) for c in range(cp)] for d in range(dp) for p in range(pp) for t in range(tp)],
           "dp_cp": [[rank(d, p, c, t) for d in range(dp) for c in range(cp)] for p in range(pp) for t in range(tp)]}
    out["ep"] = [g[i:i + ep] for g in out["dp"] for i in range(0, dp, ep)]
    out["edp"] = [g[j::ep] for g in out["dp"] for j in range(ep)]
    return out


def mesh_layout(dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict:
    """The groups of the axes in use, as lists of global ranks in group order:
    ``{"tp": [[0, 1], [2, 3], ...], "pp": [...], "dp": [...]}``, plus ``"cp"`` and ``"dp_cp"``
    when cp > 1 and ``"ep"`` and ``"edp"`` when ep > 1 (no process groups; every kind: ``all_groups``)."""
    use = {"cp": cp > 1, "dp_cp": cp > 1, "ep": ep > 1, "edp": ep > 1}
    return {k: v for k, v in all_groups(dp, tp, pp, cp, ep).items() if use.get(k, True)}


def embedding_layout(dp: int, tp: int, pp: int, cp: int = 1) -> list:
    """The embedding groups: per (dp, cp, tp) coordinates, [first stage's rank, last stage's rank]
    (none when pp == 1: the first stage is the last)."""
    return [[(d * pp * cp + c) * tp + t, ((d * pp + pp - 1) * cp + c) * tp + t]
            for d in range(dp) for c in range(cp) for t in range(tp)] if pp > 1 else []


def coordinates(rank: int, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> dict:
    """``{"dp": d, "pp": p, "tp": t}`` of global rank ``rank`` (TP innermost), plus ``"cp"`` when
    cp > 1 and ``"ep"`` (index in its ep group), ``"edp"`` (in its edp group) when ep > 1."""
    if not 0 <= rank < dp * tp * pp * cp:
        raise ValueError(f"rank {rank} is outside a mesh of {dp * tp * pp * cp} ranks")
    d = rank // (pp * cp * tp)
    out = {"dp": d, "pp": rank // (cp * tp) % pp, "tp": rank % tp}
    if cp > 1:
        out["cp"] = rank // tp % cp
    if ep > 1:
        out.update(ep=d % ep, edp=d // ep)
    return out


def check_mesh(dp, tp, pp, world_size: int, ranks_per_node: int, cp=1, ep=1) -> None:
    """Raise ``ValueError`` naming the problem: sizes that are not integers >= 1, a product that
    is not the world size, an ep that does not divide dp, a TP group that would cross a node."""
    for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"zl.mesh: {name} must be an integer >= 1, got {v!r}")
    if dp * tp * pp * cp != world_size:
        what = "dp*tp*pp" if cp == 1 else "dp*cp*tp*pp"
        raise ValueError(f"zl.mesh(dp={dp}, tp={tp}, pp={pp}{f', cp={cp}' if cp > 1 else ''}): {what} = "
                         f"{dp * tp * pp * cp}, but the world has {world_size} ranks; the product must equal the "
                         f"world size")
    if dp % ep:
        raise ValueError(f"zl.mesh: ep={ep} must divide dp={dp} (expert parallelism is carved out of the "
                         f"data-parallel ranks: each DP group splits into dp/ep groups of ep ranks)")
    if ranks_per_node % tp:
        raise ValueError(f"zl.mesh: a TP group of tp={tp} consecutive ranks would cross a node of "
                         f"{ranks_per_node} ranks (ranks_per_node={ranks_per_node}); TP all-reduces every "
                         f"layer and must stay inside a node: choose tp dividing {ranks_per_node}")


class Mesh:
    """This rank's place in the (dp, pp, cp, tp) grid: ``dp_rank``, ``pp_rank``, ``cp_rank``, ``tp_rank``
    (and ``ep_rank``, ``edp_rank``), and its groups (``group(name)``: the process group; ``ranks(name)``:
    its global ranks; ``communicator(name)``: a ``Communicator`` over it, booking into ``self.ledger``).
    Every kind of ``GROUPS`` exists whatever the sizes (a group of one rank when its axis is 1)."""

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, ranks_per_node: int | None = None, link=None,
                 cp: int = 1, ep: int = 1):
        local = not dist.is_initialized()
        world = 1 if local else dist.get_world_size()
        if ranks_per_node is None:
            ranks_per_node = world if local else int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1 \
                or world % ranks_per_node:
            raise ValueError(f"ranks_per_node must be an integer >= 1 that divides the world size ({world}), "
                             f"got {ranks_per_node!r}")
        check_mesh(dp, tp, pp, world, ranks_per_node, cp, ep)
        self.sizes = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "dp_cp": dp * cp, "ep": ep, "edp": dp // ep}
        self.dp, self.tp, self.pp, self.cp, self.ep = dp, tp, pp, cp, ep
        self.world_size, self.ranks_per_node = world, ranks_per_node
        self.rank = 0 if local else dist.get_rank()
        coords = coordinates(self.rank, dp, tp, pp, cp, ep)
        self.dp_rank, self.pp_rank, self.tp_rank = coords["dp"], coords["pp"], coords["tp"]
        self.cp_rank = self.rank // tp % cp
        self.ep_rank, self.edp_rank = self.dp_rank % ep, self.dp_rank // ep
        self.node = self.rank // ranks_per_node
        self.layout = all_groups(dp, tp, pp, cp, ep)
        self.embed_layout = embedding_layout(dp, tp, pp, cp)
        self._groups = {k: None for k in GROUPS + ("embed",)} if local else self._build_groups()
        self._link = link
        self.ledger = CommLedger(link=link if isinstance(link, dict) else get_link(link))
        self._comms = {}

    def _build_groups(self) -> dict:
        """One process group per row of each kind, built once per process and grid, in the same
        order on every rank (TP, PP, DP, then the embedding groups when pp > 1, then CP, DP×CP, EP,
        EDP: a kind whose rows are those of a kind already built shares its groups)."""
        key = ("mesh", self.dp, self.tp, self.pp, id(dist.group.WORLD)) + ((self.cp, self.ep) if self.cp * self.ep > 1
                                                                          else ())
        if key not in nodes._GROUPS:
            built = {}
            for name in ("tp", "pp", "dp"):
                built[name], _ = dist.new_subgroups_by_enumeration(self.layout[name])
            built["embed"] = dist.new_subgroups_by_enumeration(self.embed_layout)[0] if self.embed_layout else None
            for name in ("cp", "dp_cp", "ep", "edp"):
                rows = sorted(map(tuple, self.layout[name]))   # (every row is in ascending rank order)
                same = next((k for k in GROUPS if k in built and sorted(map(tuple, self.layout[k])) == rows), None)
                built[name] = built[same] if same else dist.new_subgroups_by_enumeration(self.layout[name])[0]
            nodes._GROUPS[key] = built
        return nodes._GROUPS[key]

    def _axis(self, name: str) -> str:
        if name == "embed":
            if not self.in_embedding_group:
                raise ValueError(f"{self}: only the first and the last pipeline stage (pp > 1) are in an "
                                 f"embedding group ('embed')")
            return name
        if name not in self.sizes:
            raise ValueError(f"a mesh group is one of 'dp', 'tp', 'pp'; got {name!r} (or 'cp', 'dp_cp', 'ep', 'edp'; "
                             f"or 'embed', the first and last pipeline stages)")
        return name

    @property
    def grad_group(self) -> str:
        """The group dense gradients are averaged over, the engine's DP group: "dp_cp" when cp > 1
        (the cp ranks hold the same parameters and see different tokens), else "dp"."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def in_embedding_group(self) -> bool:
        """Whether this rank is a first or last stage of a pipeline of pp > 1 (module docstring)."""
        return self.pp > 1 and self.pp_rank in (0, self.pp - 1)

    def group(self, name: str):
        """The process group of this rank's ``name`` group (one of ``GROUPS``); None on one process."""
        return self._groups[self._axis(name)]

    def ranks(self, name: str) -> list:
        """The global ranks of this rank's ``name`` group, in group order."""
        rows = self.embed_layout if self._axis(name) == "embed" else self.layout[name]
        return next(g for g in rows if self.rank in g)

    def size(self, name: str) -> int:
        return 2 if self._axis(name) == "embed" else self.sizes[name]

    def coord(self, name: str) -> int:
        """This rank's index in its ``name`` group (``dp_rank``, ``tp_rank``, ``pp_rank``, ``cp_rank``, ...)."""
        return {"dp": self.dp_rank, "tp": self.tp_rank, "pp": self.pp_rank, "cp": self.cp_rank,
                "dp_cp": self.dp_rank * self.cp + self.cp_rank, "ep": self.ep_rank, "edp": self.edp_rank,
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
        extra = (f", cp={self.cp}" if self.cp > 1 else "") + (f", ep={self.ep}" if self.ep > 1 else "")
        where = f", cp {self.cp_rank}" if self.cp > 1 else ""
        return (f"Mesh(dp={self.dp}, tp={self.tp}, pp={self.pp}{extra}; rank {self.rank} = "
                f"(dp {self.dp_rank}, pp {self.pp_rank}{where}, tp {self.tp_rank}), node {self.node})")


def mesh(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, ranks_per_node: int | None = None,
         link=None) -> Mesh:
    """``zl.mesh(dp=2, tp=2, pp=2)``: this rank's place in the grid and its process groups; ``cp``:
    context parallelism (multiplies the world), ``ep``: expert parallelism (carved out of dp).
    Call it on every rank, in the same order (it builds process groups: a collective)."""
    return Mesh(dp, tp, pp, ranks_per_node, link, cp=cp, ep=ep)
