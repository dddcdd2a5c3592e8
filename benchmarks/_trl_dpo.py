"""The baseline of `mcore-rl bench dpo`: TRL's ``DPOTrainer`` on the same model, pairs,
batches and DPO settings, timed per optimizer step. Run in a fresh process per variant:

    python -m mcore_rl.benchmarks._trl_dpo SPEC.json OUT.json

``SPEC.json`` (written by ``benchmarks/dpo.py``) holds the model directory, the pairs as the
token ids mcore-rl made of them, the order in which our run takes them, the DPO and
optimizer settings, and the variant's speed options (``precompute_ref_log_probs``,
``padding_free``). ``OUT.json`` gets one record per optimizer step (seconds from the end of
the step before, so the batch's loading and collation count as they do in ours; the
non-pad tokens of its batch; seconds in the reference model's forward), the precompute pass
(seconds, sequences and non-pad tokens it computed) and the options in effect; or
``{"skipped": why}`` when this TRL version turns a requested option off or refuses it.

Both sides train on identical sequences: TRL is given the token ids instead of text (its
own tokenizing is data preparation, outside the timed steps, and would split prompt and
completion at other token boundaries), and a sampler hands it the pairs in our order, so
its step k holds the pairs of our step k.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from mcore_rl.benchmarks._trl_grpo import _tokenizer

SPEED_OPTIONS = ("precompute_ref_log_probs", "padding_free")
"""TRL's own speed options the benchmark turns on and off (``DPOConfig`` fields)."""


def run(spec: dict) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from torch.utils.data import Sampler
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("TQDM_DISABLE", "1")  # the precompute pass's progress bar
    steps: list[dict] = []
    current: dict = {"tokens": 0, "reference": 0.0}
    reference = {"seconds": 0.0, "sequences": 0, "tokens": 0}

    class InOrder(Sampler):
        """Dataset indices in the order of our run's stream (see the module docstring)."""

        def __init__(self, order: list[int]):
            self.order = order

        def __iter__(self):
            return iter(self.order)

        def __len__(self):
            return len(self.order)

    class Timed(DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):
            return dataset  # already token ids

        def _get_train_sampler(self, train_dataset=None):
            return InOrder(spec["order"])

        def _precompute_ref_logps(self, dataset, name, batch_size):
            t0 = time.perf_counter()
            try:
                return super()._precompute_ref_logps(dataset, name, batch_size)
            finally:
                reference["seconds"] += time.perf_counter() - t0

        def compute_ref_log_probs(self, model, inputs):  # called only by the precompute pass
            reference["sequences"] += len(inputs["attention_mask"])
            reference["tokens"] += int(inputs["attention_mask"].sum())
            return super().compute_ref_log_probs(model, inputs)

        def training_step(self, model, inputs, *args, **kwargs):
            current["tokens"] += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *args, **kwargs)

    class StepTimes(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            current["mark"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            steps.append({"step": now - current["mark"], "tokens": current["tokens"],
                          "reference": current["reference"]})
            current.update(mark=now, tokens=0, reference=0.0)

    known = {f.name for f in dataclasses.fields(DPOConfig)}
    missing = [k for k in SPEED_OPTIONS if spec[k] and k not in known]
    if missing:
        return {"skipped": f"TRL {trl.__version__}'s DPOConfig has no option {missing[0]}"}
    args = DPOConfig(
        output_dir=spec["output_dir"], use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=10_000, disable_tqdm=True, seed=spec["seed"], max_steps=spec["steps"],
        per_device_train_batch_size=spec["batch_size"], gradient_accumulation_steps=1,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=spec["weight_decay"], adam_beta1=spec["adam_beta1"], adam_beta2=spec["adam_beta2"],
        adam_epsilon=spec["adam_eps"], max_grad_norm=spec["clip_grad"], beta=spec["beta"],
        loss_type=[spec["loss_type"]], label_smoothing=spec["label_smoothing"],
        max_length=spec["max_length"], **{k: spec[k] for k in SPEED_OPTIONS if k in known},
        # TRL turns gradient checkpointing on by default; ours recomputes only when asked
        # (model.recompute=full), so both sides get the same setting.
        gradient_checkpointing=spec["gradient_checkpointing"],
        bf16=spec["bf16"], fp16=False, disable_dropout=True, dataloader_num_workers=0)
    dataset = Dataset.from_list(spec["pairs"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    try:
        trainer = Timed(model=model, args=args, train_dataset=dataset,
                        processing_class=_tokenizer(spec), callbacks=[StepTimes()])
    except (ValueError, NotImplementedError, ImportError) as err:
        if not spec["padding_free"]:
            raise
        return {"skipped": f"TRL {trl.__version__} refuses padding_free=True: {err}".splitlines()[0]}
    if spec["padding_free"] and not getattr(trainer, "padding_free", False):
        return {"skipped": f"TRL {trl.__version__}'s DPOTrainer turns padding_free=True off "
                           "(it warns and pads the batch instead)"}
    if trainer.ref_model is not None:
        def started(module, inputs):
            current["t_ref"] = time.perf_counter()

        def finished(module, inputs, output):
            current["reference"] += time.perf_counter() - current["t_ref"]

        trainer.ref_model.register_forward_pre_hook(started)
        trainer.ref_model.register_forward_hook(finished)
    trainer.train()
    return {"steps": steps, "reference_pass": reference if reference["sequences"] else None,
            "effective": {"precompute_ref_log_probs": bool(getattr(trainer, "precompute_ref_logps", 0)),
                          "padding_free": bool(getattr(trainer, "padding_free", 0))},
            "trl": trl.__version__}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
