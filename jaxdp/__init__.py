"""jaxdp: Megatron-Core's data-parallel machinery for JAX.

Bucketed DDP reduced inside backward, the distributed optimizer (ZeRO-1/2) and FSDP, on
any mesh with a "data" axis. The training API is here; `jaxdp.inspect` reads compiled
steps and memory, `jaxdp.plot` draws them, `jaxdp.layout` is the static buffer layout. See
README.md and docs/guide.md.
"""

from jaxdp._src import cuda_probe as _cuda_probe

# First, before any module below imports JAX: without the CUDA plugin's "Could not find
# cuda drivers" lines and "Unable to load CUDA" traceback on a machine without an NVIDIA
# driver (jaxdp/_src/cuda_probe.py).
_cuda_probe.import_jax()
_cuda_probe.quiet_cuda_plugin()

from jaxdp import inspect as inspect
from jaxdp import layout as layout
from jaxdp import plot as plot
from jaxdp._src import __version__ as __version__
from jaxdp._src.checkpoint import CheckpointManager as CheckpointManager
from jaxdp._src.checkpoint import get_opt_state as get_opt_state
from jaxdp._src.checks import NonFiniteGradError as NonFiniteGradError
from jaxdp._src.config import DDPConfig as DDPConfig
from jaxdp._src.config import FSDPConfig as FSDPConfig
from jaxdp._src.distributed import host_local_batch_to_global as host_local_batch_to_global
from jaxdp._src.distributed import initialize as initialize
from jaxdp._src.eval import make_eval_step as make_eval_step
from jaxdp._src.nnx import NNXOptimizer as NNXOptimizer
from jaxdp._src.nnx import nnx_merge as nnx_merge
from jaxdp._src.nnx import nnx_model_state as nnx_model_state
from jaxdp._src.nnx import nnx_train_step as nnx_train_step
from jaxdp._src.nnx import nnx_split as nnx_split
from jaxdp._src.state import TrainState as TrainState
from jaxdp._src.train import abstract_state as abstract_state
from jaxdp._src.train import get_params as get_params
from jaxdp._src.train import init_state as init_state
from jaxdp._src.train import make_train_step as make_train_step

__all__ = [
  "abstract_state",
  "CheckpointManager",
  "DDPConfig",
  "FSDPConfig",
  "get_opt_state",
  "get_params",
  "host_local_batch_to_global",
  "init_state",
  "initialize",
  "inspect",
  "layout",
  "make_eval_step",
  "make_train_step",
  "nnx_merge",
  "nnx_model_state",
  "nnx_split",
  "nnx_train_step",
  "NNXOptimizer",
  "NonFiniteGradError",
  "plot",
  "TrainState",
]
