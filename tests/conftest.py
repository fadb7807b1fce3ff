import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
# Test tensors are tiny: one thread avoids thread start-up and contention costs that made
# them several times slower on 2 shared cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
