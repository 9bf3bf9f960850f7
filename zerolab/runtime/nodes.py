"""Simulated nodes: which ranks share a node, their process groups, which bytes cross nodes (chapter 9).

Ranks ``m*K .. m*K+K-1`` form node ``m`` (K = ``ranks_per_node``:
``zl.launch(..., ranks_per_node=K)`` or torchrun's ``LOCAL_WORLD_SIZE``). The
world ``Communicator`` (``comm.py``) builds, once per process, the
intra-node group (its node's K ranks, ``.intra``) and the inter-node group
(the ranks with its local index on every node, ``.inter``). Each record of
the ledger splits its algorithm bytes into those that stay in a node and
those that cross nodes, by ``inter_fraction``:

* ring collectives (all-reduce, reduce-scatter, all-gather): a ring over the
  group's ranks in order has one link per rank and every link carries the
  same bytes, so the fraction that crosses is (links joining two nodes) /
  (links). Over all N ranks with M nodes that is M/N = 1/K; inside a node 0;
  over the inter-node group 1.
* all-to-all: each rank sends one equal chunk to every other rank, so the
  fraction is (peers on other nodes) / (peers).
* broadcast (a pipelined chain): the rank's own outgoing link crosses or not.

``theory.comm.split_intra_inter`` predicts with the same rule.
"""
from __future__ import annotations

import torch.distributed as dist

from zerolab.theory.network import get_link

_GROUPS: dict = {}   # what was built, per world group: new_group is a collective, so once only


def node_links(link) -> dict | None:
    """``None``, a ``Link`` or preset name (both tiers), or ``{"intra": ..., "inter": ...}``
    -> ``{"intra": Link, "inter": Link}`` (or None)."""
    if isinstance(link, dict):
        if set(link) != {"intra", "inter"}:
            raise ValueError(f"a per-tier link needs exactly the keys 'intra' and 'inter', got {sorted(link)}")
        return {k: get_link(v) for k, v in link.items()}
    one = get_link(link)
    return None if one is None else {"intra": one, "inter": one}


def node_layout(n: int, k: int) -> tuple[list, list]:
    """(intra-node rank lists, inter-node rank lists) for N = ``n`` ranks, K = ``k`` per node (no process groups)."""
    m = n // k
    return [[a * k + b for b in range(k)] for a in range(m)], [[a * k + b for a in range(m)] for b in range(k)]


def node_groups(n: int, k: int):
    """(this rank's intra-node group, its inter-node group) for N = ``n`` ranks, K = ``k`` per node."""
    key = ("nodes", n, k, id(dist.group.WORLD))
    if key not in _GROUPS:
        intra_lists, inter_lists = node_layout(n, k)
        intra, _ = dist.new_subgroups_by_enumeration(intra_lists)
        inter, _ = dist.new_subgroups_by_enumeration(inter_lists)
        _GROUPS[key] = (intra, inter)
    return _GROUPS[key]


def consecutive_group(n: int, size: int):
    """This rank's group of ``size`` consecutive ranks (hpZ's partition inside a node)."""
    key = ("consecutive", n, size, id(dist.group.WORLD))
    if key not in _GROUPS:
        _GROUPS[key], _ = dist.new_subgroups_by_enumeration([[a * size + b for b in range(size)]
                                                             for a in range(n // size)])
    return _GROUPS[key]


def inter_fraction(op: str, members: list, rank: int, k: int) -> float:
    """The share of group rank ``rank``'s algorithm bytes for ``op`` that crosses nodes, in a group
    of the global ranks ``members`` (in group order), with ``k`` ranks per node."""
    n = len(members)
    node = [g // k for g in members]
    if n == 1 or len(set(node)) == 1:
        return 0.0
    if op == "all_to_all":
        return sum(1 for x in node if x != node[rank]) / (n - 1)
    if op == "broadcast":
        return float(node[rank] != node[(rank + 1) % n])
    return sum(1 for i in range(n) if node[i] != node[(i + 1) % n]) / n
