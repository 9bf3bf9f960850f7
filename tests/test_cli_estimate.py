"""`python -m zerolab estimate` (zerolab.cli), run as a user would: in a subprocess."""
import pathlib
import subprocess
import sys

import pytest

from zerolab import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "configs"


def run(*argv):
    return subprocess.run([sys.executable, "-m", "zerolab", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def row(out: str, label: str) -> list[str]:
    line = next(l for l in out.splitlines() if l.startswith(label))
    cells = line[len(label):].split("  ")
    return [c.strip() for c in cells if c.strip()]


def gb(x):
    return f"{x / 1e9:,.2f} GB"


def test_estimate_all_stages_side_by_side():
    r = run("estimate", "--params", "7.5e9", "--gpus", "64")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for name in ("stage 0 (DDP)", "stage 1", "stage 2", "stage 3"):
        assert name in out
    psi, n = 7.5e9, 64
    # mixed-precision Adam: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (the ZeRO paper's formulas)
    assert row(out, "GPU: total (model states)") == [gb(16 * psi), gb(4 * psi + 12 * psi / n),
                                                      gb(2 * psi + 14 * psi / n), gb(16 * psi / n)]
    assert row(out, "GPU: optimizer state")[0] == gb(12 * psi)
    sent = row(out, "sent per step per rank")
    assert sent == [gb(2 * 2 * psi * (n - 1) / n)] * 3 + [gb(3 * 2 * psi * (n - 1) / n)]
    assert "host RAM" not in out and "inter-node" not in out


def test_fp8_weights_one_byte_and_gathered_in_fp8():
    """--fp8: 1-byte weights beside the bf16 gradients, fp32 master and Adam (15 bytes per parameter, not 16);
    parameter all-gathers at one byte, gradient reductions still at two (theory/fp8.py)."""
    r = run("estimate", "--params", "70B", "--gpus", "64", "--fp8")
    assert r.returncode == 0, r.stderr
    psi, n, ring = 70e9, 64, 63 / 64
    assert row(r.stdout, "GPU: total (model states)") == [gb(15 * psi), gb(3 * psi + 12 * psi / n),
                                                           gb(psi + 14 * psi / n), gb(15 * psi / n)]
    assert row(r.stdout, "sent per step per rank") == [gb(2 * 2 * psi * ring)] + [gb((2 + 1) * psi * ring)] * 2 \
        + [gb((2 + 2 * 1) * psi * ring)]
    assert "FP8 weights" in r.stdout
    plain = run("estimate", "--params", "70B", "--gpus", "64")
    assert row(plain.stdout, "GPU: total (model states)")[3] == gb(16 * psi / n)


def test_offload_and_nodes_rows():
    r = run("estimate", "--params", "13B", "--gpus", "16", "--gpus-per-node", "8",
            "--offload-optimizer", "cpu", "--offload-param", "nvme", "--precision", "fp32")
    assert r.returncode == 0, r.stderr
    psi, n = 13e9, 16
    host = row(r.stdout, "host RAM per rank")
    assert host == ["0", gb(12 * psi / n), gb(12 * psi / n), gb(12 * psi / n)]  # fp32 Adam: K = 8, + fp32 grads
    assert row(r.stdout, "NVMe per rank") == ["0", "0", "0", gb(4 * psi / n)]
    assert row(r.stdout, "GPU: params")[3] == "0"
    # a ring over 16 ranks on 2 nodes: 2 of its 16 links cross nodes (theory/comm.py)
    assert row(r.stdout, "  of which inter-node")[0] == gb(2 * 4 * psi * (n - 1) / n * 2 / 16)
    assert "offload_param=nvme applies to stage 3 only" in r.stdout


def test_config_drives_settings_and_marks_stage():
    r = run("estimate", "--params", "7.5e9", "--gpus", "8", "--config", str(CONFIGS / "source_004b_stage3_8xA100.json"))
    assert r.returncode == 0, r.stderr
    assert "stage 3*" in r.stdout and "optimizer adamw" in r.stdout and "gradient accumulation 4" in r.stdout
    assert row(r.stdout, "host RAM per rank")[3] == gb(16 * 7.5e9 / 8)      # 12Ψ/N state + 4Ψ/N fp32 grads


def test_bad_source_config_is_a_clear_error():
    r = run("estimate", "--params", "7.5e9", "--gpus", "8", "--config",
            str(CONFIGS / "source_004g_stage1_offload_param_WRONG.json"))
    assert r.returncode == 2
    assert "zero_optimization.offload_param" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["estimate", "--params", "lots", "--gpus", "8"], "not a parameter count"),
    (["estimate", "--params", "1e9", "--gpus", "0"], "n_gpus"),
    (["estimate", "--params", "1e9", "--gpus", "8", "--precision", "fp8"], "invalid choice"),
    (["estimate", "--params", "1e9", "--gpus", "12", "--gpus-per-node", "8"], "--gpus-per-node"),
])
def test_bad_arguments(argv, needle):
    r = run(*argv)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_help_and_command_table():
    r = run("--help")
    assert r.returncode == 0 and "estimate" in r.stdout
    assert set(cli.COMMANDS) >= {"estimate"} and cli.COMMANDS["estimate"][2] is cli.cmd_estimate
    assert cli.parse_count("7.5B") == 7.5e9 and cli.parse_count("350m") == 350e6


def test_fp8_with_zeropp_config_is_refused_by_name(tmp_path):
    cfg = tmp_path / "zpp.json"
    cfg.write_text('{"train_batch_size": 8, "bf16": {"enabled": true}, '
                   '"zero_optimization": {"stage": 3, "zero_quantized_weights": true}}')
    r = run("estimate", "--params", "7B", "--gpus", "8", "--config", str(cfg), "--fp8")
    assert r.returncode != 0 and "--fp8" in r.stderr and "zero_quantized_weights" in r.stderr, r.stderr
