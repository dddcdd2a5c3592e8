"""The Python API: a plain script (or a notebook) drives distributed trainer ranks.

    from mcore_rl import RLTrainer

    with RLTrainer.from_config("configs/quickstart.yaml", ["parallel.tp=2"]) as trainer:
        rollouts = trainer.sample(prompts)          # text or token ids; n per prompt
        rollouts["reward"] = my_scores(rollouts)    # any Python, on the driver
        stats = trainer.update(rollouts)            # advantages, losses, optimizer step, sync

The script is the driver; the ranks are Ray actors of one Megatron worker group
(`mcore_rl.flow.Megatron`), each running the same phases as ``mcore-rl train``."""
from mcore_rl.api.rl_trainer import RLTrainer
from mcore_rl.api.rollouts import Rollouts

__all__ = ["RLTrainer", "Rollouts"]
