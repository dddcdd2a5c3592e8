"""Multi-turn rollouts: engine turns and environment turns, alternating, token in and out.

Every live episode's context (prompt, earlier turns, observations) goes back to the engine
as token ids, so nothing is re-tokenised. A turn ends on a stop token id (end-of-sequence or
one of the environment's); the environment answers each finished turn. An episode ends when
the environment says so, when a turn ends with end-of-sequence (``finish_reason`` "stop"),
or at a limit: a turn cut by ``max_new_tokens``, ``max_turns`` engine turns, or
``max_response_tokens`` tokens after the prompt (``finish_reason`` "length"). The first turn
is one ``generate`` call with ``sampling.n`` samples per prompt, exactly as a single-turn
rollout; each later round is one call over all live episodes (one sample each).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from mcore_rl.engines.base import RolloutEngine, Rollouts, RolloutSample, SamplingConfig
from mcore_rl.envs.base import Environment


@dataclass
class Episode:
    """One sampled response in the making."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    env: Environment
    tokens: list[int] = field(default_factory=list)
    """Everything after the prompt: the turns' tokens and the observations."""
    logprobs: list[float] = field(default_factory=list)
    observation: list[int] = field(default_factory=list)
    """1 where the token came from the environment."""
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    finish_reason: str | None = None

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def add_turn(self, sample: RolloutSample) -> None:
        n = len(sample.token_ids)
        self.tokens += sample.token_ids
        self.logprobs += sample.logprobs
        self.observation += [0] * n
        self.versions += sample.token_versions or [sample.weight_version or 0] * n
        self.turns += 1

    def add_observation(self, ids: list[int]) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.observation += [1] * len(ids)
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)

    def to_sample(self) -> RolloutSample:
        return RolloutSample(self.prompt_index, self.sample_index, self.prompt, self.tokens,
                             self.logprobs, self.finish_reason or "length",
                             min(self.versions) if self.versions else None,
                             token_versions=self.versions, observation_mask=self.observation,
                             env_reward=self.reward, turns=self.turns)


def run_episodes(engine: RolloutEngine, prompts: Sequence[Sequence[int]], metas: Sequence[dict],
                 sampling: SamplingConfig, make_env: Callable[[], Environment], *,
                 eos_id: int, max_turns: int, max_response_tokens: int,
                 seeds: Sequence[int] | None = None,
                 turn_seed: Callable[[int, int, int], int] | None = None) -> Rollouts:
    """``sampling.n`` episodes per prompt (prompt-major, as `RolloutEngine.generate`).
    ``sampling.stop_token_ids`` must hold ``eos_id`` and the environment's turn ends;
    ``seeds`` seed the first turn per prompt, ``turn_seed(prompt, sample, turn)`` the later
    ones."""
    first = engine.generate(prompts, sampling, seeds=seeds)
    episodes = []
    for sample in first.samples:
        env = make_env()
        env.reset(metas[sample.prompt_index])
        episode = Episode(sample.prompt_index, sample.sample_index, list(sample.prompt_token_ids), env)
        episodes.append(episode)
        _after_turn(episode, sample, eos_id, max_turns, max_response_tokens)
    turn = 1
    while live := [e for e in episodes if e.finish_reason is None]:
        budget = min(max_response_tokens - len(e.tokens) for e in live)
        step = replace(sampling, n=1, max_new_tokens=max(1, min(sampling.max_new_tokens, budget)))
        turn_seeds = [turn_seed(e.prompt_index, e.sample_index, turn) for e in live] \
            if turn_seed is not None else None
        result = engine.generate([e.context for e in live], step, seeds=turn_seeds)
        for episode, sample in zip(live, result.samples):
            _after_turn(episode, sample, eos_id, max_turns, max_response_tokens)
        turn += 1
    return Rollouts([e.to_sample() for e in episodes])


def _after_turn(episode: Episode, sample: RolloutSample, eos_id: int, max_turns: int,
                max_response_tokens: int) -> None:
    """Record the turn, let the environment answer it, and decide whether the episode goes on."""
    episode.add_turn(sample)
    last = sample.token_ids[-1] if sample.token_ids else None
    if last != eos_id and last not in episode.env.stop_token_ids():  # cut by max_new_tokens
        episode.finish_reason = "length"
        return
    answer = episode.env.step(list(sample.token_ids))
    episode.reward += float(answer.reward)
    if answer.done or last == eos_id:
        episode.finish_reason = "stop"
        return
    if episode.turns >= max_turns or len(episode.tokens) + len(answer.observation) >= max_response_tokens:
        episode.finish_reason = "length"
        return
    episode.add_observation(list(answer.observation))

