"""`mcore-rl bench train-engine`: tokens/s of the Megatron train engine vs HF transformers.

In one run, on the same random batch and model shape (Llama-style, fp32):
- TP1 (this process, a world of one): `TrainEngine.forward` (per-token log-probs) and one
  `train_batch` (forward + backward + Adam), against HF ``LlamaForCausalLM`` computing
  the same log-probs with ``log_softmax(logits).gather`` and the same Adam step;
- TP2 and PP2 on two local ranks (one thread each), reported next to the TP1 figure;
- a mixture-of-experts model of the same width (Qwen3-MoE-shaped: QK norm, 8 experts,
  top-2, every layer MoE) at EP1 (one rank) and EP2 (two ranks x one thread, each holding
  half the experts), both against HF ``Qwen3MoeForCausalLM`` of the same shape;
- shared prompts (`mcore_rl.train.shared_prompts`) at TP1 on a GRPO-shaped batch (groups
  of samples of one prompt, prompts longer than responses), against the same engine
  computing every row whole;
- ``packed_vs_padded``: padding-free packing (`mcore_rl.train.packing`, ``train.packing``)
  at TP1 against today's length-sorted padded micro-batches, on SmolLM2's shape (random
  weights) and a long-tailed batch: responses log-normal with the median and p90 of
  SmolLM2's natural responses in ``mcore-rl bench train`` (137 and 256 tokens), capped at
  256. Beside the speedup: ``padded_to_real``, the padded micro-batches' positions over the
  real tokens (what packing can save at most), and ``share_of_allowed``, (speedup - 1) /
  (padded_to_real - 1).
Both single-rank sides use the same number of threads. Tokens are the real (non-padding)
tokens.
"""
from __future__ import annotations

import argparse
import sys

import torch

from mcore_rl.benchmarks._common import (best_time, machine_info, throughput_comparison,
                                         write_json)
from mcore_rl.models import ModelArch

SIZES = {
    "full": dict(arch=ModelArch(vocab_size=8000, hidden_size=256, intermediate_size=688,
                                num_layers=4, num_attention_heads=8, num_kv_heads=4),
                 batch=8, min_len=160, max_len=256, repeats=3),
    "quick": dict(arch=ModelArch(vocab_size=500, hidden_size=64, intermediate_size=128,
                                 num_layers=2, num_attention_heads=4, num_kv_heads=2),
                  batch=4, min_len=8, max_len=24, repeats=1),
}


GROUPS = {"full": dict(prompts=8, samples=8, prompt_len=(96, 160), response_len=(8, 64)),
          "quick": dict(prompts=2, samples=4, prompt_len=(12, 16), response_len=(2, 6))}
"""The GRPO-shaped batch of each size: prompts x samples, lengths drawn in these ranges."""


SMOLLM2 = ModelArch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_attention_heads=9, num_kv_heads=3, tie_word_embeddings=True)
"""SmolLM2-135M's shape."""

PACKING = {"full": dict(arch=SMOLLM2, sequences=32, prompt_len=(30, 80), response_p50=137,
                        response_p90=256, response_max=256, micro_batch_tokens=2048, repeats=3),
           "quick": dict(arch=SIZES["quick"]["arch"], sequences=8, prompt_len=(4, 8),
                         response_p50=6, response_p90=12, response_max=12,
                         micro_batch_tokens=48, repeats=1)}
"""The long-tailed batch of the packing row per size (the full one: the update of
``mcore-rl bench train``'s SmolLM2 size, 32 sequences in micro-batches of 2048 tokens)."""


def make_long_tail_batch(arch: ModelArch, sequences: int, prompt_len: tuple[int, int],
                         response_p50: int, response_p90: int, response_max: int, **_):
    """Random prompts and responses whose lengths are log-normal with that median and p90
    (before the cap at ``response_max``)."""
    import math

    from mcore_rl.data.batch import Batch

    g = torch.Generator().manual_seed(2)
    sigma = math.log(response_p90 / response_p50) / 1.2816  # the normal's 90th percentile
    resp = torch.exp(torch.randn(sequences, generator=g) * sigma + math.log(response_p50))
    resp = resp.round().clamp(1, response_max).long().tolist()
    prompts = torch.randint(prompt_len[0], prompt_len[1] + 1, (sequences,), generator=g).tolist()
    seqs = [torch.randint(0, arch.vocab_size, (p + r,), generator=g).tolist()
            for p, r in zip(prompts, resp)]
    return Batch.from_sequences(seqs, prompt_lens=prompts)


def padded_to_real(batch, budget: int) -> float:
    """Positions the length-sorted padded micro-batches compute over the batch's real tokens."""
    from mcore_rl.train.micro_batches import pack_micro_batches

    lens = batch.seq_lens
    plan = pack_micro_batches(lens, list(range(len(batch))), budget)
    return sum(len(mb) * max(int(lens[i]) for i in mb) for mb in plan) / int(lens.sum())


def _packing_rates(rank, world_size, size):
    """Forward and train-step tokens/s at TP1 on the long-tailed batch, padded and packed:
    two engines from the same initial weights, timed in turns (padded, packed, padded, ...)
    so that drift in the machine's speed falls on both sides alike. Medians over
    ``repeats`` turns after one untimed turn. ``((fwd, step) padded, (fwd, step) packed)``."""
    import statistics
    import time

    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    spec = PACKING[size]
    ctx = initialize_parallel(seed=1)
    optim = OptimizerConfig(lr=1e-5, micro_batch_tokens=spec["micro_batch_tokens"])
    engines = [build_engine(build_gpt_chunks(spec["arch"], ctx), ctx,
                            vocab_size=spec["arch"].vocab_size, optim=optim, packing=packing)
               for packing in (False, True)]
    batch = make_long_tail_batch(**spec)
    tokens = int(batch.seq_lens.sum())
    times = [([], []) for _ in engines]  # per engine: forward, train step
    for turn in range(spec["repeats"] + 1):
        for engine, (fwd, step) in zip(engines, times):
            t0 = time.perf_counter()
            engine.forward(batch)
            t1 = time.perf_counter()
            engine.train_batch(batch, loss_fn)
            t2 = time.perf_counter()
            if turn:  # the first turn warms up
                fwd.append(t1 - t0)
                step.append(t2 - t1)
    destroy_parallel()
    return tuple(tuple(tokens / statistics.median(t) for t in pair) for pair in times)


def moe_arch(dense: ModelArch) -> ModelArch:
    """The mixture-of-experts model of a size: the dense shape, QK norm, 8 experts, top-2,
    each expert a quarter of the dense FFN."""
    from dataclasses import replace

    return replace(dense, qk_norm=True, num_experts=8, experts_per_token=2,
                   moe_intermediate_size=dense.intermediate_size // 4, norm_topk_prob=True,
                   expert_naming="qwen3_moe")


def make_batch(arch: ModelArch, n: int, min_len: int, max_len: int):
    from mcore_rl.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    seqs = [torch.randint(0, arch.vocab_size, (k,), generator=g).tolist() for k in lens]
    return Batch.from_sequences(seqs, prompt_lens=[min_len // 2] * n)


def make_group_batch(arch: ModelArch, prompts: int, samples: int, prompt_len: tuple[int, int],
                     response_len: tuple[int, int]):
    """``prompts`` random prompts with ``samples`` random responses each (``group_id``)."""
    from mcore_rl.data.batch import Batch

    g = torch.Generator().manual_seed(1)
    seqs, prompt_lens, groups = [], [], []
    for group in range(prompts):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        prompt = torch.randint(0, arch.vocab_size, (p,), generator=g).tolist()
        for _ in range(samples):
            r = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g))
            seqs.append(prompt + torch.randint(0, arch.vocab_size, (r,), generator=g).tolist())
            prompt_lens.append(p)
            groups.append(group)
    batch = Batch.from_sequences(seqs, prompt_lens=prompt_lens)
    return batch.with_tensors(group_id=torch.tensor(groups))


def loss_fn(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


def _engine_rates(rank, world_size, size, tp, pp, ep=0):
    """Forward and train-step tokens/s of the engine at (tp, pp); ``ep`` > 0: the MoE model
    at that expert parallelism."""
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    spec = SIZES[size]
    arch = moe_arch(spec["arch"]) if ep else spec["arch"]
    ctx = initialize_parallel(tp=tp, pp=pp, ep=max(ep, 1))
    budget = spec["max_len"] * spec["batch"] // 2  # two or more micro-batches
    engine = build_engine(build_gpt_chunks(arch, ctx), ctx, vocab_size=arch.vocab_size,
                          optim=OptimizerConfig(lr=1e-5, micro_batch_tokens=budget))
    batch = make_batch(arch, spec["batch"], spec["min_len"], spec["max_len"])
    rates = _timed_rates(engine, batch, spec["repeats"])
    destroy_parallel()
    return rates


def _timed_rates(engine, batch, repeats: int) -> tuple[float, float]:
    """Real tokens/s of ``engine``'s forward and of one train step over ``batch``."""
    tokens = int(batch.seq_lens.sum())
    fwd = best_time(lambda: engine.forward(batch), repeats)
    step = best_time(lambda: engine.train_batch(batch, loss_fn), repeats)
    return tokens / fwd, tokens / step


def _shared_prompt_rates(rank, world_size, size, share: bool):
    """Forward and train-step tokens/s at TP1 on the GRPO-shaped batch, prompts shared or
    every row whole."""
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    spec = SIZES[size]
    ctx = initialize_parallel(seed=1)
    engine = build_engine(build_gpt_chunks(spec["arch"], ctx), ctx, vocab_size=spec["arch"].vocab_size,
                          optim=OptimizerConfig(lr=1e-5), share_prompts=share)
    if engine.shares_prompts != share:
        raise RuntimeError("the engine does not share prompts on this model")
    rates = _timed_rates(engine, make_group_batch(spec["arch"], **GROUPS[size]), spec["repeats"])
    destroy_parallel()
    return rates


def _hf_rates(size: str, moe: bool = False) -> tuple[float, float]:
    import transformers as tf

    spec = SIZES[size]
    a = spec["arch"]
    common = dict(
        vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_kv_heads, max_position_embeddings=a.max_position_embeddings,
        head_dim=a.hidden_size // a.num_attention_heads, tie_word_embeddings=False)
    if moe:
        m = moe_arch(a)
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, num_experts=m.num_experts, num_experts_per_tok=m.experts_per_token,
            moe_intermediate_size=m.moe_intermediate_size, norm_topk_prob=True))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    batch = make_batch(a, spec["batch"], spec["min_len"], spec["max_len"])
    ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"].float()
    tokens = int(batch.seq_lens.sum())

    def logprobs():
        logits = model(input_ids=ids, attention_mask=attn).logits
        return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]

    def forward():
        with torch.no_grad():
            logprobs()

    def train_step():
        opt.zero_grad()
        loss = -(logprobs() * resp[:, 1:]).sum() / resp.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return tokens / best_time(forward, spec["repeats"]), tokens / best_time(train_step, spec["repeats"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-rl bench train-engine", description=__doc__)
    parser.add_argument("--json", required=True, help="output JSON path")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (for tests)")
    parser.add_argument("--threads", type=int, default=2, help="threads of the TP1/HF runs")
    parser.add_argument("--only", choices=["packing"],
                        help="only this row (packing: packed_vs_padded)")
    args = parser.parse_args(argv)
    size = "quick" if args.quick else "full"
    from mcore_rl.parallel.local_world import SharedWorld

    torch.set_num_threads(args.threads)
    if args.only == "packing":
        results = _packing_results(size, args.threads)
        out = {"benchmark": "train-engine", "size": size, "machine": machine_info(),
               "packing_batch": {k: v for k, v in PACKING[size].items() if k != "arch"},
               "results": results}
        return _report(args.json, out, results)
    print(f"[train-engine] HF transformers baseline ({size})", flush=True)
    hf_fwd, hf_step = _hf_rates(size)
    print("[train-engine] mcore-rl TP1", flush=True)
    with SharedWorld(1, threads_per_rank=args.threads) as world:
        (tp1_fwd, tp1_step), = world.run(_engine_rates, size, 1, 1)
        print("[train-engine] mcore-rl TP1, shared prompts against whole rows", flush=True)
        (whole_fwd, whole_step), = world.run(_shared_prompt_rates, size, False)
        (shared_fwd, shared_step), = world.run(_shared_prompt_rates, size, True)
    results = {
        "forward_tp1": throughput_comparison(tp1_fwd, hf_fwd, "tokens/s"),
        "train_step_tp1": throughput_comparison(tp1_step, hf_step, "tokens/s"),
        "forward_shared_prompts": throughput_comparison(shared_fwd, whole_fwd, "tokens/s"),
        "train_step_shared_prompts": throughput_comparison(shared_step, whole_step, "tokens/s"),
    }
    with SharedWorld(2, threads_per_rank=1) as world:
        for name, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2)}.items():
            print(f"[train-engine] mcore-rl {name.upper()} (2 ranks x 1 thread)", flush=True)
            fwd, step = world.run(_engine_rates, size, tp, pp)[0]
            results[f"forward_{name}"] = throughput_comparison(fwd, tp1_fwd, "tokens/s")
            results[f"train_step_{name}"] = throughput_comparison(step, tp1_step, "tokens/s")
    print(f"[train-engine] HF transformers mixture-of-experts baseline ({size})", flush=True)
    moe_fwd, moe_step = _hf_rates(size, moe=True)
    for name, ranks in {"moe_ep1": 1, "moe_ep2": 2}.items():
        print(f"[train-engine] mcore-rl {name.upper()}", flush=True)
        with SharedWorld(ranks, threads_per_rank=args.threads if ranks == 1 else 1) as world:
            fwd, step = world.run(_engine_rates, size, 1, 1, ranks)[0]
        results[f"forward_{name}"] = throughput_comparison(fwd, moe_fwd, "tokens/s")
        results[f"train_step_{name}"] = throughput_comparison(step, moe_step, "tokens/s")
    results |= _packing_results(size, args.threads)
    out = {"benchmark": "train-engine", "size": size, "machine": machine_info(),
           "model": SIZES[size]["arch"].__dict__ | {}, "batch": SIZES[size]["batch"],
           "moe_model": {k: v for k, v in moe_arch(SIZES[size]["arch"]).__dict__.items()
                         if not k.startswith("_")},
           "group_batch": GROUPS[size],
           "packing_batch": {k: v for k, v in PACKING[size].items() if k != "arch"},
           "note": "forward_/train_step_tp1 compare against HF transformers; tp2/pp2 against "
                   "our TP1 (2 ranks x 1 thread vs 1 rank x --threads threads); moe_ep1/ep2 "
                   "against HF Qwen3MoeForCausalLM of the moe_model shape; shared_prompts "
                   "against the same TP1 engine computing every row of group_batch whole; "
                   "packed_vs_padded: packed micro-batches against padded ones on "
                   "packing_batch (SmolLM2's shape in the full size)",
           "results": results}
    out["model"] = {k: v for k, v in out["model"].items() if not k.startswith("_")}
    return _report(args.json, out, results)


def _packing_results(size: str, threads: int) -> dict:
    from mcore_rl.parallel.local_world import SharedWorld

    spec = PACKING[size]
    ratio = padded_to_real(make_long_tail_batch(**spec), spec["micro_batch_tokens"])
    results = {}
    with SharedWorld(1, threads_per_rank=threads) as world:
        print("[train-engine] mcore-rl TP1, padded and packed micro-batches in turns "
              "(long-tailed batch)", flush=True)
        padded, packed = world.run(_packing_rates, size, timeout_s=3600)[0]
    for phase, ours, base in zip(("forward", "train_step"), packed, padded):
        row = throughput_comparison(ours, base, "tokens/s")
        row["padded_to_real"] = ratio
        row["share_of_allowed"] = (row["speedup"] - 1) / (ratio - 1) if ratio > 1 else None
        results[f"{phase}_packed_vs_padded"] = row
    return results


def _report(path: str, out: dict, results: dict) -> int:
    write_json(path, out)
    for name, r in results.items():
        extra = (f"  (padded/real {r['padded_to_real']:.3f})" if "padded_to_real" in r else "")
        print(f"  {name:28s} ours {r['ours']:10.1f}  baseline {r['baseline']:10.1f} {r['unit']}"
              f"  x{r['speedup']:.2f}{extra}")
    print(f"[train-engine] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
