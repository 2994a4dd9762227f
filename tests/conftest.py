from __future__ import annotations

import pytest

from tests.pools import close_pools, get_pool


@pytest.fixture
def pool1():
    return get_pool(1)


@pytest.fixture
def pool2():
    return get_pool(2)


def pytest_sessionfinish(session, exitstatus):
    close_pools()
