"""A pytest plugin: each failure's report as soon as its test ends, where ``PK_FAILURES_NOW`` is
set (``make test-gpu`` sets it). A GPU part cut at its device command's limit never reaches
pytest's summary, where the failures' messages are: on 2026-12-05 a cut ``losses`` part said only
which tests failed, and one more device call was spent to learn why."""

from __future__ import annotations

import os
from typing import Any

import pytest

_config: Any = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or not os.environ.get("PK_FAILURES_NOW") or _config is None:
        return
    out = _config.pluginmanager.get_plugin("terminalreporter")
    if out is None:
        return
    text = report.longreprtext
    if len(text) > 6000:  # the end holds the assertion and its message
        text = "...\n" + text[-6000:]
    out.write_line("")
    out.write_line(f"--- {report.nodeid} failed ({report.when}):")
    for line in text.splitlines():
        out.write_line(line)
