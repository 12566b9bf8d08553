import re
import zlib

import pytest
import torch

_NO_CUDA = "needs a CUDA GPU; torch.cuda.is_available() is False"


@pytest.fixture(autouse=True)
def _seed(request):
    # Per-test seed: each test gets different inputs, yet reruns (and xdist
    # workers, whatever order they pick tests in) see the same ones. Seeded by the
    # test's id without its floor's folder (tests/layers/test_x.py::t as tests/test_x.py::t),
    # so that grouping the files changed no test's inputs.
    torch.manual_seed(zlib.crc32(re.sub(r"^tests/[a-z_]+/", "tests/", request.node.nodeid).encode()))


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
