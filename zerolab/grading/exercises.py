"""The exercise notebooks: where they live, the learner's stub, copy and reset (all chapters).

Every exercise exists twice in the repository:

    exercises/NN_slug.ipynb             the learner's starting point (stubs, no outputs)
    exercises/solutions/NN_slug.ipynb   the executed solution: the single source of truth

The solution is the *pristine* notebook. Its answer cells (tag ``answer``)
carry the stub text in ``metadata.zerolab.stub``; its check cells (tag
``check``, name in ``metadata.zerolab.check``) carry the expected output.
``stub_notebook(solution)`` derives the learner's notebook from it, and
``zerolab.grading.answers`` builds every graded run from it plus the learner's answer
cells, so nothing the learner edits (not even exercises/NN_slug.ipynb itself,
if they work in place) can change a check or an expected output.

Where the notebooks are found: ``$ZEROLAB_EXERCISES_DIR`` if set, else the
``exercises/`` folder next to the installed package (a source checkout or an
editable install, ``pip install -e .``, which is how ``make`` installs it).

    python -m zerolab exercises                 list them
    python -m zerolab exercises --copy DIR      copy the stubs to DIR (outside the repo)
    python -m zerolab exercises --reset NAME [--dir DIR]
                                                restore one stub; the old file is kept as NAME.ipynb.bak
    python -m zerolab exercises --sync [NAME]   (maintainers) after editing a solution: re-run it,
                                                store its outputs, rewrite the stub from it
"""
from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

ANSWER, CHECK = "answer", "check"


def exercises_dir() -> Path:
    """The folder holding ``NN_slug.ipynb`` and ``solutions/``."""
    env = os.environ.get("ZEROLAB_EXERCISES_DIR")
    here = Path(env) if env else Path(__file__).resolve().parents[2] / "exercises"
    if not (here / "solutions").is_dir():
        raise FileNotFoundError(
            f"exercise notebooks not found in {here}; zerolab's exercises ship with the source tree "
            f"(install it with `pip install -e .` from a checkout) or set ZEROLAB_EXERCISES_DIR")
    return here


def names() -> list[str]:
    """Exercise names in book order, e.g. ["01_memory", "02_ring_allreduce", ...]."""
    return sorted(p.stem for p in (exercises_dir() / "solutions").glob("*.ipynb"))


def resolve_name(name: str) -> str:
    """'01_memory', '01_memory.ipynb', '01' or 'memory' -> '01_memory'."""
    stem = Path(name).name.removesuffix(".bak").removesuffix(".ipynb")
    all_names = names()
    if stem in all_names:
        return stem
    hits = [n for n in all_names if n.split("_", 1)[0] == stem or n.split("_", 1)[-1] == stem]
    if len(hits) == 1:
        return hits[0]
    raise ValueError(f"unknown exercise {name!r}; exercises: {', '.join(all_names)}")


def solution_path(name: str) -> Path:
    return exercises_dir() / "solutions" / f"{resolve_name(name)}.ipynb"


def tags(cell) -> list:
    return list(cell.get("metadata", {}).get("tags", []))


def meta(cell) -> dict:
    return cell.get("metadata", {}).get("zerolab", {})


def read(path):
    import nbformat
    return nbformat.read(str(path), as_version=4)


def write(nb, path) -> None:
    import nbformat
    nbformat.write(nb, str(path))


def exercise_of(nb, path=None) -> str:
    """The exercise a (learner's) notebook belongs to: its metadata, else its file name."""
    name = nb.metadata.get("zerolab", {}).get("exercise")
    if name:
        return resolve_name(name)
    if path is None:
        raise ValueError("the notebook does not say which exercise it is (metadata.zerolab.exercise)")
    return resolve_name(Path(path).name)


def stub_notebook(solution) :
    """The learner's notebook: answer cells replaced by their stubs, every output cleared."""
    nb = copy.deepcopy(solution)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if ANSWER in tags(cell):
            z = cell.metadata["zerolab"]
            cell.source = z.pop("stub")
        cell.outputs, cell.execution_count = [], None
    return nb


def copy_to(dest) -> list[Path]:
    """Copy every stub to ``dest`` (created); existing files there are kept, not overwritten."""
    dest = Path(dest).expanduser().resolve()
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names():
        target = dest / f"{name}.ipynb"
        if target.exists():
            continue
        write(stub_notebook(read(solution_path(name))), target)
        written.append(target)
    return written


def reset(name: str, directory=None) -> tuple[Path, Path | None]:
    """Restore exercise ``name`` in ``directory`` (default: the repository's exercises/).
    An existing file is first renamed to ``NAME.ipynb.bak`` (an older .bak gets a number)."""
    stem = resolve_name(name)
    target = Path(directory or exercises_dir()).expanduser().resolve() / f"{stem}.ipynb"
    backup = None
    if target.exists():
        backup = target.with_name(target.name + ".bak")
        k = 1
        while backup.exists():
            backup = target.with_name(f"{target.name}.bak{k}")
            k += 1
        shutil.move(str(target), str(backup))
    target.parent.mkdir(parents=True, exist_ok=True)
    write(stub_notebook(read(solution_path(stem))), target)
    return target, backup


def sync(name: str, timeout: int = 300) -> None:
    """Maintainers: execute solutions/NAME.ipynb in place (its check outputs become the expected
    ones) and rewrite exercises/NAME.ipynb from it. Raises if any cell fails."""
    from nbclient import NotebookClient
    path = solution_path(name)
    nb = read(path)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    write(nb, path)
    write(stub_notebook(nb), exercises_dir() / f"{resolve_name(name)}.ipynb")
