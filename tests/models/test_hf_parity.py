"""Megatron-Core models built from HF checkpoints compute HF transformers' logits.

Tiny random Llama (tied with Llama 3 RoPE scaling, untied), Qwen2 (QKV bias, tied) and
Mistral (untied), fp32: Megatron logits at TP1, TP2, PP2 and TP2 x PP2 equal the HF logits
(eager attention) within fp32 round-off, whether the weights come straight from the HF
directory or from a checkpoint converted at TP2 x PP2.
"""
import pytest
import torch

from mcore_rl.convert import convert_hf_to_mcore
from tests.models.tiny_hf import VARIANTS, load_hf, save_tiny_hf_model, tokens
from tests.world import shared_world

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def world():
    return shared_world(4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per variant: HF dir, converted checkpoint (TP2 x PP2), input tokens, HF logits."""
    root = tmp_path_factory.mktemp("parity")
    out = {}
    for variant in VARIANTS:
        hf_dir = save_tiny_hf_model(variant, root / variant / "hf")
        ckpt = convert_hf_to_mcore(hf_dir, root / variant / "mcore", tp=2, pp=2, progress=False)
        model = load_hf(hf_dir)
        toks = tokens(model.config.vocab_size)
        with torch.no_grad():
            out[variant] = (str(hf_dir), str(ckpt), toks, model(toks).logits)
    return out


def _logits_at_layouts(rank, world_size, hf_dir, ckpt_dir, toks):
    from mcore_rl.models.provider import build_model
    from mcore_rl.models.tied_embeddings import tied_embedding_max_diff
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from tests.models.megatron_forward import forward_all_stages

    results = {}
    for tp, pp in LAYOUTS:
        ctx = initialize_parallel(tp=tp, pp=pp)
        for name, source in (("hf", hf_dir), ("mcore", ckpt_dir)):
            built = build_model(source, ctx, role="actor")
            drift = tied_embedding_max_diff(built.chunks, ctx)
            logits = forward_all_stages(ctx, built.chunks, toks)
            if logits is not None and ctx.tp_rank == 0 and ctx.dp_rank == 0:
                results[(tp, pp, name)] = (logits, built.spec.arch.vocab_size, drift)
        destroy_parallel()
    return results


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_logits_equal_hf_logits_at_tp1_tp2_pp2_tp2xpp2(world, models, variant):
    hf_dir, ckpt_dir, toks, reference = models[variant]
    results = {}
    for per_rank in world.run(_logits_at_layouts, hf_dir, ckpt_dir, toks):
        results.update(per_rank)
    assert set(results) == {(tp, pp, s) for tp, pp in LAYOUTS for s in ("hf", "mcore")}
    for (tp, pp, source), (logits, vocab, drift) in results.items():
        where = f"{variant} TP{tp} PP{pp} from {source}"
        assert logits.shape[-1] % 128 == 0 and logits.shape[-1] >= vocab, where
        diff = (logits[..., :vocab] - reference).abs().max().item()
        assert diff <= ATOL, f"{where}: max |logit - HF| = {diff:.3g}"
        # Padded rows are zero, so padded columns are exactly 0 (and masked before softmax).
        assert torch.count_nonzero(logits[..., vocab:]) == 0, where
        assert drift == 0.0, f"{where}: last-stage copy of tied embeddings differs by {drift}"
