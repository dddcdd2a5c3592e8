"""Bad input, table-driven: every case exits 2 with one line (no traceback) that names the
field and the fix, before any rank starts, and writes nothing.

The cases run the CLI in-process (``mcore_rl.cli.main.main``) with rank start-up replaced by
a trap, so a case that got as far as starting ranks fails. `RANGE_CASES` holds one value
out of range for every bounded config field (`mcore_rl.config.ranges.RANGES`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mcore_rl.cli.main import main
from mcore_rl.config.ranges import RANGES

REPO = Path(__file__).resolve().parents[2]
QUICK = str(REPO / "configs" / "quickstart.yaml")


def _out_of_range(name: str):
    """The nearest value outside the field's range."""
    rng = RANGES[name]
    if rng.low is not None:
        value = rng.low if rng.low_open else rng.low - 1
    else:
        value = rng.high if rng.high_open else rng.high + 1
    return int(value) if float(value).is_integer() else value


RANGE_CASES = [([f"{name}={_out_of_range(name)}"], f"{name} must be", f"set {name} to a value")
               for name in sorted(RANGES)]


@pytest.fixture()
def files(tmp_path):
    """Broken inputs of every kind, made once per case."""
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "a_file").write_text("not a directory\n")
    gpt2 = d / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                  "n_layer": 2, "n_head": 4}))
    bad_json = d / "bad_json_model"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    (d / "no_field.jsonl").write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    (d / "not_json.jsonl").write_text("{oops\n")
    (d / "empty.jsonl").write_text("\n")
    (d / "words.jsonl").write_text(json.dumps({"prompt": "hello", "completion": "world"}) + "\n")
    broken_state = d / "ckpt" / "step_000002"
    broken_state.mkdir(parents=True)
    (broken_state / "run_state.json").write_text("{truncated")
    no_state = d / "ckpt2" / "step_000004"
    no_state.mkdir(parents=True)
    (d / "ckpt2" / "latest").write_text("step_000004")
    truncated = d / "ckpt3" / "step_000003"
    _fake_model_checkpoint(truncated / "actor", truncate=True)
    (truncated / "run_state.json").write_text(json.dumps({"step": 3}))
    earlier = d / "earlier_run"
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    return d


def _fake_model_checkpoint(path: Path, truncate: bool) -> None:
    """A distributed checkpoint's files (index, data, headers), its data file cut short."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(1000, dtype=torch.float32)}, checkpoint_id=str(path), no_dist=True)
    (path / "metadata.json").write_text("{}")
    (path / "common.pt").write_bytes(b"")
    if truncate:
        data = next(path.glob("*.distcp"))
        data.write_bytes(data.read_bytes()[:100])


# (command line after `mcore-rl`, text the one line must name, text of the fix it must give)
CASES = [
    # numbers that are not finite (every float field is checked)
    (["optimizer.lr=.inf"], "optimizer.lr must be a finite number", "set optimizer.lr to a finite"),
    (["optimizer.lr=.nan"], "optimizer.lr must be a finite number", "set optimizer.lr"),
    (["algorithm.gamma=-.inf"], "algorithm.gamma must be a finite number", "set algorithm.gamma"),
    (["reward.truncation_penalty=.nan"], "reward.truncation_penalty must be a finite", "finite value"),
    (["train.warm_start_lr=.inf"], "train.warm_start_lr must be a finite", "set train.warm_start_lr"),
    # cross-field
    (["rollout.max_new_tokens=30"], "rollout.max_prompt_tokens + rollout.max_new_tokens = 8 + 30 "
                                    "exceeds the model's 32 positions", "lower one of them"),
    (["rollout.min_new_tokens=5"], "rollout.min_new_tokens=5 exceeds rollout.max_new_tokens=4",
     "lower it"),
    (["optimizer.min_lr=0.1"], "optimizer.min_lr=0.1 is above optimizer.lr", "lower it"),
    (["parallel.tp=3"], "parallel.tp=3 does not divide the model's 4 attention heads", "choose one of"),
    (["parallel.pp=3"], "parallel.pp=3 does not divide the model's 2 layers", "choose one of 1, 2"),
    (["model.num_experts=4", "model.experts_per_token=5"],
     "model.experts_per_token=5 exceeds model.num_experts=4", "route each token to at most 4"),
    (["model.num_experts=4"], "rollout.engine=vllm: its CPU backend cannot load new expert weights",
     "set rollout.engine=hf"),
    (["moe.routing_replay=old_logprob"], "moe.routing_replay=old_logprob needs a "
                                         "mixture-of-experts model", "set moe.routing_replay=off"),
    (["model.num_experts=4", "rollout.engine=hf", "moe.routing_replay=old_logprob",
      "model.recompute=full"], "moe.routing_replay=old_logprob with model.recompute=full",
     "set model.recompute=selective (attention only) or none"),
    (["model.num_experts=4", "rollout.engine=sglang", "moe.routing_replay=rollout"],
     "moe.routing_replay=rollout: the sglang engine does not report the experts",
     "use rollout.engine=hf or moe.routing_replay=old_logprob"),
    (["parallel.vpp=2"], "parallel.vpp=2 needs parallel.pp >= 2", "set parallel.vpp=null"),
    (["parallel.dp=3", "--nproc", "2"], "tp*pp*dp = 1*1*3 = 3 ranks, but the world has 2",
     "set parallel.dp=2"),
    (["parallel.tp=2", "--nproc", "3"], "world size 3 is not a multiple of tp*pp = 2",
     "launch a multiple of 2"),
    (["--nproc", "-1"], "--nproc must be >= 1, got -1", "give the number of ranks"),
    (["--nproc", "0"], "--nproc must be >= 1, got 0", "give the number of ranks"),
    # paths
    (["logging.dir={d}/a_file"], "logging.dir={d}/a_file is not a directory", "choose a directory"),
    (["logging.dir={d}/a_file/run"], "({d}/a_file is a file)", "choose a directory"),
    (["checkpoint.dir={d}/a_file"], "checkpoint.dir={d}/a_file is not a directory", "choose a directory"),
    (["model.path={d}/gpt2"], "unsupported model: architecture 'GPT2LMHeadModel'", "supported:"),
    (["model.path={d}/nothing_here"], "model.path: '{d}/nothing_here' has no config.json",
     "point it at a HuggingFace checkpoint"),
    (["model.path={d}/bad_json_model"], "config.json is not valid JSON", "fix or replace the file"),
    (["model.path=builtin:gpt5"], "unknown built-in model 'gpt5'", "built-in models:"),
    # data
    (["data.source=jsonl"], "data.source=jsonl needs data.path", "data.path"),
    (["data.source=jsonl", "data.path={d}/missing.jsonl"], "data file '{d}/missing.jsonl' does not exist",
     "data file"),
    (["data.source=jsonl", "data.path={d}/no_field.jsonl"], "row 1 has no field 'prompt' (data.prompt_key)",
     "fields there: answer, question"),
    (["data.source=jsonl", "data.path={d}/not_json.jsonl"], "not_json.jsonl:1 is not valid JSON", "JSON"),
    (["data.source=jsonl", "data.path={d}/empty.jsonl"], "holds no records", "data file"),
    (["data.source=reasoning_gym"], "data.source=reasoning_gym needs data.task", "e.g. basic_arithmetic"),
    (["data.source=reasoning_gym", "data.task=no_such_task"], "reasoning-gym cannot create task "
                                                            "'no_such_task' (data.task)", "data.task"),
    # registered names
    (["rollout.engine=vlm"], "rollout.engine: unknown rollout engine 'vlm'", "did you mean 'vllm'"),
    (["data.source=jsnl"], "data.source: unknown prompt source 'jsnl'", "did you mean 'jsonl'"),
    (["reward.name=exactt"], "reward.name: unknown reward 'exactt'", "did you mean 'exact'"),
    (["reward.name=reward_model"], "reward.name=reward_model needs reward.reward_model_path",
     "an HF *ForSequenceClassification directory"),
    (["reward.name=no_such_mod:fn"], "reward.name: cannot import module 'no_such_mod'", "no_such_mod"),
    (["reward.name=mcore_rl.rewards:nope"], "module 'mcore_rl.rewards' has no attribute 'nope'", "nope"),
    (["algorithm.advantage_estimator=grop"], "algorithm.advantage_estimator: unknown advantage "
                                             "estimator 'grop'", "did you mean 'grpo'"),
    (["algorithm.policy_loss=ppo"], "algorithm.policy_loss: unknown policy loss 'ppo'", "registered:"),
    # the config file and its keys
    (["parallel.tpp=2"], "unknown key 'parallel.tpp'", "did you mean 'tp'"),
    (["optimiser.lr=1"], "unknown key 'optimiser'", "did you mean 'optimizer'"),
    (["parallel.tp=two"], "parallel.tp: expected int, got 'two'", "expected int"),
    (["rollout.placement=colo"], "rollout.placement: must be one of 'colocated', 'separate', 'fused'",
     "must be one of"),
    (["train.on_nonfinite=ignore"], "train.on_nonfinite: must be one of 'stop', 'skip'", "must be one of"),
    (["parallel=3"], "parallel: expected a mapping", "mapping"),
    # resuming
    (["checkpoint.resume=/nonexistent/step_000001"], "checkpoint.resume=/nonexistent/step_000001 cannot "
                                                     "be loaded: /nonexistent/step_000001 is not a "
                                                     "directory", "give a complete step directory"),
    (["checkpoint.resume={d}/ckpt/step_000002"], "run_state.json is unreadable (JSONDecodeError",
     "give a complete step directory"),
    (["checkpoint.resume={d}/ckpt3/step_000003"], "step_000003/actor: data file __0_0.distcp is "
                                                  "truncated", "give a complete step directory"),
    (["checkpoint.resume=auto", "checkpoint.dir={d}/ckpt2"], "checkpoint.resume=auto: ", "checkpoint.resume=never"),
    (["checkpoint.resume=auto", "logging.dir={d}/earlier_run"], "holds an earlier run but no usable "
                                                                "checkpoint", "checkpoint.resume=never"),
    (["train.schedule=one_step_off", "rollout.placement=separate"],
     "train.schedule=one_step_off trains on rollouts one weight version old", "train.max_staleness=1"),
    (["rollout.on_replica_failure=continue"],
     "rollout.on_replica_failure=continue goes on with the other replicas when one dies, but "
     "rollout.replicas=1", "set rollout.replicas=2 (or more)"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel=true splits each sequence over "
                                          "the tensor-parallel ranks, and parallel.tp=1 has one",
     "set parallel.tp >= 2"),
    (["reshard.transport=nccl"], "reshard.transport=nccl is vLLM's GPU backend (it needs CUDA)",
     "use reshard.transport=auto"),
    (["reshard.transport=nccl_m2n"], "vLLM's nccl_m2n backend is not supported",
     "use reshard.transport=nccl"),
    (["reshard.transport=ipc", "rollout.engine=hf"], "rollout.engine=hf does not speak it",
     "use reshard.transport=auto"),
    (["reshard.transport=ipc", "rollout.engine=sglang"],
     "rollout.engine=sglang takes weights over NCCL through its own update API",
     "use reshard.transport=nccl (separate placement)"),
    (["reshard.transport=nccl", "rollout.engine=sglang"],
     "reshard.transport=nccl is SGLang's NCCL update (it needs CUDA)", "use reshard.transport=auto"),
    (["reshard.transport=sparse_nccl", "launch.gpus_per_node=1"],
     "reshard.transport=sparse_nccl sends only what changed", "set reshard.delta=true"),
    (["reshard.transport=nccl", "launch.gpus_per_node=1"],
     "reshard.transport=nccl joins the trainer's sending rank and the engine's workers in one "
     "NCCL group", "set rollout.placement=separate"),
    (["reshard.transport=ipc", "launch.gpus_per_node=1", "rollout.placement=separate"],
     "reshard.transport=ipc shares each tensor from the trainer's GPU", "set rollout.placement=colocated"),
    (["reshard.transport=nccl", "reshard.delta=true", "launch.gpus_per_node=1"],
     "reshard.delta=true through vLLM's backends is sparse_nccl's work",
     "set reshard.transport=sparse_nccl"),
    (["train.offload=true"], "train.offload=true moves the trainer's state from GPU memory to host "
                             "memory", "set train.offload=false"),
    (["train.offload=true", "launch.gpus_per_node=1", "optimizer.distributed=true"],
     "train.offload=true with optimizer.distributed=true and model.dtype=fp32", "set model.dtype=bf16"),
    (["rollout.replay_sampling_mask=true", "rollout.engine=hf_batched", "rollout.top_k=5",
      "environment.name=calculator", "environment.max_response_tokens=8"],
     "multi-turn episodes do not carry the engine's sampling masks",
     "set rollout.replay_sampling_mask=false"),
    (["rollout.replay_sampling_mask=true", "rollout.top_k=5"],
     "rollout.replay_sampling_mask=true needs vLLM on a GPU: its sampling masks come from Model Runner V2",
     "set rollout.replay_sampling_mask=false"),
    (["rollout.replay_sampling_mask=true", "rollout.engine=hf", "rollout.top_k=5"],
     "rollout.replay_sampling_mask=true replays the engine's sampling masks, which rollout.engine=hf "
     "does not report", "or hf_batched"),
    (["rollout.replay_sampling_mask=true", "rollout.engine=hf_batched"],
     "rollout.replay_sampling_mask=true needs rollout.top_k > 0", "got top_k=-1"),
    (["rollout.placement=fused", "train.schedule=async", "train.max_staleness=1"],
     "rollout.placement=fused runs rollout, reward and update in line in the trainer's first rank",
     "set rollout.placement=colocated (or separate), or train.schedule=sync"),
    # the fine-tuning jobs (sft, rm, dpo, kto)
    (["train.job=dpo", "finetune.dpo_loss=sigmoud"], "finetune.dpo_loss: unknown DPO loss 'sigmoud'",
     "did you mean 'sigmoid'"),
    (["train.job=dpo", "finetune.max_length=100"], "finetune.max_length=100 exceeds the model's 32 "
                                                   "positions", "lower it"),
    (["train.job=dpo", "finetune.batch_size=1", "--nproc", "2"], "finetune.batch_size=1 pairs cannot "
     "feed 2 data-parallel rank(s)", "set finetune.batch_size >= 2"),
    (["train.job=kto", "parallel.pp=2", "parallel.vpp=1", "finetune.batch_size=3", "--nproc", "4"],
     "finetune.batch_size=3 records cannot feed 2 data-parallel rank(s) with 2 interleaved stages",
     "set finetune.batch_size >= 4"),
    (["train.job=rm"], "train.warm_start_steps: the supervised warm start trains a causal LM",
     "set train.warm_start_steps=0 for train.job=rm"),
    (["train.job=dpo", "data.source=jsonl", "data.path={d}/no_field.jsonl"],
     "{d}/no_field.jsonl has no usable record (1 no 'prompt' field)", "check the field names"),
    (["train.job=kto", "finetune.max_length=2"], "the built-in task (train) has no usable record "
                                                 "(136 over 2 tokens)", "finetune.max_length"),
    (["train.job=sft", "data.source=jsonl", "data.path={d}/words.jsonl"], "the train data cannot be "
     "tokenized: character 'h' is not in the tokenizer's alphabet", "use a model.path whose tokenizer"),
    (["train.job=sft", "data.source=reasoning_gym", "data.task=basic_arithmetic"],
     "data.source=reasoning_gym cannot feed train.job=sft", "use jsonl or parquet"),
    (["train.job=sft", "finetune.messages_key=", "data.source=jsonl", "data.path={d}/empty.jsonl"],
     "{d}/empty.jsonl has no usable record (it is empty)", "check the field names"),
    (["train.job=online_dpo"], "rollout.n_samples_per_prompt=8: online DPO pairs two responses",
     "set rollout.n_samples_per_prompt=2"),
    (["train.job=dpo", "checkpoint.resume=auto", "logging.dir={d}/earlier_run"],
     "holds an earlier run but no usable checkpoint", "checkpoint.resume=never"),
    # trackers (logging.backends)
    (["logging.backends=[jsonl,wandbb]"], "logging.backends: unknown tracker 'wandbb'",
     "did you mean 'wandb'"),
    (["logging.backends=[jsonl,tensorboard,jsonl]"], "logging.backends names jsonl twice",
     "name each backend once"),
    (["logging.backends=[jsonl,nowhere_at_all:Tracker]"], "logging.backends: cannot import module "
     "'nowhere_at_all'", "nowhere_at_all:Tracker"),
    (["logging.backends=[jsonl,os:getcwd]"], "logging.backends: os:getcwd is not a tracker",
     "subclasses mcore_rl.tracking.Tracker"),
    (["logging.tensorboard=false"], "'logging.tensorboard' is gone", "set logging.backends=[jsonl]"),
    (["logging.backends=[mlflow]", "logging.mlflow.tracking_uri=http://127.0.0.1:9"],
     "logging.mlflow.tracking_uri=http://127.0.0.1:9: the tracking server does not answer",
     "start it ('mlflow server') or fix the URI"),
    (["logging.backends=[mlflow]", "logging.mlflow.tracking_uri=file:{d}/mlruns"],
     "MLflow no longer takes new runs in a directory", "use a database file, e.g. sqlite:///"),
    (["logging.backends=[mlflow]", "logging.mlflow.tracking_uri=ftp://host/x"],
     "has scheme 'ftp', which MLflow does not track to", "use one of http:"),
    (["logging.backends=[jsonl]", "logging.wandb.mode=offlne"],
     "logging.wandb.mode: must be one of", "did you mean 'offline'"),
] + RANGE_CASES


def _listing(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("argv, names, fix", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_exit_2_before_any_rank_and_writes_nothing(
        argv, names, fix, files, tmp_path, capsys, no_rank_starts):
    argv = [a.format(d=files) for a in argv]
    run_dir = tmp_path / "run"
    if not any(a.startswith("logging.dir=") for a in argv):
        argv.append(f"logging.dir={run_dir}")
    before = _listing(files)
    assert main(["train", QUICK, *argv]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("mcore-rl train: error: "), lines[0]
    assert names.format(d=files) in lines[0], lines[0]
    assert fix.format(d=files) in lines[0], lines[0]
    assert not run_dir.exists(), "a rejected run wrote its output directory"
    assert _listing(files) == before, "a rejected run changed its inputs"


def test_every_bounded_field_has_an_out_of_range_case_and_the_cases_are_many():
    fields = {case[0][0].split("=")[0] for case in RANGE_CASES}
    assert fields == set(RANGES)
    assert all(not RANGES[c[0][0].split("=")[0]].holds(float(c[0][0].split("=")[1]))
               for c in RANGE_CASES)
    assert len(CASES) >= 81


@pytest.mark.parametrize("argv, message", [
    (["config", "show", QUICK, "--world-size", "0"], "the world size must be >= 1, got 0"),
    (["config", "show", QUICK, "reshard.bucket_mb=-1"], "reshard.bucket_mb must be > 0, got -1"),
    (["config", "show", QUICK, "reward.name=reward_modle"], "did you mean 'reward_model'"),
    (["config", "show", str(REPO / "configs" / "nope.yaml")], "config file"),
])
def test_config_show_rejects_the_same_inputs(argv, message, capsys, no_rank_starts):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_every_job_and_placement_runs_as_its_graph_through_one_entry(monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr("mcore_rl.roles.graph.run_job",
                        lambda cfg, **kwargs: started.append((cfg.train.job, cfg.rollout.placement)))
    monkeypatch.setattr("mcore_rl.flow.ray_shim.start_local", lambda *a, **kw: (lambda: None))
    monkeypatch.setattr("mcore_rl.flow.ray_shim.require",
                        lambda: type("Ray", (), {"is_initialized": staticmethod(lambda: True)}))
    monkeypatch.setattr("mcore_rl.flow.ray_head.quiet_death_notices", lambda: None)
    monkeypatch.setattr("mcore_rl.flow.ray_head.watch_head",
                        lambda on_death: type("Watch", (), {"stop": lambda self: None})())
    quick = str(REPO / "configs" / "quickstart.yaml")
    assert main(["train", quick, f"logging.dir={tmp_path}/a", "rollout.placement=fused"]) == 0
    assert main(["train", quick, f"logging.dir={tmp_path}/b"]) == 0
    assert main(["train", str(REPO / "configs" / "smoke.yaml"), f"logging.dir={tmp_path}/c"]) == 0
    assert main(["train", str(REPO / "configs" / "dpo_quickstart.yaml"),
                 f"logging.dir={tmp_path}/d"]) == 0
    assert started == [("rl", "fused"), ("rl", "colocated"), ("smoke", "colocated"),
                       ("dpo", "colocated")]


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2", "RANK": "0"},
                                 {"SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}],
                         ids=["torchrun", "srun"])
def test_under_torchrun_or_srun_what_cannot_run_fused_says_which_command_to_use(
        env, monkeypatch, capsys, no_rank_starts):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # restored after the test, whatever it set
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["train", QUICK, "train.schedule=one_step_off", "train.max_staleness=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "under torchrun or srun every role runs fused into the ranks" in err[0]
    assert "train.schedule=one_step_off needs the engine in a controller of its own" in err[0]
    assert "mcore-rl launch slurm CONFIG" in err[0] and "mcore-rl train CONFIG --nproc N" in err[0]
    assert "RANK" not in __import__("os").environ or env.get("RANK") == "0"  # nothing leaked


def test_torchrun_ranks_run_the_jobs_graph_in_their_own_world_without_ray(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
         "mcore_rl.cli.main", "train", str(REPO / "configs" / "smoke.yaml"), "train.steps=3",
         "parallel.tp=2", f"logging.dir={tmp_path}"], capture_output=True, text=True, timeout=300,
        env={k: v for k, v in __import__("os").environ.items() if k != "RAY_ADDRESS"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "in the launcher's world of 2 rank(s), without Ray" in proc.stdout
    summary = json.loads((tmp_path / "smoke_summary.json").read_text())
    assert summary["steps"] == 3 and summary["layout"].startswith("TP2")


def test_a_ray_address_nobody_answers_is_refused_in_one_line_at_once(monkeypatch, capsys, tmp_path):
    """Ray itself would retry a dead RAY_ADDRESS for minutes."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    started = time.monotonic()
    assert main(["train", QUICK, f"logging.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot join the Ray cluster at 127.0.0.1:{port} (RAY_ADDRESS" in err[0]
    assert "unset RAY_ADDRESS" in err[0] and time.monotonic() - started < 30
