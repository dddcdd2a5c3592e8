"""mcore-rl: Megatron-Core-centric RL post-training for large language models."""
from setuptools import find_packages, setup

# The top-level folders `kernels/`, `benchmarks/` and `launch/` are installed as subpackages
# of mcore_rl (never as a top-level `kernels`: transformers probes a PyPI package of that name).
MAPPED = {"mcore_rl.kernels": "kernels", "mcore_rl.benchmarks": "benchmarks",
          "mcore_rl.launch": "launch"}


def mapped_packages():
    out = []
    for name, folder in MAPPED.items():
        out.append(name)
        out += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return out


setup(
    name="mcore-rl",
    version="0.1.0",
    description="High-throughput RL post-training (PPO/GRPO) for LLMs on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mcore_rl", "mcore_rl.*"]) + mapped_packages(),
    package_dir={"mcore_rl": "mcore_rl", **MAPPED},
    package_data={"mcore_rl": ["py.typed"], "mcore_rl.launch": ["templates/*.sh"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.17",
        "psutil",
        "pyyaml",
        "safetensors",
        "transformers>=4.56",
        "tqdm",
        "tensorboard",  # the default logging.backends writes TensorBoard event files
    ],
    extras_require={
        # CPU: use scripts/install.sh (pins + constraints). These extras are for GPU clusters,
        # where torch comes from the cluster's CUDA build.
        "vllm": ["vllm>=0.11"],
        "sglang": ["sglang>=0.5"],
        "triton": ["triton>=3.6"],
        "te": ["transformer-engine[pytorch]"],
        "logging": ["matplotlib"],
        "wandb": ["wandb"],  # logging.backends: [..., wandb]
        "mlflow": ["mlflow"],  # logging.backends: [..., mlflow] (mlflow-skinny: a server's client only)
        "tasks": ["reasoning-gym"],
        "math": ["math-verify[antlr4_13_2]>=0.9"],  # the math reward, with its ANTLR runtime
        "test": ["pytest", "pytest-timeout"],
    },
    entry_points={
        "console_scripts": ["mcore-rl=mcore_rl.cli.main:run"],
        # vLLM's engine and worker processes load them: mcore-rl's weight-transfer backend
        # (mcore_rl.engines.vllm_transfer), registered in each of them, and their names
        # where vLLM's own title did not take (mcore_rl.engines.vllm_title).
        "vllm.general_plugins": [
            "mcore_rl_weight_transfer=mcore_rl.engines.vllm_transfer:register",
            "mcore_rl_process_title=mcore_rl.engines.vllm_title:title_process"],
    },
)
