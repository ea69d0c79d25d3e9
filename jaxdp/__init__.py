"""jaxdp: Megatron-Core's data-parallel machinery for JAX.

Bucketed DDP reduced inside backward, the distributed optimizer (ZeRO-1/2) and FSDP, on
any mesh with a "data" axis. See README.md and docs/design.md.
"""

from jaxdp._src import cuda_probe as _cuda_probe

# First, before any module below imports JAX: without the CUDA plugin's "Could not find
# cuda drivers" lines on a machine without an NVIDIA driver (jaxdp/_src/cuda_probe.py).
_cuda_probe.import_jax()

from jaxdp import inspect as inspect
from jaxdp import plot as plot
from jaxdp._src import __version__ as __version__
from jaxdp._src.buffer import ravel as ravel
from jaxdp._src.buffer import unravel as unravel
from jaxdp._src.checkpoint import CheckpointManager as CheckpointManager
from jaxdp._src.checkpoint import get_opt_state as get_opt_state
from jaxdp._src.checks import NonFiniteGradError as NonFiniteGradError
from jaxdp._src.config import DDPConfig as DDPConfig
from jaxdp._src.config import FSDPConfig as FSDPConfig
from jaxdp._src.distributed import host_local_batch_to_global as host_local_batch_to_global
from jaxdp._src.distributed import initialize as initialize
from jaxdp._src.eval import make_eval_step as make_eval_step
from jaxdp._src.layout import Bucket as Bucket
from jaxdp._src.layout import BufferLayout as BufferLayout
from jaxdp._src.layout import Layout as Layout
from jaxdp._src.layout import ParamSpec as ParamSpec
from jaxdp._src.layout import make_layout as make_layout
from jaxdp._src.nnx import NNXOptimizer as NNXOptimizer
from jaxdp._src.nnx import nnx_merge as nnx_merge
from jaxdp._src.nnx import nnx_model_state as nnx_model_state
from jaxdp._src.nnx import nnx_train_step as nnx_train_step
from jaxdp._src.nnx import nnx_split as nnx_split
from jaxdp._src.state import TrainState as TrainState
from jaxdp._src.train import get_params as get_params
from jaxdp._src.train import init_state as init_state
from jaxdp._src.train import make_train_step as make_train_step
from jaxdp._src.units import gather_unit as gather_unit
from jaxdp._src.units import scan_unit as scan_unit
