"""activation_memory's FlashAttention option (chapter 1; issue 15, point 6).

FlashAttention keeps no s x s score tensors: per layer sbh(16d + 2) + 4asb bytes
(one fp32 log-sum-exp per head and token). Checked against an independent count,
and by its consequence the chapter uses: activations become linear in s.
"""
import pytest

from zerolab.theory import activation_memory

GPT = dict(layers=36, hidden=4096, heads=32, seq_len=2048, micro_batch=1)


def test_flash_attention_drops_the_quadratic_term():
    L, h, a, s, b = 36, 4096, 32, 2048, 1
    linear = s * b * h * 34                                   # Korthikanti's 34·sbh at d = 2
    assert activation_memory(**GPT, flash_attention=True) == L * (linear + 4 * a * s * b)
    assert activation_memory(**GPT) == L * (linear + 5 * a * s * s * b)   # unchanged without the flag
    with_ckpt = activation_memory(**GPT, flash_attention=True, checkpointing=True)
    assert with_ckpt == L * 2 * s * b * h + linear + 4 * a * s * b


@pytest.mark.parametrize("s", [512, 1024, 4096])
def test_flash_attention_is_linear_in_sequence_length(s):
    one = activation_memory(**{**GPT, "seq_len": s}, flash_attention=True)
    assert activation_memory(**{**GPT, "seq_len": 2 * s}, flash_attention=True) == 2 * one
    assert activation_memory(**{**GPT, "seq_len": 2 * s}) > 2 * activation_memory(**{**GPT, "seq_len": s})


def test_flash_attention_must_be_a_bool():
    with pytest.raises(ValueError, match="flash_attention must be True or False"):
        activation_memory(**GPT, flash_attention="yes")
