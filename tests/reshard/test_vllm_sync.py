"""After an optimizer step, resharded weights make real vLLM generate what HF generates.

Tiny Llama (untied, vocabulary padded 1003 -> 1024), Qwen2 (QKV bias, tied embeddings) and
Qwen3 (per-head QK norm, untied), head_dim 32, fp32. Per model, engine replicas fed by the
same sync (Llama: vLLM at engine TP1; Qwen2: TP1 and TP2; Qwen3: TP2), started once
from the config only (``load_format="dummy"``), from a trainer at TP2 x PP2 on 4 ranks:

1. sync the initial weights; greedy tokens equal HF greedy of the initial checkpoint;
2. one Adam step (large enough to change greedy outputs), sync again;
3. greedy tokens of the *same* prompts, whose prefixes the engine cached before the sync
   (40 tokens, KV blocks of 32), equal HF greedy tokens of the weights exported with
   ``mcore-rl convert mcore-to-hf`` and differ from step 1 (without a prefix-cache reset
   they would not: the cached blocks still hold the old weights' keys and values);
4. ``reshard.verify``: engine log-probs of sequences it sampled at temperature 0.7 equal the
   trainer's on the same sequences within LOGPROB_TOL (fp32 on both sides).
"""
import os
from pathlib import Path

import pytest
import torch

from mcore_rl.wire import WeightSyncError
from tests.models.tiny_hf import load_hf, save_tiny_hf_model
from tests.world import SharedWorld

LAYOUT = (2, 2)
# TP2 x PP2 splits both ways (TP or PP alone is a case of it; every layout's exact tensors
# into an engine: tests/reshard/test_stream_layouts.py); the families differ in their
# tensors (QKV bias, tied embeddings across stages, QK norm).
# per model: (engine TP, placement) of its replicas. Qwen2's two replicas, one separate and one
# colocated, are fed by the same sync; Llama adds its padded vocabulary (1003 -> 1024) at
# engine TP1, Qwen3 its QK norms at engine TP2, whose vocabulary split is odd too. (Qwen2
# last: the tests after the parametrized one use its replicas, already running.)
REPLICAS = {"llama-untied": ((1, "colocated"),),
            "qwen3-untied": ((2, "colocated"),),
            "qwen2-tied": ((1, "separate"), (2, "colocated"))}
PROMPTS = [list(range(3, 43)), list(range(100, 140))]
NEW_TOKENS = 6
LOGPROB_TOL = 1e-4
TRUNCATIONS = ({}, {"top_p": 0.8}, {"top_k": 20})
BUCKET_MB = 0.1
_ENGINES: dict = {}  # in rank 0's process: the running replicas, by model
PID_FILE = f"/tmp/mcore_rl_test_vllm_sync_{os.getpid()}.pids"  # evaluated in the test process


@pytest.fixture(scope="module")
def world():
    import psutil

    with SharedWorld(4) as w:
        yield w
        try:
            w.run(_close_engine)
        finally:  # a failed test may have killed rank 0 before it could stop its engine
            pids = Path(PID_FILE).read_text().split() if Path(PID_FILE).exists() else []
            for pid in map(int, pids):
                if psutil.pid_exists(pid):
                    psutil.Process(pid).kill()
            Path(PID_FILE).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_sync")
    return {v: str(save_tiny_hf_model(v, root / v)) for v in REPLICAS}


def hf_greedy(hf_dir) -> list[list[int]]:
    model = load_hf(hf_dir)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in PROMPTS]


def _close_engine(rank, world_size):
    for engines in _ENGINES.values():
        for engine in engines:
            engine.close()
    _ENGINES.clear()


def _engines(rank, variant, hf_dir, pid_file) -> list:
    """Rank 0's replicas for ``variant`` (others are closed first), started on first use;
    their process ids go to ``pid_file`` for the module's cleanup. Empty on other ranks."""
    if rank != 0:
        return []
    if variant not in _ENGINES:
        from mcore_rl.engines.vllm_engine import VLLMEngine

        _close_engine(rank, None)
        _ENGINES[variant] = []
        for tp, placement in REPLICAS[variant]:
            engine = VLLMEngine(hf_dir, tp=tp, placement=placement, max_model_len=128,
                                block_size=32, load_format="dummy")
            _ENGINES[variant].append(engine)
            with open(pid_file, "a") as f:
                f.write(" ".join(map(str, engine.process_ids())) + " ")
    return _ENGINES[variant]


def _greedy():
    from mcore_rl.engines import SamplingConfig

    return SamplingConfig(temperature=0, max_new_tokens=NEW_TOKENS)


def _sft_batch(vocab):
    from mcore_rl.data.batch import Batch

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (12, 9, 15, 7)]
    return Batch.from_sequences(seqs, prompt_lens=[4, 3, 5, 2])


def _sft_loss(outputs, mb):
    mask = mb["response_mask"].float()
    return -(outputs["logprobs"] * mask).sum(), mask.sum(), {}


def _step_and_sync(rank, world_size, variant, hf_dir, pid_file, layout, work):
    """Sync, greedy; one step; sync, greedy, verify; export. Rank 0 returns, per replica,
    what it generated and the verify report."""
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.convert import convert_mcore_to_hf
    from mcore_rl.models.checkpoint import save_mcore_checkpoint
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.rl.engine_verify import probe_prompts, verify_engine_logprobs
    from mcore_rl.train.build import build_engine

    tp, pp = layout
    engines = _engines(rank, variant, hf_dir, pid_file)
    ctx = initialize_parallel(tp=tp, pp=pp, seed=5)
    try:
        built = build_model(hf_dir, ctx)
        arch = built.spec.arch
        train = build_engine(built.chunks, ctx, vocab_size=arch.vocab_size,
                             optim=OptimizerConfig(name="adam", lr=0.05, clip_grad=0.0))
        with WeightSync.build(train.model, arch, engines=engines, bucket_mb=BUCKET_MB) as sync:
            sync.sync(version=1)
            before = [e.generate(PROMPTS, _greedy()) for e in engines]
            train.train_batch(_sft_batch(arch.vocab_size), _sft_loss)
            stats = sync.sync(version=2)
        after = [e.generate(PROMPTS, _greedy()) for e in engines]
        # untruncated, then vLLM's processed log-probs of top-p and top-k sampling against
        # the trainer's truncated ones (vocabulary-parallel over its TP ranks)
        reports = [[verify_engine_logprobs(train, e if rank == 0 else None,
                                           probe_prompts(arch.vocab_size), temperature=0.7,
                                           tolerance=LOGPROB_TOL, **trunc)
                    for trunc in TRUNCATIONS]
                   for e in (engines or [None] * len(REPLICAS[variant]))]
        save_mcore_checkpoint([m.module for m in train.model], f"{work}/ckpt", built.spec,
                              hf_dir, {"tp": tp, "pp": pp})
        if rank != 0:
            return None
        convert_mcore_to_hf(f"{work}/ckpt", f"{work}/hf", progress=False)
        return {"before": [[s.token_ids for s in r] for r in before],
                "after": [[s.token_ids for s in r] for r in after],
                "versions": [{s.weight_version for s in r} for r in after], "reports": reports,
                "modes": [e.load_mode for e in engines], "transport": sync.transport,
                "buckets": stats.buckets, "exported": f"{work}/hf"}
    finally:
        destroy_parallel()


@pytest.mark.parametrize("variant", list(REPLICAS))
def test_after_a_step_vllm_greedy_equals_hf_greedy_of_the_exported_weights(world, hf_dirs, tmp_path,
                                                                          variant):
    initial = hf_greedy(hf_dirs[variant])
    result = world.run(_step_and_sync, variant, hf_dirs[variant], PID_FILE, LAYOUT,
                       str(tmp_path))[0]
    assert result["buckets"] > 3, "the model must span several buckets"
    assert result["transport"] == "shared", "CPU parameters that own their memory are shared"
    exported = hf_greedy(result["exported"])
    for i, (engine_tp, _) in enumerate(REPLICAS[variant]):
        where = f"{variant} trainer TP2xPP2 -> engine TP{engine_tp}"
        assert result["before"][i] == initial, where
        assert result["after"][i] == exported, where
        assert result["after"][i] != result["before"][i], f"{where}: greedy tokens must change"
        assert result["versions"][i] == {2}
        assert result["modes"][i] == "direct", where
        for trunc, report in zip(TRUNCATIONS, result["reports"][i]):
            assert report.tokens >= 16 and report.max_abs_diff <= LOGPROB_TOL, (where, trunc, report)
            assert report.outside_kept == 0, (where, trunc, report)


def _corrupt_bucket_one(k, buffer, manifest):
    if k == 1:
        buffer[manifest["tensors"][-1][4][0][0] + 5] ^= 0x01


def _refusal(engine) -> str | None:
    try:
        engine.generate(PROMPTS, _greedy())
    except WeightSyncError as err:
        return str(err)
    return None


def _corrupted_then_clean_sync(rank, world_size, variant, hf_dir, pid_file):
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync

    engines = _engines(rank, variant, hf_dir, pid_file)
    ctx = initialize_parallel(tp=2, pp=2)
    try:
        built = build_model(hf_dir, ctx)
        with WeightSync.build(built.chunks, built.spec.arch, engines=engines,
                              bucket_mb=BUCKET_MB) as sync:
            try:
                sync.sync(version=7, bucket_hook=_corrupt_bucket_one)
                error = None
            except WeightSyncError as err:
                error = str(err)
            out = {"error": error, "versions": [e.weight_version for e in engines],
                   "consistent": [e.consistent for e in engines],
                   "refused": [_refusal(e) for e in engines]}
            sync.sync(version=8)
        out["after"] = [[s.token_ids for s in e.generate(PROMPTS, _greedy())] for e in engines]
        out["versions_after"] = [e.weight_version for e in engines]
        return out
    finally:
        destroy_parallel()


def test_a_corrupted_bucket_fails_loudly_and_no_replica_serves_mixed_weights(world, hf_dirs):
    variant = "qwen2-tied"
    results = world.run(_corrupted_then_clean_sync, variant, hf_dirs[variant], PID_FILE)
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, "every trainer rank raises the same error"
    message = errors.pop()
    assert "bucket 2/" in message and "checksum" in message and "mix of weight versions" in message
    engine_side = results[0]
    assert engine_side["versions"] == [None, None] and engine_side["consistent"] == [False, False]
    assert engine_side["refused"] == [message, message]
    # a clean sync repairs both replicas
    assert engine_side["versions_after"] == [8, 8]
    assert engine_side["after"] == [hf_greedy(hf_dirs[variant])] * 2


def _param_shapes(rank, world_size, variant, hf_dir, pid_file):
    engines = _engines(rank, variant, hf_dir, pid_file)
    return engines[1].param_shapes() if engines else None


def test_engine_tp2_parameters_are_those_of_the_engine_parameter_plan(world, hf_dirs):
    from mcore_rl.engines.param_plan import engine_params
    from mcore_rl.models.hf_config import load_hf_spec

    variant = "qwen2-tied"
    per_rank = world.run(_param_shapes, variant, hf_dirs[variant], PID_FILE)[0]
    arch = load_hf_spec(hf_dirs[variant]).arch
    for rank, shapes in enumerate(per_rank):
        assert shapes == {p.name: list(p.shape) for p in engine_params(arch, tp=2, rank=rank)}


def _verify_before_and_after_perturbing(rank, world_size, variant, hf_dir, pid_file):
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.rl.engine_verify import LogprobMismatchError, probe_prompts, verify_engine_logprobs
    from mcore_rl.train.build import build_engine

    engines = _engines(rank, variant, hf_dir, pid_file)
    engine = engines[1] if engines else None
    ctx = initialize_parallel(tp=2, pp=2)
    try:
        built = build_model(hf_dir, ctx)
        arch = built.spec.arch
        with WeightSync.build(built.chunks, arch, engines=engines, bucket_mb=BUCKET_MB) as sync:
            sync.sync(version=11)
        forward_only = build_engine(built.chunks, ctx, vocab_size=arch.vocab_size)
        probe = probe_prompts(arch.vocab_size)
        synced = verify_engine_logprobs(forward_only, engine, probe, temperature=0.7,
                                        tolerance=LOGPROB_TOL)
        with torch.no_grad():  # the trainer moves on, the engine is not told
            for p in built.chunks[0].parameters():
                p.add_(0.01)
        try:
            verify_engine_logprobs(forward_only, engine, probe, temperature=0.7,
                                   tolerance=LOGPROB_TOL)
            error = None
        except LogprobMismatchError as err:
            error = str(err)
        return synced.max_abs_diff, error
    finally:
        destroy_parallel()


def test_verify_passes_after_a_sync_and_fails_clearly_when_the_engine_is_stale(world, hf_dirs):
    results = world.run(_verify_before_and_after_perturbing, "qwen2-tied", hf_dirs["qwen2-tied"],
                        PID_FILE)
    assert all(diff <= LOGPROB_TOL for diff, _ in results)
    errors = {error for _, error in results}
    assert len(errors) == 1 and None not in errors, "every rank raises the same error"
    message = errors.pop()
    assert "weight version 11" in message and "tolerance" in message and "differ by up to" in message
