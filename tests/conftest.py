import zlib

import pytest
import torch

_NO_CUDA = "needs a CUDA GPU; torch.cuda.is_available() is False"


@pytest.fixture(autouse=True)
def _seed(request):
    # Per-test seed: each test gets different inputs, yet reruns (and xdist
    # workers, whatever order they pick tests in) see the same ones.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip(_NO_CUDA)
    return torch.device("cuda")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_NO_CUDA)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
