"""A test run fails when a test was skipped for a missing Python module (a dependency the dev extra lacks):
``pytest.importorskip`` would otherwise hide it as a skip. Skips for another platform (macOS) stay allowed.

Imported by tests/conftest.py, whose namespace registers these hooks with pytest.
"""

from __future__ import annotations

import pytest

_MISSING = ("could not import", "No module named")
_missing_skips: list[str] = []
_importorskip = pytest.importorskip


def _recording_importorskip(modname: str, *args, **kwargs):
    """``pytest.importorskip``, remembering a module that is missing (its ``reason=`` may not say so)."""
    try:
        return _importorskip(modname, *args, **kwargs)
    except pytest.skip.Exception as e:
        _missing_skips.append(f"{modname}: {str(e).splitlines()[0] if str(e) else 'missing'}")
        raise


pytest.importorskip = _recording_importorskip


def _record(report) -> None:
    if report.skipped and report.longrepr is not None:
        text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if any(m in text for m in _MISSING):
            _missing_skips.append(f"{report.nodeid}: {text.splitlines()[0] if text else ''}")


def pytest_collectreport(report) -> None:
    _record(report)


def pytest_runtest_logreport(report) -> None:
    _record(report)


def pytest_sessionfinish(session, exitstatus) -> None:
    if _missing_skips and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _missing_skips:
        terminalreporter.section("skipped for a missing Python module (install the dev extra: pip install -e '.[dev]')",
                                 red=True)
        for line in _missing_skips:
            terminalreporter.line(line, red=True)
