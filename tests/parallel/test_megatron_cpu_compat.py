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


def test_suspended_leaves_torch_calls_alone_for_the_block_only():
    code = "result = torch.zeros(2, device='cuda').device.type"
    with compat.suspended():  # a Megatron caller is not redirected: no mode in the block
        with pytest.raises((RuntimeError, AssertionError)):
            _run_as("megatron.core.fake", code)
        with compat.suspended():  # nested: the mode is already out of the way
            with pytest.raises((RuntimeError, AssertionError)):
                _run_as("megatron.core.fake", code)
    assert _run_as("megatron.core.fake", code) == "cpu"  # and back after it


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


_BACKWARD_ALLOCATES = """
class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
        out.copy_(grad)
        return out * 2

x = torch.ones(3, requires_grad=True)
Gather.apply(x).sum().backward()
result = x.grad.tolist()
"""


def test_megatron_autograd_backward_allocates_on_the_cpu():
    # torch runs a custom backward with no function mode active; Megatron's backward of its
    # sequence-parallel gathers and MoE all-to-all allocate on torch.cuda.current_device().
    assert _run_as("megatron.core.fake", _BACKWARD_ALLOCATES) == [2.0, 2.0, 2.0]


def test_other_libraries_autograd_backward_is_left_alone():
    with pytest.raises((RuntimeError, AssertionError)):
        _run_as("vllm.fake", _BACKWARD_ALLOCATES)


def test_moe_dispatcher_splits_become_numpy_arrays_as_on_a_gpu():
    import numpy as np

    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert moe_utils.te_general_gemm is None  # absent Transformer Engine reads as None
    dispatcher = MoEAlltoAllTokenDispatcher.__new__(MoEAlltoAllTokenDispatcher)
    dispatcher.drop_and_pad, dispatcher.cuda_dtoh_point = False, "before_permutation_1"
    dispatcher.input_splits, dispatcher.output_splits = torch.tensor([2, 3]), torch.tensor([1, 4])
    dispatcher.output_splits_tp = None
    counts = torch.tensor([5])
    assert dispatcher._maybe_dtoh_and_synchronize("before_permutation_1", counts) is counts
    assert isinstance(dispatcher.input_splits, np.ndarray)
    assert dispatcher.output_splits.tolist() == [1, 4] and dispatcher.output_splits_tp is None
