"""Online DPO: every step the rollout engine samples two responses per prompt
(``rollout.n_samples_per_prompt: 2``), the registered reward (``reward.name``) picks the
chosen and the rejected one, the DPO update runs on the pairs whose rewards differ, and
the new weights stream into the engine (the RL job's weight sync)."""
from __future__ import annotations

from mcore_rl.data.batch import Batch
from mcore_rl.data.finetune_records import Pair
from mcore_rl.finetune.dpo import DPOJob
from mcore_rl.finetune.jobs import FINETUNE_JOBS


def pairs_from_rollouts(batch: Batch) -> list[Pair]:
    """Two scored samples per prompt -> (chosen, rejected) pairs; ties are left out."""
    pairs = []
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(batch["group_id"].tolist()):
        groups.setdefault(g, []).append(i)
    for rows in groups.values():
        if len(rows) != 2:
            continue
        a, b = rows
        sa, sb = float(batch["scores"][a]), float(batch["scores"][b])
        if sa == sb:
            continue
        win, lose = (a, b) if sa > sb else (b, a)

        def split(i):
            ids = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
            start = int(batch["response_mask"][i].argmax())
            return ids[:start], ids[start:]

        prompt, chosen = split(win)
        _, rejected = split(lose)
        pairs.append(Pair(prompt, chosen, rejected))
    return pairs


@FINETUNE_JOBS.register("online_dpo")
class OnlineDPOJob(DPOJob):
    name = "online_dpo"
    online = True

    def next_batch(self, run) -> Batch | None:
        """Sample, score and pair this step's prompts; None when every pair tied."""
        from mcore_rl.rl import phases

        state = run.scorer
        state.step = run.step
        records = run.prompts.take(self.f.batch_size)
        rollouts = phases.score(state, phases.generate(state, records))
        run.last_rollout_reward = rollouts["scores"].mean().item()
        pairs = pairs_from_rollouts(rollouts)
        if len(pairs) < run.ctx.dp:
            return None
        return self.batch(pairs, run.tokenizer.pad_id)

    def after_update(self, run) -> dict[str, float]:
        from mcore_rl.rl import phases

        metrics = phases.sync_weights(run.scorer)
        return {k: v for k, v in metrics.items() if k.startswith("sync/")}


def pair_count(batch: Batch | None) -> float:
    return 0.0 if batch is None else float(len(batch) // 2)
