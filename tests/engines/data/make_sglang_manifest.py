"""Write sglang_manifest.json: the parameters SGLang's own model code builds for the tiny
Llama and Qwen2 test models, and which rows of which HF tensors each one holds.

Not part of CI (SGLang does not install beside the CPU stack). Run once, in a separate venv
(see the SGLang notes of the environment document: torch 2.13.0 + triton 3.9.0, then
``pip install --no-deps -r requirements-no-deps.txt sglang==0.5.23``, with import stubs for
``torchvision`` and ``vllm._custom_ops`` on PYTHONPATH)::

    PYTHONPATH=STUBS VENV/bin/python tests/engines/data/make_sglang_manifest.py

Every element of every HF tensor is filled with its own address (tensor, row, column); after
SGLang's ``load_weights`` each SGLang parameter's rows are decoded back into runs (HF name,
first row, row count, first column, column count), at engine TP1 and TP2. Rows that decode
to nothing are padding. Only SGLang's model construction and weight loading run (on CPU);
its forward pass is never called.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _tiny_hf():
    """tests/models/tiny_hf.py, loaded by path: the repository root must not go on sys.path
    (its top-level ``kernels`` folder shadows a package transformers probes for)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_hf", HERE.parents[1] / "models" / "tiny_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = _tiny_hf()
COMMON, VARIANTS, hf_classes = TINY.COMMON, TINY.VARIANTS, TINY.hf_classes

ROWS, COLS = 1024, 512  # larger than any row / column count of the tiny models


def labelled_state_dict(model) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every element holds its own address: ((tensor id * ROWS) + row) * COLS + col, exact in
    fp32 for these sizes (< 2**24)."""
    names = [n for n, _ in model.named_parameters()]
    out = {}
    for i, (name, param) in enumerate(model.named_parameters()):
        rows = torch.arange(param.shape[0], dtype=torch.float64)
        base = ((i + 1) * ROWS + rows) * COLS
        if param.dim() == 1:
            out[name] = base.float()
        else:
            cols = torch.arange(param.shape[1], dtype=torch.float64)
            out[name] = (base[:, None] + cols[None, :]).float()
    assert (len(names) + 1) * ROWS * COLS < 2**24
    return out, names


def _address(value: float, names: list[str]) -> tuple[str, int, int] | None:
    if value != int(value):
        return None
    tensor_id, rest = divmod(int(value), ROWS * COLS)
    if not 1 <= tensor_id <= len(names):
        return None
    return names[tensor_id - 1], rest // COLS, rest % COLS


def decode(param: torch.Tensor, names: list[str]) -> list[list]:
    """Runs of consecutive HF rows: [hf name, first row, rows] (+ [first col, cols] for
    matrices, from each row's first and last element). Stops at the first padding row."""
    runs: list[list] = []
    for r in range(param.shape[0]):
        first = _address(float(param[r] if param.dim() == 1 else param[r, 0]), names)
        if first is None:
            break
        name, row, col = first
        cols = []
        if param.dim() == 2:
            last = _address(float(param[r, -1]), names)
            cols = [col, last[2] - col + 1]
        if runs and runs[-1][0] == name and runs[-1][1] + runs[-1][2] == row and runs[-1][3:] == cols:
            runs[-1][2] += 1
        else:
            runs.append([name, row, 1, *cols])
    return runs


def sglang_params(variant: str, hf_dir: str, tp: int, rank: int, port: int) -> list[dict]:
    """Parameters of SGLang TP rank ``rank`` of ``tp`` after loading the labelled weights."""
    import transformers
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.models.qwen2 import Qwen2ForCausalLM

    family, _ = VARIANTS[variant]
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    state, names = labelled_state_dict(transformers.AutoModelForCausalLM.from_pretrained(hf_dir))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    _publish(hf_dir, tp, rank, port)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[family]
    model = cls(config, quant_config=None)
    model.load_weights(iter(state.items()))
    return [{"name": name, "shape": list(param.shape), "dtype": str(param.dtype),
             "rows": decode(param.detach().float(), names)}
            for name, param in model.named_parameters()]


def _publish(hf_dir: str, tp: int, rank: int, port: int) -> None:
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=hf_dir, device="cpu", skip_tokenizer_init=True, tp_size=tp),
            role="scheduler", ranks=SpawnRanks(world_rank=rank))
    parallel_state.init_distributed_environment(
        world_size=tp, rank=rank, local_rank=rank, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}")
    parallel_state.initialize_model_parallel(backend="gloo")


def _rank_main(variant, hf_dir, tp, rank, port, queue):
    queue.put((rank, sglang_params(variant, hf_dir, tp, rank, port)))


def run_engine(variant: str, hf_dir: str, tp: int) -> list[list[dict]]:
    """One fresh process per SGLang TP rank (its parallel state is process-global)."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(variant, hf_dir, tp, r, port, queue))
             for r in range(tp)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return [results[r] for r in range(tp)]


def main() -> None:
    import tempfile

    import sglang
    import transformers

    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("llama-untied", "qwen2-tied"):
            family, overrides = VARIANTS[variant]
            config_cls, lm_cls, _ = hf_classes(family)
            hf_dir = Path(tmp) / variant
            lm_cls(config_cls(**COMMON, **overrides)).save_pretrained(hf_dir)
            models[variant] = {str(tp): run_engine(variant, str(hf_dir), tp) for tp in (1, 2)}
    manifest = {"sglang": sglang.__version__, "torch": torch.__version__,
                "transformers": transformers.__version__,
                "layout": "models[variant][engine TP size][engine rank] = parameters",
                "models": models}
    (HERE / "sglang_manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {HERE / 'sglang_manifest.json'}")


if __name__ == "__main__":
    main()
