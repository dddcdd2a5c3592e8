"""The loop of one reward worker process (`mcore_rl.rewards.pool.WorkerPool`).

Started as ``python -m mcore_rl.rewards.pool_worker FD``: a fresh interpreter (no fork of a
parent that has threads), importing only the standard library and ``mcore_rl.rewards``
(no torch), so it starts in a fraction of a second. It reads one task at a time from the
connection on file descriptor FD: a pickled ``(fn, args, expect)``, and answers with an
`Outcome`; it exits when the connection closes.
"""
from __future__ import annotations

import pickle
import signal
import sys
from multiprocessing.connection import Connection

from mcore_rl.rewards.outcome import Outcome, call
from mcore_rl.rewards.registry import first_line


def serve(conn: Connection) -> None:
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args, expect = pickle.loads(message)
        except Exception as err:  # noqa: BLE001 - e.g. the function's module cannot be imported
            outcome = Outcome("raised", message=f"could not be loaded in a reward worker process "
                                                f"({type(err).__name__}: {first_line(err)})")
        else:
            outcome = call(fn, args, expect)
        conn.send(outcome)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends the run; the worker follows
    serve(Connection(int(sys.argv[1])))
