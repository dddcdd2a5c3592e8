"""Routing replay: the experts a forward pass recorded are exactly those a later training
pass routes to, whatever its micro-batches; replaying the experts the engine chose closes
the bf16 log-prob gap that routing flips open between engine and trainer; the reference
model of the same process routes by itself.

Tiny Qwen3-MoE-shaped models (8 experts, top-2), one rank.
"""
import pytest
import torch

from tests.train.test_moe_layouts import ARCH
from tests.train.test_engine_layouts import VOCAB
from tests.world import shared_world


def _batch(n: int, seed: int):
    from mcore_rl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 30, (n,), generator=g).tolist()
    seqs = [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]
    return Batch.from_sequences(seqs, prompt_lens=[2] * n)


def _engine(ctx, dtype="fp32", replay=True, tokens=64, seed=5):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.models.moe import MoeOptions
    from mcore_rl.train.build import build_engine

    torch.manual_seed(seed)
    chunks = build_gpt_chunks(ARCH, ctx, dtype, moe=MoeOptions(routing_replay=replay))
    optim = OptimizerConfig(name="sgd", lr=0.0, clip_grad=0.0, micro_batch_tokens=tokens)
    return build_engine(chunks, ctx, vocab_size=VOCAB, optim=optim)


def _routed(engine):
    """Hooks that collect, per router call, the experts each token went to [tokens, k]."""
    from mcore_rl.train.routing_replay import routers_of

    seen = []

    def hook(module, args, output):
        _, routing_map = output
        seen.append((module, routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], -1)))

    handles = [r.register_forward_hook(hook) for c in engine.model for r in routers_of(c)]
    return seen, handles


def _shifted_routes_are_replayed(rank, world_size):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.routing_replay import ROUTES, routers_of

    ctx = initialize_parallel(seed=3)
    engine = _engine(ctx)
    batch = _batch(12, seed=1)
    routes = engine.forward(batch, record_routes=True)[ROUTES]
    assert routes.shape == (12, batch.num_tokens, ARCH.num_layers, 2)
    real = batch["attention_mask"].bool()
    assert routes[real].min() >= 1 and routes[~real].eq(0).all()  # recorded where tokens are
    # Replay other experts than the router's own choice (each shifted by one), in other
    # micro-batches: training must route every real token to exactly those.
    shifted = torch.where(routes > 0, routes % 8 + 1, routes).to(torch.int16)
    engine.micro_batch_tokens = 40
    seen, handles = _routed(engine)
    engine.train_batch(batch.with_tensors(routes=shifted), lambda o, mb: (o["logprobs"].sum() * 0, 1, {}))
    for h in handles:
        h.remove()
    routers = [r for c in engine.model for r in routers_of(c)]
    plan = engine._plan(batch)
    calls = iter(seen)
    for idx in plan:  # one call per router per micro-batch, in micro-batch order
        mb = batch.select(idx).trimmed()
        for layer, router in enumerate(routers):
            module, experts = next(calls)
            assert module is router
            s, b = mb.num_tokens, len(mb)
            experts = experts.reshape(s, b, 2).transpose(0, 1)  # [b, s, k]
            want = shifted[idx][:, :s, layer].long() - 1
            mask = mb["attention_mask"].bool()
            assert torch.equal(experts[mask].sort(-1).values, want[mask].sort(-1).values)
    # and after the step the routers choose again by themselves
    again = engine.forward(batch, record_routes=True)[ROUTES]
    assert torch.equal(again, routes)
    destroy_parallel()
    return True


def test_training_routes_every_token_to_exactly_the_replayed_experts():
    assert shared_world(1).run(_shifted_routes_are_replayed) == [True]


def _engine_and_trainer_gaps(rank, world_size, model_dir):
    """Mean |trainer log-prob - engine log-prob| over the response tokens of 64 sampled
    prompts (bf16 on both sides), without and with the engine's routes replayed."""
    from mcore_rl.data.batch import Batch
    from mcore_rl.engines import SamplingConfig
    from mcore_rl.engines.hf_engine import HFEngine
    from mcore_rl.models import build_model
    from mcore_rl.models.moe import MoeOptions
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine
    from mcore_rl.train.routing_replay import ROUTES

    ctx = initialize_parallel(seed=3)
    built = build_model(model_dir, ctx, dtype="bf16", moe=MoeOptions(routing_replay=True))
    trainer = build_engine(built.chunks, ctx, vocab_size=built.spec.arch.vocab_size)
    engine = HFEngine(model_dir, dtype="bf16")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (8,), generator=g).tolist() for _ in range(64)]
    rollouts = engine.generate(prompts, SamplingConfig(max_new_tokens=12, return_routes=True),
                               seeds=list(range(64)))
    batch = rollouts.to_batch()
    mask = batch["response_mask"].float()
    gaps = []
    own_routing = Batch({k: v for k, v in batch.tensors.items() if k != ROUTES}, batch.meta)
    for b in (own_routing, batch):
        lp = trainer.forward(b)["logprobs"]
        gaps.append(float(((lp - b["rollout_logprobs"]).abs() * mask).sum() / mask.sum()))
    sample = rollouts[0]
    shape = (sample.routes.shape, len(sample.prompt_token_ids) + len(sample.token_ids) - 1)
    destroy_parallel()
    return gaps, shape


def _close_router_model(path):
    """A tiny Qwen3-MoE in bf16 whose routers see close scores (router weights scaled down,
    32 experts): near ties, as in trained models with many experts, which the two sides'
    bf16 round-off decides differently."""
    import transformers as tf

    from tests.models.tiny_hf import COMMON

    config = tf.Qwen3MoeConfig(**{**COMMON, "num_hidden_layers": 2}, vocab_size=1001, num_experts=32,
                               num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True,
                               tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(0.02)
    model.to(torch.bfloat16).save_pretrained(path)
    return str(path)


def test_replaying_the_engines_routes_at_least_halves_the_bf16_trainer_engine_logprob_gap(tmp_path):
    model_dir = _close_router_model(tmp_path / "moe")
    (without, with_replay), (routes_shape, positions) = shared_world(1).run(
        _engine_and_trainer_gaps, model_dir)[0]
    assert routes_shape == (positions, 2, 4)  # every position the engine ran, per layer, top-4
    assert without > 0
    assert with_replay <= 0.5 * without, (with_replay, without)


def _reference_routes_by_itself(rank, world_size):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.routing_replay import ROUTES

    ctx = initialize_parallel(seed=3)
    actor = _engine(ctx)
    reference = _engine(ctx, replay=False)  # same weights (same seed), no replay state
    batch = _batch(8, seed=4)
    routes = actor.forward(batch, record_routes=True)[ROUTES]
    before = reference.forward(batch)["logprobs"]
    bogus = torch.where(routes > 0, routes % 8 + 1, routes).to(torch.int16)
    seen, handles = _routed(actor)
    actor.routing.replay(0, bogus[:, :, :, :])  # the actor's routers hold bogus targets...
    after = reference.forward(batch)["logprobs"]  # ...which the reference never sees
    actor.routing.stop()
    for h in handles:
        h.remove()
    assert not seen and torch.equal(before, after)
    assert reference.routing is None
    destroy_parallel()
    return True


def test_the_reference_model_routes_by_itself_while_the_actor_replays():
    assert shared_world(1).run(_reference_routes_by_itself) == [True]
