"""DPO (sigmoid, ipo) and KTO losses and gradients equal TRL's (PyPI ``trl``), fp32.

The oracle is TRL's own trainer: a `DPOTrainer` / `KTOTrainer` built on a tiny random HF
Llama (and a second one as the frozen reference), its ``compute_loss`` on a batch its own
collator made (KTO: with the mismatched completions TRL pairs the same way), backward in
plain torch. Our side is the whole job path on the same weights: records tokenized by our
loaders, the Megatron model built from the same HF directory, reference log-probs (and
KTO's reference point) from our frozen reference engine, one `train_batch` with the job's
loss. The built-in character tokenizer serves both sides (its HF form for TRL), so the
token ids agree. Gradients are compared in HF names.
"""
import pytest
import torch

from mcore_rl.data.toy_task import toy_tokenizer
from tests.world import shared_world

ROWS_DPO = [{"prompt": "3+4=", "chosen": "7", "rejected": "8"},
            {"prompt": "1+2=", "chosen": "3", "rejected": "45"},
            {"prompt": "9+9=", "chosen": "18", "rejected": "1"}]
ROWS_KTO = [{"prompt": "3+4=", "completion": "7", "label": True},
            {"prompt": "1+2=", "completion": "45", "label": False},
            {"prompt": "9+9=", "completion": "18", "label": True},
            {"prompt": "5+0=", "completion": "6", "label": False}]
BETA = 0.5


def save_model(out, seed, init):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = toy_tokenizer()
    config = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=32, initializer_range=init,
                         tie_word_embeddings=False, bos_token_id=tok.bos_id,
                         eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, attn_implementation="eager")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save(out)
    return out


def trl_loss_and_grads(job, policy_dir, ref_dir, tmp_path, loss_type="sigmoid"):
    from datasets import Dataset
    from transformers import LlamaForCausalLM

    policy = LlamaForCausalLM.from_pretrained(policy_dir, attn_implementation="eager")
    ref = LlamaForCausalLM.from_pretrained(ref_dir, attn_implementation="eager")
    tok = toy_tokenizer().to_hf()
    common = dict(output_dir=str(tmp_path / "trl"), beta=BETA, report_to=[], use_cpu=True,
                  bf16=False, dataloader_num_workers=0)
    if job == "dpo":
        from trl import DPOConfig, DPOTrainer

        rows = ROWS_DPO
        trainer = DPOTrainer(model=policy, ref_model=ref, processing_class=tok,
                             args=DPOConfig(per_device_train_batch_size=len(rows),
                                            loss_type=[loss_type], **common),
                             train_dataset=Dataset.from_list(rows))
    else:
        from trl import KTOConfig, KTOTrainer

        rows = ROWS_KTO
        trainer = KTOTrainer(model=policy, ref_model=ref, processing_class=tok,
                             args=KTOConfig(per_device_train_batch_size=len(rows),
                                            desirable_weight=1.3, undesirable_weight=0.6, **common),
                             train_dataset=Dataset.from_list(rows))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    policy.train()
    loss = trainer.compute_loss(policy, batch)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in policy.named_parameters()}


def _ours(rank, world_size, job, policy_dir, ref_dir, loss_type):
    """Our job's loss and gradients (HF names) after one train_batch at TP1."""
    from mcore_rl.config import OptimizerConfig, RLConfig
    from mcore_rl.data.finetune_records import EXAMPLES
    from mcore_rl.finetune.logps import completion_logps
    from mcore_rl.finetune.setup import build_job
    from mcore_rl.models import build_model
    from mcore_rl.models.mapping import tensor_mappings, to_hf
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    cfg = RLConfig()
    cfg.train.job, cfg.finetune.beta, cfg.finetune.dpo_loss = job, BETA, loss_type
    cfg.finetune.desirable_weight, cfg.finetune.undesirable_weight = 1.3, 0.6
    ctx = initialize_parallel(seed=1)
    built = build_model(policy_dir, ctx, role="actor")
    arch = built.spec.arch
    optim = OptimizerConfig(name="sgd", lr=0.0, clip_grad=0.0)
    model = build_engine(built.chunks, ctx, vocab_size=arch.vocab_size, optim=optim)
    reference = build_engine(build_model(ref_dir, ctx, role="reference").chunks, ctx,
                             vocab_size=arch.vocab_size)

    class Run:
        def __init__(self):
            self.model, self.reference = model, reference

        def reference_logps(self, batch):
            return completion_logps(reference, batch)

    job_obj = build_job(cfg)
    examples, _ = EXAMPLES[job](ROWS_DPO if job == "dpo" else ROWS_KTO, cfg, toy_tokenizer(), "t", 32)
    batch = job_obj.prepare(Run(), job_obj.batch(examples, 0))
    result = model.train_batch(batch, job_obj.loss_fn())
    module = model.model[0].module
    import re

    by_key = {}  # (stacked key, layer) -> gradient: by parameter name, then by the checkpoint's keys
    for name, p in module.named_parameters():
        found = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        key = (f"decoder.layers.{found[2]}", int(found[1])) if found else (name, None)
        by_key[key] = p.main_grad.detach().clone()
    grad_of = {p.data_ptr(): p.main_grad for p in module.parameters()}
    for sh in module.sharded_state_dict().values():
        if getattr(sh, "data", None) is not None and hasattr(sh, "global_offset") \
                and sh.data.data_ptr() in grad_of:
            layer = sh.global_offset[0] if sh.key.startswith("decoder.layers.") else None
            by_key[sh.key, layer] = grad_of[sh.data.data_ptr()].detach().clone()
    hf = {}
    for m in tensor_mappings(arch, "lm"):
        for layer in (range(arch.num_layers) if m.per_layer else [None]):
            full = to_hf(m, by_key[m.mcore_key, layer], arch)
            for hf_name, t in zip(m.hf_names_for(layer), full):
                hf[hf_name] = t[:arch.vocab_size] if m.fusion == "vocab" else t
    destroy_parallel()
    return result.loss, hf, batch.info.get("kto_reference_point")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_parity")
    # a sharper reference than the policy: the policy's log-probs of other prompts'
    # completions lie above the reference's on average, so KTO's reference point is not 0
    return (str(save_model(root / "policy", seed=1, init=0.2)),
            str(save_model(root / "ref", seed=2, init=1.0)))


@pytest.mark.parametrize("job, loss_type", [("dpo", "sigmoid"), ("dpo", "ipo"), ("kto", "sigmoid")],
                         ids=["dpo-sigmoid", "dpo-ipo", "kto"])
def test_loss_and_gradients_equal_trl(models, tmp_path, job, loss_type):
    policy_dir, ref_dir = models
    expected_loss, expected = trl_loss_and_grads(job, policy_dir, ref_dir, tmp_path, loss_type)
    loss, grads, z0 = shared_world(1).run(_ours, job, policy_dir, ref_dir, loss_type)[0]
    if job == "kto":
        assert z0 > 0.05, "the KL reference point must not be clamped to 0 here"

    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    assert grads.keys() == expected.keys()
    scale = max(g.abs().max().item() for g in expected.values())
    assert scale > 1e-3, "the gradient must be visible"
    worst = max(((grads[n] - expected[n]).abs().max().item(), n) for n in expected)
    assert worst[0] <= 1e-5 * scale, f"gradient of {worst[1]} differs by {worst[0]:.2e} (scale {scale:.2e})"
