"""Adversarial CLI arguments: ``sfcl serve --port 99999`` printed its "serving on" banner and then
hung (uvicorn never bound and never exited); an out-of-range port is now an argparse error."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("flag,value", [("--port", "99999"), ("--port", "-1"), ("--metrics-port", "70000"),
                                        ("--port", "http")])
def test_out_of_range_ports_are_usage_errors(flag, value):
    r = subprocess.run([sys.executable, "-m", "sfcl.cli", "serve", flag, value], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "sfcl serve: error: argument " + flag in r.stderr and "Traceback" not in r.stderr
