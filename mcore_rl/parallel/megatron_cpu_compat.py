"""Megatron-Core on CPU: the one place that bends Megatron's CUDA assumptions.

Megatron-Core 0.16.1 assumes a GPU in a few dozen places: ``torch.cuda.current_device()``
in rotary embeddings, tensor-parallel mappings and DDP buffers; ``torch.cuda.synchronize()``
in p2p and checkpointing; ``device="cuda"`` literals in the pipeline schedules, optimizer
and gradient clipping; ``param.type() == 'torch.cuda.FloatTensor'`` checks; an RNG tracker
built on CUDA generator states. With no CUDA device these all fail.

`apply()` makes them work on CPU (gloo) and is called by ``mcore_rl.parallel`` only when
``torch.cuda.is_available()`` is false. Its changes are *scoped to Megatron*: every
replacement looks at the calling frame and behaves differently only when the caller is a
``megatron.*`` module; a call from any other library (vLLM runs in the same processes)
reaches the original torch function unchanged. On a machine with CUDA nothing is patched.

What it does:
- ``torch.cuda.{current_device, synchronize, get_rng_state, set_rng_state, manual_seed}``:
  for Megatron callers, device 0 / no-op / the CPU generator.
- A ``TorchFunctionMode`` (per thread; entered for the thread that calls `apply`, and for
  new threads through ``threading.Thread.run``) that, for Megatron callers only, turns
  ``device="cuda"`` and integer devices into ``"cpu"``, makes ``Tensor.cuda()`` a no-op and
  reports CPU float tensors as ``torch.cuda.*Tensor`` to ``Tensor.type()``.
- ``transformer_config_overrides()``: ``batch_p2p_comm=False`` for pipeline p2p over gloo.
- Megatron's RNG tracker helpers ``_get_cuda_rng_state``/``_set_cuda_rng_state`` use the CPU
  generator, so ``model_parallel_cuda_manual_seed`` and ``get_cuda_rng_tracker().fork()``
  work (CPU generator states per tracker name).
- Backward passes: torch runs a custom autograd function's ``backward`` with no torch
  function mode active, so the backward of Megatron's own autograd functions (the
  sequence-parallel all-gather and reduce-scatter, the MoE all-to-all) would allocate on
  ``torch.cuda.current_device()``. ``BackwardCFunction.apply`` enters the mode for functions
  defined in ``megatron.*`` only.
- Uneven ``all_gather`` (Megatron's ``_gather_along_first_dim`` with ``output_split_sizes``,
  the all-to-all dispatcher under sequence and expert-tensor parallelism): gloo needs equal
  sizes, so the mode pads every rank's input to the longest and trims the outputs.
- Mixture of experts: ``moe_utils`` refers to Transformer Engine's ``te_general_gemm`` (and
  fused permute/router kernels) even when TE is absent; they are set to None, the value the
  code tests for. The all-to-all token dispatcher makes a CUDA side stream for its
  device-to-host copies of the token counts; on CPU those counts already live on the host,
  so the stream is a stand-in and the copy step converts them in place (numpy splits).

Every patched target is listed in `PATCHED_TARGETS` with a fingerprint of its source;
``tests/parallel/test_megatron_cpu_compat.py`` fails loudly when megatron-core's version or
one of those targets changes, so an upgrade is a conscious step.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import sys
import threading
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

SUPPORTED_MEGATRON_VERSION = "0.16.1"

# (module, qualified name) of the Megatron functions whose behaviour this module changes or
# works around, with a short fingerprint of their source at the supported version.
PATCHED_TARGETS: dict[tuple[str, str], str] = {
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"): "aa26caaa069c",
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"): "b179c9d95438",
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add"): "e5e9ab39a7c1",
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork"): "6821e1e39725",
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed"): "7423a4a62741",
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"): "84399467bcc0",
    ("megatron.core.pipeline_parallel.schedules",
     "forward_backward_pipelining_without_interleaving"): "ecf7d69308cd",
    ("megatron.core.pipeline_parallel.schedules",
     "forward_backward_pipelining_with_interleaving"): "bd10736079d7",
    ("megatron.core.pipeline_parallel.p2p_communication", "_batched_p2p_ops"): "4b0901807501",
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32"): "7fa2ba2493d4",
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"): "8edb9da53650",
    ("megatron.core.optimizer.clip_grads", "count_zeros_fp32"): "13c3d83b2465",
    ("megatron.core.optimizer.optimizer",
     "Float16OptimizerWithFloat16Params.__init__"): "1d470dedcf8e",
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__"): "9a3397b649b9",
    ("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction.forward"): "dcba4f9f02b3",
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.__init__"): "dfafd17183db",
    ("megatron.core.transformer.moe.token_dispatcher",
     "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"): "306811df7107",
    ("torch.autograd.function", "BackwardCFunction.apply"): "591cc9871c0a",
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"): "44633fe36d60",
}

_applied = False
_lock = threading.Lock()


def source_fingerprint(module_name: str, qualname: str) -> str:
    """A short hash of a function's source, to notice when an upgrade changes a target."""
    import importlib

    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    obj = getattr(obj, "__mcore_rl_original__", obj)  # fingerprint what was replaced
    obj = inspect.unwrap(obj)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[: len(
        PATCHED_TARGETS[(module_name, qualname)])]


def _called_from_megatron(depth: int) -> bool:
    """Whether the Python frame ``depth`` levels above the caller belongs to megatron.*."""
    try:
        frame = sys._getframe(depth + 1)
    except ValueError:
        return False
    return frame.f_globals.get("__name__", "").startswith("megatron.")


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_CPU_TYPE_TO_CUDA = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class MegatronCudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placements requested by Megatron code to the CPU (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _ALL_GATHER and len({tuple(t.shape) for t in args[0]}) > 1 \
                and _called_through_torch_from_megatron():
            return _all_gather_uneven(*args, **kwargs)
        if func is torch.Tensor.cuda and _called_from_megatron(1):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and _called_from_megatron(1):
            name = func(*args)
            return _CPU_TYPE_TO_CUDA.get(name, name)
        device = kwargs.get("device")
        if device is not None and _is_cuda_device(device) and _called_from_megatron(1):
            kwargs = {**kwargs, "device": "cpu"}
            kwargs.pop("pin_memory", None)
        elif kwargs.get("pin_memory") and _called_from_megatron(1):  # staged for a .cuda()
            kwargs = {k: v for k, v in kwargs.items() if k != "pin_memory"}
        elif func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]) \
                and _called_from_megatron(1):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_ALL_GATHER = torch.distributed.all_gather


@contextlib.contextmanager
def suspended():
    """This thread's torch calls without the mode, inside the block: the mode costs a Python
    call per torch operation, which code that is not Megatron's (the rollout engine when it
    runs in a trainer rank, building a rollout batch) has no use for. A no-op where the mode
    is not the innermost one (or not entered at all)."""
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if not isinstance(_get_current_function_mode(), MegatronCudaToCpuMode):
        yield
        return
    with _pop_mode_temporarily():
        yield


def _called_through_torch_from_megatron() -> bool:
    """Whether the first caller above torch's own frames (a ``torch.distributed`` function
    reaches the mode through several) belongs to megatron.*."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch.") or name == __name__):
            return name.startswith("megatron.")
        frame = frame.f_back
    return False


def _all_gather_uneven(tensor_list: list, tensor: torch.Tensor, group=None, async_op=False):
    """``all_gather`` into outputs of different lengths (the first dimension), which gloo
    refuses: every rank sends its input padded to the longest, and each output keeps its
    own length. Megatron gathers so (``output_split_sizes``) under sequence parallelism in
    the all-to-all token dispatcher with expert tensor parallelism."""
    if async_op:
        raise NotImplementedError("an uneven all_gather over gloo runs synchronously only")
    longest = max(t.shape[0] for t in tensor_list)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in tensor_list]
    torch.distributed.all_gather(gathered, padded.contiguous(), group=group)
    for out, part in zip(tensor_list, gathered):
        out.copy_(part[:out.shape[0]])


def _scoped(original: Callable, cpu_version: Callable) -> Callable:
    """``cpu_version`` for callers in megatron.*, ``original`` for everyone else."""

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if _called_from_megatron(1):
            return cpu_version(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__mcore_rl_original__ = original  # type: ignore[attr-defined]
    return dispatch


def _replacing(original: Callable, replacement: Callable) -> Callable:
    """``replacement`` (for all callers), remembering what it replaced."""

    @functools.wraps(replacement)
    def replaced(*args, **kwargs):
        return replacement(*args, **kwargs)

    replaced.__mcore_rl_original__ = original  # type: ignore[attr-defined]
    return replaced


def _cpu_get_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


_CUDA_REPLACEMENTS: dict[str, Callable] = {
    "current_device": lambda: 0,
    "synchronize": lambda *a, **k: None,
    "get_rng_state": _cpu_get_rng_state,
    "set_rng_state": _cpu_set_rng_state,
    "manual_seed": _cpu_manual_seed,
}


def _enter_mode_in_every_thread() -> None:
    """TorchFunctionMode is per thread: enter it now and at the start of every new thread."""
    MegatronCudaToCpuMode().__enter__()
    original_run = threading.Thread.run

    @functools.wraps(original_run)
    def run_with_mode(self, *args, **kwargs):
        with MegatronCudaToCpuMode():
            return original_run(self, *args, **kwargs)

    threading.Thread.run = run_with_mode  # type: ignore[method-assign]


def _enter_mode_in_megatron_backward() -> None:
    """Run the backward of autograd functions defined in megatron.* under the mode."""
    from torch.autograd.function import BackwardCFunction

    original_apply = BackwardCFunction.apply

    @functools.wraps(original_apply)
    def apply_with_mode(self, *args):
        if getattr(self._forward_cls, "__module__", "").startswith("megatron."):
            with MegatronCudaToCpuMode():
                return original_apply(self, *args)
        return original_apply(self, *args)

    apply_with_mode.__mcore_rl_original__ = original_apply  # type: ignore[attr-defined]
    BackwardCFunction.apply = apply_with_mode  # type: ignore[method-assign]


# Names moe_utils imports from Transformer Engine and checks against None before use.
_TE_NAMES_IN_MOE_UTILS = (
    "te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
    "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute")


class _HostStream:
    """Stands in for the all-to-all dispatcher's CUDA side stream (never used on CPU)."""

    def record_event(self):  # pragma: no cover - the CPU copy step below records nothing
        raise RuntimeError("no CUDA stream on CPU")


def _as_host_splits(value):
    """What Megatron's device-to-host copy makes of a split-size tensor: a numpy array (on
    CPU its own helper leaves tensors as they are, which ``all_to_all_single`` refuses)."""
    return value.numpy() if torch.is_tensor(value) else value


def _host_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """CPU version of ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``: the same
    conversions at the same point, without a stream or an event (nothing is on a device)."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _as_host_splits(self.input_splits)
        self.output_splits = _as_host_splits(self.output_splits)
        self.output_splits_tp = _as_host_splits(self.output_splits_tp)
    return tokens_per_expert


def _apply_moe() -> None:
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import token_dispatcher as dispatchers

    for name in _TE_NAMES_IN_MOE_UTILS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)
    a2a = dispatchers.MoEAlltoAllTokenDispatcher
    if a2a.cuda_dtoh_stream is None:
        a2a.cuda_dtoh_stream = _HostStream()
    a2a._maybe_dtoh_and_synchronize = _replacing(a2a._maybe_dtoh_and_synchronize,
                                                 _host_dtoh_and_synchronize)


def check_megatron_version() -> str:
    import megatron.core

    version = megatron.core.__version__
    if version != SUPPORTED_MEGATRON_VERSION:
        log.warning(
            "megatron-core %s is installed; the CPU compatibility layer was written for %s. "
            "Run tests/parallel/test_megatron_cpu_compat.py before trusting CPU results.",
            version, SUPPORTED_MEGATRON_VERSION)
    return version


def apply() -> bool:
    """Make Megatron-Core usable without CUDA. Idempotent; a no-op when CUDA is available.

    Returns whether the layer is active.
    """
    global _applied
    if torch.cuda.is_available():
        return False
    with _lock:
        if _applied:
            return True
        check_megatron_version()
        for name, cpu_version in _CUDA_REPLACEMENTS.items():
            setattr(torch.cuda, name, _scoped(getattr(torch.cuda, name), cpu_version))
        # `random.py` binds torch.cuda.random.get_rng_state through the submodule too.
        torch.cuda.random.get_rng_state = torch.cuda.get_rng_state

        from megatron.core.tensor_parallel import random as mrandom

        for name, replacement in (("_get_cuda_rng_state", _cpu_get_rng_state),
                                  ("_set_cuda_rng_state", _cpu_set_rng_state)):
            setattr(mrandom, name, _replacing(getattr(mrandom, name), replacement))
        _enter_mode_in_every_thread()
        _enter_mode_in_megatron_backward()
        _apply_moe()
        _applied = True
        log.info("Megatron-Core CPU compatibility layer applied")
        return True


def transformer_config_overrides() -> dict[str, Any]:
    """TransformerConfig settings that CPU (gloo) runs need; empty when the layer is off.

    ``batch_p2p_comm``: gloo's ``batch_isend_irecv`` mixes up the concurrent send/recv pairs
    of the interleaved (VPP) schedule's steady state: gradients of the early model chunks
    came out 3-10x too large with 4+ micro-batches. Plain isend/irecv pairs are exact.
    """
    return {"batch_p2p_comm": False} if _applied else {}


def is_applied() -> bool:
    return _applied
