"""The bad-input catalogue (rotary.conformance.error_cases, issue 14): each case raises the exact exception type with
the required words in its message, or returns the exact value required; the CLI reports the same."""

from __future__ import annotations

import argparse
import io

import pytest

from rotary.cli import conformance as _cli_conformance
from rotary.conformance import error_cases as _error_cases
from rotary.backends import available_backends

CASES = _error_cases.cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_error_case(case):
    if case.needs and not available_backends()[case.needs][0]:
        pytest.skip(f"needs {case.needs}")
    if case.raises is not None:
        with pytest.raises(Exception) as info:
            case.run()
        assert type(info.value) is case.raises, f"{type(info.value).__name__}: {info.value}"
        for word in case.words:
            assert word in str(info.value), str(info.value)
    else:
        assert case.check(case.run())
    assert _error_cases.run_case(case).passed


def test_catalogue_reports_failures():
    """The runner is not a rubber stamp: a case whose call does not raise, or raises otherwise, fails."""
    quiet = _error_cases.ErrorCase("no raise", lambda: 1, ValueError, ("x",))
    wrong = _error_cases.ErrorCase("wrong type", lambda: int("x"), TypeError, ())
    words = _error_cases.ErrorCase("wrong words", lambda: int("x"), ValueError, ("nothing like this",))
    value = _error_cases.ErrorCase("wrong value", lambda: 1, check=lambda v: v == 2)
    assert not any(_error_cases.run_case(c).passed for c in (quiet, wrong, words, value))


def test_cli_errors_flag():
    out = io.StringIO()
    status = _cli_conformance.run_cli(argparse.Namespace(errors=True, failures_only=False), stdout=out)
    text = out.getvalue()
    assert status == 0, text
    assert "errors catalogue: OK" in text and "offset wraps past int64" in text


def test_cli_frictions():
    """--version; demo --tokens 0 is a usage error (exit 2), not a traceback; info | head -2 exits quietly."""
    import subprocess
    import sys

    import rotary

    run = lambda *a: subprocess.run([sys.executable, "-m", "rotary", *a], capture_output=True, text=True, timeout=120)
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"rotary {rotary.__version__}"
    out = run("demo", "--tokens", "0")
    assert out.returncode == 2 and "--tokens: expected an integer >= 1, got 0" in out.stderr
    assert "Traceback" not in out.stderr
    proc = subprocess.Popen([sys.executable, "-m", "rotary", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()     # the reader leaves early, like `head -2`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "BrokenPipeError" not in err, err
