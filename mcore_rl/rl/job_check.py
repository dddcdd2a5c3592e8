"""Names in a config checked against their registries, before any rank starts.

Each config field that names a variant (an engine, a prompt source, a reward, an advantage
estimator, a policy loss, a weight-sync transport) is looked up in the registry that holds
it, so a new variant needs only its registry entry, and a wrong or unavailable name is one
line naming the field, what is registered, and the closest match.
"""
from __future__ import annotations

from mcore_rl.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from mcore_rl.config import RLConfig
from mcore_rl.data.prompts import PROMPT_SOURCES
from mcore_rl.engines import ENGINES
from mcore_rl.errors import UsageError
from mcore_rl.registry import Registry
from mcore_rl.rewards import REWARDS


def named_variants(cfg: RLConfig) -> list[tuple[str, str, Registry]]:
    """(config field, the name it holds, the registry it names an entry of)."""
    from mcore_rl.envs import ENVIRONMENTS
    from mcore_rl.reshard.native import is_native
    from mcore_rl.reshard.transports import TRANSPORTS

    # vLLM's own backends are vLLM's names (checked with the placement, roles.rules)
    own = cfg.reshard.transport != "auto" and not is_native(cfg.reshard.transport)
    transport = [("reshard.transport", cfg.reshard.transport, TRANSPORTS)] if own else []
    return transport + [
        ("rollout.engine", cfg.rollout.engine, ENGINES),
        ("data.source", cfg.data.source, PROMPT_SOURCES),
        *([("reward.name", cfg.reward.name, REWARDS)] if not cfg.reward.weights else
          [(f"reward.weights.{name}", name, REWARDS) for name in cfg.reward.weights]),
        ("algorithm.advantage_estimator", cfg.algorithm.advantage_estimator, ADVANTAGE_ESTIMATORS),
        ("algorithm.policy_loss", cfg.algorithm.policy_loss, POLICY_LOSSES),
        *([("environment.name", cfg.environment.name, ENVIRONMENTS)] if cfg.environment.name else []),
    ]


def check_registered_names(cfg: RLConfig) -> None:
    """Raise a one-line `UsageError` for the first name its registry does not hold."""
    for where, name, registry in named_variants(cfg):
        try:
            registry.entry(name)
        except UsageError as err:
            raise UsageError(f"{where}: {err}") from None


def check_engine_capabilities(cfg: RLConfig, num_experts: int, on_gpu: bool) -> None:
    """What the model and ``moe.routing_replay`` need of the rollout engine, against the
    facts of its registry entry; a one-line `UsageError` naming the fix."""
    if not num_experts:
        return
    engine = cfg.rollout.engine
    try:
        meta = ENGINES.entry(engine).meta
    except UsageError:
        return  # a name that is not registered is check_registered_names's to report
    if not on_gpu and not meta.get("cpu_expert_updates", True):
        raise UsageError(f"rollout.engine={engine}: its CPU backend cannot load new expert weights "
                         "once started, so a mixture-of-experts model cannot be trained with it "
                         "on this machine; set rollout.engine=hf")
    if cfg.moe.routing_replay == "rollout" and not meta.get("returns_routes", False):
        raise UsageError(f"moe.routing_replay=rollout: the {engine} engine does not report the "
                         "experts it routed each token to (vLLM's capture lives in its V2 model "
                         "runner, which needs Triton on a GPU); use rollout.engine=hf or "
                         "moe.routing_replay=old_logprob")
