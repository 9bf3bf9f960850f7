"""zerolab.book.drills: the drill check says right within 10 % and shows the working otherwise."""
from zerolab.book import drills


def test_check_is_relative_and_refuses_non_numbers():
    assert drills.check(105, 100) and drills.check(90, 100) and not drills.check(89, 100)
    assert drills.check("7.5", 7.4) and not drills.check("seven", 7.4) and not drills.check(None, 1)
    assert drills.check(0.05, 0) and not drills.check(0.5, 0)


def test_verdict_shows_the_working_only_when_wrong():
    assert drills.verdict(14.2, 14.0, "GB", "16 x 70e9 / 80").startswith("right")
    wrong = drills.verdict(3.0, 14.0, "GB", "16 x 70e9 / 80")
    assert wrong.startswith("not yet") and "16 x 70e9 / 80" in wrong and "14" in wrong


def test_drill_outside_a_kernel_prints(capsys, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_widgets(name, *a, **k):
        if name == "ipywidgets":
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_widgets)
    assert drills.drill(1, 2.5, "s", "5 / 2") is None
    assert "Drill 1: 2.5 s" in capsys.readouterr().out
