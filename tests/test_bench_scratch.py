"""bench/scratch.py: what a gloo collective holds beyond its tensors, measured per rank (issue 28)."""
from zerolab.bench import scratch


def test_scratch_is_measured_per_rank_and_call(capsys):
    numel = 2_000_000   # 8 MB of fp32
    got = scratch.measure(world_size=2, numel=numel)
    assert sorted(got) == sorted(scratch.CALLS)
    assert all(len(v) == 2 and all(isinstance(b, int) and b >= 0 for b in v) for v in got.values()), got
    # an in-place broadcast needs no second copy; gloo's all-gather holds one of its output (the fact
    # the sweep's stage-3 working set rests on): a broken measurement reads 0 or the same for both
    assert max(got["broadcast"]) < 0.25 * 4 * numel < min(got["all_gather_into_tensor"]), got
    assert scratch.main(["--numel", "1000000"]) == 0
    assert "all_gather_into_tensor" in capsys.readouterr().out
