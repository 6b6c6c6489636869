"""k3.model: the Kimi K3 architecture (ModelConfig, K3Model) and its checkpoint I/O."""

from .checkpoint import CheckpointError, load_model, load_release, save_release
from .config import ConfigError, ModelConfig
from .transformer import K3Model, build_model, count_parameters, describe_parameters

__all__ = ["CheckpointError", "ConfigError", "K3Model", "ModelConfig", "build_model", "count_parameters",
           "describe_parameters", "load_model", "load_release", "save_release"]
