"""`StatusLine`: the console's line per step, plain where the output is not a terminal and
rewritten in place where it is."""
from __future__ import annotations

import io
import os

from mcore_rl.status_line import StatusLine, format_duration, phase_shares


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


STEP = {"reward/mean": 0.25, "actor/entropy": 0.5, "perf/tokens_per_s": 12345.0, "time/step": 2.0,
        "time/generate": 0.8, "time/update": 1.0, "time/sync": 0.2, "time/score": 0.001,
        "time/batch_interval": 9.0}


def test_plain_lines_carry_step_metrics_validation_tokens_phase_shares_and_the_time_left():
    out, clock = io.StringIO(), Clock()
    line = StatusLine(30, stream=out, clock=clock)
    assert not line.live  # not a terminal
    line.update(0, {"val/score": 0.125})
    line.update(1, STEP)
    clock.t = 10.0
    line.update(2, {**STEP, "val/score": 0.5})
    clock.t = 30.0
    line.update(3, STEP, keep=False)  # not kept: not shown at all off a terminal
    line.update(4, STEP)
    line.close()
    assert out.getvalue().splitlines() == [
        "step 0: val/score 0.125",
        "step 1/30: reward/mean 0.25  actor/entropy 0.5  val/score 0.125 | 1.23e+04 tokens/s | "
        "generate 40%, update 50%, sync 10%",
        "step 2/30: reward/mean 0.25  actor/entropy 0.5  val/score 0.5 | 1.23e+04 tokens/s | "
        "generate 40%, update 50%, sync 10% | eta 0:04:40",
        "step 4/30: reward/mean 0.25  actor/entropy 0.5  val/score 0.5 | 1.23e+04 tokens/s | "
        "generate 40%, update 50%, sync 10% | eta 0:04:20",
    ]
    assert "\r" not in out.getvalue()


def test_on_a_terminal_the_line_is_rewritten_in_place_and_kept_every_log_every_steps():
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        assert StatusLine(4, stream=tty).live
    os.close(master)
    out, clock = io.StringIO(), Clock()
    line = StatusLine(4, keys=("loss",), stream=out, live=True, clock=clock)
    line.update(1, {"loss": 2.0}, keep=False)
    clock.t = 5.0
    line.update(2, {"loss": 1.5}, keep=True)
    clock.t = 10.0
    line.update(3, {"loss": 1.25}, keep=False)
    line.close()  # a line left in place gets its newline
    assert out.getvalue() == ("\r\x1b[Kstep 1/4: loss 2\r\x1b[Kstep 2/4: loss 1.5 | eta 0:00:10\n"
                              "\r\x1b[Kstep 3/4: loss 1.25 | eta 0:00:05\n")
    out = io.StringIO()
    line = StatusLine(2, keys=("loss",), stream=out, live=False)
    line.update(2, {"loss": 1.0}, keep=False)  # a caller that prints its own lines
    line.close()
    assert out.getvalue() == ""


def test_phase_shares_keep_the_largest_three_in_step_order_and_durations_read_as_clock_time():
    times = {"time/step": 10.0, "time/generate": 1.0, "time/logprobs": 0.5, "time/update": 6.0,
             "time/sync": 2.0, "time/trainer_idle_s": 50.0, "time/engine_idle_s": 30.0}
    assert phase_shares(times) == "generate 10%, update 60%, sync 20%"
    assert phase_shares({"time/generate": 1.0}) == ""
    assert format_duration(3725.4) == "1:02:05"
