"""What a compiled train step really does: its collectives, their overlap, its memory.

`schedule` / `report` read a compiled program's HLO (CPU, or a GPU program compiled for
an H100 target on a machine without a GPU via `compile_for_gpu`); `memory_stats` reads
`memory_analysis()`; `memory_ledger` predicts the bytes per device of each strategy and
`measured_bytes` reads them off a `TrainState`. `compile_train_step` compiles jaxdp's
step from params alone (for 8 H100s by default, without a GPU); `ring_formula` says what
a step should move and `memory_report` lines up predicted, measured and compiled bytes.
`predict_step` puts a compiled GPU program on a time axis with XLA's own cost model: step
time, communication and its exposed part per collective kind, every kernel's interval.
"""

from jaxdp._src.aot import abstract_like as abstract_like
from jaxdp._src.aot import compile_for_gpu as compile_for_gpu
from jaxdp._src.aot import compile_train_step as compile_train_step
from jaxdp._src.aot import gpu_compile_unavailable as gpu_compile_unavailable
from jaxdp._src.aot import gpu_mesh as gpu_mesh
from jaxdp._src.aot import gpu_topology as gpu_topology
from jaxdp._src.aot import h100_target_config as h100_target_config
from jaxdp._src.compiler import COST_MODEL_OPTIONS as COST_MODEL_OPTIONS
from jaxdp._src.compiler import compiler_options as compiler_options
from jaxdp._src.inspect import Collective as Collective
from jaxdp._src.inspect import Interval as Interval
from jaxdp._src.inspect import MemoryStats as MemoryStats
from jaxdp._src.inspect import Schedule as Schedule
from jaxdp._src.inspect import ScheduledOp as ScheduledOp
from jaxdp._src.inspect import StepPrediction as StepPrediction
from jaxdp._src.inspect import memory_stats as memory_stats
from jaxdp._src.inspect import predict_step as predict_step
from jaxdp._src.inspect import report as report
from jaxdp._src.inspect import ring_bytes as ring_bytes
from jaxdp._src.inspect import schedule as schedule
from jaxdp._src.ledger import MemoryLedger as MemoryLedger
from jaxdp._src.ledger import measured_bytes as measured_bytes
from jaxdp._src.ledger import memory_ledger as memory_ledger
from jaxdp._src.ledger import memory_report as memory_report
from jaxdp._src.ledger import ring_formula as ring_formula

__all__ = [
  "abstract_like",
  "Collective",
  "compile_for_gpu",
  "compile_train_step",
  "compiler_options",
  "COST_MODEL_OPTIONS",
  "gpu_compile_unavailable",
  "gpu_mesh",
  "gpu_topology",
  "h100_target_config",
  "Interval",
  "measured_bytes",
  "memory_ledger",
  "memory_report",
  "memory_stats",
  "MemoryLedger",
  "MemoryStats",
  "predict_step",
  "report",
  "ring_bytes",
  "ring_formula",
  "Schedule",
  "schedule",
  "ScheduledOp",
  "StepPrediction",
]
