"""What the planner's simulator charges for each piece of work (`CostModel`), and the
response-length distribution it samples from (`LengthDistribution`).

Every field of a costs JSON (``mcore-rl plan --costs FILE``) is a field of `CostModel`;
``response_lengths`` is a `LengthDistribution` written as an object. Values out of range
are refused with one line naming the field (`UsageError`), before any simulation runs.
"""
from __future__ import annotations

import bisect
import math
import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Sequence

from mcore_rl.errors import UsageError

LENGTH_KINDS = ("fixed", "empirical", "longtail")


@dataclass(frozen=True)
class LengthDistribution:
    """Response lengths in tokens. ``fixed``: every response ``max_new_tokens`` long;
    ``empirical``: drawn from ``lengths`` (e.g. measured in a run's samples); ``longtail``:
    lognormal with the given ``median`` and ``p90``. Every draw is capped at
    ``max_new_tokens`` and is at least 1."""

    kind: str = "fixed"
    max_new_tokens: int = 64
    lengths: tuple[int, ...] = ()
    median: float = 0.0
    p90: float = 0.0

    def __post_init__(self) -> None:
        where = "response_lengths"
        if self.kind not in LENGTH_KINDS:
            raise UsageError(f"{where}.kind={self.kind!r}: choose one of {', '.join(LENGTH_KINDS)}")
        _check_int(f"{where}.max_new_tokens", self.max_new_tokens, low=1)
        if self.kind == "empirical":
            if not self.lengths:
                raise UsageError(f"{where}.lengths is empty: give the measured response lengths")
            for length in self.lengths:
                _check_int(f"{where}.lengths[]", length, low=1)
        if self.kind == "longtail":
            _check_number(f"{where}.median", self.median, low=1.0)
            if not (isinstance(self.p90, (int, float)) and self.p90 > self.median):
                raise UsageError(f"{where}.p90={self.p90!r} must be > the median ({self.median}); "
                                 "a long tail has its 90th percentile above the median")

    def sampler(self, rng: random.Random):
        """A function that draws one length (with ``rng``: the same seed, the same lengths)."""
        cap = self.max_new_tokens
        if self.kind == "fixed":
            return lambda: cap
        if self.kind == "empirical":
            return lambda: min(cap, rng.choice(self.lengths))
        # lognormal: log L ~ N(mu, sigma); the median is e^mu, the 90th percentile e^(mu + z90 sigma)
        mu, sigma = math.log(self.median), math.log(self.p90 / self.median) / 1.2815515655446004
        return lambda: max(1, min(cap, round(rng.lognormvariate(mu, sigma))))

    def mean(self, draws: int = 4000) -> float:
        """The mean length (estimated from ``draws`` seeded draws for ``longtail``)."""
        if self.kind == "fixed":
            return float(self.max_new_tokens)
        draw = self.sampler(random.Random(0))
        n = len(self.lengths) if self.kind == "empirical" else draws
        if self.kind == "empirical":
            return sum(min(self.max_new_tokens, x) for x in self.lengths) / n
        return sum(draw() for _ in range(n)) / n

    @classmethod
    def from_dict(cls, data: Any) -> "LengthDistribution":
        if isinstance(data, list):  # a bare list: the measured lengths
            data = {"kind": "empirical", "lengths": data, "max_new_tokens": max(data or [1])}
        if not isinstance(data, dict):
            raise UsageError("response_lengths must be an object ({\"kind\": ...}) or a list of lengths")
        _no_unknown("response_lengths", data, cls)
        values = dict(data)
        if "lengths" in values:
            if not isinstance(values["lengths"], list):
                raise UsageError("response_lengths.lengths must be a list of token counts")
            values["lengths"] = tuple(values["lengths"])
            values.setdefault("max_new_tokens", max(values["lengths"] or [1]))
        return cls(**values)


@dataclass(frozen=True)
class CostModel:
    """Costs and workload of one RL setup, per engine replica and per trainer (as measured
    on ``trainer_devices`` devices)."""

    decode_occupancy: tuple[float, ...] = ()
    """Sequences in flight at which decode throughput was measured (ascending)."""
    decode_tokens_per_s: tuple[float, ...] = ()
    """One replica's decode tokens/s (all sequences together) at each occupancy; linear in
    between, flat beyond the last point, proportional to occupancy below the first (a step
    takes as long there as at the first point)."""
    prefill_tokens_per_s: float = 0.0
    """Prompt tokens per second one replica prefills (also the cost of a partial response's
    re-prefill after a weight sync)."""
    update_tokens_per_s: float = 0.0
    """Tokens (prompt + response of every trained sample; padded ones too when
    ``micro_batch_tokens`` is set) per second of one trainer update."""
    sync_s: float = 0.0
    """One weight sync: every engine pauses this long to take the new weights."""
    update_overhead_s: float = 0.0
    """Fixed seconds per trainer update (optimizer step, per-call costs of the log-prob and
    update passes): colocated, the engines are stopped meanwhile."""
    step_overhead_s: float = 0.0
    """Fixed seconds per trainer step before its update (the batch's hand-offs between
    controllers, its assembly): the trainer is busy, the engines are not stopped."""
    reward_s_per_group: float = 0.0
    """Seconds the reward takes per prompt group."""
    response_lengths: LengthDistribution = field(default_factory=LengthDistribution)
    prompt_tokens: int = 64
    n_samples: int = 4
    """Samples per prompt (the group size)."""
    prompts_per_step: int = 8
    """P: prompt groups per trainer step."""
    micro_batch_tokens: int = 0
    """The trainer's micro-batch budget (``optimizer.micro_batch_tokens``): the update is
    charged for the padded tokens it computes, its samples packed as the trainer packs them
    (`padded_tokens`). 0: for the real tokens only."""
    max_seqs_per_replica: int = 256
    """Sequences one replica runs at once (its batch capacity)."""
    trainer_devices: int = 1
    """Devices the update rate was measured on (`plan_for_devices` scales from here)."""
    devices_per_replica: int = 1

    def __post_init__(self) -> None:
        occ, tps = self.decode_occupancy, self.decode_tokens_per_s
        if not occ or len(occ) != len(tps):
            raise UsageError(f"decode_occupancy ({len(occ)} values) and decode_tokens_per_s "
                             f"({len(tps)}) must be two non-empty lists of the same length")
        for i, (o, r) in enumerate(zip(occ, tps)):
            _check_number(f"decode_occupancy[{i}]", o, low=1.0)
            _check_number(f"decode_tokens_per_s[{i}]", r, low=0.0, open_low=True)
        if any(b <= a for a, b in zip(occ, occ[1:])):
            raise UsageError(f"decode_occupancy={list(occ)} must be strictly ascending")
        for name in ("prefill_tokens_per_s", "update_tokens_per_s"):
            _check_number(name, getattr(self, name), low=0.0, open_low=True)
        for name in ("sync_s", "update_overhead_s", "step_overhead_s", "reward_s_per_group"):
            _check_number(name, getattr(self, name), low=0.0)
        _check_int("prompt_tokens", self.prompt_tokens, low=0)
        _check_int("micro_batch_tokens", self.micro_batch_tokens, low=0)
        for name in ("n_samples", "prompts_per_step", "trainer_devices", "devices_per_replica"):
            _check_int(name, getattr(self, name), low=1)
        _check_int("max_seqs_per_replica", self.max_seqs_per_replica, low=self.n_samples)

    def update_tokens(self, seq_lens: Sequence[int]) -> int:
        """The tokens an update over sequences of these lengths is charged for."""
        if not self.micro_batch_tokens:
            return sum(seq_lens)
        return padded_tokens(seq_lens, self.micro_batch_tokens)

    def decode_step_s(self, occupancy: int) -> float:
        """Seconds of one engine step (one token for each of ``occupancy`` sequences)."""
        occ, tps = self.decode_occupancy, self.decode_tokens_per_s
        if occupancy <= occ[0]:
            return occ[0] / tps[0]  # latency-bound: a small batch steps as fast as the first point
        if occupancy >= occ[-1]:
            return occupancy / tps[-1]
        i = bisect.bisect_right(occ, occupancy)
        frac = (occupancy - occ[i - 1]) / (occ[i] - occ[i - 1])
        return occupancy / (tps[i - 1] + frac * (tps[i] - tps[i - 1]))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["decode_occupancy"], out["decode_tokens_per_s"] = list(self.decode_occupancy), \
            list(self.decode_tokens_per_s)
        out["response_lengths"]["lengths"] = list(self.response_lengths.lengths)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "CostModel":
        """From a costs JSON object (`to_dict`'s layout; absent fields take the defaults)."""
        if not isinstance(data, dict):
            raise UsageError("the costs must be a JSON object of CostModel fields")
        _no_unknown("costs", data, cls)
        values = dict(data)
        for name in ("decode_occupancy", "decode_tokens_per_s"):
            if name in values:
                if not isinstance(values[name], list):
                    raise UsageError(f"{name} must be a list of numbers")
                values[name] = tuple(values[name])
        if "response_lengths" in values:
            values["response_lengths"] = LengthDistribution.from_dict(values["response_lengths"])
        return cls(**values)


def _no_unknown(where: str, data: dict, cls) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted(known))}")


def _check_number(name: str, value, low: float, open_low: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (open_low and value == low):
        bound = f"> {low:g}" if open_low else f">= {low:g}"
        raise UsageError(f"{name}={value!r} must be a finite number {bound}; set {name} to one")


def _check_int(name: str, value, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UsageError(f"{name}={value!r} must be an integer >= {low}; set {name} to one")


def costs_with(costs: CostModel, **changes) -> CostModel:
    """``costs`` with some fields changed (validated again)."""
    from dataclasses import replace

    return replace(costs, **changes)


def as_floats(values: Sequence) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def padded_tokens(seq_lens: Sequence[int], budget: int) -> int:
    """Tokens the trainer computes for sequences of these lengths: packed by length into
    micro-batches of at most ``budget`` padded tokens (sequences x longest; a longer sequence
    alone), each padded to its longest, as `mcore_rl.train.micro_batches` packs them. Equal
    lengths waste nothing; a long tail pads its short sequences up to their neighbours."""
    total = rows = longest = 0
    for n in sorted(seq_lens):
        if rows and n * (rows + 1) > budget:
            total += rows * longest
            rows = 0
        rows, longest = rows + 1, n
    return total + rows * longest
