"""Packaging: cheap import, one version, public API, CLI."""

import subprocess
import sys

import rotary


def test_import_is_cheap():
    code = ("import sys, rotary; rotary.apply(__import__('numpy').zeros((2, 4)), backend='numpy'); "
            "bad = [m for m in ('numba', 'cupy', 'torch', 'jax', 'scipy') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_version_single_source():
    from importlib.metadata import PackageNotFoundError, version

    try:
        assert version("rotary") == rotary.__version__
    except PackageNotFoundError:   # running from a source tree without install
        pass


def test_public_api():
    for name in ("RopeSpec", "apply", "apply_qk", "attention", "decay_curve", "available_backends",
                 "permute_weights", "convert_layout"):
        assert name in rotary.__all__ and hasattr(rotary, name)


def test_cli_info_and_demo():
    out = subprocess.run([sys.executable, "-m", "rotary", "info"], capture_output=True, text=True, check=True).stdout
    assert "numpy" in out and "backends" in out
    res = subprocess.run([sys.executable, "-m", "rotary", "demo", "--tokens", "64"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all backends agree" in res.stdout
    assert "causal linear attention" in res.stdout and "prefill+resume" in res.stdout
