"""zl.launch from a real Jupyter kernel: a function defined in a cell runs on
N ranks, prints nothing from the children, and a failing rank surfaces in the
cell with its traceback, leaving no child processes behind."""
import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

CELLS = [
    "import os, psutil, torch, torch.distributed as dist, zerolab as zl",
    # a worker defined in the notebook itself: plain spawn could not pickle it
    "def worker(scale):\n"
    "    print('child output must stay out of the notebook')\n"
    "    t = torch.ones(2) * (dist.get_rank() + 1) * scale\n"
    "    dist.all_reduce(t)\n"
    "    return dist.get_rank(), t.tolist()",
    "print(zl.launch(worker, 2, args=(10,)))\nprint(zl.launch(worker, 4, args=(1,)))",
    "print(zl.launch(worker, 2, args=(1,), start_method='spawn', timeout=60))",
    # the resource tracker and a forkserver are multiprocessing's shared helpers, not ranks
    "print(len([p for p in psutil.Process().children(recursive=True)\n"
    "           if not any(h in ' '.join(p.cmdline()) for h in ('resource_tracker', 'forkserver'))]))",
]


def _run(cells, timeout=120):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=timeout, kernel_name="python3").execute()
    return nb


def _text(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_cell_defined_worker_runs_on_ranks_and_children_stay_quiet():
    nb = _run(CELLS)
    assert _text(nb.cells[2]) == "[(0, [30.0, 30.0]), (1, [30.0, 30.0])]\n" \
                                 "[(0, [10.0, 10.0]), (1, [10.0, 10.0]), (2, [10.0, 10.0]), (3, [10.0, 10.0])]\n"
    assert _text(nb.cells[3]) == "[(0, [3.0, 3.0]), (1, [3.0, 3.0])]\n"
    assert _text(nb.cells[4]) == "0\n"
    assert not any("child output" in str(c.outputs) for c in nb.cells)


def test_failing_rank_surfaces_in_the_cell_with_its_traceback():
    cells = CELLS[:2] + [
        "def bad():\n"
        "    if dist.get_rank() == 1:\n"
        "        raise KeyError('missing-key-in-rank-1')\n"
        "    dist.barrier()\n",
        "import time\nt0 = time.monotonic()\ntry:\n    zl.launch(bad, 3)\nexcept zl.LaunchError as e:\n"
        "    print(e.rank, 'missing-key-in-rank-1' in str(e), time.monotonic() - t0 < 5)",
        CELLS[-1],
        "zl.launch(bad, 2)",
    ]
    with pytest.raises(CellExecutionError) as info:
        _run(cells)
    msg = str(info.value)
    assert "LaunchError" in msg and "rank 1 of 2 failed" in msg and "missing-key-in-rank-1" in msg
