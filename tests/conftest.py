import os

import pytest
import torch
import torch.distributed as dist
from extras import EXTRA_IN_REASON, INSTALL
from smoke import mark_smoke

os.environ.setdefault("WANDB_MODE", "disabled")
# Test tensors are tiny: one thread avoids thread start-up and contention costs that made
# them several times slower on 2 shared cores.
torch.set_num_threads(1)


@pytest.fixture
def world_of_one():
    """A gloo process group of this one process (a collective is then the identity), destroyed
    after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.hookimpl(tryfirst=True)  # before -m selects: the smoke tier's marks are set here
def pytest_collection_modifyitems(config, items):
    mark_smoke(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per optional extra whose absence skipped tests here (reasons from tests/extras.py),
    with the command that installs it: what a quickstart install (the [dev] extra alone) does not run."""
    skipped: dict[str, set[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        found = EXTRA_IN_REASON.search(str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else "")
        if found:
            skipped.setdefault(found[1], set()).add(report.nodeid)
    if not skipped:
        return
    terminalreporter.section("optional extras not installed here", sep="-")
    for extra, nodeids in sorted(skipped.items()):
        modules = {n.split("::")[0] for n in nodeids if "::" not in n}
        tests = len(nodeids) - len(modules)
        counts = [f"{len(modules)} test module{'s' * (len(modules) != 1)}"] * bool(modules)
        counts += [f"{tests} test{'s' * (tests != 1)}"] * bool(tests)
        terminalreporter.write_line(f"[{extra}]: {' and '.join(counts)} skipped; {INSTALL[extra]} runs them")
