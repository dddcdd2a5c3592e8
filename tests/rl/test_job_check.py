"""Every name in a config is checked against its registry before any rank starts: one line
naming the field, what is registered and the closest match; aliases resolve."""
import pytest

from mcore_rl.config import load_config
from mcore_rl.errors import UsageError
from mcore_rl.rl.job_check import check_registered_names, named_variants


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=vlm", r"^rollout.engine: unknown rollout engine 'vlm'; did you mean 'vllm'\? "
                           r"\(registered: hf, hf_batched, sglang, vllm; or give module:attr\)$"),
    ("data.source=jsnl", r"^data.source: unknown prompt source 'jsnl'; did you mean 'jsonl'\?"),
    ("reward.name=exatc", r"^reward.name: unknown reward 'exatc'; did you mean 'exact'\?"),
    ("algorithm.advantage_estimator=grop", r"^algorithm.advantage_estimator: unknown advantage "
                                           r"estimator 'grop'; did you mean 'grpo'\?"),
    ("algorithm.policy_loss=ppo", r"^algorithm.policy_loss: unknown policy loss 'ppo'"),
    ("reward.name=reward_modle", r"^reward.name: unknown reward 'reward_modle'; did you mean "
                                 r"'reward_model'\?"),
    ("reward.name=no_such_module:fn", r"^reward.name: cannot import module 'no_such_module'"),
])
def test_an_unregistered_name_is_one_line_naming_the_field(override, message):
    with pytest.raises(UsageError, match=message) as err:
        check_registered_names(load_config(None, [override]))
    assert "\n" not in str(err.value)


def test_aliases_and_user_objects_resolve_to_their_entries():
    cfg = load_config(None, ["reward.name=builtin", "data.source=parquet",
                             "algorithm.advantage_estimator=mcore_rl.algos.advantages:grpo"])
    check_registered_names(cfg)
    by_field = {where: registry.entry(name) for where, name, registry in named_variants(cfg)}
    assert by_field["reward.name"].name == "exact"
    assert by_field["data.source"].name == "jsonl"
    assert by_field["algorithm.advantage_estimator"].obj.__name__ == "grpo"


def test_the_critic_is_a_fact_of_the_estimator_entry():
    from mcore_rl.algos import ADVANTAGE_ESTIMATORS, needs_critic

    assert [n for n in ADVANTAGE_ESTIMATORS.names() if needs_critic(n)] == ["gae"]


@pytest.mark.parametrize("overrides", [
    ["reshard.transport=nccl", "rollout.placement=separate"],
    ["reshard.transport=sparse_nccl", "reshard.delta=true", "rollout.placement=separate"],
    ["reshard.transport=ipc"]], ids=lambda o: o[0])
def test_vllms_gpu_backends_pass_every_check_of_a_gpu_config(overrides):
    """vLLM's backends are vLLM's names, not entries of mcore-rl's transport registry: a GPU
    config naming one passes the rules and the registry check (here on CPU, where only the
    GPUs the config asks for tell the rules that CUDA will be there)."""
    from mcore_rl.roles.rules import check_config

    cfg = load_config(None, overrides + ["launch.gpus_per_node=8"])
    check_config(cfg)
    check_registered_names(cfg)
    assert "reshard.transport" not in {where for where, _, _ in named_variants(cfg)}

