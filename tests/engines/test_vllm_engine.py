"""`VLLMEngine` on CPU: sampling semantics, the log-prob convention, weight updates, parameters.

One engine for the module: tiny Qwen2 (QKV bias, tied embeddings), fp32, engine TP1. The
oracle is HF transformers on the same weights (logits, greedy tokens). It starts with a
variable that vLLM sets again as it is imported first in the environment its engine core
inherits, where setproctitle's title cannot take (`mcore_rl.engines.vllm_title`).
"""
import ctypes
import os

import pytest
import torch
from safetensors.torch import load_file

from mcore_rl.engines import SamplingConfig, WeightSyncError
from mcore_rl.engines.base import Request
from mcore_rl.engines.param_plan import engine_params
from mcore_rl.models.hf_config import load_hf_spec
from tests.models.tiny_hf import load_hf, save_tiny_hf_model

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_engine")
    return {seed: str(save_tiny_hf_model("qwen2-tied", root / f"seed{seed}", seed=seed))
            for seed in (0, 1, 2)}


def put_first_in_environment(name: str, value: str) -> None:
    """Make ``name`` the first variable of this process's environment (the one a spawned
    process inherits first): every variable (those set past ``os.environ`` too) is unset,
    then set again in order."""
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    pairs = []
    while environ[len(pairs)] is not None:
        pairs.append(environ[len(pairs)].split(b"=", 1))
    for key, _ in pairs:
        os.unsetenv(key)
    os.environ[name] = os.environ.get(name, value)
    for key, val in pairs:
        if key != name.encode():
            os.putenv(key, val)
    assert environ[0].startswith(f"{name}=".encode())


@pytest.fixture(scope="module")
def engine(dirs):
    from mcore_rl.engines.vllm_engine import VLLMEngine

    put_first_in_environment("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # vLLM's env_override sets it
    engine = VLLMEngine(dirs[0], tp=1, max_model_len=128)
    engine.stream_interval = 1  # requests cut a token or so after they start
    yield engine
    engine.close()


@pytest.fixture
def original_weights(engine, dirs):
    """Tests that change the engine's weights put the original ones back."""
    yield
    engine.load_weights_from_dir(dirs[0], version=0)


def hf_greedy(hf_dir, prompts=PROMPTS, new_tokens=6):
    model = load_hf(hf_dir)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


def test_n_samples_per_prompt_are_reproducible_per_seed_and_vary_across_seeds(engine):
    sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=10)
    first = engine.generate(PROMPTS, sampling)
    assert [(s.prompt_index, s.sample_index) for s in first] == [(i, j) for i in (0, 1) for j in range(3)]
    assert all(len(s.token_ids) == len(s.logprobs) == 8 and s.finish_reason == "length" for s in first)
    again = engine.generate(PROMPTS, sampling)
    assert [s.token_ids for s in again] == [s.token_ids for s in first]
    other = engine.generate(PROMPTS, SamplingConfig(n=3, temperature=1.0, max_new_tokens=8, seed=11))
    assert [s.token_ids for s in other] != [s.token_ids for s in first]
    assert len({tuple(s.token_ids) for s in first[:3]}) > 1, "n samples of one prompt differ"


def test_logprobs_are_log_softmax_of_logits_over_temperature_untruncated(engine, dirs):
    rollouts = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=0.7, max_new_tokens=8, seed=3))
    model = load_hf(dirs[0])
    for s in rollouts:
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_token_ids) - 1:-1]
        expected = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4), (s.logprobs, expected)


def test_rollout_batch_aligns_engine_logprobs_to_the_tokens_they_describe(engine):
    rollouts = engine.generate(PROMPTS, SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=1))
    batch = rollouts.to_batch()
    s = rollouts.samples[3]  # prompt 1 (3 tokens), sample 1
    assert batch["input_ids"][3, :7].tolist() == s.prompt_token_ids + s.token_ids
    assert batch["response_mask"][3].tolist()[:8] == [0, 0, 0, 1, 1, 1, 1, 0]
    assert torch.allclose(batch["rollout_logprobs"][3, 3:7], torch.tensor(s.logprobs))
    assert batch.meta["weight_version"] == [0] * 4 and batch["group_id"].tolist() == [0, 0, 1, 1]


def test_a_stop_token_ends_the_response_with_it_and_reason_stop(engine):
    greedy = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8)).samples[0]
    stop = greedy.token_ids[2]
    first = greedy.token_ids.index(stop)  # the stop token may already occur earlier
    stopped = engine.generate(PROMPTS[:1], SamplingConfig(
        temperature=0, max_new_tokens=8, stop_token_ids=(stop,))).samples[0]
    assert stopped.token_ids == greedy.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and greedy.finish_reason == "length"


def test_min_new_tokens_masks_the_stop_token_until_that_length(engine):
    greedy = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8)).samples[0]
    stop = greedy.token_ids[2]
    first = greedy.token_ids.index(stop)
    held = engine.generate(PROMPTS[:1], SamplingConfig(
        temperature=0, max_new_tokens=8, min_new_tokens=8, stop_token_ids=(stop,))).samples[0]
    assert len(held.token_ids) == 8 and held.finish_reason == "length"
    assert stop not in held.token_ids and held.token_ids[:first] == greedy.token_ids[:first]


@pytest.mark.parametrize("truncation", [dict(top_p=0.8), dict(top_k=20), dict(top_k=20, top_p=0.8)],
                         ids=["top_p", "top_k", "both"])
def test_truncated_sampling_logprobs_are_those_of_the_kept_set_renormalised(engine, dirs, truncation):
    """vLLM's processed log-probs against the trainer's kernel over HF's logits."""
    from mcore_rl.kernels import token_logprobs

    rollouts = engine.generate(PROMPTS, SamplingConfig(n=3, temperature=0.9, max_new_tokens=8, seed=4,
                                                       **truncation))
    model = load_hf(dirs[0])
    kept_mass_below_one = False
    for s in rollouts:
        ids = torch.tensor([s.prompt_token_ids + s.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(s.prompt_token_ids) - 1:-1]
        tokens = torch.tensor(s.token_ids)
        expected, kept = token_logprobs(logits, tokens, temperature=0.9, return_kept=True, **truncation)
        full = token_logprobs(logits, tokens, temperature=0.9)
        assert bool(kept.all()), "a sampled token outside the kept set"
        assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4), (s.logprobs, expected)
        kept_mass_below_one |= bool((full < expected - 1e-3).any())
    assert kept_mass_below_one, "the truncation never cut anything: the test shows nothing"


def test_kept_ids_from_an_engine_built_without_sampling_masks_are_refused(engine):
    with pytest.raises(Exception, match="start the engine with return_sampling_mask=True"):
        engine.generate(PROMPTS, SamplingConfig(top_k=5, return_kept_ids=True))


@pytest.mark.parametrize("loading,mode", [("auto", "direct"), ("layerwise", "layerwise")])
def test_update_weights_in_buckets_then_greedy_equals_hf_of_those_weights(engine, dirs, original_weights,
                                                                          loading, mode):
    assert engine.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6)).samples[0].token_ids \
        == hf_greedy(dirs[0])[0]
    tensors = load_file(f"{dirs[1]}/model.safetensors")
    engine.weight_loading = loading
    try:
        engine.update_weights(tensors.items(), version=5, bucket_mb=0.05)  # many buckets
    finally:
        engine.weight_loading = "auto"
    assert engine.load_mode == mode
    after = engine.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6))
    assert [s.token_ids for s in after] == hf_greedy(dirs[1])
    assert {s.weight_version for s in after} == {5}


def test_the_version_in_samples_is_the_one_vllm_recorded_when_the_sync_finished(
        engine, dirs, original_weights):
    """A sync ends with vLLM's ``finish_weight_update`` and the version recorded by vLLM,
    which reports it per span of tokens; samples carry vLLM's record, not the engine
    object's own (set apart here to tell the two sources apart)."""
    tensors = load_file(f"{dirs[1]}/model.safetensors")
    engine.update_weights(tensors.items(), version=11, bucket_mb=0.05)
    assert engine.recorded_version() == "11"
    engine.weight_version = 99
    try:
        sampling = SamplingConfig(temperature=0, max_new_tokens=4)
        assert {s.weight_version for s in engine.generate(PROMPTS, sampling)} == {11}
        done, _ = _run(engine, [Request("versioned", PROMPTS[0], sampling, None)])
        assert {s.weight_version for s in done["versioned"]} == {11}
        assert all(s.token_versions is None for s in done["versioned"])
    finally:
        engine.weight_version = 11
    # a failed sync records nothing: vLLM still labels tokens with the last good version
    del tensors["model.norm.weight"]
    with pytest.raises(WeightSyncError):
        engine.update_weights(tensors.items(), version=12, bucket_mb=0.05)
    assert engine.recorded_version() == "11"


def test_requests_in_flight_are_kept_across_a_sync_and_go_on_as_the_new_weights_generate(
        engine, dirs, original_weights):
    """Pause-and-keep (vLLM's ``AsyncLLM``): a bucket sync while greedy requests run. Each
    sample's tokens before the sync are the old weights' greedy ones, those after it the new
    weights' greedy continuation of prompt + those tokens (KV recomputed, nothing generated
    on half-loaded weights), and vLLM's spans give each token its version."""
    from mcore_rl.engines.base import Request

    assert engine.keeps_requests
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=100)
    tensors = load_file(f"{dirs[1]}/model.safetensors")
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Request(f"kept{i}", prompt, greedy, None))
    done = {}
    while not any(engine.running_lengths()):
        done.update(engine.step())
    engine.update_weights(tensors.items(), version=3, bucket_mb=0.05)
    while len(done) < len(PROMPTS):
        done.update(engine.step())
    cut = 0
    for i, prompt in enumerate(PROMPTS):
        (s,) = done[f"kept{i}"]
        versions = s.token_versions or [s.weight_version] * len(s.token_ids)
        old = versions.count(0)
        n = len(s.token_ids)  # up to 100: the model's end-of-sequence token may stop it
        assert versions == [0] * old + [3] * (n - old)
        assert s.token_ids[:old] == hf_greedy(dirs[0], [prompt], old)[0]
        if 0 < old < n:
            cut += 1
            assert s.token_ids[old:] == hf_greedy(dirs[1], [prompt + s.token_ids[:old]], n - old)[0]
    assert cut, "no request was in flight when the sync came"


def test_weights_reach_the_workers_through_vllms_weight_transfer_backend_of_ours(
        engine, dirs, original_weights):
    # the report is read from the worker's weight-transfer engine, refused if not ours
    tensors = load_file(f"{dirs[1]}/model.safetensors")
    engine.update_weights(tensors.items(), version=3, bucket_mb=0.05)
    (report,) = engine._call_workers("mcore_rl_transfer_report")
    assert report["mode"] == "direct" and report["error"] is None and report["seconds"] > 0


def test_vllms_own_checksums_of_the_plain_weights_are_those_of_the_tensors_sent(
        engine, dirs, original_weights):
    import hashlib

    tensors = load_file(f"{dirs[1]}/model.safetensors")
    engine.update_weights(tensors.items(), version=4, bucket_mb=0.05)
    (digests,) = engine.weight_checksums()
    plain = [n for n in tensors if "norm" in n]  # kept as they are (not repacked on CPU)
    assert plain
    for name in plain:
        want = hashlib.sha256(tensors[name].contiguous().view(-1).view(torch.uint8).numpy())
        assert digests[f"dp0:pp0:pcp0:tp0:{name}"] == want.hexdigest(), name


def test_registering_the_backend_twice_is_harmless():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from mcore_rl.engines import vllm_transfer
    from mcore_rl.engines.vllm_shim import BACKEND

    vllm_transfer.register()
    vllm_transfer.register()  # e.g. the plugin loaded again in the same process
    assert WeightTransferEngineFactory._registry[BACKEND]() is vllm_transfer.MappedFileEngine


@pytest.mark.parametrize("case", ["not installed", "left out of VLLM_PLUGINS"])
def test_a_missing_plugin_is_one_line_before_any_engine_starts(dirs, monkeypatch, case):
    import importlib.metadata

    from mcore_rl.engines import vllm_engine
    from mcore_rl.errors import UsageError

    if case == "not installed":
        monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
        expected = "is not installed, so vLLM's workers cannot receive mcore-rl's weight syncs"
    else:
        monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
        expected = "VLLM_PLUGINS='lora_filesystem_resolver' leaves out vLLM's plugin"
    started = []
    monkeypatch.setattr(vllm_engine, "LocalLLM", lambda *a: started.append(a))
    monkeypatch.setattr(vllm_engine, "HostedLLM", lambda *a: started.append(a))
    with pytest.raises(UsageError) as err:
        vllm_engine.VLLMEngine(dirs[0], tp=1, max_model_len=128)
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert not started


def test_a_direct_update_leaves_the_same_logits_as_vllms_own_reload(engine, dirs, original_weights):
    """Both ways of loading give bit-identical log-probs (the same repacked kernels)."""
    tensors = load_file(f"{dirs[2]}/model.safetensors")
    sampling = SamplingConfig(temperature=0.7, max_new_tokens=6, seed=3)
    engine.update_weights(tensors.items(), version=1, bucket_mb=0.05)
    assert engine.load_mode == "direct"
    direct = engine.generate(PROMPTS, sampling)
    engine.load_weights_from_dir(dirs[2], version=2)
    reloaded = engine.generate(PROMPTS, sampling)
    assert [s.token_ids for s in direct] == [s.token_ids for s in reloaded]
    assert [s.logprobs for s in direct] == [s.logprobs for s in reloaded]


def test_reloading_a_tied_model_from_a_directory_refreshes_the_output_head(engine, dirs, original_weights):
    # vLLM's own reload leaves the CPU-repacked copy of a tied head stale; ours refreshes it
    engine.load_weights_from_dir(dirs[2], version=9)
    after = engine.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6))
    assert [s.token_ids for s in after] == hf_greedy(dirs[2])


def test_engine_parameters_are_those_of_the_engine_parameter_plan(engine, dirs):
    (shapes,) = engine.param_shapes()
    arch = load_hf_spec(dirs[0]).arch
    planned = {p.name: list(p.shape) for p in engine_params(arch, tp=1)}
    assert shapes == planned


def test_a_sleeping_engine_refuses_to_generate_until_woken(engine):
    assert engine.supports_sleep is False  # vLLM's CPU backend has no sleep mode
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, SamplingConfig(max_new_tokens=2))
    engine.wake()
    assert len(engine.generate(PROMPTS, SamplingConfig(max_new_tokens=2))) == 2


@pytest.mark.parametrize("bad", ["first", "second", "last"])
def test_a_bucket_with_a_wrong_checksum_is_refused_before_anything_is_loaded(engine, dirs, original_weights,
                                                                             bad):
    from mcore_rl.engines.local_update import update_from_tensors

    class FlipChecksums:
        """Forwards to the engine, with every checksum of one bucket off by one (the first
        and the last also start and end the engine's session)."""

        def __getattr__(self, name):
            return getattr(engine, name)

        def load_bucket(self, manifest):
            k, n = manifest["bucket"], manifest["num_buckets"]
            if k == {"first": 0, "second": 1, "last": n - 1}[bad]:
                for *_, pieces in manifest["tensors"]:
                    for piece in pieces:
                        piece[3] = [value + 1 for value in piece[3]]
            return engine.load_bucket(manifest)

    tensors = load_file(f"{dirs[1]}/model.safetensors")
    with pytest.raises(WeightSyncError, match="checksum"):
        update_from_tensors(FlipChecksums(), tensors.items(), 6, 50_000)
    assert not engine.consistent and engine.weight_version is None
    with pytest.raises(WeightSyncError, match="version 6"):
        engine.generate(PROMPTS, SamplingConfig(max_new_tokens=2))
    engine.update_weights(tensors.items(), version=7, bucket_mb=0.05)  # the next session is clean
    after = engine.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6))
    assert engine.consistent and [s.token_ids for s in after] == hf_greedy(dirs[1])


def test_a_session_that_never_sent_a_parameter_fails_by_name(engine, dirs, original_weights):
    tensors = load_file(f"{dirs[1]}/model.safetensors")
    del tensors["model.norm.weight"]
    with pytest.raises(WeightSyncError, match="did not send model.norm.weight"):
        engine.update_weights(tensors.items(), version=8, bucket_mb=0.05)
    assert not engine.consistent


# ----- request by request (continuous batching) --------------------------------------------
SAMPLED = SamplingConfig(n=2, temperature=1.0, max_new_tokens=8)
SEEDS = [3, 4]


def _run(engine, requests, steps=None):
    """Submit ``requests`` and step until all finish (or ``steps`` steps); finished
    samples by request id, and the batch occupancy seen once they are submitted and at each
    step (vLLM's AsyncLLM has them all in its batch from the start)."""
    for r in requests:
        engine.submit(r)
    done, occupancy = {}, [engine.sequences_in_flight()]
    while len(done) < len(requests) and (steps is None or len(occupancy) <= steps):
        done.update(engine.step())
        occupancy.append(engine.sequences_in_flight())
    return done, occupancy


def test_requests_submitted_one_by_one_run_in_one_batch_and_give_what_generate_gives(engine):
    from mcore_rl.engines.base import Request

    expected = engine.generate(PROMPTS, SAMPLED, seeds=SEEDS)
    done, occupancy = _run(engine, [Request(f"r{i}", p, SAMPLED, seed)
                                    for i, (p, seed) in enumerate(zip(PROMPTS, SEEDS))])
    assert max(occupancy) == 4  # both prompts' samples ran together
    got = done["r0"] + done["r1"]
    assert [s.token_ids for s in got] == [s.token_ids for s in expected]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in expected]
    for a, b in zip(got, expected):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert engine.sequences_in_flight() == 0


def test_a_cancelled_request_keeps_its_tokens_and_their_continuation_gives_the_whole_answer(engine):
    from dataclasses import replace

    from mcore_rl.engines.base import Request

    one = SamplingConfig(n=1, temperature=0.0, max_new_tokens=100)
    (whole,) = engine.generate(PROMPTS[:1], one)
    length = len(whole.token_ids)  # up to 100: the model's end-of-sequence token may stop it
    assert length > 20
    engine.submit(Request("c", PROMPTS[0], one, None))
    while not any(engine.running_lengths()):
        engine.step()
    (partial,) = engine.cancel(["c"])["c"]
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < length
    assert partial.token_ids == whole.token_ids[:len(partial.token_ids)]
    rest = Request("c2", PROMPTS[0] + partial.token_ids,
                   replace(one, max_new_tokens=100 - len(partial.token_ids)), None)
    done, _ = _run(engine, [rest])
    assert partial.token_ids + done["c2"][0].token_ids == whole.token_ids
    assert engine.cancel(["c2", "never-submitted"]) == {}


def test_generate_while_requests_run_returns_its_own_answers_and_leaves_theirs_alone(engine):
    from dataclasses import replace

    from mcore_rl.engines.base import Request

    long = replace(SAMPLED, max_new_tokens=100)  # still running while generate runs
    expected = engine.generate(PROMPTS, SAMPLED, seeds=SEEDS)
    (background,) = [engine.generate(PROMPTS[1:], long, seeds=SEEDS[1:])]
    done, _ = _run(engine, [Request("bg", PROMPTS[1], long, SEEDS[1])], steps=2)
    assert not done
    during = engine.generate(PROMPTS, SAMPLED, seeds=SEEDS)
    assert [s.token_ids for s in during] == [s.token_ids for s in expected]
    while "bg" not in done:
        done.update(engine.step())
    assert [s.token_ids for s in done["bg"]] == [s.token_ids for s in background]


def test_on_cpu_at_tp1_the_engine_is_one_host_process_named_as_vllms_engine_core(engine):
    """vLLM's own layout on CPU is an engine-core process and a worker process even at TP1;
    the engine core runs both in one, and is named as vLLM names it although setproctitle
    could not (the module's environment)."""
    import psutil

    from mcore_rl.engines.vllm_engine import _child_pids

    (host,) = engine.process_ids()
    assert _child_pids() == {host}
    assert psutil.Process(host).cmdline()[:1] == ["VLLM::EngineCore"]


def _kv_cache_tokens(llm) -> int:
    cache = llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks * cache.block_size


def test_the_kv_cache_holds_256_sequences_of_the_longest_length_and_little_more(engine):
    """Sized to the model (`cpu_kv_cache_bytes`), not a fixed GiB that vLLM zeroes at start:
    vLLM's own count of the tokens its cache holds (engine max_model_len 128)."""
    tokens = engine._llm.call(_kv_cache_tokens)
    assert 256 * 128 <= tokens <= 2 * 256 * 128


def test_kv_cache_bytes_count_keys_and_values_of_every_layer_per_tp_rank_capped():
    from mcore_rl.engines.vllm_engine import cpu_kv_cache_bytes

    smollm2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
               "hidden_size": 576}
    # keys and values x 30 layers x 3 heads x 64 dims x 2 bytes, 256 sequences of 1 block
    assert cpu_kv_cache_bytes(smollm2, "bf16", 100) == 2 * 30 * 3 * 64 * 2 * 256 * 128
    assert cpu_kv_cache_bytes({**smollm2, "head_dim": 32}, "fp32", 129, tp=3) == \
        2 * 30 * 1 * 32 * 4 * 256 * 256
    assert cpu_kv_cache_bytes(smollm2, "fp32", 4096) == 2**30  # the limit
    # one sequence of the longest length always fits, with the block vLLM keeps back
    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096}
    assert cpu_kv_cache_bytes(llama8b, "fp32", 8192) == 2 * 32 * 8 * 128 * 4 * (64 + 1) * 128


def test_close_ends_the_engine_processes_and_unlinks_the_shared_memory_they_held(engine):
    """(Last in the module: it closes the module's engine.)"""
    import psutil

    from mcore_rl.engines.stale_shm import shared_memory_of

    pids = engine.process_ids()
    held = shared_memory_of(pids)
    assert pids and held, "the engine's process holds /dev/shm files (a semaphore at least)"
    engine.close()
    assert not [p for p in pids if psutil.pid_exists(p) and
                psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in held if os.path.exists(p)]
    engine.close()  # a second close is a no-op

