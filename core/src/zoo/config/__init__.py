"""Run configuration: one small dataclass per concern (`zoo.config.sections`), layered and
type-checked (`zoo.config.layers`): section defaults < the family's flavor and recipe < YAML files
< ``section.key=value`` overrides."""

from zoo.config.layers import Layers, config_from_dict, parse_override, read_yaml, resolve
from zoo.config.sections import (
    AXES,
    MAX_PARAMETERS,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    check_pattern,
    check_sizes,
    pattern_stages,
    plain,
    torch_dtype,
)

__all__ = ["AXES", "MAX_PARAMETERS", "SECTIONS", "CheckpointConfig", "DataConfig", "Layers", "LoggingConfig",
           "OptimizerConfig", "ParallelConfig", "RunConfig", "ScheduleConfig", "TrainConfig", "check_pattern",
           "check_sizes", "config_from_dict", "pattern_stages", "parse_override", "plain", "read_yaml", "resolve", "torch_dtype"]
