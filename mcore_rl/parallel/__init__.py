"""Distributed runtime: torch.distributed + Megatron-Core parallel state -> `ParallelContext`."""
from mcore_rl.parallel.context import Layout, ParallelContext
from mcore_rl.parallel.initialize import destroy_parallel, init_process_group, initialize_parallel

__all__ = ["Layout", "ParallelContext", "initialize_parallel", "destroy_parallel",
           "init_process_group"]

import warnings as _warnings

# Megatron-Core warns at import about optional GPU libraries (TE, Apex) on every rank; the
# fallbacks are what mcore-rl selects deliberately on CPU, so the warnings are noise.
for _msg in ("Transformer Engine and Apex are not installed", "Apex is not installed",
             "full scope is deprecated", "When using async grad allreduce"):
    _warnings.filterwarnings("ignore", message=_msg)
