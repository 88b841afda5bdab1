"""One rule for tests whose tool or extra is missing: skip on a developer machine, fail
where the run says the tool is required (CI: ``make test`` sets INGEST_TESTS_STRICT=1 and
DEPLOY_TOOLS_REQUIRED=1), so a green CI cannot hide a check that never ran."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

STRICT = "INGEST_TESTS_STRICT"


def required(flag: str = STRICT) -> bool:
    return os.environ.get(flag) == "1"


def unavailable(what: str, how: str, flag: str = STRICT) -> NoReturn:
    msg = f"{what} not available ({how})"
    if required(flag):
        pytest.fail(f"{msg} and {flag}=1", pytrace=False)
    pytest.skip(msg)
