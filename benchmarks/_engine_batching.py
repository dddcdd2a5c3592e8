"""The engine side of `mcore-rl bench train --schedule`, in a fresh process: ``python -m
mcore_rl.benchmarks._engine_batching SPEC OUT``.

SPEC (JSON): ``config`` and ``overrides`` (the run's config: prompts, sampling, precision),
``model_dir`` (the HF checkpoint the runs started from),
``prompts`` (how many of the task's training prompts), ``static_prompts`` (prompts per
static batch: a step's), ``capacity`` (sequences the continuous engine keeps in flight),
``occupancies`` and ``decode_tokens`` (the decode-rate curve), optionally ``modes`` (which
of static, continuous, continuous_async and decode to run; all four by default).

One in-process vLLM engine, stepped by this process (the run's precision, model and
sampling: natural lengths, stop at end-of-sequence), then one on vLLM's ``AsyncLLM``,
measure on the same prompts (the samples' seeds differ between the batching modes, the
length distribution does not):

- **static batching**: the prompts in batches of ``static_prompts``, each one blocking
  ``generate`` call that ends with its longest response (what the synchronous schedule's
  engine does every step);
- **continuous batching**: the same prompts, every sample a request of its own, a new one
  admitted whenever a sequence finishes (``capacity`` sequences at most: the engine stays
  full), as vLLM's scheduler admits the asynchronous rollout's samples; ``continuous``
  steps the blocking engine from Python, one engine step per call (the ``fused``
  placement's engine), ``continuous_async`` runs on ``AsyncLLM``, whose own loop steps
  while this process admits and collects (the other placements' engine);
- **decode rate by occupancy**: at each occupancy, that many sequences of exactly
  ``decode_tokens`` tokens stepped together (prefill included: measured apart and taken off);
- **prefill rate**: prompt tokens per second of a one-token generation.

OUT: tokens, seconds and mean occupancy of both batching modes, every response length, the
decode curve and the prefill rate (the planner's calibration: `mcore_rl.plan.CostModel`).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

MODES = ("static", "continuous", "continuous_async", "decode")


def _prompts(cfg, count: int, model_dir: str):
    from mcore_rl.data.prompts import PromptStream, load_prompt_records
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.rl import phases

    tokenizer = load_tokenizer(model_dir)
    stream = PromptStream(load_prompt_records(cfg.data, "train"), cfg.data.seed)
    ids, _, _ = phases.encode_prompts(tokenizer, cfg, stream.take(count))
    seeds = [phases.request_seed(cfg.train.seed, 0, i) for i in range(len(ids))]
    return tokenizer, ids, seeds


def static_batches(engine, ids, seeds, sampling, per_batch: int) -> dict:
    lengths, t0 = [], time.perf_counter()
    for start in range(0, len(ids), per_batch):
        rollouts = engine.generate(ids[start:start + per_batch], sampling,
                                   seeds=seeds[start:start + per_batch])
        lengths += [len(s.token_ids) for s in rollouts.samples]
    return {"tokens": sum(lengths), "seconds": time.perf_counter() - t0, "lengths": lengths}


def continuous(engine, ids, seeds, sampling, capacity: int) -> dict:
    """Every sample its own request (seeded from its prompt's seed and its index), admitted
    the moment a sequence finishes, so that the engine holds ``capacity`` sequences until
    the prompts run out (as vLLM's scheduler admits a group's samples one by one)."""
    from mcore_rl.engines.base import Request

    one = replace(sampling, n=1)
    requests = [Request(f"bench-{i}-{j}", prompt, one, seed + j)
                for i, (prompt, seed) in enumerate(zip(ids, seeds)) for j in range(sampling.n)]
    lengths, occupancy, admitted = [], [], 0
    t0 = time.perf_counter()
    while len(lengths) < len(requests):
        while admitted < len(requests) and engine.sequences_in_flight() < capacity:
            engine.submit(requests[admitted])
            admitted += 1
        occupancy.append(engine.sequences_in_flight())
        for _, samples in engine.step():
            lengths += [len(s.token_ids) for s in samples]
    return {"tokens": sum(lengths), "seconds": time.perf_counter() - t0, "lengths": lengths,
            "mean_occupancy": statistics.mean(occupancy), "capacity": capacity}


def decode_curve(engine, ids, sampling, occupancies: list[int], tokens: int) -> dict:
    """Decode tokens/s at each occupancy (prefill time, measured alone, taken off)."""
    prompt = ids[0]
    fixed = replace(sampling, n=1, min_new_tokens=tokens, max_new_tokens=tokens)
    one = replace(sampling, n=1, min_new_tokens=1, max_new_tokens=1)
    rates = []
    for occ in occupancies:
        t0 = time.perf_counter()
        engine.generate([prompt] * occ, one, seeds=list(range(occ)))
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.generate([prompt] * occ, fixed, seeds=list(range(occ)))
        rates.append(occ * (tokens - 1) / max(1e-6, time.perf_counter() - t0 - prefill))
    t0 = time.perf_counter()
    engine.generate(ids, one, seeds=list(range(len(ids))))
    prefill_rate = sum(len(p) for p in ids) / (time.perf_counter() - t0)
    return {"occupancy": occupancies, "tokens_per_s": rates, "prefill_tokens_per_s": prefill_rate}


def main(spec_path: str, out_path: str) -> None:
    from mcore_rl.config import load_config
    from mcore_rl.engines import build_rollout_engine, sampling_from_config

    spec = json.loads(open(spec_path).read())
    cfg = load_config(spec["config"], spec["overrides"])
    model_dir = spec["model_dir"]
    tokenizer, ids, seeds = _prompts(cfg, spec["prompts"], model_dir)
    sampling = sampling_from_config(cfg.rollout, stop_token_ids=[tokenizer.eos_id])
    positions = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    longest = max(len(p) for p in ids) + cfg.rollout.max_new_tokens
    engine = build_rollout_engine(cfg.rollout, model_dir, dtype=cfg.model.dtype, seed=cfg.train.seed,
                                  max_model_len=min(positions, longest), in_process=True)
    engine.generate(ids[:1], sampling, seeds=seeds[:1])  # warm-up: first-call costs
    modes = spec.get("modes", MODES)
    out = {"prompt_tokens_mean": statistics.mean(len(p) for p in ids)}
    if "static" in modes:
        out["static"] = static_batches(engine, ids, seeds, sampling, spec["static_prompts"])
    if "continuous" in modes:
        out["continuous"] = continuous(engine, ids, seeds, sampling, spec["capacity"])
    if "decode" in modes:
        out["decode"] = decode_curve(engine, ids, sampling, spec["occupancies"], spec["decode_tokens"])
    engine.close()
    if "continuous_async" in modes:
        engine = build_rollout_engine(cfg.rollout, model_dir, dtype=cfg.model.dtype,
                                      seed=cfg.train.seed, max_model_len=min(positions, longest),
                                      frontend="async")
        engine.generate(ids[:1], sampling, seeds=seeds[:1])
        out["continuous_async"] = continuous(engine, ids, seeds, sampling, spec["capacity"])
        engine.close()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
