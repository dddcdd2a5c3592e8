#!/usr/bin/env bash
# The checks that need a CUDA GPU, which CI does not have. Run on a machine with one GPU and
# mcore-rl installed (pip install -e .):
#
#   bash scripts/gpu_checks.sh OUT_DIR [CHECK ...]    (default: all, in this order)
#
#   1. the tests marked `gpu`: Triton kernels compiled for the GPU against their references,
#      the train engine on the GPU (and its offload to host memory, `train.offload`), the
#      weight stream from a trainer whose weights live there, the memory planner against the
#      GPU's peak (`mcore-rl plan memory`), and SGLang where it is installed;
#   2. the kernel benchmark on the GPU (OUT_DIR/bench_kernels.json);
#   3. the quick start's GRPO run on one GPU under torchrun (the job's graph fused into the
#      rank, without Ray, which the GPU machine may lack): Megatron actor on the GPU, the
#      in-process HF engine (OUT_DIR/grpo_metrics.jsonl);
#   4. the SFT and DPO quick starts on one GPU under torchrun.
#
# Each check writes OUT_DIR/NAME.log; the script goes on after a failed check and exits 1 if any
# failed.
set -u
out=${1:?usage: bash scripts/gpu_checks.sh OUT_DIR [gpu_tests] [bench_kernels] [grpo] [sft] [dpo]}
shift
wanted=${*:-gpu_tests bench_kernels grpo sft dpo}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
failed=0

check() {
    local name=$1 limit=$2
    shift 2
    case " $wanted " in *" $name "*) ;; *) return ;; esac
    local start=$SECONDS
    echo "== $name"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$out/$name.log"
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || failed=1
}

"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" || exit 1

gpu_tests="tests/kernels tests/reshard tests/train/test_engine_gpu.py tests/train/test_offload_gpu.py"
"$py" -c "import sglang" 2>/dev/null && gpu_tests="$gpu_tests tests/engines/test_sglang_adapter.py"
check gpu_tests 300 "$py" -m pytest -m gpu $gpu_tests -q -p no:cacheprovider
check bench_kernels 300 "$py" -m mcore_rl.cli.main bench kernels --device cuda --json "$out/bench_kernels.json"
check grpo 400 "$py" -m torch.distributed.run --nproc_per_node 1 -m mcore_rl.cli.main \
    train configs/quickstart.yaml rollout.engine=hf logging.dir="$work/grpo" "logging.backends=[jsonl]" logging.progress_bar=false
cp "$work/grpo/metrics.jsonl" "$out/grpo_metrics.jsonl" 2>/dev/null
for job in sft dpo; do
    check "$job" 200 "$py" -m torch.distributed.run --nproc_per_node 1 -m mcore_rl.cli.main \
        train "configs/${job}_quickstart.yaml" logging.dir="$work/$job" "logging.backends=[jsonl]" \
        logging.progress_bar=false
done
rm -rf "$work"
exit "$failed"
