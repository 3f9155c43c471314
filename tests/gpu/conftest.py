import pytest
import torch

from tests.models.conftest import tiny_hf  # noqa: F401  (shared session fixture)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
