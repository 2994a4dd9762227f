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


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu/run_all.sh runs these on a lent GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
