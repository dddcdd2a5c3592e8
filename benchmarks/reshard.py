"""`mcore-rl bench reshard`: one full weight sync into a running vLLM engine vs the naive path.

Per model (a tiny Llama and SmolLM2-135M; ``--quick``: the tiny one) and trainer layout (TP1,
and PP2 with one process per rank; ``--quick``: TP1), vLLM at engine TP1, fp32 on both sides,
in the same run (the two paths alternate, so both see the same machine load):

- **ours**: `WeightSync.sync` as configured by default (``reshard.transport=auto``: on these
  CPU trainers the *shared* transport, where the parameters live in the shared-memory file
  the engine maps and a sync checksums them in place; ``--transport buckets``: every sync
  copies them into buckets of ``--bucket-mb``), checksums, one engine update session,
  buckets of ``--bucket-mb`` loaded one after another. The whole sync is timed as configured
  by default (writers publish bucket k+1 while the engine loads bucket k); its split into
  *transfer* (trainer ranks copying, where they copy, and checksumming what they send) and
  *apply* (the engine checking and loading buckets, finishing the session) comes from syncs
  run one bucket at a time (``reshard.overlap=False``), where the two do not share the cores;
- **naive**: the trainer gathers the model to rank 0 as HF tensors (`gather_hf_tensors`),
  writes an HF checkpoint to disk (``save_file``, as ``save_pretrained`` does) and the running
  engine reloads it from there (vLLM's in-place reload from a directory), split the same way.
  *Disk write+read* is gather and write plus reading the checkpoint's bytes back (into a
  buffer allocated beforehand; ``load_file`` alone maps the file and reads nothing): the
  transfer that the naive path pays. (``/tmp`` here is a disk, but with 24 GB of RAM the
  page cache absorbs a 0.5 GB write: the naive path never waits for the disk itself.)

Times are medians over ``--repeats`` syncs after ``--warmup`` rounds (the naive path needs
a few to reach its steady state: its first writes run ~2x slower). Peak extra memory, each path
in a fresh set of processes (``--quick``: both in one), is the largest rise during the first
sync (for ours: creating the `WeightSync`, which allocates the bucket file, and one sync) of
(a) the *transport*: the file the engine maps, less the parameters the shared transport
moved into it (they left the trainer's heap: not extra), plus the rise of the trainer ranks'
anonymous memory (naive: the model gathered on rank 0 and its serialised bytes; the page
cache of the written file is not counted); (b) the summed PSS of trainer and engine processes: the *whole sync*,
including what vLLM itself allocates to process new weights (one layer at a time, in both
paths). Targets: transfer >= 5x faster than disk write+read, whole sync >= 2x faster than
naive, transport peak extra <= one bucket budget (``--bucket-mb``) + the largest tensor.

Measured on the development machine (SmolLM2-135M fp32, 0.54 GB, into vLLM on CPU, 2
cores, trainer TP1 or PP2): a sync takes 0.25-0.29 s. The transfer takes 0.03-0.06 s with
the shared transport (checksums only) and 0.09-0.11 s through buckets (copying with two
writer threads); the engine's loading 0.21-0.24 s, of which ~0.17 s is the CPU backend
repacking linear weights, which any load pays. The naive path takes 0.6-1.2 s: its write
alone runs at 0.20-0.25 s or at ~0.44 s from one run to the next, and vLLM's reload takes
0.35-0.41 s. Engine and trainer log-probs then agree to 5e-6. Overlapping writes and loads
(``reshard.overlap``) hides the shorter of the two where writers and engine have cores of
their own; on 2 shared cores they also compete for them. Figures behind the design:
allocating tmpfs pages costs ~0.7 s per GB (the bucket file is allocated once and reused),
faulting them in on first write runs at ~1.4 GB/s (hence ``fallocate``), writes into
existing pages at ~13 GB/s; the ``sum64`` checksum runs at ~20 GB/s on one core from
memory and ~60 GB/s from cache (hence checksumming each piece right after its copy),
``crc32`` at ~4 GB/s.
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from mcore_rl.benchmarks._common import (machine_info, memory_comparison, throughput_comparison,
                                         time_comparison, write_json)


def _log(msg: str) -> None:
    print(f"[bench reshard] {msg}", flush=True)


# ----- memory -----------------------------------------------------------------------------
def _smaps_kib(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Anonymous"):
                    out[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


class PeakExtraMemory:
    """Largest rise, while active, of (a) the summed PSS of the trainer processes and this
    process's descendants (the engine's): the whole sync, shared pages counted once; (b) the
    trainer processes' summed anonymous memory (heap: copies, gathered tensors, serialised
    checkpoints; not the shared bucket file, whose size is known exactly)."""

    def __init__(self, trainer_pids: list[int] | None = None, interval_s: float = 0.002):
        import psutil

        me = psutil.Process()
        self.trainer_pids = list(trainer_pids or [me.pid])
        self.pids = self.trainer_pids + [c.pid for c in me.children(recursive=True)
                                         if c.pid not in self.trainer_pids]
        self.interval_s = interval_s
        self._stop = threading.Event()

    def _sample(self) -> tuple[int, int]:
        maps = [_smaps_kib(p) for p in self.pids]
        trainer = sum(m.get("Anonymous", 0) for m in maps[:len(self.trainer_pids)])
        return sum(m.get("Pss", 0) for m in maps), trainer

    def _run(self) -> None:
        while not self._stop.is_set():
            self._note(self._sample())
            time.sleep(self.interval_s)

    def _note(self, sample: tuple[int, int]) -> None:
        self.peak = tuple(max(a, b) for a, b in zip(self.peak, sample))

    def __enter__(self) -> "PeakExtraMemory":
        samples = [self._sample() for _ in range(5)]
        self.baseline = tuple(statistics.median(x) for x in zip(*samples))
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._note(self._sample())

    @property
    def whole_mib(self) -> float:
        return (self.peak[0] - self.baseline[0]) / 1024

    @property
    def trainer_mib(self) -> float:
        return (self.peak[1] - self.baseline[1]) / 1024


# ----- the two paths (run inside fresh trainer processes) ---------------------------------
def _naive_sync(sync, hf_dir: str, engine, out: Path, version: int) -> dict | None:
    """Gather the model to rank 0 as HF tensors, ``save_file`` it with the config, and let the
    engine reload it from there. Collective; rank 0 returns the timings."""
    from safetensors.torch import save_file

    from mcore_rl.reshard.gather import gather_hf_tensors

    t0 = time.perf_counter()
    tensors = gather_hf_tensors(sync.plan, sync.local_views(), sync.rank)
    if sync.rank != 0:
        return None
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    del tensors
    for side in ("config.json", "generation_config.json"):
        if (Path(hf_dir) / side).exists():
            shutil.copy(Path(hf_dir) / side, out / side)
    t1 = time.perf_counter()
    engine.load_weights_from_dir(str(out), version)
    t2 = time.perf_counter()
    return {"write_s": t1 - t0, "apply_s": t2 - t1, "total_s": t2 - t0}


def _memory(rank: int, pids: list[int], run) -> dict | None:
    """Peak extra memory of ``run()`` (collective), sampled on rank 0 over every trainer rank
    (``pids``) and the engine processes."""
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        with PeakExtraMemory(pids) as mem:
            run()
        box = [{"whole_mib": mem.whole_mib, "trainer_mib": mem.trainer_mib}]
    else:
        run()
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _read_s(path: Path) -> float:
    """Seconds to read ``path``'s bytes into memory allocated (and touched) beforehand."""
    buffer = bytearray(path.stat().st_size)
    t0 = time.perf_counter()
    view, at = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as f:
        while at < len(buffer):  # one read returns at most ~2 GiB
            n = f.readinto(view[at:])
            if not n:
                break
            at += n
    return time.perf_counter() - t0


def _measure(rank, world_size, hf_dir: str, layout: tuple[int, int], bucket_mb: float,
             repeats: int, what: list[str], scratch: str, warmup: int = 1,
             transport: str = "auto") -> dict:
    """Trainer at ``layout`` (tp, pp; rank 0 holds the engine), then measure ``what``:
    time, mem_ours, mem_naive."""
    import torch.distributed as dist
    from mcore_rl.engines.vllm_engine import VLLMEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync

    ctx = initialize_parallel(tp=layout[0], pp=layout[1])
    built = build_model(hf_dir, ctx)
    arch = built.spec.arch
    engine = VLLMEngine(hf_dir, tp=1, max_model_len=256) if rank == 0 else None
    pids: list = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    out: dict = {}
    disk = Path(scratch) / "naive"
    try:
        holder = {}

        def start_ours():  # allocates the bucket file, then one sync
            holder["sync"] = WeightSync.build(built.chunks, arch,
                                              engines=[engine] if engine else None,
                                              bucket_mb=bucket_mb, transport=transport)
            holder["sync"].sync(version=1)

        if "mem_naive" in what:  # first: nothing of ours allocated yet in these processes
            probe = WeightSync.build(  # the plan: what to send
                built.chunks, arch, engines=[engine] if engine else None, bucket_mb=bucket_mb,
                transport="buckets")
            probe.close()
            out["mem_naive"] = _memory(rank, pids, lambda: _naive_sync(probe, hf_dir, engine,
                                                                       disk, version=1))
        mem = _memory(rank, pids, start_ours)
        sync = holder["sync"]
        if "mem_ours" in what:
            out["mem_ours"] = mem
        out["plan"] = {"buckets": len(sync.plan.buckets), "bytes": sync.plan.total_nbytes,
                       "file_bytes": sync.channel.nbytes,
                       "moved_bytes": sync.channel.moved_nbytes,
                       "transport": sync.transport,
                       "largest_tensor_bytes": max(t.nbytes for b in sync.plan.buckets
                                                   for t in b.tensors)}
        if "time" in what:  # alternating, so that every path sees the same machine load
            ours, alone, naive = [], [], []
            for v in range(repeats + warmup):
                ours.append(sync.sync(version=3 * v))  # as configured by default: overlapped
                sync.overlap = False  # one bucket at a time: transfer and apply apart
                alone.append(sync.sync(version=3 * v + 1))
                sync.overlap = True
                if rank == 0:
                    shutil.rmtree(disk, ignore_errors=True)
                naive.append(_naive_sync(sync, hf_dir, engine, disk, version=3 * v + 2))
            ours, alone, naive = ours[warmup:], alone[warmup:], naive[warmup:]
            if rank == 0:
                reads = [_read_s(disk / "model.safetensors") for _ in range(repeats)]
                out["ours"] = {"total_s": statistics.median(s.total_s for s in ours),
                               **{k: statistics.median(getattr(s, k) for s in alone)
                                  for k in ("transfer_s", "apply_s")},
                               "one_at_a_time_total_s": statistics.median(s.total_s for s in alone)}
                out["naive"] = {k: statistics.median(n[k] for n in naive) for k in naive[0]}
                out["naive"]["read_s"] = statistics.median(reads)
                out["load_mode"] = engine.load_mode
        sync.close()
    finally:
        if engine is not None:
            engine.close()
        destroy_parallel()
    return out


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def _fresh(hf_dir: str, layout: str, bucket_mb: float, repeats: int, what: list[str],
           threads: int, warmup: int = 1, transport: str = "auto") -> dict:
    from mcore_rl.parallel.local_world import SharedWorld

    tp, pp = LAYOUTS[layout]
    with tempfile.TemporaryDirectory(prefix="bench_reshard_") as scratch, \
            SharedWorld(tp * pp, threads_per_rank=threads, timeout_s=1800) as world:
        return world.run(_measure, hf_dir, (tp, pp), bucket_mb, repeats, what, scratch,
                         warmup, transport)[0]


def _training_batch(vocab_size: int, g: torch.Generator):
    """A batch of 4 random sequences of 64 tokens (16 of prompt) and a plain policy-gradient
    loss over its responses: a real optimizer step's inputs for the trainer benchmarks."""
    from mcore_rl.data.batch import Batch

    batch = Batch.from_sequences(torch.randint(3, vocab_size, (4, 64), generator=g).tolist(),
                                 prompt_lens=[16] * 4)

    def loss(outputs, mb):
        mask = mb["response_mask"].float()
        return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}

    return batch, loss


# ----- placement: the engine in processes of its own vs inside the trainer process ---------
def _placement(rank, world_size, hf_dir: str, in_process: bool, bucket_mb: float) -> dict:
    """Start the engine beside a TP1 trainer (own processes, or inside this trainer process)
    and time: start, generation, one sync, and a trainer step before and after the start."""
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.engines import SamplingConfig
    from mcore_rl.engines.vllm_engine import VLLMEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel()
    built = build_model(hf_dir, ctx)
    arch = built.spec.arch
    train = build_engine(built.chunks, ctx, vocab_size=arch.vocab_size, optim=OptimizerConfig())
    g = torch.Generator().manual_seed(0)
    batch, loss = _training_batch(arch.vocab_size, g)

    def step_s() -> float:
        train.train_batch(batch, loss)
        t0 = time.perf_counter()
        train.train_batch(batch, loss)
        return time.perf_counter() - t0

    out = {"threads_before": torch.get_num_threads(), "trainer_step_before_s": step_s()}
    t0 = time.perf_counter()
    engine = VLLMEngine(hf_dir, tp=1, max_model_len=256, in_process=in_process)
    out["engine_start_s"] = time.perf_counter() - t0
    try:
        prompts = torch.randint(3, arch.vocab_size, (8, 16), generator=g).tolist()
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=32, seed=0)
        engine.generate(prompts, sampling)
        t0 = time.perf_counter()
        tokens = sum(len(s.token_ids) for s in engine.generate(prompts, sampling))
        out["generate_tokens_per_s"] = tokens / (time.perf_counter() - t0)
        with WeightSync.build(train.model, arch, engines=[engine], bucket_mb=bucket_mb) as sync:
            sync.sync(version=1)
            out["sync_s"] = sync.sync(version=2).total_s
        out["threads_after"] = torch.get_num_threads()
        out["trainer_step_after_s"] = step_s()
    finally:
        engine.close()
        destroy_parallel()
    return out


def _placement_comparisons(placement: dict) -> dict:
    """Ours = engine in its own processes; baseline = engine inside the trainer process."""
    own, inproc = placement["own_processes"], placement["in_trainer_process"]
    return {
        "placement_generate_throughput": throughput_comparison(
            own["generate_tokens_per_s"], inproc["generate_tokens_per_s"], "tokens/s"),
        "placement_sync_time": time_comparison(own["sync_s"], inproc["sync_s"]),
        "placement_trainer_step_time": time_comparison(own["trainer_step_after_s"],
                                                       inproc["trainer_step_after_s"]),
        "placement_engine_start_time": time_comparison(own["engine_start_s"],
                                                       inproc["engine_start_s"]),
    }


def measure_placement(hf_dir: str, bucket_mb: float) -> dict:
    """Both placements, each in a fresh trainer process with all cores."""
    from mcore_rl.parallel.local_world import SharedWorld

    results = {}
    for name, in_process in (("own_processes", False), ("in_trainer_process", True)):
        _log(f"placement: engine in {name.replace('_', ' ')}")
        with SharedWorld(1, threads_per_rank=os.cpu_count() or 1, timeout_s=1800) as world:
            results[name] = world.run(_placement, hf_dir, in_process, bucket_mb)[0]
    return results


# ----- delta sync: only the changed words relayed, against every word ----------------------
def _delta(rank, world_size, hf_dir: str, bucket_mb: float, steps: int, lr: float) -> dict:
    """Trainer PP2 whose rank 1 stands for another node (it relays its stage), bf16 on the
    wire, vLLM TP1 on rank 0. Per real optimizer step (Adam at ``lr``, a next-token loss on
    random tokens): one sync relaying deltas, then one relaying every word of the same
    weights (``full_every=2``). Per sync: bytes relayed, transfer and whole sync seconds."""
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.engines.vllm_engine import VLLMEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(pp=2)
    built = build_model(hf_dir, ctx)
    arch = built.spec.arch
    train = build_engine(built.chunks, ctx, vocab_size=arch.vocab_size,
                         optim=OptimizerConfig(lr=lr))
    g = torch.Generator().manual_seed(0)
    batch, loss = _training_batch(arch.vocab_size, g)

    engine = VLLMEngine(hf_dir, tp=1, max_model_len=256) if rank == 0 else None
    rows = {"delta": [], "full": []}
    try:
        with WeightSync.build(train.model, arch, engines=[engine] if engine else None,
                              bucket_mb=bucket_mb, wire_dtype=torch.bfloat16, local_ranks={0},
                              transport="buckets", delta=True, full_every=2) as sync:
            sync.sync(version=1)  # the baseline (full)
            for step in range(steps):
                train.train_batch(batch, loss)
                for kind in ("delta", "full"):
                    s = sync.sync(version=2 + 2 * step + (kind == "full"))
                    rows[kind].append({"relayed_bytes": s.relayed_nbytes,
                                       "relayed_full_bytes": s.relayed_full_nbytes,
                                       "changed_fraction": s.changed_fraction,
                                       "transfer_s": s.transfer_s, "total_s": s.total_s})
    finally:
        if engine is not None:
            engine.close()
        destroy_parallel()
    return rows


def measure_delta(hf_dir: str, bucket_mb: float, steps: int, lr: float) -> dict:
    from mcore_rl.parallel.local_world import SharedWorld

    with SharedWorld(2, threads_per_rank=1, timeout_s=1800) as world:
        return world.run(_delta, hf_dir, bucket_mb, steps, lr)[0]


def _delta_comparisons(rows: dict, lr: float) -> dict:
    def median(kind, key):
        return statistics.median(r[key] for r in rows[kind])

    changed = median("delta", "changed_fraction")
    nbytes = memory_comparison(median("delta", "relayed_bytes"), median("full", "relayed_bytes"),
                               "bytes")
    nbytes.update(measured="bytes the relaying rank sent per sync (positions and words of the "
                           "changed bf16 words, against every word)", changed_fraction=changed,
                  lr=lr, target_ratio=0.25)
    transfer = time_comparison(median("delta", "transfer_s"), median("full", "transfer_s"))
    transfer.update(measured="writers copying and checksumming, the relay, until the controller "
                             "has every checksum; on one host the relay is a local gloo send, so "
                             "diffing (which reads every word) is not paid back here: the gain "
                             "belongs to a relay across nodes")
    return {"delta_vs_full.bytes_ratio": nbytes, "delta_vs_full.transfer_time": transfer,
            "delta_vs_full.sync_time": time_comparison(median("delta", "total_s"),
                                                       median("full", "total_s"))}


# ----- report -----------------------------------------------------------------------------
def _comparisons(name: str, r: dict, bucket_mb: float) -> dict:
    ours, naive, plan = r["ours"], r["naive"], r["plan"]
    gb = plan["bytes"] / 1e9
    disk = naive["write_s"] + naive["read_s"]
    bound_mib = bucket_mb + plan["largest_tensor_bytes"] / 2**20
    ours_mib = r["mem_ours"]["trainer_mib"] + (plan["file_bytes"] - plan["moved_bytes"]) / 2**20
    transport = memory_comparison(ours_mib, r["mem_naive"]["trainer_mib"], "MiB")
    transport.update(measured="file the engine maps, less the parameters moved into it, + rise "
                              "of the trainer ranks' anonymous memory (naive: the gathered "
                              "model and its serialised bytes)", transport=plan["transport"],
                     bound_mib=bound_mib, within_bound=ours_mib <= bound_mib)
    whole = memory_comparison(r["mem_ours"]["whole_mib"], r["mem_naive"]["whole_mib"], "MiB")
    whole.update(measured="PSS of trainer + engine processes (includes the engine's own "
                          "layer processing, the same in both paths)")
    transfer = time_comparison(ours["transfer_s"], disk)
    transfer.update(baseline_is="disk write + read", target_speedup=5.0)
    sync = time_comparison(ours["total_s"], naive["total_s"])
    sync.update(ours_transfer_s=ours["transfer_s"], ours_apply_s=ours["apply_s"],
                ours_one_bucket_at_a_time_s=ours["one_at_a_time_total_s"],
                naive_write_s=naive["write_s"], naive_apply_s=naive["apply_s"], target_speedup=2.0,
                engine_load_mode=r["load_mode"])
    return {f"{name}_sync_time": sync,
            f"{name}_transfer_time": transfer,
            f"{name}_apply_time": time_comparison(ours["apply_s"], naive["apply_s"]),
            f"{name}_sync_throughput": throughput_comparison(gb / ours["total_s"],
                                                             gb / naive["total_s"], "GB/s"),
            f"{name}_transfer_throughput": throughput_comparison(gb / ours["transfer_s"], gb / disk,
                                                                 "GB/s"),
            f"{name}_transport_peak_extra_memory": transport,
            f"{name}_sync_peak_extra_memory": whole}


def main(argv: list[str] | None = None) -> int:
    from mcore_rl.reshard.transports import TRANSPORTS

    parser = argparse.ArgumentParser(prog="mcore-rl bench reshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="output JSON path")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model only, one repeat, memory of both paths in one process")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help="bucket budget in MiB (default 256, as reshard.bucket_mb; --quick 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed syncs per path (default 5)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed rounds of every path first (default 3; --quick 1)")
    parser.add_argument("--placement", action="store_true",
                        help="also time the engine in its own processes vs inside the trainer")
    parser.add_argument("--layouts", default=None,
                        help="trainer layouts, comma separated among tp1, tp2, pp2 (one rank "
                             "per process; default tp1,pp2; --quick tp1)")
    parser.add_argument("--transport", choices=("auto", *TRANSPORTS.names()), default="auto",
                        help="reshard.transport of our sync (default auto: shared here)")
    parser.add_argument("--delta", action="store_true",
                        help="also compare relaying deltas against every word (bf16 wire, "
                             "trainer PP2 with one rank standing for another node, after real "
                             "optimizer steps at --delta-lr)")
    parser.add_argument("--delta-lr", type=float, default=1e-6)
    parser.add_argument("--delta-steps", type=int, default=3)
    parser.add_argument("--only-delta", action="store_true", help="--delta and nothing else")
    parser.add_argument("--trainer-threads", type=int, default=1,
                        help="torch threads of the trainer process (the engine gets all cores)")
    args = parser.parse_args(argv)
    bucket_mb = args.bucket_mb or (1.0 if args.quick else 256.0)
    repeats = args.repeats or (1 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    threads = args.trainer_threads
    layouts = (args.layouts or ("tp1" if args.quick else "tp1,pp2")).split(",")
    if args.only_delta:
        args.delta, layouts = True, []
    results, models = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench_reshard_models_") as root:
        dirs = model_dirs(args.quick, Path(root))
        for (name, hf_dir), layout in itertools.product(dirs.items(), layouts):
            key = f"{name}_{layout}"
            _log(f"{name}: trainer {layout.upper()} -> vLLM TP1, bucket budget {bucket_mb} MiB")
            if args.quick:
                r = _fresh(hf_dir, layout, bucket_mb, repeats,
                           ["time", "mem_ours", "mem_naive"], threads, warmup, args.transport)
            else:
                r = _fresh(hf_dir, layout, bucket_mb, repeats, ["time"], threads, warmup,
                           args.transport)
                _log(f"{key}: memory of our sync (fresh processes)")
                r["mem_ours"] = _fresh(hf_dir, layout, bucket_mb, 0, ["mem_ours"],
                                       threads, 1, args.transport)["mem_ours"]
                _log(f"{key}: memory of the naive sync (fresh processes)")
                r["mem_naive"] = _fresh(hf_dir, layout, bucket_mb, 0, ["mem_naive"],
                                        threads)["mem_naive"]
            models[name] = r["plan"]
            results.update(_comparisons(key, r, bucket_mb))
            _log(f"{key}: ours {r['ours']}  naive {r['naive']}")
        if args.placement:
            name = "smollm2_135m" if "smollm2_135m" in dirs else "tiny"
            placement = measure_placement(dirs[name], bucket_mb)
            results.update(_placement_comparisons(placement))
            models["placement"] = {"model": name, **placement}
        if args.delta:
            name = "smollm2_135m" if "smollm2_135m" in dirs else "tiny"
            _log(f"delta vs full: {name}, trainer PP2 (rank 1 relays), {args.delta_steps} "
                 f"steps at lr {args.delta_lr}")
            rows = measure_delta(dirs[name], bucket_mb, args.delta_steps, args.delta_lr)
            results.update(_delta_comparisons(rows, args.delta_lr))
            models["delta"] = {"model": name, "syncs": rows}
    meta = {"machine": machine_info(), "bucket_mb": bucket_mb, "repeats": repeats,
            "warmup": warmup,
            "trainer_threads": threads, "checksum": "sum64", "transport": args.transport,
            "engine": "vLLM TP1, fp32 (trainer fp32)", "trainer_layouts": layouts,
            "models": models,
            "memory": "one process for both paths" if args.quick else "fresh processes per path"}
    write_json(args.json, {"benchmark": "reshard", "metadata": meta, "comparisons": results})
    for key, c in results.items():
        ratio = c.get("speedup", c.get("ratio"))
        _log(f"{key:32s} ours {c['ours']:9.4f}  baseline {c['baseline']:9.4f} {c['unit']:5s} "
             f"{'x' if 'speedup' in c else 'ratio '}{ratio:.2f}")
    _log(f"wrote {args.json}")
    return 0


def model_dirs(quick: bool, root: Path) -> dict[str, str]:
    """HF directories of the benchmarked models: a tiny random Llama (and SmolLM2-135M)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tiny = LlamaForCausalLM(LlamaConfig(
        vocab_size=1003, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False))
    tiny.save_pretrained(root / "tiny")
    out = {"tiny": str(root / "tiny")}
    if not quick:
        from mcore_rl.models.smollm2 import prepare_smollm2_hf_dir

        out["smollm2_135m"] = str(prepare_smollm2_hf_dir())
    return out


if __name__ == "__main__":
    sys.exit(main())
