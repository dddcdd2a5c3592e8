"""The RL loop of ``mcore-rl train`` as a dataflow graph: a rollout controller (the engine)
-> a reward controller -> a trainer controller (the Megatron ranks), with the weight sync
from the trainer into the engine after every update.

    stats = run_rl_graph(load_config("configs/quickstart.yaml"))

``train.schedule: sync`` paces the feed with ``max_in_flight=1``: the next step's prompts
enter the graph only once the trainer has finished the step before, so it computes what
the SPMD loop computes, step for step (``tests/api/test_rl_graph.py`` replays the golden
runs through it). ``one_step_off`` lets one more step in: the rollout of step k+1 is
generated while step k trains, one weight version behind."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Iterator

from mcore_rl.api.reward_model_role import reward_controller
from mcore_rl.api.roles import Generate, Score, Train
from mcore_rl.config import RLConfig
from mcore_rl.config.loader import config_to_dict
from mcore_rl.rewards.reward_model import REWARD_MODEL


def model_dir_for(cfg: RLConfig) -> Path:
    """The HF directory the run starts from (``model.path``, or the random tiny model)."""
    if cfg.model.path:
        from mcore_rl.models.builtin import resolve_model_path

        return resolve_model_path(cfg.model.path)
    from mcore_rl.rl.setup import write_initial_model

    return write_initial_model(cfg)


def resume_point(cfg: RLConfig) -> tuple[int, int]:
    """(step, data position) the run continues from: those of the checkpoint that
    ``checkpoint.resume`` selects, or (0, 0)."""
    from mcore_rl.rl.setup import trained_parts
    from mcore_rl.train.run_checkpoints import RunCheckpoints

    path = RunCheckpoints.for_config(cfg).resolve_resume(cfg.checkpoint.resume, trained_parts(cfg),
                                                         cfg.logging.dir).path
    if path is None:
        return 0, 0
    run = json.loads((Path(path) / "run_state.json").read_text())
    return run["step"], run["data_position"]


def prompt_items(cfg: RLConfig, start_step: int, position: int) -> Iterator[dict]:
    """One item per step to go: ``{"step", "prompts"}``, from the config's prompt source in
    the order ``mcore-rl train`` takes them. With ``algorithm.dynamic_sampling`` a step may
    take ``dynamic_sampling_max_rounds`` more items: there are that many more per step
    (``step`` then numbers items, seeding their sampling), and the trainer ends the launch
    once it has taken its last step."""
    from mcore_rl.data.prompts import PromptStream, load_prompt_records

    stream = PromptStream(load_prompt_records(cfg.data, "train"), cfg.data.seed)
    stream.position = position
    rounds = 1 + (cfg.algorithm.dynamic_sampling_max_rounds if cfg.algorithm.dynamic_sampling else 0)
    for step in range(start_step + 1, start_step + (cfg.train.steps - start_step) * rounds + 1):
        records = stream.take(cfg.data.prompts_per_step)
        yield {"step": step, "prompts": [{"prompt": r.prompt, **r.meta} for r in records]}


def group_items(cfg: RLConfig, start_step: int, position: int) -> Iterator[dict]:
    """The prompts of `prompt_items` one by one: ``{"step", "index", "prompt"}`` (index:
    the prompt's place in its step), the items of the asynchronous schedule."""
    for item in prompt_items(cfg, start_step, position):
        for index, prompt in enumerate(item["prompts"]):
            yield {"step": item["step"], "index": index, "prompt": prompt}


def rl_graph(cfg: RLConfig, model_dir: Path, buffer_size: int = 1, stop=None):
    """The `ControllerGroup` of the RL loop for ``cfg`` (ranks: ``parallel.tp * pp * dp``).
    ``stop``: what the trainer asks at every step boundary (``should_stop(ctx)``, e.g. the
    launcher's `StopSignal` watching a stop file); an agreed stop saves a checkpoint and
    ends the launch with `StopRequested`. With ``train.schedule: async`` the items are
    prompt groups: the rollout streams (`ContinuousGenerate`), the reward scores each
    group, and the trainer merges ``data.prompts_per_step`` of them into a step."""
    from mcore_rl.api.continuous import ContinuousGenerate
    from mcore_rl.flow import Controller, ControllerGroup, DataStream, Megatron, factory

    data = config_to_dict(cfg)
    p = cfg.parallel
    streaming = cfg.train.schedule == "async"
    groups = cfg.data.prompts_per_step if streaming else 1
    rollout = DataStream("rollout", buffer_size * groups)
    scored = DataStream("scored", buffer_size * groups)
    world = (p.dp or 1) * p.tp * p.pp
    engines = [f"engine/{i}" for i in range(cfg.rollout.replicas)]
    role = ContinuousGenerate if streaming else Generate
    cores = replica_cores(len(engines))
    rollouts = [Controller("rollout", factory(role, data, str(model_dir), name),
                           data_output=rollout, streaming=streaming, devices=devices)
                for name, devices in zip(engines, cores)]
    return ControllerGroup([
        *rollouts,
        reward_controller(cfg, data, rollout, scored) if cfg.reward.name == REWARD_MODEL else
        Controller("reward", factory(Score, data), data_input=rollout, data_output=scored),
        Controller("trainer", factory(Train, data, str(model_dir), engines, False, stop,
                                      cfg.rollout.placement == "colocated"),
                   data_input=scored, batch_items=groups,
                   strategy=Megatron(tp=p.tp, pp=p.pp, dp=world // (p.tp * p.pp), vpp=p.vpp,
                                     seed=cfg.train.seed, threads_per_rank=p.cpu_threads_per_rank,
                                     backend=p.backend, ep=p.ep, etp=p.etp)),
    ])


def replica_cores(replicas: int) -> list[list[int] | None]:
    """Devices of each engine replica's controller: one replica runs unpinned (its engine
    places itself, `mcore_rl.engines.placement`); several share this machine's cores out,
    one core or more each, on CPU (GPU replicas place themselves)."""
    import os

    import torch

    if replicas == 1 or torch.cuda.is_available():
        return [None] * replicas
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // replicas)
    return [cores[(i * per) % len(cores):][:per] or [cores[i % len(cores)]] for i in range(replicas)]


def max_in_flight(cfg: RLConfig) -> int:
    """The launch's ``max_in_flight`` for ``train.schedule``: items between the prompt feed
    and the end of the trainer's steps. sync: one step's item; one_step_off: two;
    async: the prompt groups of ``max_staleness + 1`` steps (the rollout runs at most
    ``max_staleness`` steps ahead: the staleness bound at admission)."""
    t = cfg.train
    if t.schedule == "async":
        return (t.max_staleness + 1) * cfg.data.prompts_per_step
    return {"sync": 1, "one_step_off": 2}[t.schedule]


def run_rl_graph(cfg: RLConfig, max_in_flight_items: int | None = None,
                 address: str | None = None, stop=None):
    """Run ``cfg``'s RL job as the graph (``max_in_flight_items``: default by
    ``train.schedule``, `max_in_flight`); its `FlowStats`."""
    from mcore_rl.flow import launch

    from mcore_rl.rl.setup import initial_model_removed_on_failure

    with initial_model_removed_on_failure(cfg, _DRIVER):
        model_dir = model_dir_for(cfg)
        run_cfg = replace(cfg, model=replace(cfg.model, path=str(model_dir)))
        step, position = resume_point(run_cfg)
        items = group_items if cfg.train.schedule == "async" else prompt_items
        return launch(rl_graph(run_cfg, model_dir, stop=stop),
                      data=items(run_cfg, step, position),
                      max_in_flight=max_in_flight_items or max_in_flight(cfg),
                      address=address)


class _Driver:
    is_controller = True


_DRIVER = _Driver()
