"""A failing test whose report cannot be formatted is still one failure, not the end of the run.

CPython 3.11 can raise `SystemError: AST constructor recursion depth mismatch` from `ast.parse`
(python/cpython#106905, seen with pytest in pytest-dev/pytest#10763 and #11724). pytest parses
the test's source to draw its traceback, so the error escapes the report and pytest stops the
whole session with INTERNALERROR. Here such a report falls back to Python's own traceback
text, or to the exception's type and message when that cannot be drawn either.
"""

from __future__ import annotations

import traceback
from collections.abc import Generator

import pytest

_AST_BUG = "AST constructor recursion depth mismatch"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    try:
        return (yield)
    except SystemError as error:
        if _AST_BUG not in str(error) or call.excinfo is None:
            raise
        return _plain_report(item, call, call.excinfo.value, error)


def _plain_report(
    item: pytest.Item, call: pytest.CallInfo[None], failure: BaseException, error: SystemError
) -> pytest.TestReport:
    try:
        text = "".join(traceback.format_exception(failure))
    except SystemError:
        text = f"{type(failure).__name__}: {failure}\n"
    text += f"(pytest could not draw this failure's traceback: {error})\n"
    return pytest.TestReport(
        item.nodeid,
        item.location,
        {name: 1 for name in item.keywords},
        "failed",
        text,
        call.when,
        duration=call.duration,
        start=call.start,
        stop=call.stop,
    )
