"""Run configuration: one small dataclass per concern (`zoo.config.sections`), layered and
type-checked (`zoo.config.layers`): section defaults < the family's flavor and recipe < YAML files
< ``section.key=value`` overrides."""

from zoo.config.layers import Layers, config_from_dict, parse_override, read_yaml, resolve
from zoo.config.sections import (
    AXES,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    plain,
)

# The most parameters a configuration may describe: far beyond any model trained so far, so a
# size typed or decoded wrong (a layer count of 10**13) is refused instead of built for hours.
MAX_PARAMETERS = 10**13


def check_sizes(config: object, *names: str, parameters: int | None = None) -> None:
    """For a family's config ``__post_init__``: ``names`` are positive integers, and the
    ``parameters`` they add up to stay below `MAX_PARAMETERS`. Raises ValueError naming the keys."""
    for name in names:
        value = getattr(config, name)
        if type(value) is not int or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if parameters is not None and parameters > MAX_PARAMETERS:
        sizes = ", ".join(f"{n}={getattr(config, n)}" for n in names)
        raise ValueError(f"{sizes} describe a model of ~1e{len(str(parameters)) - 1} parameters, more than the "
                         f"{MAX_PARAMETERS:.0e} zoo builds")


__all__ = ["MAX_PARAMETERS", "check_sizes", "AXES", "SECTIONS", "CheckpointConfig", "DataConfig", "Layers", "LoggingConfig", "OptimizerConfig",
           "ParallelConfig", "RunConfig", "ScheduleConfig", "TrainConfig", "config_from_dict", "parse_override",
           "plain", "read_yaml", "resolve"]
