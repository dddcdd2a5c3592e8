"""The SGLang adapter against SGLang's own model code (recorded once, outside CI).

``data/sglang_manifest.json`` was made by ``data/make_sglang_manifest.py`` in a separate venv
with SGLang 0.5.23: for the tiny Llama and Qwen2 models at engine TP1 and TP2 it lists every
parameter SGLang builds per rank, its shape, and which rows/columns of which HF tensors it
holds after ``load_weights``. The engine parameter plan (names, shapes, fusion order, TP
split, vocabulary padding, tied head, KV heads) must reproduce it exactly, and the stream
must carry every HF tensor SGLang reads. SGLang itself needs CUDA: its engine test is `gpu`.
"""
import json
from pathlib import Path

import pytest

from mcore_rl.engines.param_plan import EngineParam, engine_params
from mcore_rl.models.hf_config import load_hf_spec
from mcore_rl.models.mapping import tensor_mappings
from tests.models.tiny_hf import save_tiny_hf_model

MANIFEST = json.loads((Path(__file__).parent / "data" / "sglang_manifest.json").read_text())
CASES = [(v, int(tp), rank) for v, tps in MANIFEST["models"].items()
         for tp, ranks in tps.items() for rank in range(len(ranks))]


@pytest.fixture(scope="module")
def archs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    return {v: load_hf_spec(save_tiny_hf_model(v, root / v)).arch for v in MANIFEST["models"]}


def as_runs(p: EngineParam) -> list[list]:
    """Our plan in the manifest's notation: [hf name, first row, rows(, first col, cols)]."""
    runs = []
    for s in p.sources:
        if len(p.shape) == 1:
            runs.append([s.hf_name, s.start, s.length])
        elif p.axis == 0:
            runs.append([s.hf_name, s.start, s.length, 0, p.shape[1]])
        else:
            runs.append([s.hf_name, 0, p.shape[0], s.start, s.length])
    return runs


def test_the_manifest_covers_both_models_at_engine_tp1_and_tp2():
    assert MANIFEST["sglang"] == "0.5.23"
    assert {(v, tp) for v, tp, _ in CASES} == {(v, tp) for v in ("llama-untied", "qwen2-tied")
                                              for tp in (1, 2)}


@pytest.mark.parametrize("variant, tp, rank", CASES, ids=[f"{v}-tp{t}-rank{r}" for v, t, r in CASES])
def test_engine_parameters_match_sglangs_names_shapes_and_fusions(archs, variant, tp, rank):
    recorded = {p["name"]: p for p in MANIFEST["models"][variant][str(tp)][rank]}
    planned = {p.name: p for p in engine_params(archs[variant], tp=tp, rank=rank)}
    assert sorted(planned) == sorted(recorded)
    for name, p in planned.items():
        assert list(p.shape) == recorded[name]["shape"], name
        assert as_runs(p) == recorded[name]["rows"], name


@pytest.mark.parametrize("variant", ["llama-untied", "qwen2-tied"])
def test_the_stream_carries_every_hf_tensor_sglang_reads(archs, variant):
    arch = archs[variant]
    sent = {n for m in tensor_mappings(arch, "lm")
            for layer in (range(arch.num_layers) if m.per_layer else [None])
            for n in m.hf_names_for(layer)}
    read = {run[0] for ranks in MANIFEST["models"][variant].values() for params in ranks
            for p in params for run in p["rows"]}
    assert read == sent


@pytest.mark.gpu
def test_sglang_engine_generates_hf_greedy_tokens_after_a_weight_update(tmp_path):
    import torch
    from safetensors.torch import load_file

    from mcore_rl.engines import SamplingConfig
    from mcore_rl.engines.sglang_engine import SGLangEngine
    from tests.models.tiny_hf import load_hf

    start = save_tiny_hf_model("qwen2-tied", tmp_path / "start", seed=0)
    target = save_tiny_hf_model("qwen2-tied", tmp_path / "target", seed=1)
    engine = SGLangEngine(start, tp=1)
    try:
        engine.update_weights(load_file(target / "model.safetensors").items(), version=1,
                              bucket_mb=0.05)
        prompt = [5, 6, 7, 8]
        got = engine.generate([prompt], SamplingConfig(temperature=0, max_new_tokens=6))[0]
        hf = load_hf(target)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 4:].tolist()
        assert got.token_ids == want and got.weight_version == 1
    finally:
        engine.close()


@pytest.mark.gpu
def test_an_nccl_sync_into_sglang_gives_hf_greedy_tokens_of_the_trainers_weights(tmp_path,
                                                                                 monkeypatch):
    """``reshard.transport=nccl`` into SGLang (`mcore_rl.reshard.sglang_broadcast`): a trainer
    at TP1 on GPU 0 syncs into an engine on GPU 1 started from other weights; the engine then
    generates what HF generates from the trainer's checkpoint. Needs SGLang and two GPUs."""
    import torch

    pytest.importorskip("sglang")
    if torch.cuda.device_count() < 2:
        pytest.skip("the engine needs a GPU of its own (one NCCL rank per GPU)")
    from mcore_rl.config.sections import ReshardConfig
    from mcore_rl.engines import SamplingConfig
    from mcore_rl.engines.sglang_engine import SGLangEngine
    from mcore_rl.engines.sglang_shim import weight_update_group
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync
    from tests.models.tiny_hf import load_hf

    start = save_tiny_hf_model("qwen2-tied", tmp_path / "start", seed=0)
    target = save_tiny_hf_model("qwen2-tied", tmp_path / "target", seed=1)
    ctx = initialize_parallel()  # a world of one, on GPU 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    engine = SGLangEngine(start, tp=1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    try:
        built = build_model(str(target), ctx)
        sync = WeightSync.from_config(built.chunks, built.spec.arch, ReshardConfig(transport="nccl"),
                                      engines=[engine], engine="sglang",
                                      sglang_group=weight_update_group)
        sync.sync(1)
        prompt = [5, 6, 7, 8]
        got = engine.generate([prompt], SamplingConfig(temperature=0, max_new_tokens=6))[0]
        want = load_hf(target).generate(torch.tensor([prompt]), max_new_tokens=6,
                                        do_sample=False, eos_token_id=None,
                                        pad_token_id=0)[0, 4:].tolist()
        assert got.token_ids == want and got.weight_version == 1
    finally:
        if "sync" in locals():
            sync.close()
        engine.close()
        destroy_parallel()


class _SGLangCalls:
    """SGLang's ``Engine`` as far as the NCCL update goes: records calls, answers (ok, message)."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def __getattr__(self, method):
        def call(**kwargs):
            self.calls.append((method, kwargs))
            return (method != self.fail, f"{method} failed" if method == self.fail else "")
        return call


def _engine_over(calls):
    from mcore_rl.engines.base import RolloutEngine
    from mcore_rl.engines.sglang_engine import SGLangEngine

    engine = SGLangEngine.__new__(SGLangEngine)  # SGLang itself is not installed here
    RolloutEngine.__init__(engine)
    engine.engine, engine.tp, engine._groups, engine._buffer = calls, 2, [], None
    return engine


def test_the_nccl_update_refuses_generation_mid_sync_and_serves_the_version_it_finishes():
    from mcore_rl.engines import SamplingConfig
    from mcore_rl.wire import WeightSyncError

    engine = _engine_over(_SGLangCalls())
    init = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
            "world_size": 3, "group_name": "g", "backend": "nccl"}
    assert engine.transfer("ranks") == 2
    engine.transfer("init", init)
    engine.transfer("update", {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 2]],
                               "group_name": "g"})
    with pytest.raises(WeightSyncError, match="a weight sync is in progress"):
        engine.generate([[1, 2]], SamplingConfig(max_new_tokens=1))
    engine.transfer("finish", 7)
    assert engine.weight_version == 7 and engine._torn is None
    assert [m for m, _ in engine.engine.calls] == [
        "init_weights_update_group", "update_weights_from_distributed", "flush_cache"]
    assert engine.engine.calls[0][1] == init
    assert engine.engine.calls[1][1]["flush_cache"] is False  # flushed once, at the end
    engine.transfer("abort", "engine 2 failed")  # its group goes; no version is served
    assert engine.weight_version is None and engine._torn == "engine 2 failed"
    assert engine.engine.calls[-1] == ("destroy_weights_update_group", {"group_name": "g"})


def test_sglangs_refusal_of_an_update_is_a_weight_sync_error_with_its_message():
    from mcore_rl.wire import WeightSyncError

    engine = _engine_over(_SGLangCalls(fail="update_weights_from_distributed"))
    with pytest.raises(WeightSyncError, match="update_weights_from_distributed failed"):
        engine.transfer("update", {"names": [], "dtypes": [], "shapes": [], "group_name": "g"})
