"""Every job as a graph of controllers, placed on the machine's cores or the cluster's GPUs.

- RL (``train.job: rl``): rollout (an engine per replica) -> reward -> trainer, the weight
  sync from the trainer into every engine after each update. ``rollout.placement``:
  ``colocated`` (the engine takes turns with the trainer on the same devices), ``separate``
  (devices of its own, overlapping), ``fused`` (rollout and reward fused into the trainer's
  first rank: in-process streams, the engine owned by rank 0; the synchronous schedule).
  A synchronous step of one replica scores in the trainer's first rank under every
  placement (`scores_in_trainer`); a reward model always has a controller of its own.
- Fine-tuning (sft, rm, dpo, kto, online_dpo) and ``smoke``: one trainer controller that
  reads its own records step by step.

``train.schedule``: ``sync`` admits one step's prompts at a time (``max_in_flight``);
``one_step_off`` one step more; ``async`` streams prompt groups through the engines, at
most ``max_staleness`` steps ahead. Several replicas take a step's prompt groups by load,
under every schedule.

    stats = run_job(load_config("configs/quickstart.yaml"))
"""
from __future__ import annotations

import itertools
import json
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from mcore_rl.config import RLConfig
from mcore_rl.config.loader import config_to_dict
from mcore_rl.rewards.reward_model import REWARD_MODEL


@dataclass
class JobGraph:
    """A job's controllers and how to launch them."""

    group: Any
    """The `ControllerGroup`."""
    data: Any = None
    """What the driver feeds (several rollout replicas share the prompt groups), or None:
    the first controller reads its own."""
    max_in_flight: int | None = None
    launch_kwargs: dict = field(default_factory=dict)


def model_dir_for(cfg: RLConfig) -> Path:
    """The HF directory the run starts from (``model.path``, or the random tiny model)."""
    if cfg.model.path:
        from mcore_rl.models.builtin import resolve_model_path

        return resolve_model_path(cfg.model.path)
    from mcore_rl.rl.setup import write_initial_model

    return write_initial_model(cfg)


def resume_point(cfg: RLConfig) -> tuple[int, int, tuple[int, ...]]:
    """(step, data position, stream positions past it already taken) the run continues
    from: those of the checkpoint that ``checkpoint.resume`` selects, or (0, 0, ())."""
    from mcore_rl.rl.setup import trained_parts
    from mcore_rl.train.run_checkpoints import RunCheckpoints

    path = RunCheckpoints.for_config(cfg).resolve_resume(cfg.checkpoint.resume, trained_parts(cfg),
                                                         cfg.logging.dir).path
    if path is None:
        return 0, 0, ()
    run = json.loads((Path(path) / "run_state.json").read_text())
    return run["step"], run["data_position"], tuple(run.get("data_taken_ahead", ()))


def _prompt_stream(cfg_data: dict, position: int):
    """(the config, its training prompt stream at ``position``, items per step: 1, or with
    ``algorithm.dynamic_sampling`` 1 + its extra rounds)."""
    from mcore_rl.config import config_from_dict
    from mcore_rl.data.prompts import PromptStream, load_prompt_records

    cfg = config_from_dict(cfg_data) if isinstance(cfg_data, dict) else cfg_data
    stream = PromptStream(load_prompt_records(cfg.data, "train"), cfg.data.seed)
    stream.position = position
    rounds = 1 + (cfg.algorithm.dynamic_sampling_max_rounds if cfg.algorithm.dynamic_sampling else 0)
    return cfg, stream, rounds


def prompt_items(cfg_data: dict, start_step: int, position: int) -> Iterator[dict]:
    """One item per step to go: ``{"step", "prompts"}``, from the config's prompt source in
    the order ``mcore-rl train`` takes them. With ``algorithm.dynamic_sampling`` a step may
    take ``dynamic_sampling_max_rounds`` more items: there are that many more per step
    (``step`` then numbers items, seeding their sampling), and the trainer ends the launch
    once it has taken its last step."""
    cfg, stream, rounds = _prompt_stream(cfg_data, position)
    # Items number on from those the run took before (a step may take several), so a
    # resumed run samples as the uninterrupted one would: one item per step's prompts taken.
    done = position // cfg.data.prompts_per_step if cfg.algorithm.dynamic_sampling else start_step
    for step in range(done + 1, done + (cfg.train.steps - start_step) * rounds + 1):
        records = stream.take(cfg.data.prompts_per_step)
        yield {"step": step, "prompts": [{"prompt": r.prompt, **r.meta} for r in records]}


def group_items(cfg_data: dict, start_step: int, position: int,
                taken_ahead: tuple[int, ...] = ()) -> Iterator[dict]:
    """The prompts of `prompt_items` one by one: ``{"step", "index", "prompt"}`` (index:
    the prompt's place in its step), the items when prompt groups stream through engines.
    Groups reach the trainer in the order they finish, so a resumed run starts at the
    first stream position not taken and skips ``taken_ahead``, those past it it had taken;
    a group is numbered by its stream position (``step``: position // prompts_per_step + 1),
    as the uninterrupted run numbers it, which seeds its sampling."""
    cfg, stream, rounds = _prompt_stream(cfg_data, position)
    per_step = cfg.data.prompts_per_step
    skip, left = set(taken_ahead), (cfg.train.steps - start_step) * rounds * per_step
    while left > 0:
        at = stream.position
        (record,) = stream.take(1)
        if at in skip:
            continue
        left -= 1
        yield {"step": at // per_step + 1, "index": at % per_step,
               "prompt": {"prompt": record.prompt, **record.meta}}


def group_key(item: dict) -> tuple[int, int]:
    """A streamed prompt group's identity: (step, index)."""
    return item["step"], item["index"]


def finished_groups(entry: Any) -> list[tuple[int, int]]:
    """The groups an entry of the rollout's output finishes (`group_key` of each)."""
    from mcore_rl.flow.entries import unpack

    return [tuple(batch.meta["group_key"][0]) for batch in unpack(entry)]


def streams_groups(cfg: RLConfig) -> bool:
    """Whether the rollout streams prompt groups (asynchronous, or several replicas taking a
    step's groups by load) rather than generating a step's prompts in one call."""
    return cfg.train.schedule == "async" or cfg.rollout.replicas > 1


def max_in_flight(cfg: RLConfig) -> int:
    """Items between the prompt source and the end of the trainer's steps: a step's item
    (or prompt groups) for sync, two steps for one_step_off, ``max_staleness + 1`` steps
    for async (the rollout runs at most ``max_staleness`` steps ahead: the staleness bound
    at admission)."""
    t = cfg.train
    steps = {"sync": 1, "one_step_off": 2}.get(t.schedule, t.max_staleness + 1)
    return steps * (cfg.data.prompts_per_step if streams_groups(cfg) else 1)


def trainer_strategy(cfg: RLConfig):
    """The Megatron layout of the trainer's worker group."""
    from mcore_rl.flow import Megatron

    p = cfg.parallel
    return Megatron(tp=p.tp, pp=p.pp, dp=p.dp or 1, vpp=p.vpp, seed=cfg.train.seed,
                    threads_per_rank=p.cpu_threads_per_rank, backend=p.backend, ep=p.ep, etp=p.etp,
                    cp=p.cp)


def replica_cores(replicas: int, gpus: bool) -> list[list[int] | None]:
    """CPU devices of each engine replica's controller: one replica runs unpinned (its engine
    places itself, `mcore_rl.engines.placement`); several share this machine's cores out,
    one core or more each. On GPUs: None (they get GPUs)."""
    if replicas == 1 or gpus:
        return [None] * replicas
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // replicas)
    return [cores[(i * per) % len(cores):][:per] or [cores[i % len(cores)]] for i in range(replicas)]


def scores_in_trainer(cfg: RLConfig, by_groups: bool) -> bool:
    """Whether a reward function (not a reward model) runs in the trainer's first rank:
    always with ``fused``; with the other placements when the step is synchronous and one
    batch (``sync``, one replica), where scoring sits between generation and update whatever
    process does it, so the rollout hands its batch to the trainer directly. With overlapping
    schedules the reward keeps a controller of its own, scoring beside the update."""
    return cfg.rollout.placement == "fused" or (cfg.train.schedule == "sync" and not by_groups)


def rl_graph(cfg: RLConfig, model_dir: Path, stop: Any = None, gpus: bool = False,
             driven: bool = False, plan_only: bool = False) -> JobGraph:
    """The RL job's graph (module doc). ``stop``: what the trainer asks at every step
    boundary (``should_stop(ctx)``); ``gpus``: place on the cluster's GPUs; ``driven``: for
    `RLTrainer` (no reward controller, no data: the driver samples, scores and updates);
    ``plan_only``: a graph to place, never run (no checkpoint is read: its paths may exist
    only on the cluster)."""
    from mcore_rl.flow import GPUs, Controller, ControllerGroup, DataStream, Replaceable, factory
    from mcore_rl.roles.continuous import ContinuousGenerate
    from mcore_rl.roles.generate import Generate
    from mcore_rl.roles.reward_model import reward_controller
    from mcore_rl.roles.score import Score
    from mcore_rl.roles.train import Train

    data = config_to_dict(cfg)
    r = cfg.rollout
    fused, colocated = r.placement == "fused", r.placement in ("colocated", "fused")
    by_groups = streams_groups(cfg) and not driven
    groups = cfg.data.prompts_per_step if by_groups else 1
    rollout, scored = DataStream("rollout", groups), DataStream("scored", groups)
    step, position, taken_ahead = (0, 0, ()) if driven or plan_only else resume_point(cfg)
    own = None if by_groups or driven else factory(prompt_items, data, step, position)
    engines = [f"engine/{i}" for i in range(r.replicas)]
    role = ContinuousGenerate if by_groups else Generate
    engine_devices = [GPUs(r.engine_tp, share="trainer" if colocated else None)] * r.replicas \
        if gpus else replica_cores(r.replicas, gpus)
    replaceable = Replaceable(group_key, finished_groups) \
        if by_groups and r.on_replica_failure == "continue" else None
    rollouts = [Controller("rollout", factory(role, data, str(model_dir), name), data=own,
                           data_output=None if driven else rollout, streaming=by_groups,
                           replaceable=replaceable,
                           devices=None if fused else devices,
                           fused_with="trainer" if fused else None)
                for name, devices in zip(engines, engine_devices)]
    trainer = Controller("trainer", factory(Train, data, str(model_dir), engines, False, stop,
                                            colocated),
                         data_input=None if driven else scored, batch_items=groups,
                         strategy=trainer_strategy(cfg), devices=GPUs() if gpus else None)
    if driven:
        return JobGraph(ControllerGroup([*rollouts, trainer]))
    if cfg.reward.name == REWARD_MODEL:
        reward = reward_controller(cfg, data, rollout, scored, devices=GPUs() if gpus else None)
    else:
        # Synchronous steps score on the trainer's critical path anyway: there the reward
        # runs in the trainer's first rank, one hand-off fewer (`scores_in_trainer`).
        reward = Controller("reward", factory(Score, data), data_input=rollout, data_output=scored,
                            fused_with="trainer" if fused or scores_in_trainer(cfg, by_groups)
                            else None)
    graph = ControllerGroup([*rollouts, reward, trainer])
    if by_groups:  # the driver feeds the groups: the replicas take them by load
        return JobGraph(graph, data=group_items(data, step, position, taken_ahead),
                        max_in_flight=max_in_flight(cfg))
    return JobGraph(graph, max_in_flight=None if fused else max_in_flight(cfg))


def trainer_graph(cfg: RLConfig, stop: Any = None, gpus: bool = False, driven: bool = False) -> JobGraph:
    """The graph of a fine-tuning or smoke job: one trainer controller that reads its own
    records, a step per call (``driven``: stepped by `RLTrainer` instead)."""
    from mcore_rl.flow import GPUs, Controller, ControllerGroup, factory
    from mcore_rl.roles.finetune import FinetuneTrain
    from mcore_rl.roles.smoke import SmokeTrain

    role = SmokeTrain if cfg.train.job == "smoke" else FinetuneTrain
    trainer = Controller("trainer", factory(role, config_to_dict(cfg), stop),
                         data=None if driven else factory(itertools.count, 1),
                         strategy=trainer_strategy(cfg), devices=GPUs() if gpus else None)
    return JobGraph(ControllerGroup([trainer]))


def job_graph(cfg: RLConfig, stop: Any = None, gpus: bool = False, driven: bool = False,
              dry_run: bool = False):
    """(the run's config, with the model directory it starts from, and its `JobGraph`).
    ``dry_run``: a graph to plan only (`mcore-rl placement`): no model is written or read."""
    if cfg.train.job != "rl":
        return cfg, trainer_graph(cfg, stop, gpus, driven)
    if dry_run:
        return cfg, rl_graph(cfg, Path(cfg.model.path or "<random initial model>"), stop, gpus,
                             plan_only=True)
    model_dir = model_dir_for(cfg)
    cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
    return cfg, rl_graph(cfg, model_dir, stop, gpus, driven)


class ModelDirAhead:
    """The directory an RL job starts from (`model_dir_for`), prepared in a thread from
    construction on, beside what the caller does meanwhile: writing the random initial
    model imports transformers, seconds that starting Ray beside it hides. `run_job` takes
    it; a caller that gives up before then calls `discard`."""

    def __init__(self, cfg: RLConfig):
        from mcore_rl.rl.setup import writes_initial_model

        self.cfg = cfg
        self.fresh = writes_initial_model(cfg)
        """Whether this run writes its random initial model (what a failed start removes)."""
        self._error: BaseException | None = None
        self._thread = None
        if cfg.train.job == "rl":
            self._thread = threading.Thread(target=self._prepare, name="model-dir", daemon=True)
            self._thread.start()

    def _prepare(self) -> None:
        try:
            model_dir_for(self.cfg)
        except BaseException as err:  # noqa: BLE001 - raised by `wait`
            self._error = err

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Until the directory is there; its failure raised here."""
        self.join()
        if self._error is not None:
            raise self._error

    def discard(self) -> None:
        """After a start that failed before `run_job`: the random initial model this run
        wrote removed, once written."""
        from mcore_rl.rl.setup import remove_initial_model

        self.join()
        if self.fresh:
            remove_initial_model(self.cfg)


def run_job(cfg: RLConfig, stop: Any = None, address: str | None = None,
            ahead: ModelDirAhead | None = None):
    """Launch ``cfg``'s job as its graph on Ray (joined, or started here) and wait for it;
    its `FlowStats`. A run that fails before its first checkpoint removes the random
    initial model it wrote. Once every process is up, ``<logging.dir>/processes.json`` says
    which is which (`process_map`): the pids to attach a profiler to, or to look for.
    ``ahead``: the model directory, prepared while the caller started Ray (default: here,
    beside starting Ray if this call does)."""
    from mcore_rl.flow import gpu_placement, launch, ray_shim
    from mcore_rl.rl.setup import initial_model_removed_on_failure

    ray = ray_shim.require()
    ahead = ahead or ModelDirAhead(cfg)
    stop_ray = None
    try:
        with initial_model_removed_on_failure(cfg, _DRIVER, wrote=ahead.fresh):
            try:
                if not ray.is_initialized():
                    stop_ray = ray_shim.start_local(cfg.launch.ray_reconnect_timeout_s,
                                                    address=address, include_dashboard=False)
            finally:
                ahead.join()  # written or failed before anything is removed
            ahead.wait()
            cfg, job = job_graph(cfg, stop, gpus=gpu_placement.has_gpus())
            return launch(job.group, data=job.data, max_in_flight=job.max_in_flight,
                          on_started=lambda processes: write_process_map(cfg, processes))
    finally:
        if stop_ray is not None:
            stop_ray()


PROCESS_MAP = "processes.json"
"""The file in ``logging.dir`` that names the run's processes (`write_process_map`)."""


def write_process_map(cfg: RLConfig, processes: dict[str, list[int]]) -> Path:
    """``{"driver": pid, "ray_session": its directory, "processes": {"hub": [pid],
    "<role>#<index>": [controller pid, then the ranks or engines it started]}}``."""
    from mcore_rl.atomic_write import write_json_atomic
    from mcore_rl.flow import ray_shim

    return write_json_atomic(Path(cfg.logging.dir) / PROCESS_MAP, {
        "driver": os.getpid(), "ray_session": ray_shim.session_dir(), "processes": processes})


def run_in_this_world(cfg: RLConfig, stop: Any = None):
    """``cfg``'s job with every role in the trainer's ranks, on the torch.distributed world
    this process is a rank of (`mcore_rl.flow.in_world`): how tests and benchmarks run the
    ``fused`` placement in a world they keep for many runs. Rank 0's stats."""
    from mcore_rl.flow.in_world import run_in_world
    from mcore_rl.rl.setup import initial_model_removed_on_failure

    import torch.distributed as dist

    if cfg.train.job == "rl":
        cfg = replace(cfg, rollout=replace(cfg.rollout, placement="fused"))
    p = cfg.parallel
    if p.dp is None:  # the world's ranks, as mcore-rl train --nproc sets them
        cfg = replace(cfg, parallel=replace(p, dp=dist.get_world_size() // (p.tp * p.pp)))

    with initial_model_removed_on_failure(cfg, _Rank(dist.get_rank() == 0)):
        if cfg.train.job == "rl" and dist.get_rank() == 0:
            model_dir_for(cfg)  # written once, before the other ranks read it
        dist.barrier()
        cfg, job = job_graph(cfg, stop)
        return run_in_world(job.group)


class _Rank:
    def __init__(self, is_controller: bool):
        self.is_controller = is_controller


_DRIVER = _Rank(True)
