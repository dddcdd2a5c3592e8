"""Typed configuration: dataclass sections, YAML loading, overrides, validation."""
from mcore_rl.config.loader import config_from_dict, dump_yaml, load_config
from mcore_rl.config.sections import (AlgorithmConfig, CheckpointConfig, DataConfig, EnvironmentConfig, FinetuneConfig,
                                      LaunchConfig, LoggingConfig, MlflowConfig, MoEConfig, ModelConfig,
                                      OptimizerConfig, ParallelConfig, RewardConfig, RLConfig,
                                      RolloutConfig, TrainConfig, WandbConfig)
from mcore_rl.config.validate import validate_config, validate_layout

__all__ = [
    "RLConfig", "ModelConfig", "ParallelConfig", "RolloutConfig", "AlgorithmConfig",
    "OptimizerConfig", "DataConfig", "RewardConfig", "EnvironmentConfig", "CheckpointConfig", "LoggingConfig",
    "LaunchConfig", "TrainConfig", "MoEConfig", "FinetuneConfig", "WandbConfig", "MlflowConfig", "load_config", "dump_yaml",
    "config_from_dict",
    "validate_config",
    "validate_layout",
]
