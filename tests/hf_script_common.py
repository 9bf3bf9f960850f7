"""What the Hugging Face door scripts (hf_trainer_script, hf_trainer_zero3_script, accelerate_script) share:
under real DeepSpeed, skip a JIT build used only for inference; the token dataset every rank draws the same way."""
import sys

import torch
from torch.utils.data import Dataset


def skip_deepspeed_shm_build() -> None:
    try:
        import deepspeed
    except ImportError:
        return
    if "zerolab" not in deepspeed.__version__:
        import deepspeed.comm.torch  # noqa: F401
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *a, **k: None


class Tokens(Dataset):
    """``n`` sequences of 16 tokens below 64, sequence i seeded by i; labels = inputs."""

    def __init__(self, n: int = 16):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": x, "labels": x.clone()}
