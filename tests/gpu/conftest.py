import pytest
import torch


def pytest_collection_modifyitems(config, items):
    # Every test in tests/gpu is a GPU test: marked, and skipped cleanly where CUDA is absent.
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
