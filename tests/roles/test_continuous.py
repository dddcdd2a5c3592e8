"""`ContinuousGenerate` on a vLLM engine of this process: new weights arriving while
responses run. Continued responses keep their tokens so far (stamped with the old version)
and go on exactly as the new weights generate from the prompt plus those tokens (their KV
cache computed again, none of the old weights' cache reused); aborted ones start over under
the new weights. The oracle is the engine itself, greedy, after the switch.

The engine is vLLM's ``AsyncLLM`` (pause-and-keep inside the engine, the versions as vLLM
recorded them); one test also runs the blocking engine this role steps itself (the running
requests cut and their rest submitted)."""
from __future__ import annotations

import itertools
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcore_rl.config import load_config

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 40
SWITCH_AFTER = 28
"""Response tokens a running sample has when the new weights arrive: past a full cache block
of prompt and response (`BLOCK`), which vLLM caches, so a continuation could reuse the old
weights' KV."""
BLOCK = 32


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from mcore_rl.data.toy_task import toy_tokenizer
    from mcore_rl.data.tokenizer import load_tokenizer
    from mcore_rl.engines import build_rollout_engine
    from mcore_rl.models.random_init import write_random_model
    from mcore_rl.rl.setup import write_initial_model

    root = tmp_path_factory.mktemp("continuous")
    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"logging.dir={root}", "rollout.engine=vllm", "rollout.temperature=0",
        "rollout.n_samples_per_prompt=1", f"rollout.max_new_tokens={NEW_TOKENS}",
        "rollout.placement=separate", "model.max_position_embeddings=64"])
    model_dir = write_initial_model(cfg)
    tok = toy_tokenizer()
    other = write_random_model(cfg.model, root / "other", tok.vocab_size, tok.bos_id, tok.eos_id,
                               tok.pad_id, seed=1)
    engine = build_rollout_engine(cfg.rollout, model_dir, dtype=cfg.model.dtype, seed=0,
                                  block_size=BLOCK)
    engine.stream_interval = 1  # every token reported: the switches come where they are asked
    made = SimpleNamespace(cfg=cfg, model_dir=model_dir, other=other, engine=engine,
                           tokenizer=load_tokenizer(model_dir))
    yield made
    engine.close()
    if hasattr(made, "stepped"):
        made.stepped.close()


@pytest.fixture(params=["async", "llm"])
def frontend_parts(request, parts):
    """``parts`` with the engine of that frontend (the blocking one started on first use)."""
    from mcore_rl.engines import build_rollout_engine

    if request.param == "async":
        return parts
    if not hasattr(parts, "stepped"):
        parts.stepped = build_rollout_engine(parts.cfg.rollout, parts.model_dir,
                                             dtype=parts.cfg.model.dtype, seed=0,
                                             block_size=BLOCK, frontend="llm")
    return SimpleNamespace(**{**vars(parts), "engine": parts.stepped})


def _rollout(parts, monkeypatch, mode: str, samples: int = 1, switches=(SWITCH_AFTER,),
             min_new_tokens: int = 0):
    """Four prompt groups of ``samples`` samples through the role, the other weights (and
    back, and so on) loaded once a running sample has reported each of ``switches`` tokens
    (vLLM's AsyncLLM generates on meanwhile: the cut comes a few tokens later); per group: prompt ids,
    response ids, their versions (of its first sample); the role's counts; every sample's
    response ids and versions. Greedy for one sample, sampled (temperature 1) for more."""
    from mcore_rl.roles.continuous import ContinuousGenerate
    from mcore_rl.roles.graph import group_items
    from mcore_rl.flow.entries import unpack

    engine = parts.engine
    engine.load_weights_from_dir(str(parts.model_dir), version=0)  # and an empty prefix cache
    cfg = replace(parts.cfg, rollout=replace(parts.cfg.rollout, partial_rollout=mode,
                                             n_samples_per_prompt=samples,
                                             min_new_tokens=min_new_tokens,
                                             temperature=0.0 if samples == 1 else 1.0))
    real_step, pending = engine.step, list(switches)

    def step():
        finished = real_step()
        longest = max(engine.running_lengths(), default=0)
        if pending and longest >= pending[0]:  # a weight sync between two engine steps
            version = len(switches) - len(pending) + 1
            pending.pop(0)
            weights = parts.other if version % 2 else parts.model_dir
            engine.load_weights_from_dir(str(weights), version=version)
        return finished

    monkeypatch.setattr(engine, "step", step)
    role = ContinuousGenerate.around(SimpleNamespace(engine=engine, lock=threading.RLock(), cfg=cfg,
                                                    tokenizer=parts.tokenizer))
    groups, every = [], []
    counts = {"partial_continued": 0.0, "partial_restarted": 0.0}
    batches = [b for entry in role(itertools.islice(group_items(cfg, 0, 0), 4))
               for b in unpack(entry)]
    for batch in batches:
        for row in range(len(batch)):
            mask = batch["response_mask"][row].bool()
            every.append((batch["input_ids"][row][mask].tolist(),
                          batch["token_versions"][row][mask].tolist()))
        ids, mask = batch["input_ids"][0], batch["response_mask"][0].bool()
        prompt_len = int(mask.nonzero()[0])
        groups.append((ids[:prompt_len][batch["attention_mask"][0][:prompt_len].bool()].tolist(),
                       ids[mask].tolist(), batch["token_versions"][0][mask].tolist()))
        for name in counts:
            counts[name] += sum(batch.meta[name])
    monkeypatch.undo()
    engine.reset_prefix_cache()  # the oracle starts from an empty cache
    return groups, counts, every


def _rollout_cut(parts, monkeypatch, mode: str, cut, switches=(SWITCH_AFTER,), tries: int = 3):
    """`_rollout` until ``cut(groups, counts)`` says the switch met the responses where the
    test needs them (AsyncLLM generates on while the role reads its reports: on a busy
    machine every response may have finished before the switch lands); at most ``tries``."""
    for _ in range(tries):
        groups, counts, every = _rollout(parts, monkeypatch, mode, switches=switches)
        if cut(groups, counts):
            return groups, counts, every
    raise AssertionError(f"no try of {tries} met a running response: {counts}, versions "
                         f"{[g[2] for g in groups]}")


def _greedy(engine, prompt, new_tokens):
    from mcore_rl.engines import SamplingConfig

    (sample,) = engine.generate([prompt], SamplingConfig(n=1, temperature=0.0, max_new_tokens=new_tokens))
    return sample.token_ids


def test_continued_responses_go_on_as_the_new_weights_generate_after_their_old_tokens(frontend_parts,
                                                                                    monkeypatch):
    parts = frontend_parts
    groups, counts, _ = _rollout_cut(parts, monkeypatch, "continue", lambda groups, _: any(
        0 in g and 1 in g and len(p) + g.count(0) >= BLOCK for p, _, g in groups))
    assert parts.engine.keeps_requests == (parts.engine.frontend == "async")
    assert len(groups) == 4
    cut = [g for g in groups if 0 in g[2] and 1 in g[2]]
    assert counts["partial_continued"] == len(cut) and counts["partial_restarted"] == 0
    for prompt, response, versions in groups:
        old = versions.count(0)
        assert versions == [0] * old + [1] * (len(response) - old)
        if old < len(response):  # the rest: the new weights from the prompt and the old tokens
            assert response[old:] == _greedy(parts.engine, prompt + response[:old], NEW_TOKENS - old)


def test_aborted_responses_start_over_under_the_new_weights(parts, monkeypatch):
    """The new weights come early (no cached block is at stake here)."""
    groups, counts, _ = _rollout_cut(parts, monkeypatch, "abort", switches=(4,),
                                     cut=lambda _, counts: counts["partial_restarted"] > 0)
    restarted = [g for g in groups if set(g[2]) == {1}]
    assert counts["partial_restarted"] == len(restarted)
    assert counts["partial_continued"] == 0
    for prompt, response, versions in restarted:
        assert response == _greedy(parts.engine, prompt, NEW_TOKENS)


def test_every_sample_of_a_group_cut_by_two_syncs_is_continued_once_per_sync(parts, monkeypatch):
    """Groups of 4 samples, new weights twice mid-generation: the group's request is cut
    into 4 continuations, which the second sync cuts again. Each unfinished sample goes on
    once per sync (no slot resubmitted twice: no response grows past its token limit), and
    its tokens' versions only rise."""
    groups, counts, every = _rollout(parts, monkeypatch, "continue", samples=4, switches=(8, 16))
    assert len(groups) == 4 and len(every) == 16
    assert all(len(response) <= NEW_TOKENS for response, _ in every), \
        sorted(len(r) for r, _ in every)
    assert all(versions == sorted(versions) for _, versions in every)
    cuts = sum(len(set(versions)) - 1 for _, versions in every)
    assert cuts > 0 and counts["partial_continued"] >= cuts
    assert counts["partial_continued"] <= 2 * 16  # at most once per sample and sync


def test_a_continued_response_keeps_its_minimum_length_counted_from_its_first_token(parts,
                                                                                    monkeypatch):
    """``rollout.min_new_tokens`` counts the whole response: a continuation asks only for
    what its slot still lacks (asking the full minimum of its shorter remainder is refused
    by the engine, and would lengthen the response past the limit)."""
    groups, counts, every = _rollout(parts, monkeypatch, "continue", samples=4, switches=(3,),
                                     min_new_tokens=NEW_TOKENS)
    assert counts["partial_continued"] > 0
    assert [len(response) for response, _ in every] == [NEW_TOKENS] * 16
