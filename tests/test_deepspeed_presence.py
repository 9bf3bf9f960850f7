"""Where DeepSpeed is not installed (CI), nothing may pretend it is.

A folder named ``deepspeed`` without ``__init__.py`` on ``sys.path`` -- tests/fixtures/deepspeed holds
DeepSpeed's checkpoint files, examples/deepspeed its scripts -- is importable as a namespace package, so
``importlib.util.find_spec("deepspeed")`` and ``pytest.importorskip("deepspeed")`` both say "installed"
and every DeepSpeed half then fails instead of skipping (CI, stop 31: 11 failures, 4 errors).
"""
import importlib
import sys

from zerolab.bench.peers import deepspeed_available


def test_a_folder_named_deepspeed_is_not_deepspeed(tmp_path, monkeypatch):
    (tmp_path / "deepspeed").mkdir()
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if "site-packages" not in p])
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    importlib.invalidate_caches()
    assert importlib.util.find_spec("deepspeed") is not None      # what the old check saw
    assert not deepspeed_available()


def test_the_test_helpers_leave_sys_path_alone():
    before = list(sys.path)
    sys.modules.pop("ds_resume_run", None)
    import ds_resume_run  # noqa: F401  (it used to put tests/fixtures, and so fixtures/deepspeed, on the path)
    added = [p for p in sys.path if p not in before]
    assert added == []
