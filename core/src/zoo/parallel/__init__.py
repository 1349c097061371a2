"""The parallel core: the layout of a run (`layout`), process start-up (`distributed`), the process
grid with named axes (`grid`), communication primitives (`comm`), how each parameter is split
(`sharding`), tensor/sequence parallelism (`tensor_parallel`, `apply`), pipeline stages and
schedules (`pipeline`), ring attention (`context`), data-parallel buckets (`data_parallel`), the
distributed optimizer (`zero`), and `Parallel`, which applies a layout to a model (`engine`)."""

from zoo.parallel.engine import Parallel, StepOutput
from zoo.parallel.grid import ProcessGrid
from zoo.parallel.layout import Layout, plan
from zoo.parallel.sharding import Placement, Placements, TPShard

__all__ = ["Layout", "Parallel", "Placement", "Placements", "ProcessGrid", "StepOutput", "TPShard", "plan"]
