"""The phases of one RL step. Each is a function ``(state, batch) -> batch`` (or metrics) of
its own, collective over the trainer ranks, with no hidden global state, so the loop can be
re-arranged (e.g. generation of step k+1 beside training of step k) without rewriting them.

Every rank holds the whole rollout batch (the graph's item loop hands it from the trainer's
first rank to the others; validation's greedy rollouts the controller rank broadcasts). Group statistics (GRPO/RLOO) and advantage whitening therefore
see all samples, however the train engine later splits the batch over data-parallel ranks.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

import torch

from mcore_rl.algos import ADVANTAGE_ESTIMATORS, AdvantageInputs, kl_per_token
from mcore_rl.algos.losses import mismatch_metrics
from mcore_rl.algos.objective import FRESH, KEPT, actor_loss_fn, critic_loss_fn
from mcore_rl.data.batch import Batch
from mcore_rl.engines import sampling_from_config
from mcore_rl.errors import MismatchError, NonFiniteError
from mcore_rl.parallel import megatron_cpu_compat
from mcore_rl.train.engine import MAX_SUFFIX


def request_seed(seed: int, step: int, prompt: int, round: int = 0) -> int:
    """Per-request sampling seed derived from (run seed, step, prompt) and, for a step's
    extra generation rounds (dynamic sampling), the round; the engine derives each sample's
    stream from it and the sample index."""
    key = f"{seed}/{step}/{prompt}" + (f"/{round}" if round else "")
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def encode_prompts(tokenizer, cfg, records) -> tuple[list[list[int]], list[dict], int]:
    """Token ids of prompts within the length limit (and how many were filtered out)."""
    ids, metas = [], []
    for r in records:
        tokens = list(r.token_ids) if r.token_ids is not None else \
            tokenizer.encode_prompt(r.prompt, cfg.data.apply_chat_template)
        if len(tokens) <= cfg.rollout.max_prompt_tokens:
            ids.append(tokens)
            metas.append({"prompt": r.prompt, **r.meta})
    if not ids:
        raise RuntimeError(f"every prompt is longer than rollout.max_prompt_tokens="
                           f"{cfg.rollout.max_prompt_tokens}")
    return ids, metas, len(records) - len(ids)


def sample_batch(engine, tokenizer, cfg, encoded, *, step: int, greedy: bool = False,
                 n: int | None = None, round: int = 0) -> Batch:
    """On the process that owns ``engine``: encoded prompts (`encode_prompts`) -> the rollout
    batch: token ids, the engine's log-probs and weight version per sample, the prompts'
    fields (``prompt_meta``) and the responses' text. ``step`` (and ``round``) seed the
    sampling."""
    prompt_ids, metas, filtered = encoded
    sampling = sampling_from_config(cfg.rollout, stop_token_ids=[tokenizer.eos_id])
    if greedy:
        sampling = type(sampling)(n=1, temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens,
                                  stop_token_ids=sampling.stop_token_ids)
    elif n is not None:
        sampling = replace(sampling, n=n)
    if not greedy and cfg.moe.routing_replay == "rollout":
        sampling = replace(sampling, return_routes=True)  # the update replays the engine's experts
    seeds = [request_seed(cfg.train.seed, step, i, round) for i in range(len(prompt_ids))]
    if cfg.environment.name:
        rollouts = episodes(engine, tokenizer, cfg, prompt_ids, metas, sampling, seeds, step, round)
    else:
        rollouts = engine.generate(prompt_ids, sampling, seeds=seeds)
    batch = rollouts.to_batch(pad_id=tokenizer.pad_id)
    batch.meta["prompt_meta"] = [metas[s.prompt_index] for s in rollouts.samples]
    batch.meta["response_text"] = [tokenizer.decode(s.token_ids) for s in rollouts.samples]
    batch.info["filtered_prompts"] = filtered
    return batch


def context_length(cfg) -> int:
    """Tokens of prompt and response the engine must hold: the prompt and one response, or,
    in multi-turn episodes, all of an episode's turns and observations."""
    r = cfg.rollout
    return r.max_prompt_tokens + (cfg.environment.max_response_tokens if cfg.environment.name
                                  else r.max_new_tokens)


def episodes(engine, tokenizer, cfg, prompt_ids, metas, sampling, seeds, step: int, round: int):
    """Multi-turn rollouts with ``environment.name`` (`mcore_rl.envs.episodes`): a turn also
    ends on the environment's stop tokens; later turns are seeded by (step, prompt, sample,
    turn)."""
    from mcore_rl.envs import ENVIRONMENTS
    from mcore_rl.envs.episodes import run_episodes

    env_cls, env = ENVIRONMENTS.get(cfg.environment.name), cfg.environment
    stops = tuple(env_cls(tokenizer).stop_token_ids())
    sampling = replace(sampling, stop_token_ids=(*sampling.stop_token_ids, *stops))
    return run_episodes(
        engine, prompt_ids, metas, sampling, lambda: env_cls(tokenizer), eos_id=tokenizer.eos_id,
        max_turns=env.max_turns, max_response_tokens=env.max_response_tokens, seeds=seeds,
        turn_seed=lambda p, s, t: request_seed(cfg.train.seed, step, f"{p}.{s}.{t}", round))


def mark_truncated(cfg, batch: Batch) -> Batch:
    """``truncated`` per sample (stopped by the length limit); masked out of the loss with
    ``rollout.truncated_response=mask``."""
    truncated = torch.tensor([r == "length" for r in batch.meta["finish_reason"]])
    batch = batch.with_tensors(truncated=truncated)
    if cfg.rollout.truncated_response == "mask":
        batch = batch.with_tensors(response_mask=batch["response_mask"] * (~truncated).long()[:, None])
    return batch


def generate(state, records, *, greedy: bool = False, n: int | None = None,
             step: int | None = None, round: int = 0) -> Batch:
    """Prompts -> rollouts (``n`` per prompt, default ``rollout.n_samples_per_prompt``; one
    greedy sample each for validation), generated by the controller's engine (``state.rollout``:
    the first rollout role's) and shared with every rank.
    ``step`` (default the run's) and ``round`` (a step's extra rounds) seed the sampling."""
    step = state.step if step is None else step
    encoded = encode_prompts(state.tokenizer, state.cfg, records)  # every rank: same checks
    batch = None
    if state.is_controller:
        with megatron_cpu_compat.suspended():  # an engine in this process is not Megatron
            batch = sample_batch(state.rollout, state.tokenizer, state.cfg, encoded, step=step,
                                 greedy=greedy, n=n, round=round)
    return mark_truncated(state.cfg, state.ctx.broadcast_object(batch))


def score(state, batch: Batch) -> Batch:
    """Rewards on the controller (``state.reward``, a `RewardScorer`), shared with their
    metrics (``reward/*`` in ``batch.info``); the score sits on the last response token."""
    scored = None
    if state.is_controller:
        scored = score_rollouts(state.reward, batch)
    scores, metrics = state.ctx.broadcast_object(scored)
    batch = with_scores(state, batch, scores)
    batch.info.update(metrics)
    return batch


def score_rollouts(scorer, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    """A `RewardScorer`'s scores of the batch's responses and its metrics; in multi-turn
    episodes plus the environment's rewards (``reward/environment_mean``)."""
    prompts = [m["prompt"] for m in batch.meta["prompt_meta"]]
    scores, metrics = scorer.score(prompts, batch.meta["response_text"], batch.meta["prompt_meta"])
    if "env_reward" in batch.meta:
        env = torch.tensor(batch.meta["env_reward"], dtype=scores.dtype)
        scores = scores + env
        metrics = {**metrics, "reward/environment_mean": float(env.mean())}
    return scores, metrics


def with_scores(state, batch: Batch, scores: torch.Tensor) -> Batch:
    """One score per sample (the same on every rank) as ``scores`` and as the reward on
    its last response token (the engine's, not an observation's);
    ``rollout.truncated_response=penalize`` replaces the scores
    of truncated responses."""
    if state.cfg.rollout.truncated_response == "penalize":
        scores = torch.where(batch["truncated"], torch.tensor(state.cfg.reward.truncation_penalty),
                             scores)
    rewards = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    mask = batch["response_mask"]
    # the last token of the response's own (an observation may follow it in an episode)
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    has_response = mask.sum(-1) > 0
    rows = torch.arange(len(batch))[has_response]
    rewards[rows, last[has_response]] = scores[has_response]
    return batch.with_tensors(scores=scores, token_rewards=rewards)


def on_policy(cfg) -> bool:
    """One epoch over one mini-batch: the update starts from the generating weights."""
    return cfg.algorithm.ppo_epochs == 1 and cfg.algorithm.mini_batches == 1


def truncation(cfg) -> dict:
    """The sampling truncation trainer log-probs describe: ``rollout.top_k`` / ``top_p`` (none
    with ``rollout.renormalize_truncated: false``), as `TrainEngine` keyword arguments."""
    r = cfg.rollout
    if not r.renormalize_truncated or not r.temperature or (r.top_k <= 0 and r.top_p >= 1.0):
        return {}  # (greedy rollouts: engines take the argmax, truncating nothing)
    return {"top_k": r.top_k, "top_p": r.top_p}


def with_kept(batch: Batch, out: dict, field: str) -> Batch:
    """``batch`` with ``out``'s kept flags as ``field``, when the log-probs were truncated."""
    return batch.with_tensors(**{field: out[KEPT]}) if KEPT in out else batch


def old_logprobs(state, batch: Batch) -> Batch:
    """The trainer's log-probs under the weights that generated the batch. With
    ``moe.routing_replay: old_logprob`` also the experts each token was routed to
    (``routes``), which every update of the step then replays; with ``rollout`` the batch
    already carries the engine's routes, and this pass and the updates replay those."""
    temperature = state.cfg.rollout.temperature or 1.0
    if on_policy(state.cfg):
        return batch  # filled in by the first (and only) update from its own forward
    record = state.cfg.moe.routing_replay == "old_logprob"
    out = state.actor.forward(batch, temperature=temperature, record_routes=record,
                              **truncation(state.cfg))
    batch = with_kept(batch.with_tensors(old_logprobs=out["logprobs"]), out, "old_kept")
    return batch.with_tensors(routes=out["routes"]) if "routes" in out else batch


def reference_logprobs(state, batch: Batch) -> Batch:
    """The frozen reference's log-probs (``ref_logprobs``), when a KL term is configured.
    Under a sampling truncation they are those of the reference's own truncated distribution,
    and ``ref_kept`` marks the tokens it could have sampled (the KL is taken over those); with
    ``rollout.replay_sampling_mask`` the reference is renormalised over the engine's kept set
    (the policy's), which holds every sampled token."""
    if state.reference is None:
        return batch
    temperature = state.cfg.rollout.temperature or 1.0
    out = state.reference.forward(batch, temperature=temperature, **truncation(state.cfg))
    return with_kept(batch.with_tensors(ref_logprobs=out["logprobs"]), out, "ref_kept")


def rollout_kl(state, batch: Batch) -> torch.Tensor:
    """[B, T] per-token KL(policy || reference) of the rollout batch, 0 off the response."""
    kl = kl_per_token(batch.policy_logprobs, batch["ref_logprobs"],
                      state.cfg.algorithm.kl_estimator) * batch["response_mask"]
    return kl * batch["ref_kept"] if "ref_kept" in batch else kl


def kl_penalty(state, batch: Batch) -> Batch:
    """``algorithm.kl_in_reward``: the KL to the reference as a per-token reward penalty,
    ``token_rewards - kl_coef * KL`` (otherwise the KL is a loss term of the update)."""
    if state.reference is None or not state.cfg.algorithm.kl_in_reward:
        return batch
    penalty = state.kl.coef * rollout_kl(state, batch)
    return batch.with_tensors(token_rewards=batch["token_rewards"] - penalty)


def measured_kl(state, batch: Batch, update_metrics: dict[str, float]) -> float | None:
    """The KL the adaptive coefficient steers by: with the KL in the reward, the mean
    per-token KL of the rollout batch (what was penalised); as a loss term, the update's KL
    term (``actor/kl_loss``, of its last mini-batch). None without a reference."""
    if state.reference is None:
        return None
    if state.cfg.algorithm.kl_in_reward:
        mask = batch["response_mask"].float()
        return (rollout_kl(state, batch).sum() / mask.sum().clamp(min=1)).item()
    return update_metrics["actor/kl_loss"]


def values(state, batch: Batch) -> Batch:
    if state.critic is None:
        return batch
    return batch.with_tensors(old_values=state.critic.forward(batch)["values"])


def advantages(state, batch: Batch) -> Batch:
    """Advantages and returns of the configured estimator (``algorithm.advantage_estimator``)."""
    a = state.cfg.algorithm
    estimator = ADVANTAGE_ESTIMATORS.get(a.advantage_estimator)
    inputs = AdvantageInputs(batch["token_rewards"], batch["response_mask"], batch["group_id"],
                             batch["old_values"] if "old_values" in batch else None)
    adv, returns = estimator(inputs, gamma=a.gamma, lam=a.lam, whiten=a.whiten_advantages)
    return batch.with_tensors(advantages=adv, returns=returns)


def _mini_batches(batch: Batch, n: int, epoch: int, seed: int) -> list[Batch]:
    order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(seed * 131 + epoch))
    return [batch.select(chunk) for chunk in torch.chunk(order, n) if len(chunk)]


def _with_current_as_old(loss):
    """The loss with old log-probs taken from the micro-batch's own forward pass (detached):
    before the first optimizer step of a rollout batch they are the generating policy's,
    and taking them from the same pass makes the importance ratio exactly 1."""

    def fn(outputs, micro):
        return loss(outputs, micro.with_tensors(old_logprobs=outputs["logprobs"].detach()))

    return fn


def update_actor(state, batch: Batch) -> dict[str, float]:
    """PPO epochs over mini-batches. The first mini-batch of a step starts from the weights
    that generated the batch, so its old log-probs come from its own forward pass (ratio
    exactly 1); later ones use the log-probs computed before the update (`old_logprobs`)."""
    a, temperature = state.cfg.algorithm, state.cfg.rollout.temperature or 1.0
    loss = actor_loss_fn(a, state.kl.coef)
    batch = with_fresh_mask(batch, state.weight_version)
    results = []
    for epoch in range(a.ppo_epochs):
        for mb in _mini_batches(batch, a.mini_batches, epoch, state.cfg.train.seed + state.step):
            fn = _with_current_as_old(loss) if not results else loss
            results.append(state.actor.train_batch(mb, fn, temperature=temperature,
                                                   with_entropy=True, **truncation(state.cfg)))
    skipped = skipped_updates(state, "actor", results)
    last = results[-1]
    mismatch = mismatch_metrics(_summed(results[:a.mini_batches], "mismatch_"))
    check_mismatch(state, mismatch)
    return {"actor/loss": sum(r.loss for r in results) / len(results),
            "actor/skipped_updates": skipped,
            "actor/grad_norm": last.grad_norm, "actor/lr": last.lr,
            "actor/first_minibatch_ratio_abs_dev": results[0].metrics["ratio_abs_dev"],
            **{f"actor/{k}": v for k, v in last.metrics.items() if not k.startswith("mismatch_")},
            **mismatch}


def with_fresh_mask(batch: Batch, version: int) -> Batch:
    """The batch with `FRESH`: its response tokens generated by weights ``version`` (the ones
    the update starts from), where trainer and engine log-probs describe the same weights."""
    if "rollout_logprobs" not in batch or "token_versions" not in batch:
        return batch
    fresh = (batch["token_versions"] == version) & batch["response_mask"].bool()
    return batch.with_tensors(**{FRESH: fresh.float()})


def _summed(results: list, prefix: str) -> dict[str, float]:
    """The loss function's sums of metrics named ``prefix...`` over the updates ``results``
    (one pass over the batch): each update reports them divided by its units; maxima
    (`MAX_SUFFIX`) as they are."""
    out: dict[str, float] = {}
    for r in results:
        for k, v in r.metrics.items():
            if not k.startswith(prefix):
                continue
            if k.endswith(MAX_SUFFIX):
                out[k] = max(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v * max(r.units, 1.0)
    return out


def check_mismatch(state, mismatch: dict[str, float]) -> None:
    """``rollout.mismatch_warn``: a warning line; ``rollout.mismatch_stop``: the run ends in
    one line naming the step."""
    error = mismatch.get("rollout/token_mult_prob_error")
    r = state.cfg.rollout
    if error is None:
        return
    what = (f"step {state.step}: rollout/token_mult_prob_error {error:.4f} (the engine's and the "
            f"trainer's probabilities of the sampled tokens differ by a factor of {error:.3f} on "
            f"average; largest log-prob gap {mismatch['rollout/logprob_abs_diff_max']:.3g})")
    if r.mismatch_stop is not None and error > r.mismatch_stop:
        raise MismatchError(f"{what} is above rollout.mismatch_stop={r.mismatch_stop:g}; check "
                            "that engine and trainer run the same dtype and sampling settings, "
                            "or raise the threshold")
    if r.mismatch_warn is not None and error > r.mismatch_warn and state.is_controller:
        print(f"mcore-rl: warning: {what} is above rollout.mismatch_warn={r.mismatch_warn:g}",
              flush=True)


def skipped_updates(state, model: str, results: list) -> float:
    """How many of the updates were skipped for a non-finite loss or gradient (the weights
    stay as they were); with ``train.on_nonfinite: stop``, any of them ends the run."""
    skipped = [r for r in results if not r.applied]
    if skipped and state.cfg.train.on_nonfinite == "stop":
        raise NonFiniteError(
            f"step {state.step}: the {model}'s loss or gradient is not finite (loss "
            f"{skipped[0].loss:.4g}) in {len(skipped)} of {len(results)} updates; none of them was "
            "applied; lower the learning rate, check the data and reward, or set "
            "train.on_nonfinite=skip to skip such updates")
    return float(len(skipped))


def update_critic(state, batch: Batch) -> dict[str, float]:
    if state.critic is None:
        return {}
    a = state.cfg.algorithm
    results = [state.critic.train_batch(mb, critic_loss_fn(a))
               for epoch in range(a.ppo_epochs)
               for mb in _mini_batches(batch, a.mini_batches, epoch, state.cfg.train.seed + state.step)]
    return {"critic/loss": sum(r.loss for r in results) / len(results),
            "critic/skipped_updates": skipped_updates(state, "critic", results),
            "critic/grad_norm": results[-1].grad_norm}


def engine_sleep(state) -> None:
    """Colocated: the engines give the devices to the trainer (free their KV caches and
    offload their weights where they can; on vLLM-CPU they only fence: generation is
    refused until they wake); with ``train.offload`` the trainer's state comes back."""
    if state.colocated:  # the controller rank's engines (none elsewhere)
        state.sync.call_engines(lambda engine: engine.sleep())
    for engine in trainer_engines(state):
        engine.reload()


def trainer_engines(state) -> list:
    """Every model of the trainer's (actor, critic, reference)."""
    models = (getattr(state, name, None) for name in ("actor", "critic", "reference"))
    return [e for e in models if e is not None and hasattr(e, "offloaded")]


def offload_trainer(state) -> None:
    """``train.offload``: the engine's turn on the devices begins; the trainer's parameters,
    gradients and optimizer state go to host memory until `engine_sleep`."""
    if state.cfg.train.offload and getattr(state, "colocated", False):
        for engine in trainer_engines(state):
            engine.offload()


def sync_weights(state) -> dict[str, float]:
    """Stream the new actor weights into the engines, then optionally verify engine
    log-probs. Colocated, each engine's weights wake before the sync writes into them and its
    KV cache after, within the sync's one call per engine (`WeightSync.sync`); beside the
    trainer (``rollout.placement: separate``) the engines never sleep."""
    state.weight_version += 1
    try:
        stats = state.sync.sync(state.weight_version, wake=state.colocated)
    except Exception:
        if state.rollout is not None:
            state.rollout.check_alive("the weight sync")  # a dead engine is the cause to report
        raise
    out = {"sync/seconds": stats.total_s, "sync/transfer_s": stats.transfer_s,
           "sync/apply_s": stats.apply_s, "sync/bytes": float(stats.sent_nbytes)}
    if stats.changed_fraction is not None:
        out["sync/changed_fraction"] = stats.changed_fraction
    if state.cfg.rollout.replicas > 1:  # those the sync reached (controller rank's count)
        out["rollout/replicas_alive"] = float(state.ctx.broadcast_object(len(state.sync.engines)))
    r = state.cfg.reshard
    if r.verify and (state.weight_version - 1) % r.verify_every == 0:
        from mcore_rl.rl.engine_verify import probe_prompts, verify_engine_logprobs

        # every replica the sync reached (other ranks hold none: one pass each all the same)
        engines = list(state.sync.engines) if state.sync.engines else [state.rollout]
        replicas = state.ctx.broadcast_object(len(engines))
        diffs = []
        for i in range(replicas):
            report = verify_engine_logprobs(
                state.actor, engines[i] if state.is_controller else None,
                probe_prompts(state.vocab_size, r.verify_prompts),
                temperature=state.cfg.rollout.temperature, tolerance=verify_tolerance(state.cfg),
                max_new_tokens=r.verify_new_tokens, controller=state.ctx.controller,
                group=state.ctx.world_group)
            diffs.append(report.max_abs_diff)
        out["sync/verify_max_abs_diff"] = max(diffs)
        if replicas > 1:
            out["sync/verified_replicas"] = float(replicas)
    offload_trainer(state)
    return out


def verify_tolerance(cfg) -> float:
    """``reshard.verify_tolerance``, or its default for the model's dtype."""
    if cfg.reshard.verify_tolerance is not None:
        return cfg.reshard.verify_tolerance
    return 0.05 if cfg.model.dtype == "fp32" else 1.0
