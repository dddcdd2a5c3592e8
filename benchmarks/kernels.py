"""Benchmark of the fused kernels against the code most RL frameworks run instead.

    mcore-rl bench kernels --json OUT [--quick] [--device cpu|cuda] [--tokens N] [--vocab V] ...

Comparisons, all measured in one run on one device:
  * GAE (``impl="auto"``) vs a per-time-step loop vectorised over the batch, at [256 x 2048]
    and [64 x 16384], with a right-padded response mask (the common case) and with holes;
  * ``token_logprobs`` forward vs ``torch.log_softmax(logits.float(), -1).gather(...)`` at
    N=4096, V=151936 (bf16 logits): time and peak extra memory; forward+backward likewise
    (and with ``inplace_backward``);
  * log-probs of a top-k / top-p truncated distribution (``token_logprobs`` with ``top_k`` /
    ``top_p``), forward+backward, vs plain torch: the sort-based mask an engine's sampler
    applies, then ``log_softmax``; at top_k=50 with top_p=0.9, and at top_p=0.95 alone;
  * ``linear_token_logprobs`` vs ``hidden @ weight.T`` followed by the same baseline.

Each entry reads {"ours", "baseline", "unit", "speedup"} for times (speedup = baseline / ours)
and {"ours", "baseline", "unit", "ratio"} for memory (ratio = ours / baseline), plus
"max_abs_diff" between the two results where they compute the same thing.

Timing: median wall time of ``--repeats`` runs after one untimed run (CUDA: synchronised).
Peak extra memory: on CUDA, ``max_memory_allocated`` above what was allocated before the call.
On CPU (Linux), the process' resident-set high-water mark (VmHWM) is reset before each call
(free heap memory is first handed back to the OS with ``malloc_trim`` and the mark is reset
through /proc/self/clear_refs) and read after it: peak extra = VmHWM - RSS before the call.
Inputs are created before the reset, so only what the call itself allocates counts, outputs
and gradients included. Without /proc (non-Linux) memory is reported as null.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from mcore_rl.kernels import gae, linear_token_logprobs, token_logprobs
from mcore_rl.kernels.gae import gae_reference

MiB = 1024**2


# ----------------------------------------------------------------------------- measuring


class _CpuPeak:
    """Peak resident memory of this process around a call (Linux), see the module docstring."""

    def __init__(self) -> None:
        self.available = False
        try:
            self._libc = ctypes.CDLL("libc.so.6")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.available = self._status("VmHWM") is not None
        except (OSError, AttributeError):
            pass

    @staticmethod
    def _status(key: str) -> int | None:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return None

    def start(self) -> int:
        gc.collect()
        self._libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current VmRSS
        return self._status("VmRSS")

    def peak_since(self, base: int) -> int:
        return self._status("VmHWM") - base


class Meter:
    """Times a call and measures its peak extra memory on the benchmark's device."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats
        self.cpu_peak = _CpuPeak() if device.type == "cpu" else None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, run: Callable[[Any], Any], prepare: Callable[[], Any] = lambda: None,
                repeats: int | None = None) -> tuple[float, int | None, Any]:
        """(median seconds, peak extra bytes or None, result of the first run).

        ``prepare()`` makes per-run inputs (untimed, not counted as extra memory); ``run(arg)``
        is the measured call. The first run is measured for memory only (it is also the
        warm-up); the next ``repeats`` runs are timed.
        """
        arg = prepare()
        self.sync()
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            first = run(arg)
            self.sync()
            peak = torch.cuda.max_memory_allocated(self.device) - base
        elif self.cpu_peak is not None and self.cpu_peak.available:
            base = self.cpu_peak.start()
            first = run(arg)
            peak = self.cpu_peak.peak_since(base)
        else:
            first, peak = run(arg), None
        del arg
        times = []
        for _ in range(self.repeats if repeats is None else repeats):
            arg = prepare()
            self.sync()
            t0 = time.perf_counter()
            out = run(arg)
            self.sync()
            times.append(time.perf_counter() - t0)
            del out, arg
        return statistics.median(times), peak, first


def _time_entry(ours: float, baseline: float, **extra) -> dict:
    return {"ours": ours * 1e3, "baseline": baseline * 1e3, "unit": "ms", "speedup": baseline / ours, **extra}


def _memory_entry(ours: int | None, baseline: int | None, **extra) -> dict:
    if ours is None or baseline is None:
        return {"ours": None, "baseline": None, "unit": "MiB", "ratio": None, **extra}
    return {"ours": ours / MiB, "baseline": baseline / MiB, "unit": "MiB",
            "ratio": ours / baseline if baseline > 0 else None, **extra}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to b's largest entry (for gradients in the inputs' dtype)."""
    return _max_diff(a, b) / max(b.float().abs().max().item(), 1e-30)


def _bandwidth(entry: dict, bytes_moved: int, device_gbps: float | None) -> None:
    """Add achieved GB/s (and the fraction of the device's bandwidth) to a time entry."""
    achieved = bytes_moved / (entry["ours"] / 1e3) / 1e9
    entry["achieved_gbps"] = achieved
    entry["device_gbps"] = device_gbps
    entry["fraction_of_device_bandwidth"] = achieved / device_gbps if device_gbps else None


def _device_bandwidth_gbps(device: torch.device) -> dict:
    """Nominal DRAM bandwidth from the device properties, and a measured copy bandwidth."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    nominal = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None
    x = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize(device)
    copy = 2 * x.numel() * 10 / (time.perf_counter() - t0) / 1e9
    return {"nominal": nominal, "measured_copy": copy}


# ----------------------------------------------------------------------------- inputs


def _fill_random(t: torch.Tensor, seed: int, scale: float = 3.0) -> torch.Tensor:
    """Fill a large [rows, cols] tensor with normal values quickly: a 64-row random block is
    tiled over the rows (generating 600M normals one by one takes longer than the benchmark)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows, cols = t.shape
    block = (torch.randn(min(64, rows), cols, generator=g) * scale).to(device=t.device, dtype=t.dtype)
    for s in range(0, rows, block.shape[0]):
        e = min(rows, s + block.shape[0])
        t[s:e].copy_(block[: e - s])
    return t


def _gae_inputs(batch: int, steps: int, holes: bool, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(batch, steps, generator=g)
    v = torch.randn(batch, steps, generator=g)
    lengths = torch.randint(steps // 4, steps + 1, (batch,), generator=g)
    m = (torch.arange(steps) < lengths[:, None]).float()  # a right-padded response mask
    if holes:  # e.g. tool outputs inside a multi-turn response, masked out
        m[:, 3::7] = 0
    return r.to(device), v.to(device), m.to(device)


# ----------------------------------------------------------------------------- benchmarks


def bench_gae(meter: Meter, shapes: list[tuple[int, int]], device: torch.device, out: dict, log) -> None:
    for batch, steps in shapes:
        for holes in (False, True):
            name = f"gae_{batch}x{steps}" + ("_mask_holes" if holes else "")
            r, v, m = _gae_inputs(batch, steps, holes, device)
            t_ours, _, (adv, ret) = meter.measure(lambda _: gae(r, v, m, 0.99, 0.95), repeats=max(meter.repeats, 20))
            t_base, _, (badv, bret) = meter.measure(lambda _: gae_reference(r, v, m, 0.99, 0.95))
            entry = _time_entry(t_ours, t_base, max_abs_diff=max(_max_diff(adv, badv), _max_diff(ret, bret)),
                                mask="right-padded" + (" with a hole every 7 steps" if holes else ""),
                                baseline_is="per-time-step loop vectorised over the batch")
            if meter.device.type == "cuda":
                _bandwidth(entry, 5 * batch * steps * 4, out["metadata"]["device_bandwidth_gbps"]["measured_copy"])
            out["comparisons"][name] = entry
            log(f"{name}: ours {entry['ours']:.3f} ms, loop {entry['baseline']:.1f} ms, "
                f"x{entry['speedup']:.1f}, max |diff| {entry['max_abs_diff']:.2e}")


def _baseline_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def _fingerprint_rows(n: int) -> torch.Tensor:
    return torch.linspace(0, n - 1, steps=min(n, 8)).long()


def bench_token_logprobs(meter: Meter, n: int, vocab: int, dtype: torch.dtype, device: torch.device,
                         out: dict, log) -> None:
    logits = _fill_random(torch.empty(n, vocab, dtype=dtype, device=device), seed=1)
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(2)).to(device)
    rows = _fingerprint_rows(n).to(device)
    comp = out["comparisons"]

    # forward
    t_o, m_o, lp_o = meter.measure(lambda _: token_logprobs(logits, labels))
    t_b, m_b, lp_b = meter.measure(lambda _: _baseline_logprobs(logits, labels))
    diff = _max_diff(lp_o, lp_b)
    comp["token_logprobs_fwd_time"] = _time_entry(t_o, t_b, max_abs_diff=diff)
    comp["token_logprobs_fwd_peak_memory"] = _memory_entry(m_o, m_b)
    if device.type == "cuda":
        _bandwidth(comp["token_logprobs_fwd_time"], logits.numel() * logits.element_size(),
                   out["metadata"]["device_bandwidth_gbps"]["measured_copy"])
    log(f"token_logprobs fwd: {t_o * 1e3:.1f} ms vs {t_b * 1e3:.1f} ms; peak extra "
        f"{_fmt_mib(m_o)} vs {_fmt_mib(m_b)}; max |diff| {diff:.2e}")

    # forward + backward (d sum(logp) / d logits)
    def ours_fb(x, **kw):
        x = x.requires_grad_(True)
        lp = token_logprobs(x, labels, **kw)
        lp.sum().backward()
        return lp.detach(), x.grad[rows].clone()

    def base_fb(x):
        x = x.requires_grad_(True)
        lp = _baseline_logprobs(x, labels)
        lp.sum().backward()
        return lp.detach(), x.grad[rows].clone()

    view = lambda: logits.detach()  # noqa: E731 - a fresh leaf sharing the logits' storage
    t_o, m_o, (lp_o, g_o) = meter.measure(ours_fb, prepare=view)
    t_i, m_i, (lp_i, g_i) = meter.measure(lambda x: ours_fb(x, inplace_backward=True),
                                          prepare=lambda: logits.detach().clone())
    t_b, m_b, (lp_b, g_b) = meter.measure(base_fb, prepare=view)
    diff = _max_diff(lp_o, lp_b)
    comp["token_logprobs_fwd_bwd_time"] = _time_entry(t_o, t_b, max_abs_diff=diff, max_rel_grad_diff=_rel_diff(g_o, g_b))
    comp["token_logprobs_fwd_bwd_peak_memory"] = _memory_entry(m_o, m_b)
    comp["token_logprobs_fwd_bwd_inplace_time"] = _time_entry(t_i, t_b, max_abs_diff=_max_diff(lp_i, lp_b),
                                                              max_rel_grad_diff=_rel_diff(g_i, g_b))
    comp["token_logprobs_fwd_bwd_inplace_peak_memory"] = _memory_entry(m_i, m_b)
    if device.type == "cuda":
        _bandwidth(comp["token_logprobs_fwd_bwd_time"], 3 * logits.numel() * logits.element_size(),
                   out["metadata"]["device_bandwidth_gbps"]["measured_copy"])
    log(f"token_logprobs fwd+bwd: {t_o * 1e3:.1f} ms vs {t_b * 1e3:.1f} ms; peak extra "
        f"{_fmt_mib(m_o)} (in-place backward {_fmt_mib(m_i)}) vs {_fmt_mib(m_b)}; max |diff| {diff:.2e}, "
        f"max rel grad diff {_rel_diff(g_o, g_b):.2e}")


TRUNCATIONS = {"top_k50_top_p0.9": (50, 0.9), "top_p0.95": (-1, 0.95)}
"""Sampling truncations measured: a bounded set, and a nucleus of random logits (most of the
vocabulary: the candidates grow to a full sort, the worst case)."""


def bench_truncated(meter: Meter, n: int, vocab: int, dtype: torch.dtype, device: torch.device,
                    out: dict, log) -> None:
    """Log-probs of a top-k / top-p distribution, forward and backward: ours against plain
    torch (the truncation by a sort, as an engine's sampler does it, then log_softmax)."""
    from mcore_rl.kernels.token_logprobs.reference import truncate_reference

    logits = _fill_random(torch.empty(n, vocab, dtype=dtype, device=device), seed=3)
    labels = logits.float().argmax(-1)  # inside every kept set
    rows = _fingerprint_rows(n).to(device)
    comp = out["comparisons"]
    for name, (top_k, top_p) in TRUNCATIONS.items():
        def ours(x):
            x = x.requires_grad_(True)
            lp = token_logprobs(x, labels, top_k=top_k, top_p=top_p)
            lp.sum().backward()
            return lp.detach(), x.grad[rows].clone()

        def base(x):
            x = x.requires_grad_(True)
            z = truncate_reference(x.float(), top_k, top_p)
            lp = torch.log_softmax(z, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
            lp.sum().backward()
            return lp.detach(), x.grad[rows].clone()

        view = lambda: logits.detach()  # noqa: E731
        t_o, m_o, (lp_o, g_o) = meter.measure(ours, prepare=view)
        t_b, m_b, (lp_b, g_b) = meter.measure(base, prepare=view)
        diff = _max_diff(lp_o, lp_b)
        comp[f"truncated_logprobs_{name}_fwd_bwd_time"] = _time_entry(
            t_o, t_b, max_abs_diff=diff, max_rel_grad_diff=_rel_diff(g_o, g_b),
            baseline_is="sort-based top-k/top-p mask, log_softmax, autograd")
        comp[f"truncated_logprobs_{name}_fwd_bwd_peak_memory"] = _memory_entry(m_o, m_b)
        log(f"truncated logprobs {name} fwd+bwd: {t_o * 1e3:.1f} ms vs {t_b * 1e3:.1f} ms; peak extra "
            f"{_fmt_mib(m_o)} vs {_fmt_mib(m_b)}; max |diff| {diff:.2e}")


def bench_linear(meter: Meter, n: int, vocab: int, hidden: int, chunk: int, dtype: torch.dtype,
                 device: torch.device, out: dict, log) -> None:
    h = _fill_random(torch.empty(n, hidden, dtype=dtype, device=device), seed=3, scale=1.0)
    w = _fill_random(torch.empty(vocab, hidden, dtype=dtype, device=device), seed=4, scale=hidden**-0.5 * 3)
    labels = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(5)).to(device)
    comp = out["comparisons"]
    t_o, m_o, lp_o = meter.measure(lambda _: linear_token_logprobs(h, w, labels, chunk_size=chunk))
    t_b, m_b, lp_b = meter.measure(lambda _: _baseline_logprobs(h @ w.t(), labels))
    diff = _max_diff(lp_o, lp_b)
    comp["linear_token_logprobs_fwd_time"] = _time_entry(t_o, t_b, max_abs_diff=diff)
    comp["linear_token_logprobs_fwd_peak_memory"] = _memory_entry(m_o, m_b)
    log(f"linear_token_logprobs fwd: {t_o * 1e3:.1f} ms vs {t_b * 1e3:.1f} ms; peak extra "
        f"{_fmt_mib(m_o)} vs {_fmt_mib(m_b)}; max |diff| {diff:.2e}")

    def fb(fn):
        def run(_):
            hh, ww = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
            lp = fn(hh, ww)
            lp.sum().backward()
            return lp.detach(), hh.grad, ww.grad
        return run

    t_o, m_o, (lp_o, gh_o, gw_o) = meter.measure(
        fb(lambda hh, ww: linear_token_logprobs(hh, ww, labels, chunk_size=chunk)))
    t_b, m_b, (lp_b, gh_b, gw_b) = meter.measure(fb(lambda hh, ww: _baseline_logprobs(hh @ ww.t(), labels)))
    rel = max(_rel_diff(gh_o, gh_b), _rel_diff(gw_o, gw_b))
    comp["linear_token_logprobs_fwd_bwd_time"] = _time_entry(t_o, t_b, max_abs_diff=_max_diff(lp_o, lp_b),
                                                             max_rel_grad_diff=rel)
    comp["linear_token_logprobs_fwd_bwd_peak_memory"] = _memory_entry(m_o, m_b)
    log(f"linear_token_logprobs fwd+bwd: {t_o * 1e3:.1f} ms vs {t_b * 1e3:.1f} ms; peak extra "
        f"{_fmt_mib(m_o)} vs {_fmt_mib(m_b)}; max rel grad diff {rel:.2e}")


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def _fmt_mib(b: int | None) -> str:
    return "n/a" if b is None else f"{b / MiB:.1f} MiB"


# ----------------------------------------------------------------------------- entry point


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mcore-rl bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", dest="json_out", help="write the results here")
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test, not a measurement)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="logits / hidden dtype")
    p.add_argument("--tokens", type=int, help="N for the log-prob benchmarks (default 4096)")
    p.add_argument("--vocab", type=int, help="V for the log-prob benchmarks (default 151936)")
    p.add_argument("--hidden", type=int, help="hidden size for linear_token_logprobs (default 256 on CPU, 4096 on GPU)")
    p.add_argument("--chunk-size", type=int, default=1024, help="linear_token_logprobs chunk size")
    p.add_argument("--repeats", type=int, help="timed runs per measurement (default 3, quick: 2)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--skip", nargs="*", default=[], choices=["gae", "token_logprobs", "truncated", "linear"])
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    quick = args.quick
    n = args.tokens or (64 if quick else 4096)
    vocab = args.vocab or (1000 if quick else 151936)
    hidden = args.hidden or (32 if quick else (256 if device.type == "cpu" else 4096))
    gae_shapes = [(8, 64), (4, 256)] if quick else [(256, 2048), (64, 16384)]
    meter = Meter(device, args.repeats or (2 if quick else 3))

    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - reported, not required
        triton_version = None
    out: dict[str, Any] = {
        "metadata": {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "triton": triton_version,
            "python": platform.python_version(),
            "cpu_threads": torch.get_num_threads(),
            "quick": quick,
            # other processes competing for the CPU distort CPU timings: recorded for the reader
            "load_average_at_start": _load_average(),
            # glibc malloc tuning changes CPU timings a lot (first-touch page faults): recorded
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            "dtype": args.dtype,
            "shapes": {
                "gae": [list(s) for s in gae_shapes],
                "token_logprobs": {"tokens": n, "vocab": vocab},
                "linear_token_logprobs": {"tokens": n, "vocab": vocab, "hidden": hidden, "chunk_size": args.chunk_size},
            },
            "timing": f"median of {meter.repeats} runs after a warm-up run",
            "memory": ("torch.cuda.max_memory_allocated above the allocation before the call"
                       if device.type == "cuda" else
                       "VmHWM - VmRSS around the call, after malloc_trim and a /proc/self/clear_refs reset"
                       if meter.cpu_peak is not None and meter.cpu_peak.available else "unavailable"),
        },
        "comparisons": {},
    }
    if device.type == "cuda":
        out["metadata"]["device_bandwidth_gbps"] = _device_bandwidth_gbps(device)

    def log(msg: str) -> None:
        print(f"[bench kernels] {msg}", flush=True)

    log(f"device {out['metadata']['device_name']} ({device}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads")
    if "gae" not in args.skip:
        bench_gae(meter, gae_shapes, device, out, log)
    if "token_logprobs" not in args.skip:
        bench_token_logprobs(meter, n, vocab, dtype, device, out, log)
    if "truncated" not in args.skip:
        bench_truncated(meter, n, vocab, dtype, device, out, log)
    if "linear" not in args.skip:
        bench_linear(meter, n, vocab, hidden, args.chunk_size, dtype, device, out, log)

    out["metadata"]["load_average_at_end"] = _load_average()
    if args.json_out:
        path = Path(args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
