"""One reading of "a model cut by its blocks" (parallel/pipeline_blocks.py) for contiguous and interleaved stages."""
from __future__ import annotations

import types

import pytest
from torch import nn

from zerolab.parallel import pipeline_stage
from zerolab.parallel.pipeline_blocks import as_sequential


def test_contiguous_and_interleaved_stages_read_a_model_the_same_way():
    blocks = [nn.Linear(2, 2) for _ in range(4)]
    assert isinstance(as_sequential(blocks), nn.Sequential) and len(as_sequential(nn.ModuleList(blocks))) == 4
    mesh = types.SimpleNamespace(pp=2, pp_rank=1)
    assert [n.split(".")[0] for n, _ in pipeline_stage(list(blocks), mesh).named_parameters()][::2] == ["2", "3"]
    assert sorted({n.split(".")[0] for n, _ in pipeline_stage(list(blocks), mesh, virtual=2).named_parameters()}) \
        == ["1", "3"]
    for virtual in (1, 2):
        with pytest.raises(ValueError, match="got Linear, which cannot be cut"):
            pipeline_stage(nn.Linear(2, 2), mesh, virtual=virtual)
