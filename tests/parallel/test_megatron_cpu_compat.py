"""The CPU compatibility layer: pinned to its megatron-core version, scoped to Megatron."""
import pytest
import torch

from mcore_rl.parallel import megatron_cpu_compat as compat



@pytest.fixture(scope="module", autouse=True)
def applied():
    compat.apply()


def test_installed_megatron_core_is_the_version_the_layer_was_written_for():
    import megatron.core

    assert megatron.core.__version__ == compat.SUPPORTED_MEGATRON_VERSION, (
        "megatron-core changed: re-check every target in PATCHED_TARGETS, then update the pin")


@pytest.mark.parametrize("target", sorted(compat.PATCHED_TARGETS), ids=lambda t: t[1])
def test_patched_megatron_target_is_unchanged(target):
    got = compat.source_fingerprint(*target)
    assert got == compat.PATCHED_TARGETS[target], (
        f"{target[0]}.{target[1]} changed in the installed megatron-core; review the CPU "
        "compatibility layer for it and update its fingerprint")


def _run_as(module_name: str, code: str):
    """Run ``code`` with ``__name__`` = module_name, as if it were that module's source."""
    scope = {"__name__": module_name, "torch": torch}
    exec(compile(code, f"<{module_name}>", "exec"), scope)
    return scope["result"]


def test_megatron_callers_get_cpu_placements():
    code = ("result = (torch.zeros(2, device='cuda').device.type, torch.cuda.current_device(),"
            " torch.ones(1).cuda().device.type, torch.ones(1).type())")
    assert _run_as("megatron.core.fake", code) == ("cpu", 0, "cpu", "torch.cuda.FloatTensor")


def test_other_libraries_still_see_plain_torch_behaviour():
    assert _run_as("vllm.fake", "result = torch.ones(1).type()") == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        _run_as("vllm.fake", "result = torch.zeros(2, device='cuda')")
    with pytest.raises((RuntimeError, AssertionError)):
        _run_as("vllm.fake", "result = torch.cuda.current_device()")


def test_megatron_rng_tracker_forks_cpu_generator_states():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.CudaRNGStatesTracker()
    tracker.add("a", 123)
    before = torch.rand(1)
    with tracker.fork("a"):
        inside = torch.rand(3)
    tracker2 = mrandom.CudaRNGStatesTracker()
    tracker2.add("a", 123)
    with tracker2.fork("a"):
        again = torch.rand(3)
    assert torch.equal(inside, again), "the same seed must give the same stream"
    torch.manual_seed(0)
    assert not torch.equal(before, inside[:1])


def test_pipeline_p2p_batching_is_turned_off_for_gloo():
    assert compat.transformer_config_overrides() == {"batch_p2p_comm": False}
