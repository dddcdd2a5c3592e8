"""What can be checked of a fine-tuning job before any rank starts: its registered names,
its data (every split tokenized; a split with no usable record stops with one line) and the
checkpoint to resume from. Raises a one-line `UsageError`."""
from __future__ import annotations

from mcore_rl.algos.preference import DPO_LOSSES
from mcore_rl.config import RLConfig
from mcore_rl.data.tokenizer import Tokenizer
from mcore_rl.errors import UsageError
from mcore_rl.finetune.setup import load_examples, trained_parts
from mcore_rl.train.run_checkpoints import RunCheckpoints


def start_tokenizer(cfg: RLConfig) -> Tokenizer:
    """The tokenizer the run will use (the built-in task's without ``model.path``)."""
    if cfg.model.path:
        from mcore_rl.data.tokenizer import load_tokenizer
        from mcore_rl.models.builtin import resolve_model_path

        return load_tokenizer(resolve_model_path(cfg.model.path))
    from mcore_rl.data.toy_task import toy_tokenizer

    return toy_tokenizer(cfg.data.source)


def check_finetune_job(cfg: RLConfig) -> None:
    if cfg.train.job in ("dpo", "online_dpo"):
        try:
            DPO_LOSSES.entry(cfg.finetune.dpo_loss)
        except UsageError as err:
            raise UsageError(f"finetune.dpo_loss: {err}") from None
    if cfg.train.job == "online_dpo" or cfg.finetune.val_score:
        from mcore_rl.rewards import RewardScorer

        RewardScorer.from_config(cfg.reward)  # a reward that cannot run in the ranks refuses here
    tokenizer = start_tokenizer(cfg)
    for split in ("train", "val"):
        try:
            load_examples(cfg, tokenizer, split)
        except ValueError as err:  # a character the built-in tokenizer does not know
            raise UsageError(f"the {split} data cannot be tokenized: {err}; use a model.path whose "
                             "tokenizer covers the data") from None
    RunCheckpoints.for_config(cfg).resolve_resume(cfg.checkpoint.resume, trained_parts(cfg),
                                                  cfg.logging.dir)
