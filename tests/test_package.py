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


def test_testing_is_an_attribute_and_import_stays_cheap():
    """``rotary.testing`` after a plain ``import rotary`` (imported on first access, listed in dir()), and the
    import itself pulls in no accelerator or framework module."""
    code = ("import sys, numpy as np, rotary; heavy = ('numba', 'cupy', 'torch', 'jax'); "
            "before = [m for m in heavy if m in sys.modules]; lazy = 'rotary.testing' in sys.modules; "
            "listed = 'testing' in dir(rotary); "
            "y = rotary.testing.rope_2x2(np.ones((3, 4)), np.arange(3), rotary.RopeSpec(4).inv_freq()); "
            "print(before, lazy, listed, y.shape, [m for m in heavy if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] False True (3, 4) []"
    import rotary.testing

    assert rotary.testing is sys.modules["rotary.testing"]
