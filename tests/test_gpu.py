"""The nccl path. Runs only where CUDA GPUs exist (`make gpu-check`); CI has none."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")]


def test_gpu_check_passes():
    from zerolab.runtime.gpu_check import main
    assert main() == 0


def test_backend_auto_picks_nccl_with_one_gpu_per_rank():
    from zerolab.runtime.launch import choose_backend
    assert choose_backend(torch.cuda.device_count()) == "nccl"
    assert choose_backend(torch.cuda.device_count() + 1) == "gloo"
