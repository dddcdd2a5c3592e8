"""Exactly once across a resume when prompt groups stream (async, replicas): groups reach the
trainer in the order they finish, not the stream's, so a checkpoint records the first
stream position not taken and the positions past it that were (`mcore_rl.trainer.
take_groups`), and the resumed feed generates exactly the others, numbered (and so seeded)
as the uninterrupted run numbers them (`mcore_rl.roles.graph.group_items`)."""
from dataclasses import replace
from types import SimpleNamespace

from mcore_rl.config import load_config
from mcore_rl.config.loader import config_to_dict
from mcore_rl.roles.graph import group_items
from mcore_rl.trainer import take_groups

PER_STEP = 4


def _cfg(steps: int = 3):
    cfg = load_config("configs/quickstart.yaml")
    return replace(cfg, data=replace(cfg.data, prompts_per_step=PER_STEP),
                   train=replace(cfg.train, steps=steps))


def _state():
    return SimpleNamespace(prompts=SimpleNamespace(position=0), taken_ahead=set(),
                           cfg=SimpleNamespace(data=SimpleNamespace(prompts_per_step=PER_STEP)))


def test_groups_taken_out_of_order_leave_the_position_at_the_first_one_not_taken():
    state = _state()
    take_groups(state, {(1, 1), (1, 2), (1, 3), (2, 0)})  # (1, 0) is still generating
    assert (state.prompts.position, state.taken_ahead) == (0, {1, 2, 3, 4})
    take_groups(state, {(1, 0), (2, 2)})
    assert (state.prompts.position, state.taken_ahead) == (5, {6})


def test_the_resumed_feed_is_the_uninterrupted_one_without_the_groups_already_taken():
    cfg = config_to_dict(_cfg(steps=3))
    whole = list(group_items(cfg, 0, 0))
    assert [(g["step"], g["index"]) for g in whole] == [(s, i) for s in (1, 2, 3)
                                                        for i in range(PER_STEP)]
    # a checkpoint after step 1 whose groups were stream positions 1-4 (0 still generating)
    resumed = list(group_items(cfg, 1, 0, taken_ahead=(1, 2, 3, 4)))
    assert resumed == [whole[0]] + whole[5:]  # the 2 steps to go: 8 groups

