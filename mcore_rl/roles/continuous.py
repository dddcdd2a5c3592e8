"""The rollout role of the asynchronous schedule: an engine kept busy with prompt groups as
they arrive, each group handed on the moment all its samples are done.

    Controller("rollout", factory(ContinuousGenerate, cfg, model_dir, "engine/0"),
               data_output=rollouts, streaming=True)

It is a streaming controller function (`mcore_rl.flow.Controller.streaming`): called once
with the iterator of prompt groups (``{"step", "index", "prompt"}``; the launch paces them
to at most ``train.max_staleness`` steps ahead of the trainer), it yields one rollout
`Batch` per group (the groups one engine step ended, as one stream entry:
`mcore_rl.flow.Many`). A reader thread takes groups from the stream while the main loop
steps the engine, so a group submitted now joins the engine's running batch at its next step
(continuous batching, on an engine that has it: `RolloutEngine.continuous`).

The trainer's weight sync reaches the engine through the object this role publishes; it
runs between two of the loop's steps (the loop holds the engine's lock only for a step), so
an update pauses generation for the apply alone. Responses still running then go on under
the new weights, or start over (``rollout.partial_rollout``: continue / abort); every token
records the version that generated it. On vLLM's ``AsyncLLM`` (`VLLMEngine.keeps_requests`)
the engine itself pauses around the update: with ``keep`` the requests stay in it, their KV
cache dropped and recomputed under the new weights, and vLLM reports each span's version;
with ``abort`` it ends them and this role submits them again. On an engine stepped by this
loop, the role cuts the running requests and submits their rest (their tokens so far
prefilled again) or the whole sample anew. A finished group already more than ``train.max_staleness`` versions old is
generated again with the current weights when ``train.on_stale: regenerate`` (counted).

Per group, the batch's metadata carries its key (step, index) and what the engine did
meanwhile: samples in flight at its steps (occupancy) and seconds with nothing to do.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from mcore_rl.data.batch import Batch
from mcore_rl.engines.base import Request, RolloutSample
from mcore_rl.flow.entries import pack

IDLE_WAIT_S = 0.02
"""How long the loop waits for a new group when the engine has nothing to do."""


@dataclass
class _Group:
    """One prompt group on its way through the engine."""

    item: dict
    prompt: list[int]
    meta: dict
    seed: int
    samples: list[RolloutSample | None]
    pending: dict[str, int | None] = field(default_factory=dict)
    """Request id -> the one sample it generates, or None (all of them)."""
    occupancy: list[int] = field(default_factory=list)


class ContinuousGenerate:
    """Prompt groups in, one rollout `Batch` per group out (see the module doc)."""

    def __init__(self, cfg_data: dict, model_dir: str | Path, name: str):
        from mcore_rl.roles.generate import Generate

        self._attach(Generate(cfg_data, model_dir, name))  # the engine, published as ``name``

    @classmethod
    def around(cls, base) -> "ContinuousGenerate":
        """The role around an existing rollout role ``base`` (its ``engine``, ``lock``,
        ``cfg`` and ``tokenizer``), e.g. an engine of this process in a test."""
        self = cls.__new__(cls)
        self._attach(base)
        return self

    def _attach(self, base) -> None:
        self.base = base
        self.engine, self.lock, self.cfg = base.engine, base.lock, base.cfg
        self.groups: dict[str, _Group] = {}
        """Request id -> its group, for every request in the engine."""
        self.versions: dict[str, int] = {}
        """Request id -> the weight version it was submitted under (every token of it was
        generated with it: new weights stop and resubmit every running request)."""
        self.counter = 0
        self.version_seen = self.engine.weight_version
        self.counts = {"stale_regenerated": 0.0, "partial_continued": 0.0,
                       "partial_restarted": 0.0, "engine_idle_s": 0.0}
        """Since the last completed group; read and reset under the engine's lock (`_park`
        may complete a group on the trainer's thread)."""
        self._idle_s = 0.0
        """The loop's idle time not yet in ``counts``: its own, added there under the lock
        at the next step (an update outside the lock could be lost to a reset)."""
        self.waiting: list[tuple[_Group, int | None]] = []
        """Submissions held while the engine sleeps (colocated: the trainer updates)."""
        self.ready: list[Batch] = []
        """Groups done, to hand on. Every change to the groups happens under the engine's
        lock: the trainer's sleep call (`_park`, another thread) may cut requests while the
        loop takes finished ones."""
        self.sleeping = False
        self.engine.before_sleep = self._park
        if hasattr(self.engine, "on_update"):  # the engine pauses around updates itself
            self.engine.on_update = "keep" if self.cfg.rollout.partial_rollout == "continue" \
                else "abort"
        self.keeps = bool(getattr(self.engine, "keeps_requests", False))
        """Requests in flight go on across weight updates inside the engine, which reports
        each token's version."""

    def __call__(self, items: Iterator[dict]) -> Iterator[Batch]:
        arrived: queue.Queue = queue.Queue()
        reader = threading.Thread(target=self._read, args=(items, arrived), daemon=True,
                                  name="rollout-reader")
        reader.start()
        ended = False
        while not (ended and not self.groups and not self.waiting and not self.ready):
            idle = not self.groups and not self.waiting and not self.ready
            ended = self._admit(arrived, block=idle) or ended
            if self.groups or self.waiting:
                self._step()
            with self.lock:
                done, self.ready = self.ready, []
            if done:  # the groups one engine step ended: one stream entry
                yield pack(done)
        reader.join(timeout=1.0)

    def close(self) -> None:
        self.base.close()

    # ----- admission ------------------------------------------------------------------
    @staticmethod
    def _read(items: Iterator[dict], arrived: queue.Queue) -> None:
        try:
            for item in items:
                arrived.put(item)
        finally:
            arrived.put(None)

    def _admit(self, arrived: queue.Queue, block: bool) -> bool:
        """Submit every group that has arrived (waiting a little for one if the engine has
        nothing to do); whether the input has ended."""
        while True:
            t = time.perf_counter()
            try:
                item = arrived.get(timeout=IDLE_WAIT_S) if block else arrived.get_nowait()
            except queue.Empty:
                if block:
                    self._idle_s += time.perf_counter() - t
                return False
            if block:
                self._idle_s += time.perf_counter() - t
            if item is None:
                return True
            self._start(item)
            block = False

    def _start(self, item: dict) -> None:
        from mcore_rl.roles.generate import prompt_records
        from mcore_rl.rl import phases

        (record,) = prompt_records([item["prompt"]])
        ids, metas, _ = phases.encode_prompts(self.base.tokenizer, self.cfg, [record])
        seed = phases.request_seed(self.cfg.train.seed, item["step"], item["index"])
        group = _Group(item, ids[0], metas[0], seed, [None] * self.cfg.rollout.n_samples_per_prompt)
        self._submit(group, None)

    def _submit(self, group: _Group, sample: int | None) -> None:
        """A request for all of ``group``'s samples (``sample`` None), or for one sample: a
        fresh one, or the rest of the partial one in its slot (its tokens so far become
        part of the prompt)."""
        from mcore_rl.engines import sampling_from_config

        self.counter += 1
        rid = f"g{self.counter}"
        sampling = sampling_from_config(self.cfg.rollout, stop_token_ids=[self.base.tokenizer.eos_id])
        prompt, seed = group.prompt, group.seed
        if sample is not None:
            prefix = group.samples[sample]
            done = len(prefix.token_ids) if prefix is not None else 0
            prompt = prompt + (prefix.token_ids if prefix is not None else [])
            sampling = replace(sampling, n=1, max_new_tokens=sampling.max_new_tokens - done,
                               min_new_tokens=max(0, sampling.min_new_tokens - done))
            seed = group.seed + 7919 * (sample + 1) + self.counter  # a stream of its own
        with self.lock:
            if self.sleeping or self.engine.asleep:
                self.counter -= 1
                self.waiting.append((group, sample))  # submitted once the engine wakes
                return
            if self.engine.weight_version != self.version_seen:
                self._new_weights(self.engine.weight_version)  # the running ones first
            group.pending[rid] = sample
            self.groups[rid] = group
            self.versions[rid] = self.version_seen
            self.engine.submit(Request(rid, prompt, sampling, seed))

    # ----- stepping -------------------------------------------------------------------
    def _step(self) -> None:
        """One engine step; the groups it finished go to ``ready``."""
        with self.lock:
            self.counts["engine_idle_s"] += self._idle_s
            self._idle_s = 0.0
            asleep = self.engine.asleep
            if not asleep:
                if self.engine.weight_version != self.version_seen:
                    self._new_weights(self.engine.weight_version)
                if self.sleeping or self.waiting:  # awake again: what waited goes in
                    self.sleeping, waiting, self.waiting = False, self.waiting, []
                    for group, sample in waiting:
                        self._submit(group, sample)
                finished = self.engine.step()
                in_flight = self.engine.sequences_in_flight()
                for group in {id(g): g for g in self.groups.values()}.values():
                    group.occupancy.append(in_flight)
                for rid, samples in finished:
                    group = self._finished(rid, samples)
                    if group is not None and not group.pending:
                        self._complete(group)
        if asleep:  # colocated: the trainer has the devices until it wakes the engine
            time.sleep(IDLE_WAIT_S)
            self._idle_s += IDLE_WAIT_S

    def _finished(self, rid: str, samples: list[RolloutSample]) -> _Group | None:
        """Put a request's samples into their group's slots (stamped with the version the
        request ran under); its group."""
        group = self.groups.pop(rid, None)
        if group is None:
            return None
        sample, version = group.pending.pop(rid), self.versions.pop(rid)
        indices = range(len(samples)) if sample is None else [sample]
        for j, s in zip(indices, samples):
            if self.keeps and s.weight_version is not None:  # as the engine recorded them
                self.counts["partial_continued"] += len(set(_versions(s))) - 1
                s = replace(s, sample_index=j)
            else:  # every token of the request ran under the version it was submitted with
                s = replace(s, sample_index=j, weight_version=version, token_versions=None)
            prefix = group.samples[j] if sample is not None else None
            if prefix is not None:  # a continuation: after the tokens its slot holds
                kept = None if prefix.kept_ids is None or s.kept_ids is None else \
                    prefix.kept_ids + s.kept_ids
                s = RolloutSample(0, j, group.prompt, prefix.token_ids + s.token_ids,
                                  prefix.logprobs + s.logprobs, s.finish_reason,
                                  prefix.weight_version,
                                  token_versions=_versions(prefix) + _versions(s),
                                  kept_ids=kept)
            elif sample is not None:
                s = replace(s, prompt_token_ids=group.prompt)
            group.samples[j] = s
        return group

    def _new_weights(self, version: int) -> None:
        """Requests that started under older weights: each unfinished sample goes on under
        the new ones (continue: its KV cache dropped, its tokens so far prefilled again) or
        starts over (abort); finished ones are kept. An engine that keeps its requests
        across the update has already done the first (`keeps`)."""
        self.version_seen = version
        if not self.keeps:
            self._resubmit(self._cancel_running())

    def _park(self) -> None:
        """Before the engine sleeps (colocated: under the lock of the trainer's sleep call):
        the running requests stop and wait, as after new weights, until it wakes."""
        self.sleeping = True
        self._resubmit(self._cancel_running())

    def _cancel_running(self) -> list[tuple[_Group, int]]:
        """Stop every request in the engine; the (group, sample) slots left unfinished."""
        if not self.groups or not self.engine.continuous:
            return []
        slots, cut = [], {}
        for rid, samples in self.engine.cancel(list(self.groups)).items():
            group = self.groups[rid]
            sample = group.pending[rid]
            self._finished(rid, samples)
            cut[id(group)] = group
            # only this request's slots: a group cut into several requests has each of its
            # unfinished samples once among the slots
            indices = range(len(group.samples)) if sample is None else [sample]
            slots += [(group, j) for j in indices
                      if group.samples[j] is not None and group.samples[j].finish_reason == "abort"]
        going_on = {id(group) for group, _ in slots}
        for key, group in cut.items():  # its last requests had finished when they were cut
            if key not in going_on and not group.pending:
                self._complete(group)
        return slots

    def _resubmit(self, slots: list[tuple[_Group, int]]) -> None:
        """Each unfinished sample continues (its tokens so far as prompt) or starts over."""
        for group, j in slots:
            if self.cfg.rollout.partial_rollout == "abort":
                group.samples[j] = None
                self.counts["partial_restarted"] += 1
            else:
                self.counts["partial_continued"] += 1
            self._submit(group, j)

    def _complete(self, group: _Group) -> None:
        """The group's rollout batch into ``ready``; or, too old, the group generated again."""
        from mcore_rl.engines.base import Rollouts

        oldest = min(s.weight_version for s in group.samples)
        if self.cfg.train.on_stale == "regenerate" and \
                self.engine.weight_version - oldest > self.cfg.train.max_staleness:
            self.counts["stale_regenerated"] += 1
            group.samples = [None] * len(group.samples)
            self._submit(group, None)
            return
        batch = Rollouts(list(group.samples)).to_batch(pad_id=self.base.tokenizer.pad_id)
        n = len(batch)
        batch.meta["prompt_meta"] = [group.meta] * n
        batch.meta["response_text"] = [self.base.tokenizer.decode(s.token_ids) for s in group.samples]
        batch.meta["group_key"] = [(group.item["step"], group.item["index"])] * n
        batch.meta["producer"] = [os.getpid()] * n
        batch.meta["engine_occupancy"] = [sum(group.occupancy) / max(1, len(group.occupancy))] * n
        for name in self.counts:  # since the group before; spread over its rows (they are summed)
            batch.meta[name] = [self.counts[name] / n] * n
            self.counts[name] = 0.0
        batch.info["filtered_prompts"] = 0
        self.ready.append(batch)


def _versions(sample: RolloutSample) -> list[int]:
    return list(sample.token_versions) if sample.token_versions is not None else \
        [sample.weight_version] * len(sample.token_ids)
