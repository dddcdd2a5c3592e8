"""Megatron-Core MoE models built from HF checkpoints compute HF transformers' logits.

Tiny random Qwen3-MoE (``norm_topk_prob`` False and True) and Mixtral, 8 experts, top-2,
fp32, on 4 ranks: Megatron logits equal the HF logits (eager attention) within 1e-4 at EP2
(DP4 for the dense part), EP2 x PP2, TP2 x PP2 and TP2 x EP2, with both token dispatchers
(all-to-all and all-gather), from the HF directory and from a checkpoint converted at
TP2 x PP2. The two Qwen3-MoE variants share their weights and differ only in how routing
weights are normalised, and their HF logits differ: a router set up the other way round
would fail the comparison.
"""
import pytest
import torch

from mcore_rl.convert import convert_hf_to_mcore
from tests.models.tiny_hf import load_hf, tokens
from tests.models.tiny_moe import save_tiny_moe_model
from tests.world import shared_world

ATOL = 1e-4
# (tp, pp, ep, dispatcher)
FULL = [(1, 1, 1, "alltoall"), (1, 1, 2, "alltoall"), (1, 1, 2, "allgather"),
        (1, 2, 2, "alltoall"), (2, 2, 1, "alltoall"), (2, 1, 2, "allgather")]
SHORT = [(1, 2, 2, "alltoall"), (2, 2, 1, "allgather"), (2, 1, 2, "alltoall")]
LAYOUTS = {"qwen3moe": FULL, "qwen3moe-norm": SHORT, "mixtral": SHORT}
FROM_CHECKPOINT = (1, 2, 2, "alltoall")


@pytest.fixture(scope="module")
def world():
    return shared_world(4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per variant: HF dir, converted checkpoint (TP2 x PP2), input tokens, HF logits."""
    root = tmp_path_factory.mktemp("moe_parity")
    out = {}
    for variant in LAYOUTS:
        hf_dir = save_tiny_moe_model(variant, root / variant / "hf")
        ckpt = convert_hf_to_mcore(hf_dir, root / variant / "mcore", tp=2, pp=2, progress=False)
        model = load_hf(hf_dir)
        toks = tokens(model.config.vocab_size, batch=2, seq=16)
        with torch.no_grad():
            out[variant] = (str(hf_dir), str(ckpt), toks, model(toks).logits)
    return out


def _logits_at_layouts(rank, world_size, hf_dir, ckpt_dir, toks, layouts):
    from mcore_rl.models.moe import MoeOptions
    from mcore_rl.models.provider import build_model
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from tests.models.megatron_forward import forward_all_stages

    results = {}
    for layout in layouts:
        tp, pp, ep, dispatcher = layout
        ctx = initialize_parallel(tp=tp, pp=pp, ep=ep)
        sources = [("hf", hf_dir)] + ([("mcore", ckpt_dir)] if layout == FROM_CHECKPOINT else [])
        for name, source in sources:
            built = build_model(source, ctx, role="actor", moe=MoeOptions(dispatcher=dispatcher))
            for chunk in built.chunks:  # Megatron trains MoE under TP only with sequence parallel
                chunk.eval()
            logits = forward_all_stages(ctx, built.chunks, toks)
            if logits is not None and ctx.tp_rank == 0:
                results.setdefault((layout, name), []).append(logits)
        destroy_parallel()
    return results


def test_router_normalisation_changes_the_hf_logits(models):
    a, b = models["qwen3moe"][3], models["qwen3moe-norm"][3]
    assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_moe_logits_equal_hf_at_ep2_tp2xpp2_ep2xpp2_and_tp2xep2(world, models, variant):
    hf_dir, ckpt_dir, toks, reference = models[variant]
    results: dict = {}
    for per_rank in world.run(_logits_at_layouts, hf_dir, ckpt_dir, toks, LAYOUTS[variant]):
        for key, logits in per_rank.items():
            results.setdefault(key, []).extend(logits)
    expected = {(lay, "hf") for lay in LAYOUTS[variant]}
    if FROM_CHECKPOINT in LAYOUTS[variant]:
        expected.add((FROM_CHECKPOINT, "mcore"))
    assert set(results) == expected
    vocab = reference.shape[-1]
    for ((tp, pp, ep, dispatcher), source), per_dp_rank in results.items():
        where = f"{variant} TP{tp} PP{pp} EP{ep} {dispatcher} from {source}"
        for logits in per_dp_rank:  # every data-parallel replica computes the same logits
            diff = (logits[..., :vocab] - reference).abs().max().item()
            assert diff <= ATOL, f"{where}: max |logit - HF| = {diff:.3g}"
