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
  computing every row whole.
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
    args = parser.parse_args(argv)
    size = "quick" if args.quick else "full"
    from mcore_rl.parallel.local_world import SharedWorld

    torch.set_num_threads(args.threads)
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
    out = {"benchmark": "train-engine", "size": size, "machine": machine_info(),
           "model": SIZES[size]["arch"].__dict__ | {}, "batch": SIZES[size]["batch"],
           "moe_model": {k: v for k, v in moe_arch(SIZES[size]["arch"]).__dict__.items()
                         if not k.startswith("_")},
           "group_batch": GROUPS[size],
           "note": "forward_/train_step_tp1 compare against HF transformers; tp2/pp2 against "
                   "our TP1 (2 ranks x 1 thread vs 1 rank x --threads threads); moe_ep1/ep2 "
                   "against HF Qwen3MoeForCausalLM of the moe_model shape; shared_prompts "
                   "against the same TP1 engine computing every row of group_batch whole",
           "results": results}
    out["model"] = {k: v for k, v in out["model"].items() if not k.startswith("_")}
    write_json(args.json, out)
    for name, r in results.items():
        print(f"  {name:18s} ours {r['ours']:10.1f}  baseline {r['baseline']:10.1f} {r['unit']}"
              f"  x{r['speedup']:.2f}")
    print(f"[train-engine] wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
