"""The baseline of `mcore-rl bench train`: TRL's ``GRPOTrainer`` on the same model, prompts,
reward and hyper-parameters, timed per phase. Run in a fresh process:

    python -m mcore_rl.benchmarks._trl_grpo SPEC.json OUT.json

``SPEC.json`` (written by ``benchmarks/train.py``) holds the model directory, the prompt
records, the reward name and the GRPO settings; ``OUT.json`` gets one record per optimizer
step: seconds of the whole step and of its phases, and the tokens it processed.

Phases, mapped onto those of mcore-rl's loop: *generate* is TRL's ``_generate`` (HF
``generate`` with the trained model); *score* its ``_calculate_rewards``; *logprobs* the rest
of ``_generate_and_score_completions`` (reference / old log-probs, advantages); *update* the
rest of the step (forward, backward and optimizer over micro-batches). TRL needs no weight
sync: generation runs on the trained model itself.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _reward_function(name: str):
    """A TRL reward function (``prompts, completions, **columns -> list[float]``) around an
    mcore-rl registered reward, fed the same prompt text and metadata as in mcore-rl."""
    from mcore_rl.rewards import REWARDS, score_all

    reward = REWARDS.get(name)

    def score(prompts, completions, meta_json, prompt_text, **_):
        metas = [json.loads(m) for m in meta_json]
        # conversational prompts give completions as [{"role": "assistant", "content": ...}]
        completions = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return score_all(reward, list(prompt_text), list(completions), metas).tolist()

    score.__name__ = f"mcore_rl_{name}"
    return score


def _dataset(spec: dict):
    from datasets import Dataset

    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}] if spec["chat"] else r["prompt"],
             "prompt_text": r["prompt"], "meta_json": json.dumps(r["meta"])}
            for r in spec["records"]]
    return Dataset.from_list(rows)


def _tokenizer(spec: dict):
    if spec["tokenizer"] == "char":
        from mcore_rl.data.tokenizer import CharTokenizer

        return CharTokenizer.load(spec["model_dir"]).to_hf()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec["model_dir"], padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def run(spec: dict) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(spec["threads"])
    steps: list[dict] = []
    current: dict = {}

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[phase] = current.get(phase, 0.0) + time.perf_counter() - t0
        return wrapper

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            return timed("generate", super()._generate)(prompts)

        def _calculate_rewards(self, *args, **kwargs):
            return timed("score", super()._calculate_rewards)(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            out = timed("rollout", super()._generate_and_score_completions)(inputs)
            current["tokens"] = current.get("tokens", 0) + int(out["prompt_mask"].sum()
                                                               + out["completion_mask"].sum())
            current["responses"] = current.get("responses", 0) + len(out["completion_mask"])
            return out

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            current.clear()
            current["t0"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            total = time.perf_counter() - current.pop("t0")
            rollout = current.get("rollout", 0.0)
            steps.append({"step": total, "generate": current.get("generate", 0.0),
                          "score": current.get("score", 0.0),
                          "logprobs": rollout - current.get("generate", 0.0) - current.get("score", 0.0),
                          "update": total - rollout, "tokens": current.get("tokens", 0),
                          "responses": current.get("responses", 0)})

    batch = spec["prompts_per_step"] * spec["num_generations"]
    micro = spec["micro_batch"]
    args = GRPOConfig(
        output_dir=spec["output_dir"], use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=10_000, disable_tqdm=True, seed=spec["seed"], max_steps=spec["steps"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_generations=spec["num_generations"],
        max_completion_length=spec["max_new_tokens"],
        generation_kwargs={"min_new_tokens": spec["min_new_tokens"]} if spec["min_new_tokens"] else None,
        temperature=spec["temperature"], top_p=1.0, top_k=0, learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=spec["weight_decay"],
        adam_beta1=spec["adam_beta1"], adam_beta2=spec["adam_beta2"], adam_epsilon=spec["adam_eps"],
        max_grad_norm=spec["clip_grad"], beta=spec["kl_coef"], loss_type=spec["loss_type"],
        epsilon=spec["clip_low"], epsilon_high=spec["clip_high"], num_iterations=1,
        scale_rewards="group", disable_dropout=True, remove_unused_columns=False,
        dataloader_num_workers=0, bf16=spec["bf16"], fp16=False, log_completions=False)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    trainer = Timed(model=model, reward_funcs=_reward_function(spec["reward"]), args=args,
                    train_dataset=_dataset(spec), processing_class=_tokenizer(spec),
                    callbacks=[StepTimes()])
    trainer.train()
    return steps


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    steps = run(spec)
    Path(argv[1]).write_text(json.dumps(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
