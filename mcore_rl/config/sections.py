"""Typed configuration: one dataclass per section, a docstring per field.

YAML files load into `RLConfig` (see ``loader.py``); ``section.field=value`` overrides on the
command line; cross-field checks run in ``validate.py`` before any rank starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    """The policy model (and the critic/reference, which share its backbone and layout)."""

    path: str = ""
    """HF checkpoint directory (config.json + safetensors) or Megatron checkpoint made by
    `mcore-rl convert hf-to-mcore`. Empty: a randomly initialised model of the inline
    architecture below (smoke tests and the built-in quick start)."""
    num_layers: int = 2
    """Transformer layers (inline architecture only)."""
    hidden_size: int = 128
    """Model width (inline architecture only)."""
    intermediate_size: int = 256
    """SwiGLU inner size (inline architecture only)."""
    num_attention_heads: int = 4
    """Query heads (inline architecture only)."""
    num_kv_heads: int = 2
    """Key/value heads, GQA groups (inline architecture only)."""
    vocab_size: int = 256
    """Vocabulary size (inline architecture only)."""
    max_position_embeddings: int = 512
    """Longest sequence the model supports (inline architecture only)."""
    tie_word_embeddings: bool = False
    """Share input embedding and output layer (inline architecture only)."""
    num_experts: int = 0
    """Routed experts per layer (inline architecture only): 0 is a dense Llama; more makes a
    Qwen3-MoE (QK norm, every layer a mixture of experts)."""
    experts_per_token: int = 2
    """Experts each token is routed to (inline mixture of experts only)."""
    moe_intermediate_size: int = 64
    """SwiGLU inner size of each expert (inline mixture of experts only)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter dtype. bf16 trains with fp32 main parameters in the optimizer."""
    critic_path: str = ""
    """Checkpoint for the critic (PPO); empty: initialised from `path` with a fresh value head."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute: ``selective`` keeps each layer's inputs and weights' outputs but
    recomputes core attention (softmax(QK^T) V) in backward; ``full`` keeps only each layer's
    input and recomputes the whole layer. Both give the plain run's gradients."""


@dataclass
class ParallelConfig:
    """How ranks split the model: tp x pp x cp x dp = world size. Actor, critic and reference
    share this layout."""

    tp: int = 1
    """Tensor-parallel size; must divide attention heads and KV heads."""
    pp: int = 1
    """Pipeline-parallel size; must divide the number of layers."""
    vpp: int | None = None
    """Virtual pipeline stages per PP rank (interleaved 1F1B); pp*vpp must divide layers."""
    dp: int | None = None
    """Data-parallel size; None: world size / (tp*pp*cp)."""
    cp: int = 1
    """Context-parallel size: each sequence of a micro-batch is split over cp ranks in
    Megatron's load-balanced order (2 x cp chunks, rank r runs chunks r and 2cp-1-r) and
    attention gathers keys and values from all of them, which divides activations by cp
    for long sequences (`mcore_rl.parallel.context_parallel`); with ``train.packing`` every
    packed row is split so. Dense models; on a GPU with Transformer Engine, Megatron's TE
    layer spec gives TE's attention the CP group and TE runs its own CP attention on the
    same chunk order (not yet run anywhere: unverified); shared prompts are off under CP."""
    ep: int = 1
    """Expert-parallel size (mixture-of-experts models): the experts of every layer are split
    over ep ranks; must divide the number of experts, and ep*etp the tp*dp ranks of a
    pipeline stage."""
    etp: int | None = None
    """Tensor-parallel size inside each expert; None: tp (Megatron's default)."""
    sequence_parallel: bool = False
    """With tp > 1: split each sequence over the TP ranks outside the tensor-parallel blocks
    (norms, residuals, dropout), which divides those activations by tp for an all-gather and
    a reduce-scatter in place of each all-reduce. Always on for mixture-of-experts models
    under TP."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto: nccl with CUDA, gloo without."""
    cpu_threads_per_rank: int = 1
    """OMP/torch threads per rank on CPU (ranks share the cores)."""


@dataclass
class MoEConfig:
    """Mixture-of-experts layers (Qwen3-MoE, Mixtral); ignored for dense models."""

    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """Megatron token dispatcher that sends tokens to the ranks holding their experts (both
    run on gloo and give the same results)."""
    aux_loss_coef: float = 0.0
    """Coefficient of Megatron's load-balancing loss; 0 turns it off."""
    routing_replay: Literal["off", "old_logprob", "rollout"] = "off"
    """Which experts the policy update routes each token to. off: its own router's choice.
    old_logprob: those chosen in the trainer's log-prob pass before the update (the ratio's
    denominator), so the update's first forward reproduces it exactly and a near tie that
    round-off flips cannot move a token to another expert. rollout: those the engine chose
    while generating (needs an engine that reports them; refused otherwise)."""


@dataclass
class RolloutConfig:
    """Generation of responses by the inference engine."""

    engine: str = "vllm"
    """Registered inference engine (`mcore_rl.engines.ENGINES`): vllm, sglang, hf (transformers,
    one prompt at a time), hf_batched (transformers, all prompts of a call as one batch: the
    fastest on CPU for tiny models)."""
    placement: Literal["colocated", "separate", "fused"] = "colocated"
    """Where the engines run against the trainer. colocated: a rollout controller of its own
    that takes turns with the trainer on the same devices (the engine sleeps while the
    trainer computes); separate: devices of its own, so generation can overlap training;
    fused: the rollout and reward roles run in the trainer's first rank (verl's hybrid
    engine): one process, in-process streams, the weight sync a copy in memory and no Ray
    round trip per step; the synchronous schedule only. Worth it where the hand-offs weigh:
    tiny models, few cores. With vLLM the fused engine is the blocking in-process one
    (vLLM's ``AsyncLLM`` always starts an engine process of its own); colocated and separate
    run vLLM's ``AsyncLLM``, which pauses around each weight sync (``partial_rollout``)."""
    engine_tp: int = 1
    """Tensor-parallel size of each engine replica."""
    replicas: int = 1
    """Engine replicas, each a rollout controller of its own with the whole model (on CPU
    each pinned to its own cores, on GPUs given ``engine_tp`` GPUs of its own, or of the
    trainer's when colocated). One weight sync reaches all of them; a step's prompt groups
    go to whichever replica takes them first, i.e. by load, under every schedule."""
    on_replica_failure: Literal["stop", "continue"] = "stop"
    """A replica whose engine or rollout process dies. stop: the run ends, in one line
    naming it. continue (``replicas`` >= 2): a line says so, the prompt groups it had taken
    and not handed on go to the other replicas, the weight syncs skip it, and the run goes
    on (``rollout/replicas_alive``) until no replica is left."""
    partial_rollout: Literal["continue", "abort"] = "continue"
    """``train.schedule: async``: a response still being generated when new weights reach
    the engine. continue: its tokens so far are kept and it goes on under the new weights
    (its KV cache, computed with the old ones, is dropped and the partial response
    prefilled again; every token records the version that generated it); abort: it starts
    over with the new weights."""
    mismatch_warn: float | None = 1.1
    """Print a warning for a step whose ``rollout/token_mult_prob_error`` (the mean over the
    response tokens generated by the weights the trainer evaluates of exp|log p_trainer -
    log p_engine|, always >= 1) is above this; None: never."""
    mismatch_stop: float | None = None
    """End the run, in one line naming the step, once ``rollout/token_mult_prob_error`` is
    above this (after that step's update); None: never."""
    n_samples_per_prompt: int = 4
    """Responses per prompt (the group size of GRPO/RLOO)."""
    max_new_tokens: int = 64
    """Longest response."""
    min_new_tokens: int = 0
    """Stop tokens are masked until a response has this many tokens (benchmarks use it for
    fixed-length responses; 0 for training)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are filtered out (counted in the logs)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs use the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches
    top_p (< 1). The engine's log-probs and the trainer's are then those of that truncated
    distribution, renormalised (see ``renormalize_truncated``)."""
    top_k: int = -1
    """Top-k sampling: sample from the top_k most likely tokens (before top_p); -1 disables."""
    renormalize_truncated: bool = True
    """With top_p < 1 or top_k > 0, the trainer computes every log-prob under the same
    truncation, renormalised over the kept set (the distribution the tokens were sampled
    from); a sampled token outside the trainer's kept set is masked out of the loss and
    counted (``rollout/outside_kept_set``). False: the full softmax, which biases every
    importance ratio by the kept mass (for comparison only)."""
    replay_sampling_mask: bool = False
    """The engine reports the ids each token's top-k / top-p kept, and the trainer
    renormalises over exactly those (the reference too) instead of finding the kept set from
    its own logits. Needs top_k > 0. Engines: hf_batched, and vLLM on GPUs only (its sampling
    masks come from Model Runner V2; unverified: no GPU run has exercised it)."""
    truncated_response: Literal["mask", "penalize", "keep"] = "keep"
    """Responses cut at max_new_tokens: excluded from the loss, given the minimum reward, or kept."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory the engine may take (GPU)."""
    engine_timeout_s: float = 600.0
    """Longest wait for one call into an engine that runs in processes of its own (a
    generation, one bucket of a weight sync); an engine process that dies ends the wait
    within a second whatever this is."""
    batch_rows: int = 256
    """hf_batched only: the most rows (prompts x samples) decoded as one batch; a call with
    more runs in several batches, which bounds the KV cache's memory."""
    weight_loading: Literal["auto", "layerwise"] = "auto"
    """vLLM only: how a weight sync loads. auto: straight into the live modules where the model
    has mcore-rl's layout and unquantized weights (otherwise as layerwise); layerwise: always
    vLLM's own reload steps (slower on CPU, for models the direct path does not cover)."""


@dataclass
class ReshardConfig:
    """Streaming the trainer's weights into the rollout engine after every step."""

    bucket_mb: float = 256.0
    """Size of the shared-memory bucket weights travel through; bounds the extra memory of a
    sync (an engine module larger than this gets a bucket of its own)."""
    shm_dir: str = "/dev/shm"
    """Directory of the file weights reach the engine through (a tmpfs: RAM, no disk): the
    bucket file, or with the shared transport the trainer's parameters."""
    transport: str = "auto"
    """How weights reach the engine: a registered transport (`mcore_rl.reshard.TRANSPORTS`)
    or module:Class. shared: the trainer's parameters are moved into a shared-memory file
    the engine maps, and a sync only checksums them (CPU parameters that own their memory,
    in the wire dtype); buckets: every sync copies them into the bucket file; auto: shared
    where possible, buckets otherwise (the reason is logged). Trainer ranks on another node
    than the engine relay their pieces to it over the process group either way. On GPUs
    with vLLM: nccl (separate placement), ipc (colocated) or sparse_nccl (with ``delta``),
    vLLM's own backends, GPU to GPU (`mcore_rl.reshard.native`; unverified)."""
    wire_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Dtype of the weights in the bucket; auto: the trainer's parameter dtype."""
    delta: bool = False
    """Trainer ranks on another node than the engine relay only the words of the wire dtype
    that changed since the last sync (their positions and new values), where that is
    smaller; the engine still checks checksums of the full values. Costs the wire dtype's
    size per relayed parameter on the relaying rank and as much on the controller. Ranks on
    the engine's node are unaffected (nothing crosses a network there). With
    ``transport: sparse_nccl`` (GPUs) only the changed elements reach the engine at all."""
    full_every: int = 10
    """With ``delta``: every N-th sync relays every word (so does the one after a failure)."""
    checksum: Literal["sum64", "crc32"] = "sum64"
    """Per-piece checksum checked by the engine before loading a bucket: sum64 (two 64-bit
    word sums, ~20 GB/s on CPU, catches any corrupted word or misplaced block) or crc32
    (zlib, ~4 GB/s)."""
    overlap: bool = True
    """Trainer ranks write bucket k+1 while the engine loads bucket k (False: one bucket at a
    time; the transfer and the engine's loading then never compete for cores)."""
    writer_threads: int | None = None
    """Threads each trainer rank copies its pieces with; None: the rank's share of the
    machine's cores (cores / ranks on the node) divided by its torch intra-op threads."""
    verify: bool = True
    """After each sync, compare engine and trainer log-probs on a fixed probe batch and fail
    above verify_tolerance."""
    verify_every: int = 10
    """Verify the first sync and then every N-th one (1: after every sync)."""
    verify_tolerance: float | None = None
    """Largest allowed |engine - trainer| log-prob on probe tokens; None: 0.05 in fp32 (engine
    and trainer agree to ~1e-5), 1.0 in bf16/fp16 (logits of magnitude ~20 round to ~0.1,
    so single tokens differ by up to a few 1e-1; a wrong weight moves them by nats)."""
    verify_prompts: int = 2
    """Probe prompts (fixed, pseudo-random token ids)."""
    verify_new_tokens: int = 16
    """Tokens the engine samples per probe prompt."""


@dataclass
class AlgorithmConfig:
    """The RL objective."""

    advantage_estimator: str = "grpo"
    """Registered estimator: gae (PPO with critic), grpo, rloo, reinforce_plus_plus."""
    policy_loss: str = "ppo_clip"
    """Registered policy loss."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio <= 1 + clip_ratio_high."""
    dual_clip: float | None = None
    """Dual-clip constant c (> 1) bounding the loss of negative advantages; None: off."""
    value_clip: float = 0.2
    """Clipping range of the value loss (PPO)."""
    gamma: float = 1.0
    """Discount (GAE)."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.0
    """KL(policy || reference) coefficient; 0 skips the reference model entirely."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator per token."""
    kl_in_reward: bool = False
    """Apply KL as a reward penalty (True) or as a loss term (False)."""
    adaptive_kl_target: float | None = None
    """Target KL for an adaptive coefficient; None: fixed coefficient."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    loss_aggregation: Literal["token_mean", "seq_mean"] = "token_mean"
    """Mean over all tokens of the batch, or over sequences (each the mean of its tokens)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the rollout batch is split into this many)."""
    whiten_advantages: bool = True
    """Normalise advantages (statistics over all DP ranks)."""
    off_policy_correction: Literal["none", "decoupled_ppo", "tis", "icepop", "mis"] = "none"
    """Correction for samples generated by older weights (the behaviour policy, whose
    log-probs the engine recorded) than those the update starts from (the proximal policy).
    none: the policy loss against the proximal policy only. decoupled_ppo (Hilton et al.,
    2021; AReaL): the policy loss (PPO's clip against the proximal policy) times the
    constant min(pi_prox / pi_behav, is_cap) per token. tis: truncated importance sampling
    against the behaviour policy, -A * sg(min(pi / pi_behav, is_cap)) * log pi per token, in
    place of `policy_loss` (no clipping). icepop: the policy loss, with no gradient for a
    token whose pi / pi_behav leaves [is_mask_low, is_mask_high]. mis (masked importance
    sampling): decoupled_ppo's weight pi_prox / pi_behav, set to 0 instead of truncated where
    the ratio pi / pi_behav is out of range (`mis_level`). The masked share is logged as
    ``actor/is_masked_fraction``."""
    is_cap: float = 2.0
    """Cap of the importance weights of decoupled_ppo and tis (a weight above it is cut to
    it); unused otherwise."""
    is_mask_low: float = 0.5
    """icepop, and mis at sequence level: the lowest trusted pi / pi_behav."""
    is_mask_high: float = 2.0
    """icepop and mis: the highest trusted pi / pi_behav."""
    mis_level: Literal["token", "sequence"] = "token"
    """mis: mask each token whose ratio is above is_mask_high, or each whole sequence whose
    geometric-mean ratio exp(mean log(pi / pi_behav)) leaves [is_mask_low, is_mask_high]."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: prompt groups whose rewards are all equal (no group-relative
    signal) are left out, and more prompts are generated until the step has
    ``data.prompts_per_step`` groups that differ (``rollout/dynamic_filtered_frac``: the
    share left out). Needs a group estimator (grpo, rloo) and
    ``rollout.n_samples_per_prompt >= 2``."""
    dynamic_sampling_max_rounds: int = 3
    """Extra generation rounds a step may take to fill its batch; at the limit it trains on
    the informative groups it has and ``rollout/dynamic_short_groups`` counts those missing."""


@dataclass
class OptimizerConfig:
    """Adam with warm-up and decay; used for the actor (and critic with its own lr)."""

    name: Literal["adam", "sgd"] = "adam"
    """Optimizer (sgd: plain gradient descent, mostly for exactness tests)."""
    lr: float = 1e-5
    """Peak learning rate of the actor."""
    critic_lr: float = 1e-5
    """Peak learning rate of the critic."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    distributed: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron distributed optimizer)."""
    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch: rows x its longest row (padding included), or its
    real tokens with ``train.packing``."""


@dataclass
class DataConfig:
    """Prompts for training and validation."""

    source: str = "builtin"
    """Registered prompt source (`mcore_rl.data.PROMPT_SOURCES`): jsonl, parquet,
    reasoning_gym, builtin (the quick start's synthetic task)."""
    path: str = ""
    """Training file (jsonl/parquet)."""
    val_path: str = ""
    """Validation file (jsonl/parquet); empty: a held-out split of the source."""
    prompt_key: str = "prompt"
    """Field holding the prompt text (or chat messages)."""
    answer_key: str = "answer"
    """Field passed to the reward function as the reference answer."""
    task: str = ""
    """reasoning-gym task name (source=reasoning_gym), e.g. basic_arithmetic."""
    apply_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template."""
    prompts_per_step: int = 8
    """Prompts per RL step (each sampled n_samples_per_prompt times)."""
    num_val: int = 32
    """Validation prompts."""
    seed: int = 0
    """Seed of the dataset order and of generated tasks."""


@dataclass
class RewardConfig:
    """How responses are scored."""

    name: str = "builtin"
    """Registered reward (exact, alias builtin; math; reasoning_gym; code: sandboxed tests
    of a Python program, `mcore_rl.rewards.code_execution`) or module:function;
    reward_model: a trained reward model's score, computed by a worker group of its own
    (the graph on Ray: ``mcore-rl train``, ``mcore-rl launch slurm CONFIG``)."""
    reward_model_path: str = ""
    """The reward model (name=reward_model): an HF ``*ForSequenceClassification`` directory
    (converted on load), an mcore-rl checkpoint with a score head, or a ``train.job: rm``
    run (its logging.dir, checkpoint directory or one step directory)."""
    rm_tp: int = 1
    """Tensor parallelism of the reward model's worker group (name=reward_model)."""
    rm_pp: int = 1
    """Pipeline parallelism of the reward model's worker group (name=reward_model)."""
    rm_dp: int = 1
    """Data parallelism of the reward model's worker group (name=reward_model): it has
    rm_tp * rm_pp * rm_dp ranks."""
    val_reward: str = ""
    """With name=reward_model: the reward of the greedy validation responses logged as
    ``val/score`` (registered or module:function, e.g. exact on the built-in task); empty:
    ``val/score`` is the reward model's mean score. ``val/rm_score`` (the reward model's
    mean score) is logged either way."""
    truncation_penalty: float = 0.0
    """Reward given to responses cut at the length limit (truncated_response=penalize)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Several rewards combined: name (registered, or module:function) -> weight; a
    response's score is the weighted sum, and each reward's mean is logged as
    ``reward/<name>/mean``. Empty: ``name`` alone, weight 1 (``name`` is unused otherwise).
    Override one as ``reward.weights.math=0.5`` (a module:function name with dots: in YAML)."""
    workers: int = 0
    """Processes that run synchronous reward functions in parallel, one sample (or one chunk
    of a batched function's batch) at a time each; started with the first scored batch and
    reused until the run ends. 0: in the scoring process, one call after another."""
    async_slots: int = 8
    """Samples an ``async def`` reward function scores at once (event loop of the scoring
    process)."""
    timeout_s: float = 0.0
    """Time limit per sample (a batched call: per sample of its chunk) for async functions
    and functions run by ``workers``; past it the sample scores ``failure_score`` and counts
    in ``reward/timeouts``. A synchronous function with ``workers: 0`` is not interrupted
    (the built-in ``math`` reward bounds each sample to 5 s itself, and ``code`` to
    ``code_time_limit_s`` per run). 0: no limit."""
    failure_score: float = 0.0
    """Score of a sample that timed out, whose worker process died (``reward/worker_deaths``),
    whose function reported a failure (`RewardFailure`, e.g. a program that crashed under
    the ``code`` reward: ``reward/failures``), raised anything else (``reward/errors``) or
    returned something that is not a finite number (``reward/nonfinite``)."""
    max_failure_fraction: float = 0.5
    """Largest fraction of a scored batch (a step's, or with async schedules a prompt
    group's) whose samples may fail by faults of one reward function (past ``timeout_s``,
    worker died, raised, not a finite number; a reported `RewardFailure` does not count)
    and still score ``failure_score``; past it the run stops with one line naming the
    reward and the first fault. 0: the first fault stops the run; 1: never stops."""
    code_time_limit_s: float = 5.0
    """``code`` reward: wall-clock limit of one run of the program (one per stdin/stdout
    test, one for all the code tests); past it the sample counts as timed out."""
    code_memory_mb: int = 512
    """``code`` reward: address-space limit of the program, in MiB (beyond it allocations
    fail: a program that dies of it is a failure)."""
    sandbox: Literal["namespaces", "remote"] = "namespaces"
    """``code`` reward: where programs run. namespaces: on this machine, in new Linux user,
    mount, PID, network and IPC namespaces (needs user namespaces); remote: through the
    HTTP sandbox service at ``sandbox_url`` (protocol: `mcore_rl.rewards.sandbox.protocol`).
    Where the chosen one cannot run a program the reward refuses to start."""
    sandbox_url: str = ""
    """``code`` reward with sandbox=remote: the service's address, http(s)://host:port/path
    (e.g. of ``python -m mcore_rl.rewards.sandbox.service``)."""


@dataclass
class EnvironmentConfig:
    """Multi-turn rollouts: engine turns alternate with an environment's (`mcore_rl.envs`)."""

    name: str = ""
    """Registered environment (calculator) or module:Class; empty: single-turn responses.
    Each response's score is the reward function's plus the environment's rewards (use
    ``reward.name: env`` to score by the environment alone)."""
    max_turns: int = 4
    """Engine turns per response at most (``rollout.max_new_tokens`` bounds each turn)."""
    max_response_tokens: int = 64
    """Tokens after the prompt at most, turns and observations together."""


@dataclass
class CheckpointConfig:
    """Saving and resuming the full training state."""

    dir: str = ""
    """Checkpoint directory; empty: <logging.dir>/checkpoints."""
    save_every: int = 0
    """Save every N steps (and at the end); 0: only at the end."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint if any; never; or a path."""
    keep_last: int = 2
    """Complete checkpoints kept on disk."""


@dataclass
class WandbConfig:
    """Weights & Biases, when ``logging.backends`` names ``wandb``."""

    project: str = "mcore-rl"
    """The W&B project."""
    entity: str = ""
    """The W&B entity (team or user); empty: the account's default entity."""
    run_name: str = ""
    """The run's display name; empty: the name of ``logging.dir``."""
    mode: Literal["", "online", "offline", "disabled"] = ""
    """``online`` (needs an API key: ``WANDB_API_KEY`` or ``wandb login``), ``offline`` (files
    under ``logging.dir``/wandb, uploaded later with ``wandb sync``), ``disabled``; empty:
    ``$WANDB_MODE``, else online."""


@dataclass
class MlflowConfig:
    """MLflow, when ``logging.backends`` names ``mlflow``."""

    tracking_uri: str = ""
    """A tracking server (``http://host:5000``) or a database (``sqlite:///path/mlflow.db``,
    ``postgresql://...``); empty: ``$MLFLOW_TRACKING_URI``, else the database file
    ``logging.dir``/mlflow.db (view it with ``mlflow ui --backend-store-uri sqlite:///...``)."""
    experiment: str = "mcore-rl"
    """The experiment the run belongs to (created when missing)."""
    run_name: str = ""
    """The run's name; empty: the name of ``logging.dir``."""


@dataclass
class LoggingConfig:
    """Metrics, progress and samples."""

    dir: str = "runs/default"
    """Output directory of the run (metrics, TensorBoard, samples, plots)."""
    backends: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where each step's metrics go, any of ``jsonl`` (``logging.dir``/metrics.jsonl and
    samples.jsonl), ``tensorboard`` (``logging.dir``/tensorboard), ``wandb`` (see
    ``logging.wandb``) and ``mlflow`` (see ``logging.mlflow``), or a tracker class of your own
    (``package.module:Class``). The console lines (``log_every``) and the progress bar
    (``progress_bar``) do not depend on it."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow settings."""
    log_every: int = 1
    """Keep the console's status line every N steps (and at the last)."""
    samples_every: int = 5
    """Write sample rollouts every N steps; 0 disables."""
    samples_per_step: int = 8
    """Samples written for each such step (the first ones of its batch); 0: all of them,
    which with ``samples_every: 1`` records every prompt each step trained on."""
    progress_bar: bool = True
    """Where the trainer's first rank writes to a terminal (under torchrun or srun; on Ray
    its output is relayed as plain lines), rewrite the status line (step, metrics, tokens/s,
    phase shares, time left) in place between the lines ``log_every`` keeps; false: only the
    kept lines, plain."""


@dataclass
class LaunchConfig:
    """A SLURM job (``mcore-rl launch slurm``): Ray on its nodes, the job's graph placed there."""

    nodes: int = 1
    """Nodes to allocate."""
    gpus_per_node: int | None = None
    """GPUs per node (GPU clusters); None: CPU nodes. The job's graph places its ranks and
    engines on them (Ray placement groups)."""
    partition: str = ""
    """SLURM partition."""
    time: str = "01:00:00"
    """SLURM time limit."""
    account: str = ""
    """SLURM account."""
    cpus_per_node: int = 0
    """CPU cores per node for SLURM and Ray; 0: the cluster's default."""
    job_name: str = "mcore-rl"
    """SLURM job name."""
    signal_lead_s: int = 300
    """SLURM signals the job this many seconds before its time limit to checkpoint and requeue
    (--signal=B:USR1@N); leave room for one step and a checkpoint."""
    preflight_timeout_s: int = 300
    """Seconds each rank waits for all others in the start-up collective before it fails,
    naming its node and rank."""
    ray_reconnect_timeout_s: int = 5
    """Seconds Ray's processes (the driver, every node's raylet and workers) retry a GCS
    that is gone before they give up (Ray's own default is 60): with the driver's watch of
    the head (`mcore_rl.flow.ray_head`), the longest a run outlives its Ray head."""


@dataclass
class FinetuneConfig:
    """The supervised and preference jobs (``train.job`` sft | rm | dpo | kto): record fields,
    batch and loss. Their data come from ``data`` (source, path, val_path, num_val, seed,
    prompt_key, apply_chat_template); their steps, seed and validation interval from ``train``."""

    batch_size: int = 16
    """Records per optimizer step: pairs (dpo, rm) or completions (sft, kto)."""
    max_length: int | None = None
    """Longest prompt + completion in tokens; longer records are counted and left out.
    None: the model's positions (max_position_embeddings)."""
    completion_key: str = "completion"
    """Field of the completion (sft, kto)."""
    messages_key: str = "messages"
    """Field of a chat conversation (sft; used when a record has it): the last message is
    the completion (it must be the assistant's), the ones before it the prompt."""
    chosen_key: str = "chosen"
    """Field of the preferred completion (dpo, rm)."""
    rejected_key: str = "rejected"
    """Field of the dispreferred completion (dpo, rm)."""
    label_key: str = "label"
    """Field of a KTO record's label: true/1/"desirable" or false/0/"undesirable"."""
    margin_key: str = ""
    """rm: field of a per-pair margin in the Bradley-Terry loss
    -log sigmoid(r_chosen - r_rejected - margin); empty: no margin."""
    dpo_loss: str = "sigmoid"
    """Registered DPO loss (`mcore_rl.algos.preference.DPO_LOSSES`): sigmoid (DPO; with
    label_smoothing > 0 conservative DPO), ipo (length-normalised), hinge."""
    beta: float = 0.1
    """Strength of the tie to the reference (dpo, kto): implicit reward beta * log-ratio."""
    label_smoothing: float = 0.0
    """dpo sigmoid: assumed fraction of flipped labels (conservative DPO); 0: plain DPO."""
    rpo_alpha: float = 0.0
    """dpo, online_dpo: weight of the chosen completion's negative log-likelihood per token,
    added to each pair's DPO loss (RPO, Pang et al. 2024; TRL's ``rpo_alpha``). DPO alone
    may lower the chosen completion's likelihood too, as long as the rejected one falls
    faster; this term keeps the chosen one likely. 0: plain DPO."""
    desirable_weight: float = 1.0
    """kto: weight of the loss of desirable completions."""
    undesirable_weight: float = 1.0
    """kto: weight of the loss of undesirable completions."""
    val_score: bool = False
    """sft, dpo, kto: also log the greedy ``val/score`` on the task's validation prompts (as
    the RL job does: the rollout engine ``rollout.engine`` answers after a weight sync, the
    reward ``reward.name`` scores) at step 0 and every ``train.val_every`` steps."""
    reference_logps: Literal["on_the_fly", "cached"] = "on_the_fly"
    """dpo, kto: the frozen reference's log-probs computed for every batch (on_the_fly), or
    once per dataset before the first step and kept on disk, keyed by model and data, in
    <logging.dir>/reference_cache/ (cached; a resumed run reads them back)."""


@dataclass
class TrainConfig:
    """The run as a whole."""

    job: Literal["rl", "smoke", "sft", "rm", "dpo", "kto", "online_dpo"] = "rl"
    """rl: the RL loop; smoke: a synthetic next-token run that checks a parallel layout;
    sft, rm, dpo, kto: supervised fine-tuning, reward-model training, DPO and KTO on a
    dataset (section ``finetune``); online_dpo: DPO on pairs the rollout engine samples
    and the reward ranks, every step."""
    steps: int = 20
    """RL steps (generate -> score -> update -> sync)."""
    seed: int = 1234
    """Global seed; sampling seeds derive from (seed, step, prompt, sample)."""
    val_every: int = 5
    """Evaluate the validation set every N steps; 0 disables."""
    warm_start_steps: int = 0
    """Supervised steps on the task's reference answers before RL (0: none)."""
    warm_start_lr: float = 1e-3
    """Learning rate of the supervised warm start."""
    warm_start_batch: int = 32
    """Prompts per supervised warm-start step."""
    offload: bool = False
    """GPUs with ``rollout.placement: colocated``: while the engine generates, the trainer's
    parameters, gradients and optimizer state (actor, critic, reference) wait in host memory
    (Megatron's buffer and optimizer offload), and come back for the trainer's turn."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A loss or gradient that is not finite (on any rank): the optimizer step is never
    applied; stop: the run ends with one line naming the step; skip: the update is skipped,
    counted in ``actor/skipped_updates`` (``critic/...``), and the run goes on."""
    share_prompts: bool = True
    """The trainer computes a prompt once for all its samples in a micro-batch (a prompt's n
    rows become one row: the prompt, then each sample's response, under a mask that keeps
    the responses apart; `mcore_rl.train.shared_prompts`); so do the fine-tuning jobs for the
    two completions of a DPO pair. The same log-probs, values and gradients up to round-off,
    for a fraction of the compute when prompts are long against responses. Dense models on
    the local layer spec; others run every row whole."""
    packing: bool = False
    """Padding-free micro-batches: each micro-batch's rows run end to end as one sequence
    (positions restart per row, attention never crosses rows: Megatron's ``thd`` format,
    `mcore_rl.train.packing`), and ``optimizer.micro_batch_tokens`` budgets real tokens
    instead of rows x the longest row. The same outputs up to round-off, without the
    padding's compute; pays most on long-tailed response lengths. Needs the local layer
    spec's attention or Transformer Engine's."""
    schedule: Literal["sync", "one_step_off", "async"] = "sync"
    """How generation and training overlap (the RL graph of ``mcore-rl train``): sync: the
    next step's rollout starts once the update and weight sync of this one are done;
    one_step_off: the rollout of step k+1 is generated while step k trains, with the
    weights of step k-1 (needs ``max_staleness >= 1``; colocated, the engine and the
    trainer take turns: the rollout waits while the engine sleeps for the update);
    async: the engine generates continuously, prompt group by prompt group (new prompts
    enter its running batch as others finish, up to ``max_staleness`` steps ahead of the
    trainer), and the trainer takes a step as soon as ``data.prompts_per_step`` groups are
    scored (``max_staleness: 0`` is the synchronous schedule)."""
    max_staleness: int = 0
    """K: no update consumes a sample generated more than K weight versions before the
    weights it updates. Enforced when a prompt is admitted (the rollout runs at most K steps
    ahead) and when a batch is consumed (``on_stale``). 0 with ``schedule: sync`` is
    on-policy."""
    on_stale: Literal["drop", "regenerate"] = "drop"
    """A prompt group whose samples fell over ``max_staleness`` (a slow engine replica):
    drop: the trainer leaves it out (``rollout/stale_dropped``); regenerate (async): the
    rollout generates it again with the current weights before handing it on
    (``rollout/stale_regenerated``); a group that still arrives too old is dropped."""


@dataclass
class RLConfig:
    """A complete mcore-rl run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout of the trainer."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Expert layers."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    reshard: ReshardConfig = field(default_factory=ReshardConfig)
    """Weight sync into the rollout engine."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL objective."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn rollouts (none by default)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Logging."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Launch."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Run length and seeds."""
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """The supervised and preference jobs."""
