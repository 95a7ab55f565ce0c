"""The GPU parts' plugin (tests/_failures_now.py): a failure's message as its test ends."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("on", [True, False])
def test_a_failures_message_is_printed_as_it_happens(tmp_path, on):
    # --tb=no --no-summary: what a run cut before its summary shows (the messages are only there)
    (tmp_path / "test_x.py").write_text("def test_fails():\n    assert 1 + 1 == 3, 'the message'\n\ndef test_passes():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PK_FAILURES_NOW"}
    env["PYTHONPATH"] = str(TESTS)
    if on:
        env["PK_FAILURES_NOW"] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_failures_now", "-p", "no:cacheprovider", "-v", "--tb=no", "--no-summary", "test_x.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    out = run.stdout
    assert ("test_x.py::test_fails failed (call):" in out) is on
    assert ("the message" in out) is on
    if on:  # before the next test's line: printed as it ended
        assert out.index("the message") < out.index("test_passes")
