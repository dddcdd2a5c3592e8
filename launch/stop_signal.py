"""Stop every rank at the same step boundary, checkpoint, and hand the job back for requeue.

The protocol, end to end (the SLURM side lives in ``templates/sbatch_ray.sh``):

1. SLURM sends SIGUSR1 to the batch shell ``launch.signal_lead_s`` seconds before the time
   limit (``--signal=B:USR1@N``); an operator does the same with
   ``scancel --batch --signal=USR1 JOB``. torchrun forwards SIGTERM to its workers but not
   SIGUSR1, so the batch shell's trap touches the *stop file*, whose path every rank finds in
   ``$MCORE_RL_STOP_FILE`` (in the run directory). SIGTERM or SIGUSR1 that reaches a rank
   directly (``scancel``, preemption, torchrun forwarding SIGTERM) is caught by `StopSignal`.
2. At each step boundary the training loop calls ``stop.should_stop(ctx)``: every rank's own
   view (a caught signal, or the stop file exists) is reduced with MAX over the world, so all
   ranks agree on the same step even if only one of them saw the request.
3. The loop saves a checkpoint and raises `StopRequested`; the rank entry acknowledges
   (`StopSignal.acknowledge`: rank 0 writes ``$MCORE_RL_STOP_FILE.saved`` holding the step,
   after every rank finished the checkpoint) and exits with `stop_exit_code()`.
4. The batch shell requeues the job (``scontrol requeue``) when the acknowledgement exists.
   The file decides, not an exit status: torchrun reports any failing worker as status 1,
   and a failing worker makes the agents on the other nodes lose their rendezvous store
   mid-shutdown. So under torchrun stopped ranks exit 0 (its agents then leave cleanly);
   elsewhere (``mcore-rl train`` alone, plain ``srun``) they exit with `STOP_EXIT_CODE`.
   The requeued job starts again and resumes from the checkpoint (``checkpoint.resume=auto``).

A driver script on Ray (``mcore-rl launch slurm SCRIPT.py``) plays all of these parts itself: it
is the one process that receives the signal and sees the stop file, so it checks
`StopSignal.requested_here` between its steps, saves (``RLTrainer.save``), calls
`StopSignal.write_ack` and exits with `stop_exit_code()` (``examples/slurm_grpo.py``).

A second signal of the same kind while a stop is pending gets the default action (a second
SIGTERM still ends the process at once). The run directory must be on a file system
that all nodes share, as the checkpoints are.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from mcore_rl.errors import StopRequested

__all__ = ["STOP_EXIT_CODE", "STOP_FILE_ENV", "StopRequested", "StopSignal", "stop_exit_code"]

STOP_FILE_ENV = "MCORE_RL_STOP_FILE"
"""Environment variable naming the stop file (set by the sbatch script)."""
STOP_EXIT_CODE = 3
"""Exit status of a rank that stopped on request after saving its checkpoint."""
ACK_SUFFIX = ".saved"


def stop_exit_code() -> int:
    """The exit status of a rank after an acknowledged stop (see step 4 above)."""
    return 0 if "TORCHELASTIC_RUN_ID" in os.environ else STOP_EXIT_CODE


class StopSignal:
    """Catches stop signals, watches the stop file, and lets all ranks agree on stopping."""

    def __init__(self, stop_file: str | os.PathLike | None = None,
                 signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGTERM)):
        path = stop_file if stop_file is not None else os.environ.get(STOP_FILE_ENV)
        self.stop_file = Path(path) if path else None
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopSignal":
        """Install the handlers (main thread only; elsewhere only the stop file is watched)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.received == signum:  # asked twice: stop waiting for the step boundary
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    def requested_here(self) -> bool:
        """This rank's own view: a signal arrived or the stop file exists."""
        return self.received is not None or (self.stop_file is not None and self.stop_file.exists())

    def should_stop(self, ctx) -> bool:
        """Collective over the whole world (call it on every rank at the same point): True on
        all ranks if any rank saw a stop request."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.requested_here() else 0.0], device=ctx.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def acknowledge(self, ctx, step: int) -> Path | None:
        """Tell the batch shell the stop checkpoint is complete (collective; rank 0 writes)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        if ctx.rank != 0:
            return None
        return self.write_ack(step)

    def write_ack(self, step: int) -> Path | None:
        """Write the acknowledgement for the batch shell (no-op without a stop file). A driver
        script, whose ranks are Ray actors, calls it itself once its checkpoint is saved."""
        if self.stop_file is None:
            return None
        ack = self.stop_file.with_name(self.stop_file.name + ACK_SUFFIX)
        tmp = ack.with_name(ack.name + ".tmp")
        tmp.write_text(f"{step}\n")
        os.replace(tmp, ack)
        return ack
