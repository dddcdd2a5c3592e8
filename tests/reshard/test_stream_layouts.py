"""The bucketed stream delivers exactly the HF tensors, from every trainer layout.

Oracle: the HF checkpoint itself. Trainer ranks build the model from it at TP2, PP2,
TP2 x PP2, PP2 x VPP2 and DP4 (4 ranks; DP fills the rest) and stream into an `HFEngine` that was started
from *other* weights; afterwards every engine parameter must equal the checkpoint's tensor
bit for bit (fp32 wire), or its bf16 rounding (bf16 wire). Plan properties (one writer per
region, dp_rank 0 only, tied embeddings once, padding stripped, bounded buckets) are checked
on the same holdings. No vLLM here: see test_vllm_sync.py.
"""
import pytest
import torch
from safetensors.torch import load_file

from mcore_rl.engines.param_plan import engine_params
from mcore_rl.reshard.plan import ReshardPlan
from mcore_rl.wire import WeightSyncError, engine_module
from tests.reshard import staged_transport
from tests.reshard.tiny_models import save_model
from tests.reshard.trace import engine_param_sources
from tests.world import SharedWorld

LAYOUTS = {"TP2": (2, 1, None), "PP2": (1, 2, None), "TP2xPP2": (2, 2, None),
           "PP2xVPP2": (1, 2, 2), "DP4": (1, 1, None)}
BUCKET_MB = 0.05  # ~50 KB: the tiny models span 15-20 buckets
_ENGINE = {}  # per rank process: the HFEngine the controller streams into


@pytest.fixture(scope="module")
def world():
    with SharedWorld(4) as w:
        yield w


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    out = {}
    for variant in ("llama-untied", "qwen2-tied"):
        target = save_model(variant, root / variant, seed=0)
        start = save_model(variant, root / f"{variant}-start", seed=5)
        out[variant] = (str(target), str(start), load_file(target / "model.safetensors"))
    return out


def _stream(rank, world_size, layout, hf_dir, start_dir, wire, hook=None, threaded_above=None,
            **options):
    """Build at ``layout`` from ``hf_dir``, sync into a fresh HFEngine (rank 0); return the
    engine's parameters, the holdings and the plan's shape, or the error raised."""
    from mcore_rl.engines.hf_engine import HFEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.sources import local_holdings
    from mcore_rl.reshard.stream import WeightSync

    tp, pp, vpp, *cp = layout
    ctx = initialize_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp[0] if cp else 1)
    built = build_model(hf_dir, ctx)
    engine = HFEngine(start_dir) if rank == 0 else None
    try:
        sync = WeightSync.build(built.chunks, built.spec.arch,
                                engines=[engine] if engine else None, bucket_mb=BUCKET_MB,
                                wire_dtype=getattr(torch, wire), **options)
        if threaded_above is not None:  # the tiny buckets are below the default threshold
            sync.writer.threaded_above = threaded_above
        error = None
        try:
            sync.sync(version=3, bucket_hook=hook)
        except WeightSyncError as err:
            error = str(err)
        sync.close()
        result = {"error": error, "holdings": local_holdings(built.chunks, rank)[0],
                  "plan_buckets": [b.nbytes for b in sync.plan.buckets],
                  "transport": sync.transport}
        if rank == 0:
            result["params"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
            result["version"], result["consistent"] = engine.weight_version, engine.consistent
            try:
                result["generated"] = engine.generate([[5, 6, 7]], _greedy()).samples[0].token_ids
            except WeightSyncError as err:
                result["generated"] = f"refused: {err}"
        return result
    finally:
        destroy_parallel()


def _greedy():
    from mcore_rl.engines import SamplingConfig

    return SamplingConfig(temperature=0, max_new_tokens=4)


def _flip_one_byte_of_bucket_two(k, buffer, manifest):
    if k == 2:
        offset = manifest["tensors"][0][4][0][0]
        buffer[offset] ^= 0x10


@pytest.mark.parametrize("variant, transport", [
    ("llama-untied", "shared"), ("llama-untied", "buckets"), ("llama-untied", staged_transport.NAME),
    ("qwen2-tied", "buckets")])
def test_every_layout_streams_the_exact_hf_tensors_into_the_engine(world, models, variant, transport):
    """Every transport on every layout; the tied variant (one embedding tensor for two HF names,
    a matter of the plan, not of how bytes travel) on one transport."""
    hf_dir, start_dir, expected = models[variant]
    for name, layout in LAYOUTS.items():
        results = world.run(_stream, layout, hf_dir, start_dir, "float32", transport=transport)
        assert all(r["error"] is None for r in results), (name, results[0]["error"])
        assert {r["transport"] for r in results} == {transport}
        params = results[0]["params"]
        assert results[0]["version"] == 3
        for hf_name, tensor in expected.items():
            assert torch.equal(params[hf_name], tensor), f"{variant} {name}: {hf_name} differs"


def test_context_parallelism_is_not_a_weight_layout(world, models):
    """CP2 and TP2 x CP2 stream the same exact tensors: the CP ranks beyond the first hold
    replicas and write nothing."""
    hf_dir, start_dir, expected = models["qwen2-tied"]
    for name, layout in {"CP2xDP2": (1, 1, None, 2), "TP2xCP2": (2, 1, None, 2)}.items():
        results = world.run(_stream, layout, hf_dir, start_dir, "float32", transport="shared")
        assert all(r["error"] is None for r in results), (name, results[0]["error"])
        writers = {h.rank for r in results for h in r["holdings"] if h.main}
        assert writers == ({0} if layout[0] == 1 else {0, 1}), (name, writers)
        for hf_name, tensor in expected.items():
            assert torch.equal(results[0]["params"][hf_name], tensor), f"{name}: {hf_name} differs"


def _stream_into_two_engines(rank, world_size, hf_dir, start_dir, fail_second=False):
    """TP2 x PP2 into two HFEngines on the controller, one sync; the second engine fails to
    load bucket 3 when ``fail_second``. Each engine's parameters, version and state."""
    from mcore_rl.engines.hf_engine import HFEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync

    ctx = initialize_parallel(tp=2, pp=2)
    built = build_model(hf_dir, ctx)
    engines = [HFEngine(start_dir), HFEngine(start_dir)] if rank == 0 else None
    if engines and fail_second:
        load = engines[1].load_bucket

        def lose_bucket_three(manifest):
            if manifest["bucket"] == 2:
                raise RuntimeError("the second engine lost bucket 3")
            return load(manifest)
        engines[1].load_bucket = lose_bucket_three
    try:
        with WeightSync.build(built.chunks, built.spec.arch, engines=engines,
                              bucket_mb=BUCKET_MB) as sync:
            try:
                sync.sync(version=5)
                out = {"error": None}
            except WeightSyncError as err:
                out = {"error": str(err)}
        if rank == 0:
            out["params"] = [{k: v.clone() for k, v in e.model.state_dict().items()}
                             for e in engines]
            out["versions"] = [e.weight_version for e in engines]
            out["consistent"] = [e.consistent for e in engines]
        return out
    finally:
        destroy_parallel()


def test_one_sync_updates_every_engine_it_was_given_with_the_exact_tensors(world, models):
    hf_dir, start_dir, expected = models["llama-untied"]
    results = world.run(_stream_into_two_engines, hf_dir, start_dir)
    assert [r["error"] for r in results] == [None] * 4, results[0]["error"]
    assert results[0]["versions"] == [5, 5]
    for i, params in enumerate(results[0]["params"]):
        for hf_name, tensor in expected.items():
            assert torch.equal(params[hf_name], tensor), f"engine {i}: {hf_name} differs"


def test_a_failure_in_one_engine_aborts_every_engine_and_fails_the_sync_on_every_rank(world,
                                                                                      models):
    hf_dir, start_dir, _ = models["llama-untied"]
    results = world.run(_stream_into_two_engines, hf_dir, start_dir, fail_second=True)
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, errors
    message = errors.pop()
    assert "bucket 3/" in message and "the second engine lost bucket 3" in message
    assert results[0]["versions"] == [None, None]
    assert results[0]["consistent"] == [False, False]


@pytest.mark.parametrize("transport", ["shared", "buckets"])
def test_several_writer_threads_one_bucket_at_a_time_stream_the_same_exact_tensors(world, models,
                                                                                  transport):
    hf_dir, start_dir, expected = models["qwen2-tied"]
    results = world.run(_stream, LAYOUTS["TP2"], hf_dir, start_dir, "float32",
                        writer_threads=3, overlap=False, threaded_above=0, transport=transport)
    assert results[0]["error"] is None, results[0]["error"]
    for hf_name, tensor in expected.items():
        assert torch.equal(results[0]["params"][hf_name], tensor), hf_name


def test_a_bf16_wire_carries_the_bf16_rounding_of_every_tensor(world, models):
    hf_dir, start_dir, expected = models["qwen2-tied"]
    results = world.run(_stream, LAYOUTS["TP2xPP2"], hf_dir, start_dir, "bfloat16")
    params = results[0]["params"]
    for hf_name, tensor in expected.items():
        assert torch.equal(params[hf_name], tensor.to(torch.bfloat16).float()), hf_name


def _plan_for(results, hf_dir, bucket_bytes=int(BUCKET_MB * 2**20)):
    from mcore_rl.models.hf_config import load_hf_spec

    holdings = [h for r in results for h in r["holdings"]]
    return ReshardPlan.build(holdings, load_hf_spec(hf_dir).arch, bucket_bytes)


@pytest.mark.parametrize("variant", ["llama-untied", "qwen2-tied"])
def test_plan_has_one_writer_per_region_on_dp_rank_0_and_sends_no_padding(world, models, variant):
    hf_dir, start_dir, expected = models[variant]
    results = world.run(_stream, LAYOUTS["PP2"], hf_dir, start_dir, "float32")  # PP2 x DP2
    plan = _plan_for(results, hf_dir)
    # Megatron orders ranks tp, dp, pp: at PP2 x DP2, dp_rank 0 is ranks 0 (stage 0) and 2.
    assert plan.writers() == {0, 2}
    names = [t.hf_name for b in plan.buckets for t in b.tensors]
    assert sorted(names) == sorted(expected), "every HF tensor exactly once"
    if variant.endswith("-tied"):
        assert "lm_head.weight" not in names  # the last stage's copy is never sent
    embed = next(t for b in plan.buckets for t in b.tensors if t.hf_name == "model.embed_tokens.weight")
    assert embed.shape[0] == expected["model.embed_tokens.weight"].shape[0]  # 997/1003 rows, not 1024
    for b in plan.buckets:  # over the bound only when one engine module alone is larger
        assert b.nbytes <= plan.bucket_bytes or len({engine_module(t.hf_name) for t in b.tensors}) == 1
    # q, k, v (and biases) of a layer share one bucket: the engine completes qkv_proj at once.
    for b in plan.buckets:
        for t in b.tensors:
            if ".q_proj." in t.hf_name:
                siblings = {t.hf_name.replace("q_proj", x) for x in ("k_proj", "v_proj")}
                assert siblings <= {u.hf_name for u in b.tensors}


def test_at_equal_tp_each_engine_rank_is_fed_by_its_own_trainer_tp_rank(world, models):
    hf_dir, start_dir, _ = models["llama-untied"]
    results = world.run(_stream, LAYOUTS["TP2xPP2"], hf_dir, start_dir, "float32")
    plan = _plan_for(results, hf_dir)
    arch = plan.arch
    for engine_rank in (0, 1):
        params = {p.name: p for p in engine_params(arch, tp=2, rank=engine_rank)}
        qkv = engine_param_sources(plan, params["model.layers.1.self_attn.qkv_proj.weight"])
        # layer 1 lives on stage 0 (ranks 0, 1); trainer tp_rank == engine rank
        assert qkv == {(engine_rank, "decoder.layers.self_attention.linear_qkv.weight", 1)}
        down = engine_param_sources(plan, params["model.layers.0.mlp.down_proj.weight"])
        assert {r for r, _, _ in down} == {engine_rank}
    # at engine TP1 one qkv_proj needs both trainer TP shards
    whole = {p.name: p for p in engine_params(arch, tp=1)}["model.layers.1.self_attn.qkv_proj.weight"]
    assert {r for r, _, _ in engine_param_sources(plan, whole)} == {0, 1}


@pytest.mark.parametrize("overlap,transport", [(True, "shared"), (True, "buckets"),
                                               (False, "buckets")])
def test_a_corrupted_bucket_fails_the_sync_on_every_rank_and_the_engine_says_so(
        world, models, overlap, transport):
    hf_dir, start_dir, expected = models["llama-untied"]
    results = world.run(_stream, LAYOUTS["TP2xPP2"], hf_dir, start_dir, "float32",
                        _flip_one_byte_of_bucket_two, overlap=overlap, writer_threads=2,
                        threaded_above=0, transport=transport)
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, "every rank raises the same error"
    message = errors.pop()
    assert "bucket 3/" in message and "checksum" in message and "mix of weight versions" in message
    assert results[0]["version"] is None and not results[0]["consistent"]
    assert results[0]["generated"].startswith("refused: weight sync to version 3 failed")
    # nothing of the corrupted bucket was loaded; buckets 1-2 were (the engine is mixed)
    params = results[0]["params"]
    assert torch.equal(params["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])
    assert not torch.equal(params["model.norm.weight"], expected["model.norm.weight"])


def _controller_fails_at_bucket_two(k, buffer, manifest):
    if k == 2:
        raise RuntimeError("manifest lost")


@pytest.mark.parametrize("overlap", [True, False])
def test_a_controller_side_failure_fails_the_sync_on_every_rank(world, models, overlap):
    hf_dir, start_dir, _ = models["llama-untied"]
    results = world.run(_stream, LAYOUTS["TP2xPP2"], hf_dir, start_dir, "float32",
                        _controller_fails_at_bucket_two, overlap=overlap)
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, errors
    assert "bucket 3/" in errors.pop()
    assert results[0]["version"] is None and not results[0]["consistent"]


def _whole_plan(built, rank) -> ReshardPlan:
    """The plan from every rank's holdings of ``built`` (collective), 64 KB buckets."""
    from mcore_rl.parallel.agreement import all_gather
    from mcore_rl.reshard.sources import local_holdings

    everyone = all_gather(local_holdings(built.chunks, rank)[0])
    return ReshardPlan.build([h for hs in everyone for h in hs], built.spec.arch, 2**16)


def _gathered(rank, world_size, layout, hf_dir):
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.gather import gather_hf_tensors
    from mcore_rl.reshard.sources import local_holdings

    tp, pp, vpp, *cp = layout
    ctx = initialize_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp[0] if cp else 1)
    try:
        built = build_model(hf_dir, ctx)
        return gather_hf_tensors(_whole_plan(built, rank), local_holdings(built.chunks, rank)[1], rank)
    finally:
        destroy_parallel()


def test_gathering_every_piece_to_one_rank_rebuilds_the_hf_checkpoint(world, models):
    hf_dir, _, expected = models["qwen2-tied"]
    results = world.run(_gathered, LAYOUTS["TP2xPP2"], hf_dir)
    assert all(r is None for r in results[1:])
    assert sorted(results[0]) == sorted(expected)
    assert all(torch.equal(results[0][n], t) for n, t in expected.items())


def _shared_misuse(rank, world_size, hf_dir, start_dir):
    """Shared transport asked for where it cannot be; then parameters reallocated after the
    `WeightSync` was built. The errors raised, per rank."""
    from mcore_rl.engines.hf_engine import HFEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync

    ctx = initialize_parallel(tp=2, pp=2)
    built = build_model(hf_dir, ctx)
    engines = [HFEngine(start_dir)] if rank == 0 else None
    out = {}
    try:
        try:  # no engine given to the controller
            WeightSync.build(built.chunks, built.spec.arch, bucket_mb=BUCKET_MB)
        except ValueError as err:
            out["no_engine"] = str(err)
        try:
            WeightSync.build(built.chunks, built.spec.arch, engines=engines, bucket_mb=BUCKET_MB,
                             wire_dtype=torch.bfloat16, transport="shared")
        except ValueError as err:
            out["unshareable"] = str(err)
        with WeightSync.build(built.chunks, built.spec.arch, engines=engines,
                              bucket_mb=BUCKET_MB, transport="shared") as sync:
            if rank == 3:  # a TP shard: rank 3 sends it
                param = built.chunks[0].decoder.layers[0].self_attention.linear_qkv.weight
                param.data = param.data.clone()
            try:
                sync.sync(version=1)
            except WeightSyncError as err:
                out["moved"] = str(err)
        return out
    finally:
        destroy_parallel()


def test_shared_transport_misuse_fails_with_the_reason_on_every_rank(world, models):
    hf_dir, start_dir, _ = models["qwen2-tied"]
    results = world.run(_shared_misuse, hf_dir, start_dir)
    assert [r.get("no_engine") for r in results] == \
        ["the controller rank needs at least one engine to sync into"] * 4
    assert len({r.get("unshareable") for r in results}) == 1
    assert "reshard.transport=shared is not possible here (rank 0:" in results[0]["unshareable"]
    assert "the engine takes torch.bfloat16" in results[0]["unshareable"]
    assert len({r.get("moved") for r in results}) == 1
    assert "rank 3" in results[0]["moved"]
    assert "moved out of the shared weight file" in results[0]["moved"]


def _relayed(rank, world_size, layout, hf_dir, start_dir, wire, fail_rank=None):
    """Ranks 2 and 3 stand for another node: they cannot map the bucket file and relay."""
    from mcore_rl.engines.hf_engine import HFEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync

    ctx = initialize_parallel(tp=layout[0], pp=layout[1])
    built = build_model(hf_dir, ctx)
    engine = HFEngine(start_dir) if rank == 0 else None
    try:
        with WeightSync.build(built.chunks, built.spec.arch,
                              engines=[engine] if engine else None, bucket_mb=BUCKET_MB,
                              wire_dtype=getattr(torch, wire), local_ranks={0, 1}) as sync:
            if rank == fail_rank:
                def broken(share):
                    raise RuntimeError("staging copy failed")
                sync.writer.run = broken
            out = {"transport": sync.transport, "maps_file": sync.channel.buffer is not None}
            try:
                sync.sync(version=4)
                out["error"] = None
            except WeightSyncError as err:
                out["error"] = str(err)
        if rank == 0:
            out["params"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
            out["version"] = engine.weight_version
        return out
    finally:
        destroy_parallel()


@pytest.mark.parametrize("layout", ["PP2", "TP2xPP2"])
def test_ranks_on_another_node_relay_their_pieces_and_the_engine_gets_the_exact_tensors(
        world, models, layout):
    hf_dir, start_dir, expected = models["llama-untied"]
    results = world.run(_relayed, LAYOUTS[layout][:2], hf_dir, start_dir, "float32")
    assert [r["error"] for r in results] == [None] * 4, results[0]["error"]
    assert {r["transport"] for r in results} == {"buckets"}
    assert [r["maps_file"] for r in results] == [True, True, False, False]
    assert results[0]["version"] == 4
    for hf_name, tensor in expected.items():
        assert torch.equal(results[0]["params"][hf_name], tensor), f"{layout}: {hf_name}"


def test_a_relaying_rank_that_fails_fails_the_sync_everywhere_without_a_hang(world, models):
    hf_dir, start_dir, _ = models["qwen2-tied"]
    results = world.run(_relayed, LAYOUTS["TP2xPP2"][:2], hf_dir, start_dir, "bfloat16",
                        fail_rank=3)
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors
    message = errors.pop()
    assert "rank 3 writing bucket" in message and "staging copy failed" in message
    assert results[0]["version"] is None


def _delta_relayed(rank, world_size, hf_dir, start_dir):
    """TP2xPP2, ranks 2 and 3 relay with deltas (every 2nd sync in full), bf16 on the wire.
    Syncs: 1 full (no baseline yet); 2 a delta after 5% of every parameter changed by 1%;
    3 full, same weights; 4 a delta with a word of the controller's baseline flipped; 5 full
    again (after the failure). The engine's parameters after 2, 3 and 5, and the stats."""
    from mcore_rl.engines.hf_engine import HFEngine
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.sources import parameters
    from mcore_rl.reshard.stream import WeightSync

    ctx = initialize_parallel(tp=2, pp=2)
    built = build_model(hf_dir, ctx)
    engine = HFEngine(start_dir) if rank == 0 else None
    out = {"stats": {}, "params": {}, "errors": {}}

    def snapshot():
        return {k: v.clone() for k, v in engine.model.state_dict().items()} if engine else None

    try:
        with WeightSync.build(built.chunks, built.spec.arch, engines=[engine] if engine else None,
                              bucket_mb=BUCKET_MB, wire_dtype=torch.bfloat16, local_ranks={0, 1},
                              delta=True, full_every=2) as sync:
            for version in range(1, 6):
                if version == 2:
                    with torch.no_grad():
                        for p in parameters(built.chunks):
                            p.view(-1)[::20].mul_(1.01)
                if version == 4 and rank == 0:
                    base = next(iter(sync.channel._receiver.base.values()))
                    base[0] ^= 1
                try:
                    stats = sync.sync(version=version)
                    out["stats"][version] = (stats.relayed_nbytes, stats.relayed_full_nbytes,
                                             stats.changed_fraction)
                except WeightSyncError as err:
                    out["errors"][version] = str(err)
                out["params"][version] = snapshot()
        return out
    finally:
        destroy_parallel()


def test_relayed_deltas_give_the_engine_what_a_full_sync_gives_and_a_bad_one_is_caught(world,
                                                                                        models):
    hf_dir, start_dir, _ = models["llama-untied"]
    results = world.run(_delta_relayed, hf_dir, start_dir)
    controller = results[0]
    assert {v for r in results for v in r["errors"]} == {4}  # every rank, sync 4 only
    assert "checksum" in controller["errors"][4], controller["errors"][4]
    stats, params = controller["stats"], controller["params"]
    sent, full, changed = stats[2]
    assert 0.03 < changed < 0.07, changed  # 1 word in 20 changed
    assert sent < 0.25 * full, (sent, full)
    for version in (1, 3, 5):  # full sends
        assert stats[version][0] >= stats[version][1] * 0.99 and stats[version][2] is None
    assert not all(torch.equal(params[1][k], params[2][k]) for k in params[1])  # a real change
    for version in (3, 5):  # the full path, the verified one, gives the same weights
        for k, tensor in params[2].items():
            assert torch.equal(params[version][k], tensor), (version, k)


def _as_weight_source(rank, world_size, layout, hf_dir, bad_rank=None):
    """The plan as vLLM's WeightSource, driven by vLLM's own ``iter_groups`` (its order
    check) on every rank, twice (a fresh pass each time)."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.stream import WeightSync
    from mcore_rl.reshard.weight_source import plan_source

    ctx = initialize_parallel(tp=layout[0], pp=layout[1])
    built = build_model(hf_dir, ctx)

    class _Engine:  # the controller needs one to map the file; it loads nothing here
        def attach_update_buffer(self, path, nbytes):
            from mcore_rl.wire import BucketReader
            self.reader = BucketReader()
            self.reader.open(path, nbytes)

        def release_update_buffer(self):
            self.reader.close()

    try:
        with WeightSync.build(built.chunks, built.spec.arch,
                              engines=[_Engine()] if rank == 0 else None,
                              bucket_mb=BUCKET_MB, transport="buckets") as sync:
            source = plan_source(sync)
            meta = source.metadata()
            out = {"names": [m.name for m in meta],
                   "grouped": [n for g in layerwise_groups([m.name for m in meta]) for n in g],
                   "shapes": {m.name: tuple(m.shape) for m in meta}, "passes": []}
            if rank == bad_rank:
                def broken(share):
                    raise RuntimeError("copy failed")
                sync.writer.run = broken
            for _ in range(2):
                got = {}
                try:
                    for names, tensors in source.iter_groups():
                        for name, t in zip(names, tensors):
                            got[name] = None if t is None else t.clone()
                except WeightSyncError as err:
                    got = str(err)
                out["passes"].append(got)
        return out
    finally:
        destroy_parallel()


def test_the_plan_as_vllms_weight_source_passes_its_order_check_and_yields_the_checkpoint(
        world, models):
    hf_dir, _, expected = models["qwen2-tied"]
    results = world.run(_as_weight_source, LAYOUTS["TP2xPP2"][:2], hf_dir)
    controller = results[0]
    assert controller["names"] == controller["grouped"]  # metadata is in layerwise order
    assert sorted(controller["names"]) == sorted(expected)
    for got in controller["passes"]:  # every pass, fresh: the checkpoint's tensors exactly
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert got[name].shape == controller["shapes"][name]
            assert torch.equal(got[name], tensor), name
    for r in results[1:]:  # the other ranks iterate in lockstep, holding nothing
        assert r["names"] == controller["names"]
        assert all(set(p.values()) == {None} for p in r["passes"])


def test_a_rank_failing_inside_the_weight_source_fails_every_rank_without_a_hang(world, models):
    hf_dir, _, _ = models["qwen2-tied"]
    results = world.run(_as_weight_source, LAYOUTS["TP2xPP2"][:2], hf_dir, bad_rank=2)
    messages = {p for r in results for p in r["passes"]}
    assert len(messages) == 1, messages
    assert "rank 2 writing bucket 1" in messages.pop()


# ----- vLLM's GPU backends (mcore_rl.reshard.native), checked on CPU -----------------------------
def _stub_trainer():
    """A trainer-side engine registered in vLLM's factory that drives the protocol as vLLM's
    full-resync backends do (every rank iterates the source; the sender calls the client and
    'sends' the tensors by handing them to the engine as update info), or takes patches."""
    from dataclasses import dataclass
    from typing import ClassVar

    from vllm.distributed.weight_transfer import (TrainerWeightTransferEngine,
                                                  WeightTransferTrainerFactory)
    from vllm.distributed.weight_transfer.base import TrainerInitInfo

    if "mcore_rl_test_stub" in WeightTransferTrainerFactory._registry:
        return WeightTransferTrainerFactory._registry["mcore_rl_test_stub"]()

    @dataclass
    class StubInit(TrainerInitInfo):
        backend: ClassVar[str] = "mcore_rl_test_stub"
        engine_ranks: int = 1

    class StubTrainer(TrainerWeightTransferEngine):
        init_info_cls = StubInit

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            if engine.is_sender:
                client.init_weight_transfer_engine({"engine_ranks": init_info.engine_ranks})
            return engine

        def send_weights(self):  # a full-resync backend: vLLM's order check, then 'send'
            if not self.is_sender:
                for _ in self.source.iter_groups():
                    pass
                return
            self.client.start_weight_update()
            for names, ts in self.source.iter_groups():  # one update per layer, as it comes
                self.client.update_weights({"tensors": list(zip(names, ts))})
            self.client.finish_weight_update()

        def send_weight_chunk(self, patches):  # sparse_nccl's, inside the caller's session
            for p in patches:  # what vLLM's sparse trainer checks before sending
                assert p.indices.dtype == torch.int32 and p.indices.ndim == p.values.ndim == 1
                assert p.indices.numel() == p.values.numel() and p.full_shape
            if self.is_sender:
                self.client.update_weights({"patches": patches})

    WeightTransferTrainerFactory.register_engine("mcore_rl_test_stub", StubTrainer)
    StubTrainer.init_cls = StubInit
    return StubTrainer


class _ProtocolEngine:
    """The engine's side of the protocol: keeps what arrives, applying patches in place."""

    tp = 2

    def __init__(self, fail_update_of_sync=None):
        self.calls, self.weights, self.version = [], {}, None
        self.fail_update_of_sync, self.syncs = fail_update_of_sync, 0

    def transfer(self, step, payload=None):
        self.calls.append(step)
        if step == "ranks":
            return self.tp
        if step == "start":
            self.syncs += 1
        if step == "update" and self.syncs == self.fail_update_of_sync:
            raise RuntimeError("worker 1 lost its NCCL peer")
        if step == "update" and "tensors" in payload:
            self.weights.update({n: t.clone() for n, t in payload["tensors"]})
        elif step == "update":
            for p in payload["patches"]:
                flat = self.weights.setdefault(p.name, torch.zeros(p.full_shape)).view(-1)
                flat[p.indices.long()] = p.values
        elif step == "finish":
            self.version = payload
        elif step == "abort":  # as VLLMEngine: no version served until a sync finishes
            self.version = None


def _native(rank, world_size, layout, hf_dir, transport, steps, fail=None):
    """NativeWeightSync at ``layout`` into two protocol engines through the stub trainer:
    per sync, what each engine holds and its calls, or the error raised on this rank; between
    syncs one element of one parameter changes. ``fail``: (sync, engine) whose update fails."""
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.native import NativeWeightSync

    stub = _stub_trainer()
    ctx = initialize_parallel(tp=layout[0], pp=layout[1])
    try:
        built = build_model(hf_dir, ctx)
        plan = _whole_plan(built, rank)
        fails = [fail[0] if fail and fail[1] == k else None for k in range(2)]
        engines = [_ProtocolEngine(f) for f in fails] if rank == 0 else []
        sync = NativeWeightSync(
            built.chunks, plan, transport, engines=engines, full_every=3,
            init_info=lambda backend, r, n: stub.init_cls(rank=r, engine_ranks=n))
        out = []
        for version in range(1, steps + 1):
            if rank == 0 and version > 1:  # the trainer 'steps': one element of a parameter
                with torch.no_grad():
                    next(p for c in built.chunks for p in c.parameters()).view(-1)[0] += 1.0
            try:
                stats = sync.sync(version)
            except WeightSyncError as err:
                out.append({"error": str(err), "versions": [e.version for e in engines]})
                continue
            out.append({"weights": [{n: t.clone() for n, t in e.weights.items()} for e in engines],
                        "versions": [e.version for e in engines],
                        "changed_fraction": stats.changed_fraction,
                        "sent": stats.sent_nbytes, "full": stats.nbytes})
        sync.close()
        out.append([e.calls for e in engines])
        return out
    finally:
        destroy_parallel()


def test_vllm_backends_sync_sends_the_checkpoint_once_per_engine_with_its_version(world, models):
    hf_dir, _, expected = models["qwen2-tied"]
    results = world.run(_native, LAYOUTS["TP2xPP2"][:2], hf_dir, "nccl", 1)
    first, calls = results[0][0], results[0][-1]
    assert first["versions"] == [1, 1]
    for held in first["weights"]:  # every engine, the checkpoint exactly, in vLLM's order
        assert sorted(held) == sorted(expected)
        assert all(torch.equal(held[n], t) for n, t in expected.items())
    for engine_calls in calls:  # one session, an update per layer
        assert engine_calls[:4] == ["ranks", "init", "check", "start"]
        assert engine_calls[-2:] == ["finish", "shutdown"] and set(engine_calls[4:-2]) == {"update"}
    assert all(r[-1] == [] for r in results[1:])  # only the controller calls the engines
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert first["sent"] == 2 * checkpoint_bytes  # every tensor, to each engine


@pytest.mark.parametrize("transport", ["nccl", "sparse_nccl"])
def test_an_engine_failing_mid_sync_fails_it_on_every_rank_and_the_next_sync_is_whole(
        world, models, transport):
    hf_dir, _, expected = models["qwen2-tied"]
    results = world.run(_native, LAYOUTS["TP2xPP2"][:2], hf_dir, transport, 3, fail=(2, 1))
    # sync 2 failed on every rank, the same way: the controller gave up mid-pass (nccl: at the
    # first layer), the others went on gathering, and nobody hung
    errors = {r[1]["error"] for r in results}
    assert len(errors) == 1 and "worker 1 lost its NCCL peer" in errors.pop()
    controller = results[0]
    assert controller[1]["versions"][1] is None  # the failed engine serves no version
    third, calls = controller[2], controller[-1]
    assert third["versions"] == [3, 3]
    for held in third["weights"]:  # whole again: the checkpoint, one element moved twice
        diff = [n for n in expected if not torch.equal(held[n], expected[n])]
        assert len(diff) == 1 and held[diff[0]].view(-1)[0] == expected[diff[0]].view(-1)[0] + 2
    if transport == "sparse_nccl":
        assert third["changed_fraction"] == 1.0  # after a failure, every element
    for engine_calls in calls:  # each engine was told, and the backend started again
        assert "abort" in engine_calls and engine_calls.count("init") == 2


def test_sparse_patches_rebuild_the_weights_and_send_only_what_changed(world, models):
    hf_dir, _, expected = models["qwen2-tied"]
    results = world.run(_native, LAYOUTS["TP2xPP2"][:2], hf_dir, "sparse_nccl", 4)
    syncs = results[0][:-1]
    total = sum(t.numel() for t in expected.values())
    assert syncs[0]["changed_fraction"] == 1.0  # the first sync is full
    for s in syncs[1:3]:  # one element changed: one patched element per engine
        assert s["changed_fraction"] == pytest.approx(1 / total)
    assert syncs[3]["changed_fraction"] == 1.0  # every full_every-th (3rd) sync is full again
    bumped = None
    for k, s in enumerate(syncs):
        for held in s["weights"]:
            diff = [n for n in expected if not torch.equal(held[n], expected[n])]
            if k == 0:
                assert diff == []
            else:  # the engine holds the trainer's weights: one element moved by k
                assert len(diff) == 1
                bumped = bumped or diff[0]
                assert diff == [bumped]
                assert held[bumped].view(-1)[0] == expected[bumped].view(-1)[0] + k
    assert syncs[-1]["versions"] == [4, 4]
    # bytes to both engines: every element with its int32 index when full, one element's when not
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert syncs[0]["sent"] == 2 * 2 * checkpoint_bytes  # fp32 values + int32 indices
    assert syncs[1]["sent"] == 2 * (4 + 4)


def _gathered_source(rank, world_size, layout, hf_dir, everyone):
    from vllm.distributed.weight_transfer.base import layerwise_groups

    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.native import gathered_source
    from mcore_rl.reshard.sources import local_holdings

    ctx = initialize_parallel(tp=layout[0], pp=layout[1])
    try:
        built = build_model(hf_dir, ctx)
        plan = _whole_plan(built, rank)
        source = gathered_source(plan, lambda: local_holdings(built.chunks, rank)[1], rank, 0,
                                 everyone=everyone)
        names = [m.name for m in source.metadata()]
        got = {n: t for names_, ts in source.iter_groups() for n, t in zip(names_, ts)}
        return {"ordered": names == [n for g in layerwise_groups(names) for n in g],
                "got": got}
    finally:
        destroy_parallel()


@pytest.mark.parametrize("everyone", [False, True], ids=["to-sender", "everyone"])
def test_the_gathered_source_yields_the_checkpoint_in_vllms_order(world, models, everyone):
    hf_dir, _, expected = models["llama-untied"]
    results = world.run(_gathered_source, LAYOUTS["TP2xPP2"][:2], hf_dir, everyone)
    for rank, r in enumerate(results):
        assert r["ordered"]
        assert sorted(r["got"]) == sorted(expected)
        if rank == 0 or everyone:
            assert all(torch.equal(r["got"][n], t) for n, t in expected.items())
        else:
            assert set(r["got"].values()) == {None}


class _SGLangStandIn:
    """SGLang's side of ``init_weights_update_group`` / ``update_weights_from_distributed``
    as `SGLangEngine.transfer` drives it: one receiving worker in a gloo group with the
    controller (rank 0), taking each broadcast tensor of a bucket by name, dtype and shape.
    ``fail_bucket``: (sync, bucket) whose load fails after the tensors arrived;
    ``fail_before``: (sync, bucket) refused before anything is received (as SGLang's checks
    of the request refuse it), which leaves the controller's broadcast without a receiver."""

    tp = 1

    def __init__(self, fail_bucket=None, fail_before=None):
        self.calls, self.weights, self.version, self.groups = [], {}, None, {}
        self.fail_bucket, self.fail_before = fail_bucket, fail_before
        self.syncs, self.buckets = 0, 0

    def transfer(self, step, payload=None):
        import datetime

        import torch.distributed as dist

        self.calls.append(step)
        if step == "ranks":
            return self.tp
        if step == "check":
            self.syncs, self.buckets = self.syncs + 1, 0
        elif step == "init":  # rank 1: the engine's only worker
            host, port = payload["master_address"], payload["master_port"]
            store = dist.TCPStore(host, port, payload["world_size"], is_master=False)
            self.groups[payload["group_name"]] = dist.ProcessGroupGloo(
                dist.PrefixStore(payload["group_name"], store), payload["rank_offset"],
                payload["world_size"], datetime.timedelta(seconds=STAND_IN_TIMEOUT_S))
        elif step == "update":
            self.buckets += 1
            if (self.syncs, self.buckets) == self.fail_before:
                raise RuntimeError("SGLang's update_weights_from_distributed: group not found")
            group = self.groups[payload["group_name"]]
            for name, dtype, shape in zip(payload["names"], payload["dtypes"], payload["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                group.broadcast(t, 0).wait()
                self.weights[name] = t
            if (self.syncs, self.buckets) == self.fail_bucket:
                raise RuntimeError("SGLang's update_weights_from_distributed: load_weights failed")
        elif step == "finish":
            self.version = payload
        elif step == "abort":
            self.version, self.groups = None, {}


def _controller_group(*, backend, init_method, world_size, rank, group_name, timeout):
    """The controller's side, as SGLang's helper makes it, over gloo (the TCP store's host)."""
    import datetime

    import torch.distributed as dist

    assert timeout.total_seconds() > 0  # the rendezvous is bounded

    host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world_size, is_master=True, wait_for_workers=False)
    _controller_group.stores.append(store)  # held for the group's life
    return dist.ProcessGroupGloo(dist.PrefixStore(group_name, store), rank, world_size,
                                 datetime.timedelta(seconds=STAND_IN_TIMEOUT_S))


_controller_group.stores = []
STAND_IN_TIMEOUT_S = 10  # gloo's wait for a peer (NCCL's side: the controller aborts its group)


def _sglang_sync(rank, world_size, layout, hf_dir, syncs, fail_bucket=None, fail_before=None):
    """SGLangBroadcastSync at ``layout`` into two stand-in engines: per sync what each holds
    and its version, or the error on this rank; then each engine's calls."""
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.parallel.ports import free_port
    from mcore_rl.reshard.sglang_broadcast import SGLangBroadcastSync

    ctx = initialize_parallel(tp=layout[0], pp=layout[1])
    try:
        built = build_model(hf_dir, ctx)
        plan = _whole_plan(built, rank)
        engines = [_SGLangStandIn(), _SGLangStandIn(fail_bucket, fail_before)] \
            if rank == 0 else []
        sync = SGLangBroadcastSync(built.chunks, plan, engines=engines,
                                   make_group=_controller_group, device="cpu", backend="gloo",
                                   address=lambda: ("127.0.0.1", free_port()))
        out = []
        for version in range(1, syncs + 1):
            try:
                stats = sync.sync(version)
            except WeightSyncError as err:
                out.append({"error": str(err), "versions": [e.version for e in engines]})
                continue
            out.append({"weights": [dict(e.weights) for e in engines], "sent": stats.sent_nbytes,
                        "versions": [e.version for e in engines], "buckets": len(plan.buckets)})
        sync.close()
        out.append([e.calls for e in engines])
        return out
    finally:
        destroy_parallel()


def test_sglang_nccl_updates_give_each_engine_the_checkpoint_bucket_by_bucket(world, models):
    hf_dir, _, expected = models["qwen2-tied"]
    results = world.run(_sglang_sync, LAYOUTS["TP2xPP2"][:2], hf_dir, 1)
    first, calls = results[0][0], results[0][-1]
    assert first["versions"] == [1, 1]
    for held in first["weights"]:  # what SGLang's workers received: the checkpoint exactly
        assert sorted(held) == sorted(expected)
        assert all(torch.equal(held[n], t) for n, t in expected.items())
    for engine_calls in calls:  # joined once, one update call per bucket, then the version
        assert engine_calls == ["ranks", "init", "check", *["update"] * first["buckets"],
                                "finish", "shutdown"]
    assert all(r[-1] == [] for r in results[1:])  # only the controller calls the engines
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert first["sent"] == 2 * checkpoint_bytes


@pytest.mark.parametrize("where, cause", [("fail_bucket", "load_weights failed"),
                                          ("fail_before", "group not found")])
def test_an_sglang_update_failing_fails_the_sync_everywhere_and_the_next_one_rejoins(
        world, models, where, cause):
    """A load that fails after its tensors arrived, or a request refused before the engine
    receives anything (the controller's broadcast then has no receiver: it fails at the
    group's timeout here; on NCCL the controller aborts the group): no rank hangs."""
    hf_dir, _, expected = models["qwen2-tied"]
    results = world.run(_sglang_sync, LAYOUTS["TP2xPP2"][:2], hf_dir, 2, **{where: (1, 2)})
    errors = {r[0]["error"] for r in results}
    assert len(errors) == 1 and "engine 2, bucket 2/" in (e := errors.pop()) and cause in e
    controller = results[0]
    assert controller[0]["versions"] == [None, None]  # both told: neither serves a version
    second, calls = controller[1], controller[-1]
    assert second["versions"] == [2, 2]
    for held in second["weights"]:
        assert all(torch.equal(held[n], t) for n, t in expected.items())
    for engine_calls in calls:  # each engine was told, and joined a new group
        assert "abort" in engine_calls and engine_calls.count("init") == 2
