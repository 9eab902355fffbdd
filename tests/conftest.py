import os

import pytest
import torch

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "fixtures")
if not os.path.isdir(FIXTURES):  # CI lays shared/ beside the clone; a checkout may also carry it inside
    FIXTURES = os.path.join(os.path.dirname(__file__), "..", "shared", "fixtures")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixtures_dir():
    if not os.path.isdir(FIXTURES):
        pytest.skip("shared/fixtures not found beside the repository")
    return FIXTURES


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: on the shared 2-core machines (and with several ranks on them),
    spinning OpenMP threads make thousands of tiny CPU ops crawl."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
