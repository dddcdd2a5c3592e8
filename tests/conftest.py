"""Suite-wide rules: one CPU code path on every x86 machine; `gpu` tests skip without CUDA;
any other skip fails the run."""
from __future__ import annotations

from tests.cpu_kernels import pin_cpu_kernels

pin_cpu_kernels()  # before torch: see tests/cpu_kernels.py

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip is allowed only for `gpu` tests: elsewhere it would hide a broken dependency."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not item.get_closest_marker("gpu") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} was skipped ({reason}); only tests marked `gpu` may "
                           "skip. Install what it needs (bash scripts/install.sh) or fix the test.")


@pytest.fixture(scope="session", autouse=True)
def _stop_shared_worlds_at_session_end():
    yield
    from tests.world import close_shared_worlds

    close_shared_worlds()


@pytest.fixture()
def no_rank_starts(monkeypatch):
    """Fails the test if any rank would start (checks that must come before any work)."""
    def trap(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("mcore_rl.parallel.local_launch.run_ranks", trap)
    monkeypatch.setattr("mcore_rl.cli.rank_main.rank_main", trap)
    monkeypatch.setattr("mcore_rl.cli.train_graph.run_graph", trap)
