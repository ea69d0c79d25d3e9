"""Pictures of layouts, schedules and memory, drawn with matplotlib.

`plot_layout` / `plot_bucket` draw a `Layout`'s buffers and buckets, `plot_timeline` a
compiled program's `jaxdp.inspect.Schedule`, `plot_predicted_timeline` its predicted time
(`jaxdp.inspect.StepPrediction`), `plot_memory` bytes per device (a
`MemoryLedger`, measured or compiled numbers). The notebooks in `notebooks/` use them.
"""

from jaxdp._src.plot import MEMORY_KINDS as MEMORY_KINDS
from jaxdp._src.plot import param_group as param_group
from jaxdp._src.plot import plot_bucket as plot_bucket
from jaxdp._src.plot import plot_layout as plot_layout
from jaxdp._src.plot import plot_memory as plot_memory
from jaxdp._src.plot import plot_predicted_timeline as plot_predicted_timeline
from jaxdp._src.plot import plot_timeline as plot_timeline

__all__ = [
  "MEMORY_KINDS",
  "param_group",
  "plot_bucket",
  "plot_layout",
  "plot_memory",
  "plot_predicted_timeline",
  "plot_timeline",
]
