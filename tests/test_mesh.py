"""zl.mesh (runtime/mesh.py): the groups of a (dp, tp, pp) grid against hand-written tables, checked
with real collectives on 4 and 8 gloo ranks; each record booked under its group; bad meshes refused."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zerolab as zl
from zerolab.runtime.mesh import check_mesh, coordinates, mesh_layout

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# (dp, tp, pp) -> every group of each kind, written out by hand (TP innermost, then PP, then DP)
TABLES = {
    (2, 2, 1): {"tp": [[0, 1], [2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]]},
    (1, 2, 2): {"tp": [[0, 1], [2, 3]], "pp": [[0, 2], [1, 3]], "dp": [[0], [1], [2], [3]]},
    (2, 1, 2): {"tp": [[0], [1], [2], [3]], "pp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]},
    (4, 1, 1): {"tp": [[0], [1], [2], [3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 1, 2, 3]]},
    (2, 2, 2): {"tp": [[0, 1], [2, 3], [4, 5], [6, 7]], "pp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "dp": [[0, 4], [1, 5], [2, 6], [3, 7]]},
}
# global rank -> (dp_rank, pp_rank, tp_rank) on the 2x2x2 mesh, by hand
COORDS_222 = {0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1),
              4: (1, 0, 0), 5: (1, 0, 1), 6: (1, 1, 0), 7: (1, 1, 1)}


@pytest.mark.parametrize("shape", list(TABLES), ids=str)
def test_layout_matches_hand_table(shape):
    dp, tp, pp = shape
    assert mesh_layout(dp, tp, pp) == TABLES[shape]


def test_coordinates_by_hand():
    for r, (d, p, t) in COORDS_222.items():
        assert coordinates(r, 2, 2, 2) == {"dp": d, "pp": p, "tp": t}
    with pytest.raises(ValueError, match="rank 8 is outside a mesh of 8"):
        coordinates(8, 2, 2, 2)


def test_bad_meshes_named():
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 8, but the world has 4 ranks"):
        check_mesh(2, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="tp=4 .* cross a node of 2 ranks"):
        check_mesh(1, 4, 1, 4, 2)
    with pytest.raises(ValueError, match="tp=2 .* cross a node of 3 ranks"):   # 2 does not divide 3
        check_mesh(3, 2, 1, 6, 3)
    with pytest.raises(ValueError, match="pp must be an integer >= 1, got 0"):
        check_mesh(4, 1, 0, 4, 4)
    check_mesh(2, 2, 1, 4, 2)   # TP inside each 2-rank node: fine


def _groups_worker(shapes):
    """Inside a rank: for each mesh, each group's members seen through a real all-gather of the
    global ranks over that group, the coordinates, and the bytes booked per group."""
    out = []
    for dp, tp, pp in shapes:
        m = zl.mesh(dp=dp, tp=tp, pp=pp)
        seen = {}
        for name in ("dp", "tp", "pp"):
            n = m.size(name)
            got = torch.zeros(n, dtype=torch.int64)
            _all_gather(got, torch.tensor([dist.get_rank()]), group=m.group(name))
            seen[name] = (got.tolist(), m.ranks(name), dist.get_world_size(m.group(name)))
        c = m.communicator("tp")
        c.all_reduce(torch.ones(10))
        booked = {g: m.ledger.total_bytes(group=g) for g in ("dp", "tp", "pp")}
        again = zl.mesh(dp=dp, tp=tp, pp=pp)   # the same grid: the same process groups, not new ones
        out.append({"seen": seen, "coords": (m.dp_rank, m.pp_rank, m.tp_rank), "booked": booked,
                    "same_groups": all(again.group(g) is m.group(g) for g in ("dp", "tp", "pp"))})
    return out


def _check(results, shapes):
    for r, per_rank in enumerate(results):
        for (dp, tp, pp), got in zip(shapes, per_rank):
            table = TABLES[(dp, tp, pp)]
            for name in ("dp", "tp", "pp"):
                row = next(g for g in table[name] if r in g)
                members, ranks, size = got["seen"][name]
                assert members == row == ranks and size == len(row), (r, (dp, tp, pp), name, members, row)
            d, p, t = got["coords"]
            assert table["tp"][d * pp + p][t] == r and table["dp"][p * tp + t][d] == r
            assert got["same_groups"]
            # 10 fp32 all-reduced over the TP group: 2 (tp-1)/tp * 40 bytes, all booked under "tp"
            assert got["booked"] == {"dp": 0, "tp": 2 * (tp - 1) * 40 // tp, "pp": 0}


def test_groups_on_4_ranks():
    shapes = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (4, 1, 1)]
    _check(zl.launch(_groups_worker, 4, args=(shapes,), timeout=120, threads=1), shapes)


def test_groups_on_8_ranks():
    results = zl.launch(_groups_worker, 8, args=([(2, 2, 2)],), timeout=180, threads=1)
    _check(results, [(2, 2, 2)])
    assert [tuple(res[0]["coords"]) for res in results] == [COORDS_222[r] for r in range(8)]


def _bad_worker(dp, tp, pp):
    zl.mesh(dp=dp, tp=tp, pp=pp)


def test_bad_mesh_inside_ranks():
    with pytest.raises(zl.LaunchError, match=r"dp\*tp\*pp = 8, but the world has 4 ranks"):
        zl.launch(_bad_worker, 4, args=(2, 2, 2), timeout=60, threads=1)
    with pytest.raises(zl.LaunchError, match="tp=4 .* cross a node of 2 ranks"):
        zl.launch(_bad_worker, 4, args=(1, 4, 1), timeout=60, threads=1, ranks_per_node=2)


def test_one_process_mesh():
    m = zl.mesh()
    assert (m.dp_rank, m.tp_rank, m.pp_rank) == (0, 0, 0) and m.group("tp") is None
    with pytest.raises(ValueError, match="one of 'dp', 'tp', 'pp'; got 'xp'"):
        m.group("xp")
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 2, but the world has 1 ranks"):
        zl.mesh(tp=2)
