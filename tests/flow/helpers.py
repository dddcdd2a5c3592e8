"""Controller functions for the flow tests. They run in Ray actors, which import this
module by name, so they live here rather than in the test files; each records what it
saw as JSON lines in a log file (several processes append to one file: one short write
per line). torch is imported only where a test needs it: each actor imports this module,
and importing torch costs about a second of CPU per process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.lingering import linger


def write(path: str, **record) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read(path: str | Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that still runs (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Numbered:
    """A producer: item -> {"pid", "seq", "x"}; logs the start of each call."""

    def __init__(self, log: str, delay_s: float = 0.0):
        self.log, self.delay_s, self.seq = log, delay_s, 0

    def __call__(self, x):
        write(self.log, event="produce", pid=os.getpid(), seq=self.seq, x=x, t=time.monotonic())
        time.sleep(self.delay_s)
        out = {"pid": os.getpid(), "seq": self.seq, "x": x}
        self.seq += 1
        return out


class Consume:
    """A sink or a relay: logs each item it gets; sleeps ``delay_s``; passes it on if
    ``relay``."""

    def __init__(self, log: str, delay_s: float = 0.0, relay: bool = False):
        self.log, self.delay_s, self.relay = log, delay_s, relay

    def __call__(self, item):
        write(self.log, event="consume", item=item, t=time.monotonic())
        time.sleep(self.delay_s)
        return item if self.relay else None


class GroupSizes:
    """batch_items consumer: logs what a call got; returns a Batch with one row per item."""

    def __init__(self, log: str, role: str):
        self.log, self.role = log, role

    def __call__(self, items):
        import torch

        from mcore_rl.data.batch import Batch

        if isinstance(items, Batch):
            write(self.log, role=self.role, kind="Batch", rows=len(items),
                  x=items["x"].tolist(), meta=items.meta["x"])
            return None
        write(self.log, role=self.role, kind=type(items).__name__, x=list(items))
        xs = list(items)
        return Batch({"x": torch.tensor(xs)}, meta={"x": xs})


class Interval:
    """Sleeps ``delay_s`` per call and logs the call's start and end (for turn taking)."""

    def __init__(self, log: str, name: str, delay_s: float, relay: bool = True):
        self.log, self.name, self.delay_s, self.relay = log, name, delay_s, relay

    def __call__(self, item):
        start = time.monotonic()
        time.sleep(self.delay_s)
        write(self.log, name=self.name, start=start, end=time.monotonic())
        return item if self.relay else None


def placement(item):
    """The process's affinity, torch's threads (if the process imported torch: pinning
    does) and the CPUs Ray has free, as seen from inside."""
    import ray

    torch = sys.modules.get("torch")
    return {"item": item, "cores": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads() if torch else None, "pid": os.getpid(),
            "free_cpus": ray.available_resources().get("CPU", 0.0)}


class Placed:
    """Logs where its process is pinned when built (after the strategy pinned it) and
    appends the placement report of each call to the item (a list of reports)."""

    def __init__(self, log: str, name: str):
        self.log, self.name = log, name
        write(log, name=name, at="build", **placement(None))

    def __call__(self, item):
        return [*(item if isinstance(item, list) else []), {"name": self.name, **placement(None)}]


class Faulty:
    """Logs its pid and a child ``sleep 600`` it starts; fails on item ``fail_at``: raises,
    or ``os._exit`` (a dead process), or waits to be killed from outside (``hang``: the
    file ``<log>.<name>.hanging`` says it waits)."""

    def __init__(self, log: str, name: str, fail_at: int | None = None, how: str = "raise"):
        self.log, self.name, self.fail_at, self.how, self.calls = log, name, fail_at, how, 0
        child = subprocess.Popen(["sleep", "600"])
        write(log, name=name, pid=os.getpid(), child=child.pid)

    def __call__(self, item):
        self.calls += 1
        if self.calls == self.fail_at:
            if self.how == "raise":
                raise ValueError(f"bad item in {self.name}")
            if self.how == "exit":
                os._exit(3)
            Path(f"{self.log}.{self.name}.hanging").touch()
            time.sleep(600)
        time.sleep(0.01)
        return item


def tensors(seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1024, 1024, generator=g),
            "ids": torch.randint(0, 50_000, (64, 512), generator=g)}


def make_tensors(seed: int) -> dict:
    return {"seed": seed, **tensors(seed)}


def make_batch(seed: int):
    from mcore_rl.data.batch import Batch

    t = tensors(seed)
    return Batch({"w": t["w"][:256], "ids": t["ids"][:256 // 4].repeat(4, 1)},
                 meta={"seed": [seed] * 256})


def make_tensors_or_batch(seed: int):
    """A dict of tensors for seeds 1 and 2, a `Batch` for the others."""
    return make_tensors(seed) if seed <= 2 else make_batch(seed)


def check_tensors(log: str):
    import torch

    from mcore_rl.data.batch import Batch

    def check(item):
        if isinstance(item, Batch):
            seeds = sorted(set(item.meta["seed"]))
            want = Batch.cat([make_batch(s) for s in seeds])
            equal = all(torch.equal(item[k], want[k]) for k in want.tensors)
            write(log, kind="Batch", seeds=seeds, rows=len(item), equal=equal)
        else:
            want = tensors(item["seed"])
            equal = all(torch.equal(item[k], want[k]) and item[k].dtype == want[k].dtype for k in want)
            write(log, kind="dict", seeds=[item["seed"]], equal=equal)
    return check


class RankSum:
    """For worker groups: every rank adds ``x * (rank + 1)`` in an all-reduce; logs its pid.
    Rank ``fail_rank`` raises on call ``fail_at`` (before the collective, so the others
    wait in it)."""

    def __init__(self, log: str, fail_rank: int | None = None, fail_at: int | None = None):
        import torch.distributed as dist

        self.log, self.fail_rank, self.fail_at, self.calls = log, fail_rank, fail_at, 0
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        write(log, rank=self.rank, pid=os.getpid(), cores=sorted(os.sched_getaffinity(0)))

    def __call__(self, x):
        import torch
        import torch.distributed as dist

        self.calls += 1
        if self.rank == self.fail_rank and self.calls == self.fail_at:
            raise RuntimeError(f"rank {self.rank} failed")
        total = torch.tensor([float(x) * (self.rank + 1)])
        dist.all_reduce(total)
        return {"x": x, "sum": total.item(), "rank": self.rank, "world": self.world}


class RankLog:
    """For worker groups: logs (rank, pid, item) of every call on every rank; rank 0 returns
    the item with its pid, the others None."""

    def __init__(self, log: str):
        import torch.distributed as dist

        self.log, self.rank = log, dist.get_rank()

    def __call__(self, item):
        write(self.log, event="rank_call", rank=self.rank, pid=os.getpid(), item=item)
        return {"item": item, "pid": os.getpid()} if self.rank == 0 else None


class Stamp:
    """A fused stage: logs its pid and passes ``{"x": item, "stamped_by": pid}`` on."""

    def __init__(self, log: str, name: str):
        self.log, self.name = log, name

    def __call__(self, item):
        write(self.log, event=self.name, pid=os.getpid(), item=item)
        return {"x": item, self.name: os.getpid()} if not isinstance(item, dict) else \
            {**item, self.name: os.getpid()}

    def hello(self, who: str) -> str:
        return f"{self.name} says hello to {who} from {os.getpid()}"


class LayoutReport:
    """For the Megatron strategy: each call all-reduces ``x * (global rank + 1)`` over the
    rank's tensor-parallel group and reports its coordinates in the layout."""

    def __init__(self, log: str):
        from mcore_rl.flow import rank_context

        self.ctx = rank_context()
        write(log, rank=self.ctx.rank, pid=os.getpid(), tp_rank=self.ctx.tp_rank,
              pp_rank=self.ctx.pp_rank, dp_rank=self.ctx.dp_rank)

    def __call__(self, x):
        import torch
        import torch.distributed as dist

        total = torch.tensor([float(x) * (self.ctx.rank + 1)])
        dist.all_reduce(total, group=self.ctx.tp_group)
        return {"x": x, "tp_sum": total.item(), "rank": self.ctx.rank,
                "layout": str(self.ctx.layout)}


def seed_roles():
    """The RL roles with a log of what each call saw (imported late: they load torch)."""
    from mcore_rl.roles.generate import Generate
    from mcore_rl.roles.train import Train

    class RecordingGenerate(Generate):
        def __init__(self, log: str, *args):
            super().__init__(*args)
            self.log = log
            import psutil

            children = [c.pid for c in psutil.Process().children(recursive=True)]
            write(log, event="engine", pid=os.getpid(), cores=sorted(os.sched_getaffinity(0)),
                  children=children)

        def __call__(self, prompts):
            t = time.monotonic()
            batch = super().__call__(prompts)
            write(self.log, event="generate", pid=os.getpid(), t=t,
                  item=prompts[0]["item"], versions=sorted(set(batch.meta["weight_version"])))
            return batch

    class RecordingTrain(Train):
        def __init__(self, log: str, *args):
            super().__init__(*args)
            self.log = log
            write(log, event="rank", pid=os.getpid())

        def __call__(self, batch):
            metrics = super().__call__(batch)
            if self.state.is_controller:
                write(self.log, event="train", t=time.monotonic(),
                      item=batch.meta["prompt_meta"][0]["item"], producer=batch.meta["producer"][0],
                      generated_with=metrics["rollout/weight_version"],
                      synced=metrics["weight_version"],
                      gap=metrics["actor/engine_logprob_gap"], tp=str(self.state.ctx.layout))
            return metrics

    return RecordingGenerate, RecordingTrain


def recording_generate(log, *args):
    return seed_roles()[0](log, *args)


def recording_train(log, *args):
    return seed_roles()[1](log, *args)


def digit_share_failing_at_2(batch):
    """`digit_share` that raises on its second item."""
    global _scored
    _scored = globals().get("_scored", 0) + 1
    if _scored == 2:
        raise ValueError("the critic failed on purpose")
    return digit_share(batch)


def digit_share(batch):
    """A critic: the share of digits in each response (it varies between samples, so GRPO
    has advantages to learn from even with an untrained model)."""
    import torch

    scores = [sum(c.isdigit() for c in text) / max(len(text), 1)
              for text in batch.meta["response_text"]]
    return batch.with_tensors(scores=torch.tensor(scores, dtype=torch.float32))


class Reorder:
    """A streaming function (continuous batching in miniature): keeps up to ``hold`` inputs
    in flight and emits the oldest-but-one first, so outputs leave out of input order; logs
    when it takes each input."""

    def __init__(self, log: str, hold: int = 3):
        self.log, self.hold = log, hold

    def __call__(self, items):
        held = []
        for x in items:
            write(self.log, event="take", x=x, t=time.monotonic())
            held.append(x)
            if len(held) == self.hold:
                yield {"x": held.pop(1)}
        while held:
            yield {"x": held.pop()}


class Chunked:
    """A streaming function that hands its inputs on ``size`` at a time as one entry
    (`mcore_rl.flow.Many`), the rest at the end: item x -> {"x": x}."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, items):
        from mcore_rl.flow import Many

        chunk = []
        for x in items:
            chunk.append({"x": x})
            if len(chunk) == self.size:
                yield Many(chunk)
                chunk = []
        if chunk:
            yield Many(chunk)



class AfterSink:
    """A streaming function: its first three inputs as one entry, then (once ``sink_log``
    exists: the sink has had something) the rest as one entry; fails after 20 s without."""

    def __init__(self, sink_log: str):
        self.sink_log = sink_log

    def __call__(self, items):
        from mcore_rl.flow import Many

        items = iter(items)
        yield Many([{"x": next(items)} for _ in range(3)])
        deadline = time.monotonic() + 20.0
        while not os.path.exists(self.sink_log):
            if time.monotonic() > deadline:
                raise RuntimeError("the relay held back its results: the sink got nothing")
            time.sleep(0.02)
        yield Many([{"x": x} for x in items])


class FinishAtFirstCall:
    """A sink that logs each call and ends the launch at its first (`finish_launch`)."""

    def __init__(self, log: str):
        self.log = log

    def __call__(self, items):
        from mcore_rl.flow import finish_launch

        write(self.log, event="call", x=[i["x"] for i in items])
        finish_launch()


def item_key(x):
    """`Replaceable.item_key` of the replacement tests: the fed integers are their keys."""
    return x


def output_keys(out) -> list:
    """`Replaceable.output_keys`: the ``x`` of each output dict (one, or a `Many`)."""
    from mcore_rl.flow.entries import unpack

    return [d["x"] for d in unpack(out)]


class Holding:
    """A streaming replica with up to ``hold`` items in flight: a reader takes them while the
    loop hands each on (as a `Many` of one {"x", "by"}) after ``delay_s``, never waiting for
    the end of its input; with ``die_at``, its process exits as it takes that many-th item,
    the ones taken before it still in flight; with ``die_on_emit``, as it is about to hand on
    that many-th item. ``start_s``: it waits that long before it takes any."""

    def __init__(self, log: str, name: str, hold: int = 3, die_at: int | None = None,
                 delay_s: float = 0.02, die_on_emit: int | None = None, start_s: float = 0.0):
        self.log, self.name, self.hold, self.die_at, self.delay_s = log, name, hold, die_at, delay_s
        self.die_on_emit, self.start_s = die_on_emit, start_s

    def __call__(self, items):
        import queue
        import threading

        from mcore_rl.flow.entries import pack

        arrived, room, end = queue.Queue(), threading.Semaphore(self.hold), object()

        def read() -> None:
            time.sleep(self.start_s)
            for taken, x in enumerate(items, 1):
                write(self.log, event="take", by=self.name, x=x)
                if self.die_at is not None and taken >= self.die_at:
                    os._exit(3)
                arrived.put(x)
                room.acquire()
            arrived.put(end)

        threading.Thread(target=read, daemon=True).start()
        emitted = 0
        while (x := arrived.get()) is not end:
            time.sleep(self.delay_s)
            emitted += 1
            if emitted == self.die_on_emit:
                os._exit(3)
            yield pack([{"x": x, "by": self.name}])
            room.release()


class ExitRecorder:
    """For worker groups: every rank registers an exit handler that logs, and leaves an
    object whose deletion in the interpreter's module teardown logs and then takes 30 s."""

    def __init__(self, log: str):
        import atexit

        import torch.distributed as dist

        rank = dist.get_rank()
        write(log, event="started", rank=rank, pid=os.getpid())
        atexit.register(write, log, event="atexit", rank=rank, pid=os.getpid())
        linger(log, json.dumps({"event": "module_teardown", "rank": rank}) + "\n")

    def __call__(self, item):
        return None
