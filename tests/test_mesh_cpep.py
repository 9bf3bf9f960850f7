"""zl.mesh's context- and expert-parallel axes (runtime/mesh.py): the "cp", "dp_cp", "ep" and "edp" groups
against hand-written tables; every dp/tp/pp mesh keeps the 3-D layout it had; bad sizes refused by name;
the groups checked with real collectives on 4 gloo ranks."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.runtime.mesh import all_groups, check_mesh, coordinates, embedding_layout, mesh_layout

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# (dp, tp, pp, cp, ep) -> the groups, by hand (rank = ((d*pp + p)*cp + c)*tp + t; ep carved out of each DP group)
TABLES = {
    (2, 1, 1, 2, 1): {"tp": [[0], [1], [2], [3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]],
                      "cp": [[0, 1], [2, 3]], "dp_cp": [[0, 1, 2, 3]]},
    (1, 2, 1, 2, 1): {"tp": [[0, 1], [2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0], [1], [2], [3]],
                      "cp": [[0, 2], [1, 3]], "dp_cp": [[0, 2], [1, 3]]},
    (1, 1, 2, 2, 1): {"tp": [[0], [1], [2], [3]], "pp": [[0, 2], [1, 3]], "dp": [[0], [1], [2], [3]],
                      "cp": [[0, 1], [2, 3]], "dp_cp": [[0, 1], [2, 3]]},
    (4, 1, 1, 1, 2): {"tp": [[0], [1], [2], [3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]],
                      "ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]]},
    (2, 2, 1, 2, 1): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[r] for r in range(8)],
                      "dp": [[0, 4], [1, 5], [2, 6], [3, 7]], "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                      "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]]},
    (4, 2, 1, 1, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[r] for r in range(8)],
                      "dp": [[0, 2, 4, 6], [1, 3, 5, 7]], "ep": [[0, 2], [4, 6], [1, 3], [5, 7]],
                      "edp": [[0, 4], [2, 6], [1, 5], [3, 7]]},
    (2, 1, 1, 2, 2): {"tp": [[0], [1], [2], [3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]],
                      "cp": [[0, 1], [2, 3]], "dp_cp": [[0, 1, 2, 3]], "ep": [[0, 2], [1, 3]],
                      "edp": [[0], [2], [1], [3]]},
}


@pytest.mark.parametrize("shape", list(TABLES), ids=str)
def test_layout_matches_hand_table(shape):
    assert mesh_layout(*shape) == TABLES[shape]


def test_3d_layouts_unchanged():
    """Every dp/tp/pp mesh: the same groups, coordinates and embedding groups as the 3-D formula
    rank = (d*pp + p)*tp + t, written out here; no cp/ep keys appear."""
    for dp, tp, pp in itertools.product((1, 2, 3), (1, 2, 4), (1, 2, 3)):
        def r(d, p, t):
            return (d * pp + p) * tp + t
        old = {"tp": [[r(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
               "pp": [[r(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
               "dp": [[r(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}
        assert mesh_layout(dp, tp, pp) == old == mesh_layout(dp, tp, pp, cp=1, ep=1)
        full = all_groups(dp, tp, pp)
        assert full["dp_cp"] == full["dp"] == full["edp"]
        assert sorted(full["cp"]) == sorted(full["ep"]) == [[k] for k in range(dp * tp * pp)]
        assert embedding_layout(dp, tp, pp) == ([[r(d, 0, t), r(d, pp - 1, t)] for d in range(dp) for t in range(tp)]
                                                if pp > 1 else [])
        for k in range(dp * tp * pp):
            assert coordinates(k, dp, tp, pp) == {"dp": k // (pp * tp), "pp": k // tp % pp, "tp": k % tp}


def test_coordinates_with_cp_and_ep():
    # (dp, tp, pp, cp) = (2, 2, 1, 2): rank = (d*2 + c)*2 + t
    for k in range(8):
        d, c, t = k // 4, k // 2 % 2, k % 2
        assert coordinates(k, 2, 2, 1, cp=2) == {"dp": d, "pp": 0, "tp": t, "cp": c}
    # (dp, ep) = (4, 2): ep index = d % 2, edp index = d // 2
    assert [coordinates(k, 4, 1, 1, ep=2) for k in (0, 1, 2, 3)] == [
        {"dp": 0, "pp": 0, "tp": 0, "ep": 0, "edp": 0}, {"dp": 1, "pp": 0, "tp": 0, "ep": 1, "edp": 0},
        {"dp": 2, "pp": 0, "tp": 0, "ep": 0, "edp": 1}, {"dp": 3, "pp": 0, "tp": 0, "ep": 1, "edp": 1}]
    # the embedding groups keep (dp, cp, tp): (dp, pp, cp) = (2, 2, 2), rank = (d*2 + p)*2 + c
    assert embedding_layout(2, 1, 2, cp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_bad_sizes_named():
    with pytest.raises(ValueError, match="cp must be an integer >= 1, got 0"):
        check_mesh(4, 1, 1, 4, 4, cp=0)
    with pytest.raises(ValueError, match=r"cp must be an integer >= 1, got 1.5"):
        check_mesh(4, 1, 1, 4, 4, cp=1.5)
    with pytest.raises(ValueError, match="ep must be an integer >= 1, got True"):
        check_mesh(4, 1, 1, 4, 4, ep=True)
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        check_mesh(4, 1, 1, 4, 4, ep=3)
    with pytest.raises(ValueError, match=r"dp\*cp\*tp\*pp = 8, but the world has 4 ranks"):
        check_mesh(2, 2, 1, 4, 4, cp=2)
    with pytest.raises(ValueError, match=r"dp\*cp\*tp\*pp = 8, but the world has 1 ranks"):
        zl.mesh(dp=4, cp=2)   # not inside ranks: the world is one process, so the product check speaks
    check_mesh(2, 1, 1, 4, 4, cp=2, ep=2)
    m = zl.mesh()
    assert (m.cp, m.ep, m.cp_rank, m.ep_rank, m.edp_rank, m.grad_group) == (1, 1, 0, 0, 0, "dp")
    with pytest.raises(ValueError, match="one of 'dp', 'tp', 'pp'; got 'xp'"):
        m.size("xp")


def _groups_worker(shapes):
    """Each group's members seen through a real all-gather over it, the coordinates, the engine's
    gradient group and one all-reduce over the cp group booked under "cp"."""
    out = []
    for dp, tp, pp, cp, ep in shapes:
        m = zl.mesh(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        seen = {}
        for name in ("tp", "pp", "dp", "cp", "dp_cp", "ep", "edp"):
            got = torch.zeros(m.size(name), dtype=torch.int64)
            _all_gather(got, torch.tensor([dist.get_rank()]), group=m.group(name))
            seen[name] = (got.tolist(), m.ranks(name), m.coord(name))
        m.communicator("cp").all_reduce(torch.ones(10))
        out.append({"seen": seen, "grad": m.grad_group, "repr": repr(m),
                    "booked": {g: m.ledger.total_bytes(group=g) for g in ("dp", "cp", "dp_cp")},
                    "coords": (m.dp_rank, m.pp_rank, m.cp_rank, m.tp_rank, m.ep_rank, m.edp_rank)})
    return out


def test_groups_on_4_ranks():
    shapes = [(2, 1, 1, 2, 1), (1, 2, 1, 2, 1), (4, 1, 1, 1, 2), (2, 1, 1, 2, 2)]
    results = zl.launch(_groups_worker, 4, args=(shapes,), timeout=180, threads=1)
    for r, per_rank in enumerate(results):
        for shape, got in zip(shapes, per_rank):
            full = all_groups(*shape)
            for name, (members, ranks, index) in got["seen"].items():
                row = next(g for g in full[name] if r in g)
                assert members == ranks == row and row[index] == r, (r, shape, name, members, row)
            dp, tp, pp, cp, ep = shape
            d, p, c, t, e, ed = got["coords"]
            assert ((d * pp + p) * cp + c) * tp + t == r and (e, ed) == (d % ep, d // ep)
            assert got["grad"] == ("dp_cp" if cp > 1 else "dp")
            assert got["booked"] == {"dp": 0, "cp": 2 * (cp - 1) * 40 // cp, "dp_cp": 0}
            assert (f"cp {c}" in got["repr"]) == (cp > 1)
