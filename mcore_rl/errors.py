"""Errors that reach users as one line (the CLI prints them without a traceback)."""


class UsageError(Exception):
    """Bad input from the user: the message names the problem and the fix."""


class ConfigError(UsageError):
    """A configuration that cannot run; raised before any rank starts."""


class StopRequested(Exception):
    """Raised by a training loop after it saved the checkpoint of a stop all ranks agreed on
    (preemption, a time limit; see `mcore_rl.launch.stop_signal`)."""

    def __init__(self, step: int, checkpoint):
        from pathlib import Path

        super().__init__(f"stopped after step {step}; checkpoint {checkpoint}")
        self.step = step
        self.checkpoint = Path(checkpoint)

    def __reduce__(self):  # it crosses processes (a controller's error, back to the driver)
        return (StopRequested, (self.step, self.checkpoint))


class NonFiniteError(UsageError):
    """A loss, gradient or weight that is not finite: the run stops with one line naming the
    step (``train.on_nonfinite: stop``), before the update reaches the weights."""


class MismatchError(UsageError):
    """The engine's and the trainer's log-probs of the sampled tokens differ beyond
    ``rollout.mismatch_stop``: the run stops with one line naming the step."""
