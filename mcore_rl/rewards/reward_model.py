"""``reward.name: reward_model``: a trained reward model's score as the reward.

The model runs in a Megatron worker group of its own (``reward.rm_tp/rm_pp/rm_dp``), a
controller of ``mcore-rl train``'s RL graph (`mcore_rl.roles.reward_model`); the
scoring itself is `mcore_rl.rl.reward_model`. This module holds what needs no model: where
the checkpoint is and what it is (`resolve_reward_model`), the checks made before any rank
starts (`check_reward_model`), and how texts become the model's tokens (`encode_exchanges`).

Sources (``reward.reward_model_path``):

- an HF ``*ForSequenceClassification`` directory with one label (converted on load);
- an mcore-rl checkpoint with a score head (``mcore-rl convert hf-to-mcore`` of one);
- a ``train.job: rm`` run: its ``logging.dir``, its checkpoint directory (the step that
  ``latest`` names) or one ``step_*`` directory. The architecture and tokenizer are those of
  the model the run started from (named in its ``run_state.json``, else the run's
  ``initial_model/``).

Texts are tokenised again with the reward model's own tokenizer. With a chat template, the
prompt is the user turn and the response the assistant turn (the whole conversation, no
generation prompt); without one, the prompt's tokens (with the tokenizer's own prefix, e.g.
BOS), the response's tokens and EOS, as ``train.job: rm`` encodes its pairs. The score is
pooled as HF's ``*ForSequenceClassification`` pools it: at the rightmost token that is not
the pad token (``pad_token_id`` of the model's config), so where pad equals EOS (SmolLM2)
it is the token before a trailing EOS. The model is causal, so that token's score does not
depend on what follows it: trailing pad tokens are dropped and the engine pools at the last
token. A sequence longer than the model's positions keeps its last tokens (counted in
``reward/rm_truncated``).

Nothing here imports torch at module level.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from mcore_rl.errors import UsageError
from mcore_rl.rewards.registry import REWARDS

if TYPE_CHECKING:
    from mcore_rl.config import RLConfig
    from mcore_rl.data.tokenizer import Tokenizer
    from mcore_rl.models import ModelSpec

REWARD_MODEL = "reward_model"

IN_PROCESS = ("reward 'reward_model' scores with a worker group of its own, a controller of "
              "mcore-rl train's RL graph (train.job: rl); it cannot score here (RLTrainer, a "
              "fine-tuning job or one of reward.weights): use a rule-based reward or your own "
              "function here")


def _refuse_in_process(fn, cfg):
    raise UsageError(IN_PROCESS)


@REWARDS.register(REWARD_MODEL, prepare=_refuse_in_process)
def reward_model_reward(prompt: str, response: str, meta: dict) -> float:
    """The reward model's score: computed by the reward controller of the RL graph, never by
    a reward scorer (its ``prepare`` refuses)."""
    raise UsageError(IN_PROCESS)


@dataclass(frozen=True)
class RewardModelSource:
    """What ``reward.reward_model_path`` holds."""

    kind: str
    """``hf`` (an HF directory), ``mcore`` (an mcore-rl checkpoint) or ``run`` (the
    ``model`` part of a ``train.job: rm`` run checkpoint)."""
    weights: Path
    """Where the weights are read from."""
    spec: ModelSpec
    """Architecture and head (a score head); for ``run``, with the padded vocabulary the
    run saved."""
    tokenizer_dir: Path

    @property
    def pad_id(self) -> int | None:
        """HF's pooling pad token (``pad_token_id`` of config.json); None: the last token."""
        return self.spec.hf_config.get("pad_token_id")


def resolve_reward_model(path: str) -> RewardModelSource:
    """The source at ``reward.reward_model_path``, or a one-line `UsageError` naming the fix."""
    from mcore_rl.models import SCORE_HEAD
    from mcore_rl.models.checkpoint import HF_DIR, is_mcore_checkpoint, read_checkpoint_meta
    from mcore_rl.models.hf_config import load_hf_spec

    where = f"reward.reward_model_path={path}"
    if not path:
        raise UsageError("reward.name=reward_model needs reward.reward_model_path: an HF "
                         "*ForSequenceClassification directory, an mcore-rl checkpoint or a "
                         "train.job: rm run")
    root = Path(path)
    if not root.exists():
        raise UsageError(f"{where} does not exist; give an HF *ForSequenceClassification "
                         "directory, an mcore-rl checkpoint or a train.job: rm run")
    if is_mcore_checkpoint(root):
        spec, kind, tokenizer_dir = read_checkpoint_meta(root).spec, "mcore", root / HF_DIR
    elif (root / "config.json").is_file():
        spec, kind, tokenizer_dir = load_hf_spec(root), "hf", root
    else:
        step = _run_step(root, where)
        return _run_source(step, where)
    if spec.head != SCORE_HEAD:
        raise UsageError(f"{where} is a causal LM ({spec.hf_architecture}) with no scalar score "
                         f"head; give a reward model: an HF {spec.family.sequence_classification} "
                         "with num_labels=1, or a train.job: rm run")
    return RewardModelSource(kind, root, spec, tokenizer_dir)


def _run_step(root: Path, where: str) -> Path:
    """The step directory of a run checkpoint given as a step, a checkpoint directory (its
    ``latest``) or a run's logging.dir (its ``checkpoints/latest``)."""
    for base in (root, root / "checkpoints"):
        if (base / "run_state.json").is_file():
            return base
        pointer = base / "latest"
        if pointer.is_file():
            step = base / pointer.read_text().strip()
            if (step / "run_state.json").is_file():
                return step
    raise UsageError(f"{where} is neither an HF model (no config.json), an mcore-rl checkpoint "
                     "(no mcore_rl.json) nor a run checkpoint (no run_state.json or "
                     "checkpoints/latest); give a reward model or a train.job: rm run")


def _run_source(step: Path, where: str) -> RewardModelSource:
    """A ``train.job: rm`` step directory: its ``model`` part, described by the model the
    run started from."""
    from mcore_rl.models import SCORE_HEAD, read_model_spec
    from mcore_rl.models.checkpoint import HF_DIR, is_mcore_checkpoint

    weights = step / "model"
    if not (weights / "metadata.json").is_file():
        raise UsageError(f"{where}: {step} has no 'model' part (it is not a train.job: rm "
                         "checkpoint); give a train.job: rm run")
    stored = _stored_shapes(weights)
    head = stored.get("output_layer.weight")
    if head is None or head[0] != 1:
        raise UsageError(f"{where}: {step} holds a causal LM (no scalar score head), not a "
                         "reward model; give a train.job: rm run")
    state = json.loads((step / "run_state.json").read_text())
    model_dir = Path(state["model_dir"]) if state.get("model_dir") else \
        step.parent.parent / "initial_model"
    tokenizer_dir = model_dir / HF_DIR if is_mcore_checkpoint(model_dir) else model_dir
    if not (tokenizer_dir / "config.json").is_file():
        raise UsageError(f"{where}: cannot tell which model {step} was trained from (its "
                         f"run_state.json names none and {model_dir} holds no config.json); "
                         "give the run's logging.dir or its checkpoint directory")
    spec = read_model_spec(model_dir)
    rows = stored.get("embedding.word_embeddings.weight", (spec.arch.padded_vocab_size,))[0]
    arch = spec.arch if rows == spec.arch.padded_vocab_size else \
        replace(spec.arch, vocab_pad_multiple=rows)  # the padded size the run saved
    return RewardModelSource("run", weights, replace(spec, arch=arch, head=SCORE_HEAD),
                             tokenizer_dir)


def _stored_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> global shape of a Megatron distributed checkpoint (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in metadata.items() if hasattr(v, "size")}


def check_reward_model(cfg: RLConfig) -> None:
    """Before any rank starts: no ``reward.weights`` beside it, the reward model exists and
    has a score head, its layout (``reward.rm_tp/rm_pp``) splits it, and
    ``reward.val_reward`` is a usable reward."""
    from mcore_rl.models import check_layout

    r = cfg.reward
    if r.weights:
        raise UsageError("reward.name=reward_model is the reward on its own, not a sum of "
                         "reward.weights (with which reward.name is unused); leave reward.weights "
                         "empty")
    source = resolve_reward_model(r.reward_model_path)
    arch = source.spec.arch  # a checkpoint keeps its padded vocabulary; an HF model gets one
    if source.kind == "hf":
        arch = arch.with_vocab_multiple_for_tp(r.rm_tp)
    try:
        check_layout(arch, r.rm_tp, r.rm_pp)
    except UsageError as err:
        raise UsageError(f"reward.rm_tp={r.rm_tp}, reward.rm_pp={r.rm_pp}: {err} of the reward "
                         f"model {r.reward_model_path}; choose a layout that divides it") from None
    if r.val_reward:
        try:
            entry = REWARDS.entry(r.val_reward)
        except UsageError as err:
            raise UsageError(f"reward.val_reward: {err}") from None
        if entry.name == REWARD_MODEL:
            raise UsageError("reward.val_reward=reward_model: leave reward.val_reward empty for "
                             "val/score to be the reward model's score")


def encode_exchanges(tokenizer: Tokenizer, prompts: Sequence[str], responses: Sequence[str],
                     pad_id: int | None, max_tokens: int) -> tuple[list[list[int]], int]:
    """Token ids to score, one list per (prompt, response), ending at the token HF pools
    (see the module doc); and how many were cut to their last ``max_tokens`` tokens."""
    sequences, cut = [], 0
    for prompt, response in zip(prompts, responses, strict=True):
        ids = _encode_exchange(tokenizer, prompt, response)
        if pad_id is not None:
            while len(ids) > 1 and ids[-1] == pad_id:
                ids.pop()
        if len(ids) > max_tokens:
            ids, cut = ids[-max_tokens:], cut + 1
        sequences.append(ids)
    return sequences, cut


def _encode_exchange(tokenizer: Tokenizer, prompt: str, response: str) -> list[int]:
    hf = getattr(tokenizer, "tok", None)  # an HFTokenizer's transformers tokenizer
    if hf is not None and hf.chat_template:
        out = hf.apply_chat_template([{"role": "user", "content": prompt},
                                      {"role": "assistant", "content": response}],
                                     tokenize=True, add_generation_prompt=False)
        ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5: a BatchEncoding
        return [int(i) for i in ids]
    return tokenizer.encode_prompt(prompt, False) + tokenizer.encode(response) + [tokenizer.eos_id]
