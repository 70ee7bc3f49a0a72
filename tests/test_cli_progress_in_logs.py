"""``sfcl.cli.quiet_progress_in_logs``: progress bars written to a file or pipe (a service's log)
update every ``PROGRESS_LOG_INTERVAL_S`` seconds, at a terminal as tqdm does by default, and a
``TQDM_MININTERVAL`` the user set wins."""

import os
import subprocess
import sys

import sfcl.cli as cli

CODE = ("import sys, sfcl.cli, tqdm; b = tqdm.tqdm(total=1, file=sys.stderr); "
        "print(b.mininterval); b.close()")


def _mininterval(env_extra: dict) -> float:
    env = {k: v for k, v in os.environ.items() if k != "TQDM_MININTERVAL"} | env_extra
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, check=True)
    return float(out.stdout.strip())


def test_bars_to_a_pipe_update_every_interval():
    assert _mininterval({}) == cli.PROGRESS_LOG_INTERVAL_S


def test_a_value_the_user_set_wins():
    assert _mininterval({"TQDM_MININTERVAL": "0.5"}) == 0.5


def test_a_terminal_keeps_tqdms_default(monkeypatch):
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.quiet_progress_in_logs() is False and "TQDM_MININTERVAL" not in os.environ
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli.quiet_progress_in_logs() is True and os.environ["TQDM_MININTERVAL"] == str(cli.PROGRESS_LOG_INTERVAL_S)
