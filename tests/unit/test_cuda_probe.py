"""`cuda_available` answers as torch does, without importing torch where torch is not loaded yet."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.cpu

PROBE = "import sys; from slime.utils.cuda import cuda_available; print(cuda_available(), 'torch' in sys.modules)"


def test_answers_like_torch_without_importing_it():
    import torch

    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(torch.cuda.is_available()), "False"]


def test_hidden_devices_count_as_none():
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["False", "False"]
