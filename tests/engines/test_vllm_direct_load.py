"""`DirectLoad` on stand-in modules shaped like vLLM's (the real engine: test_vllm_engine.py).

Linear layers repack like vLLM's CPU backend (the kernel keeps its own copy, the parameter
becomes empty); the oracle for the fused weights is ``torch.cat`` of the HF tensors.
"""
import pytest
import torch

from mcore_rl.engines.param_plan import engine_params
from mcore_rl.engines.vllm_direct_load import DirectLoad
from mcore_rl.models.hf_config import spec_from_hf_config
from mcore_rl.wire import WeightSyncError

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 16,
          "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 4, "tie_word_embeddings": False}


class UnquantizedLinearMethod:
    """Stands in for vLLM's: on CPU, processing repacks the weight (a copy in the weight's
    dtype) and leaves an empty parameter of that dtype."""

    def __init__(self, keeps_weight=False, fails=False):
        self.keeps_weight = keeps_weight  # a kernel that reads the weight it is given
        self.fails = fails

    def process_weights_after_loading(self, layer):
        if self.fails:
            raise RuntimeError("repacking failed")
        layer.packed = layer.weight.detach().clone()
        if not self.keeps_weight:
            layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype),
                                              requires_grad=False)


class UnquantizedEmbeddingMethod:
    def process_weights_after_loading(self, layer):
        layer.packed = layer.weight.detach().clone()


class ParallelLMHead(torch.nn.Module):
    pass


def fake_model(method=UnquantizedLinearMethod):
    """Modules at the names and shapes of the engine parameter plan (engine TP1), linear
    weights repacked once, as vLLM does when it loads the model."""
    arch = spec_from_hf_config(CONFIG).arch
    root, shapes = torch.nn.Module(), {}
    for p in engine_params(arch):
        path, _, attr = p.name.rpartition(".")
        parent = root
        for part in path.split("."):
            if not hasattr(parent, part):
                child = ParallelLMHead() if part == "lm_head" else torch.nn.Module()
                parent.add_module(part, child)
            parent = getattr(parent, part)
        shapes[p.name] = list(p.shape)
        if path.endswith("_proj"):
            parent.quant_method = method()
            parent.register_parameter(attr, torch.nn.Parameter(torch.zeros(p.shape), requires_grad=False))
            parent.quant_method.process_weights_after_loading(parent)
        else:
            if "embed" in path or "lm_head" in path:
                parent.quant_method = UnquantizedEmbeddingMethod()
            parent.register_parameter(attr, torch.nn.Parameter(torch.zeros(p.shape), requires_grad=False))
    return root, shapes


def hf_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    h, f, v, d = 16, 24, 100, 4
    out = {"model.embed_tokens.weight": torch.randn(v, h, generator=g),
           "model.norm.weight": torch.randn(h, generator=g),
           "lm_head.weight": torch.randn(v, h, generator=g)}
    for i in range(2):
        p = f"model.layers.{i}"
        out.update({f"{p}.self_attn.q_proj.weight": torch.randn(4 * d, h, generator=g),
                    f"{p}.self_attn.k_proj.weight": torch.randn(2 * d, h, generator=g),
                    f"{p}.self_attn.v_proj.weight": torch.randn(2 * d, h, generator=g),
                    f"{p}.self_attn.o_proj.weight": torch.randn(h, 4 * d, generator=g),
                    f"{p}.mlp.gate_proj.weight": torch.randn(f, h, generator=g),
                    f"{p}.mlp.up_proj.weight": torch.randn(f, h, generator=g),
                    f"{p}.mlp.down_proj.weight": torch.randn(h, f, generator=g),
                    f"{p}.input_layernorm.weight": torch.randn(h, generator=g),
                    f"{p}.post_attention_layernorm.weight": torch.randn(h, generator=g)})
    return out


def in_bucket(tensors: dict, order: list[str]):
    """The tensors back to back in one uint8 buffer, in ``order``; views of it by name."""
    buffer = torch.zeros(sum(t.numel() * t.element_size() for t in tensors.values()),
                         dtype=torch.uint8)
    views, at = {}, 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        views[name] = buffer[at:at + n].view(t.dtype).view(t.shape)
        views[name].copy_(t)
        at += n
    return buffer, views


def loaded(model, name):
    module = model.get_submodule(name.rpartition(".")[0])
    return getattr(module, "packed", None) if name.endswith("_proj.weight") else getattr(module, "weight")


@pytest.mark.parametrize("order", ["qkv", "vkq"])
def test_fused_weights_equal_the_concatenated_hf_tensors_and_outlive_the_bucket(order):
    model, shapes = fake_model()
    direct, why = DirectLoad.build(model, CONFIG, shapes, tp=1, rank=0)
    assert direct is not None, why
    tensors = hf_tensors()
    names = list(tensors)  # q, k, v back to back: qkv_proj is a view of the bucket
    if order == "vkq":  # not in the engine's order: gathered into the staging tensor
        for i in range(2):
            at = names.index(f"model.layers.{i}.self_attn.q_proj.weight")
            names[at:at + 3] = reversed(names[at:at + 3])
    buffer, views = in_bucket(tensors, names)
    direct.begin()
    direct.load(views, buffer)
    direct.finish()
    buffer.zero_()  # the next bucket overwrites the file: nothing may still point into it
    for i in range(2):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        qkv = torch.cat([tensors[f"{attn}.{x}_proj.weight"] for x in "qkv"])
        gate_up = torch.cat([tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"]])
        assert torch.equal(loaded(model, f"{attn}.qkv_proj.weight"), qkv)
        assert torch.equal(loaded(model, f"{mlp}.gate_up_proj.weight"), gate_up)
        assert torch.equal(loaded(model, f"{mlp}.down_proj.weight"), tensors[f"{mlp}.down_proj.weight"])
        assert torch.equal(loaded(model, f"model.layers.{i}.input_layernorm.weight"),
                           tensors[f"model.layers.{i}.input_layernorm.weight"])
    embed = model.model.embed_tokens.weight  # padded to 128 rows; padding stays zero
    assert torch.equal(embed[:100], tensors["model.embed_tokens.weight"]) and not embed[100:].any()
    head = model.lm_head
    assert torch.equal(head.packed[:100], tensors["lm_head.weight"]), "the LM head's kernel is refreshed"


def test_a_kernel_that_keeps_the_weight_gets_its_own_copy_not_a_view_of_the_bucket():
    model, shapes = fake_model()
    direct, _ = DirectLoad.build(model, CONFIG, shapes, tp=1, rank=0)
    for module in model.modules():  # from now on, processing keeps the weight it is given
        if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
            module.quant_method.keeps_weight = True
    tensors = hf_tensors(1)
    buffer, views = in_bucket(tensors, list(tensors))  # q, k, v back to back: a view
    direct.load(views, buffer)
    buffer.zero_()
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj").weight
    assert torch.equal(qkv, torch.cat([tensors[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]))


def test_a_bf16_bucket_is_repacked_in_the_engines_dtype():
    model, shapes = fake_model()
    direct, _ = DirectLoad.build(model, CONFIG, shapes, tp=1, rank=0)
    tensors = {k: v.to(torch.bfloat16) for k, v in hf_tensors(2).items()}
    buffer, views = in_bucket(tensors, list(tensors))
    direct.load(views, buffer)
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj"):
        module = model.get_submodule(name)
        assert module.packed.dtype == torch.float32 and module.weight.dtype == torch.float32, name
    down = tensors["model.layers.1.mlp.down_proj.weight"].float()
    assert torch.equal(model.get_submodule("model.layers.1.mlp.down_proj").packed, down)
    assert model.model.norm.weight.dtype == torch.float32


def test_a_failed_repack_leaves_the_placeholder_and_the_next_sync_repacks_again():
    model, shapes = fake_model()
    direct, _ = DirectLoad.build(model, CONFIG, shapes, tp=1, rank=0)
    down = model.get_submodule("model.layers.0.mlp.down_proj")
    down.quant_method.fails = True
    tensors = hf_tensors(3)
    buffer, views = in_bucket(tensors, list(tensors))
    with pytest.raises(RuntimeError, match="repacking failed"):
        direct.load(views, buffer)
    assert down.weight.numel() == 0, "the placeholder is back, not a view of the bucket"
    down.quant_method.fails = False
    direct.load(views, buffer)
    assert torch.equal(down.packed, tensors["model.layers.0.mlp.down_proj.weight"])


def test_a_parameter_that_never_arrived_fails_the_session_by_name():
    model, shapes = fake_model()
    direct, _ = DirectLoad.build(model, CONFIG, shapes, tp=1, rank=0)
    tensors = hf_tensors()
    del tensors["model.norm.weight"]
    buffer, views = in_bucket(tensors, list(tensors))
    direct.begin()
    direct.load(views, buffer)
    with pytest.raises(WeightSyncError, match="did not send model.norm.weight"):
        direct.finish()


def test_half_a_fused_module_in_a_bucket_is_refused():
    model, shapes = fake_model()
    direct, _ = DirectLoad.build(model, CONFIG, shapes, tp=1, rank=0)
    tensors = {k: v for k, v in hf_tensors().items() if k.startswith("model.layers.0.mlp.gate")}
    buffer, views = in_bucket(tensors, list(tensors))
    with pytest.raises(WeightSyncError, match="gate_up_proj.weight arrived without .*up_proj"):
        direct.load(views, buffer)


def test_models_it_does_not_know_go_to_the_layerwise_reload_with_a_reason():
    model, shapes = fake_model()
    assert DirectLoad.build(model, {**CONFIG, "architectures": ["GPT2LMHeadModel"]}, shapes, 1, 0)[0] is None
    wrong = {**shapes, "model.norm.weight": [17]}
    direct, why = DirectLoad.build(model, CONFIG, wrong, 1, 0)
    assert direct is None and "model.norm.weight" in why and "[17]" in why

    class Fp8LinearMethod(UnquantizedLinearMethod):
        pass

    quantized, shapes = fake_model(Fp8LinearMethod)
    direct, why = DirectLoad.build(quantized, CONFIG, shapes, 1, 0)
    assert direct is None and "Fp8LinearMethod" in why
    delattr(model.get_submodule("model.layers.1.mlp"), "down_proj")
    direct, why = DirectLoad.build(model, CONFIG, shapes, 1, 0)
    assert direct is None and "down_proj" in why
