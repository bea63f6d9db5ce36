"""`tpf doctor` on this machine: exits 0 and says what the install runs on, with or without a GPU."""
import os

import torch

import tpfkit
from tpfkit import _C
from tpfkit.cli import main


def test_doctor_reports_gpu_kernels_and_versions(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    info = _C.cuda_info()
    assert f"tpfkit {tpfkit.__version__} at " in out
    assert f"PyTorch: {torch.__version__} " in out
    assert f"tpfkit.cuda_available() = {tpfkit.cuda_available()}" in out
    if torch.cuda.is_available() or info["devices"]:
        assert "GPU 0: " in out and "compute capability " in out
    else:
        assert "GPU: none" in out
    if info["built"]:
        # The kernels' library is linked into the module: loaded, from a file that exists.
        line = next(x for x in out.splitlines() if x.startswith("CUDA kernels: built"))
        assert "(sm_90a)" in line
        assert os.path.isfile(line.split("libtpf_cuda loaded from ", 1)[1])
        assert f"CUTLASS: {info['cutlass']} " in out and info["cutlass"].count(".") == 2
        assert "CUDA runtime: " in out and "cuBLAS: " in out
    else:
        assert "CUDA kernels: not built into this install" in out
        assert "CUDA kernels in use: no" in out
