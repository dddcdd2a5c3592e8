"""Suite-wide rules: one CPU code path on every x86 machine; `gpu` tests skip without CUDA,
`golden` tests on a kind of CPU with no golden values recorded; any other skip fails the run.
`learning` runs (minutes each) and the benchmarks' end-to-end `bench` runs are left out of
the default run (``-m "not learning and not bench"`` in pytest.ini) and run with
``pytest -m learning`` and ``pytest -m bench``."""
from __future__ import annotations

from tests.cpu_kernels import pin_cpu_kernels

pin_cpu_kernels()  # before torch: see tests/cpu_kernels.py

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    global _config
    _config = config
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("markers", "golden: replays golden values recorded on this kind of "
                            "CPU (tests/rl/golden/<kind>/); skipped on a kind with none")
    config.addinivalue_line("markers", "learning: a learning run of minutes that proves a "
                            "capability (a score rises); not in the default run, which replays "
                            "its mechanics cheaply: run these with `pytest -m learning`")
    config.addinivalue_line("markers", "bench: a benchmark's end-to-end quick run (`mcore-rl bench "
                            "NAME --quick`: fresh processes on both sides, a minute or more); not "
                            "in the default run, which checks every benchmark's arguments: run "
                            "these with `pytest -m bench`")


def pytest_collection_modifyitems(config, items):
    from tests.rl.golden.runs import golden_dir

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device")
    golden = golden_dir()
    if not golden.is_dir():
        skips["golden"] = pytest.mark.skip(
            reason=f"no golden values for CPU kind {golden.name}: record them on such a machine "
                   "with `PYTHONPATH=. python -m tests.rl.golden.runs`")
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker):
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip is allowed only for `gpu` and `golden` tests: elsewhere it would hide a broken
    dependency."""
    outcome = yield
    report = outcome.get_result()
    allowed = item.get_closest_marker("gpu") or item.get_closest_marker("golden")
    if report.skipped and not allowed and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} was skipped ({reason}); only tests marked `gpu` or "
                           "`golden` may skip. Install what it needs (bash scripts/install.sh) or fix the test.")


_SLOW_S = 45.0
_durations: dict[str, float] = {}
_config = None  # pytest's, for its terminal reporter (set in pytest_configure)


def pytest_runtest_logreport(report):
    """A test of 45 s or more shows its time beside its dot, e.g. ``.[76s]``, so that a run cut
    short (a CI limit) still says where its time went."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        total = _durations.pop(report.nodeid)
        reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
        if total >= _SLOW_S and reporter is not None:
            reporter.write(f"[{total:.0f}s]", flush=True)


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

    import importlib

    runtime = importlib.import_module("mcore_rl.flow.launch")  # the module, not the function
    monkeypatch.setattr("mcore_rl.roles.graph.run_job", trap)
    monkeypatch.setattr(runtime._Launch, "start_actors", trap)
    monkeypatch.setattr("mcore_rl.flow.ray_shim.start_local", trap)
