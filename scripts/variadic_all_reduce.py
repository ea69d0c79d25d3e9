"""Can a bucket be all-reduced as ONE collective without ravelling its grads? (issue 13)

jaxdp's DDP bucket is ravelled (concatenated) into one flat buffer before its one
all-reduce; at the peak the flat copy and the grads are both alive. StableHLO's
`all_reduce` is variadic, so one op could take the grads as they are. This script checks,
with the installed jax / jaxlib, the two ways to get a variadic all-reduce:

1. emitted by JAX inside `jax.shard_map` (a small primitive lowered to one
   `stablehlo.all_reduce` of several operands), compiled on 8 CPU devices with Shardy and
   with GSPMD, and for the 8 x H100 target (`aot.gpu_mesh`, no GPU needed);
2. made by XLA itself: one `psum` per array plus XLA:GPU's all-reduce combiner (threshold
   above their bytes): does the combined all-reduce read the arrays, or a concatenate?
3. the same as 1 for a variadic `stablehlo.all_gather` (the sharded strategies' param
   gather), on the H100 target with Shardy and with GSPMD.

Usage: python scripts/variadic_all_reduce.py   (seconds; prints one line per check)

Result with jax / jaxlib 0.10.2: 1. fails to compile everywhere ("Sharding is
tuple-shaped but validation shape is not" with Shardy, "SPMD partitioner supports only
single-operand allreduce in manual partitioning mode" with GSPMD); 2. compiles, and the
combined all-reduce's operand is a concatenate of the arrays (XLA:GPU copies them too);
3. fails with Shardy (the same error), compiles with GSPMD to one tuple-shaped
`all-gather-start` of the arrays as they are (no copy).
"""

import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jaxdp  # noqa: F401  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import mlir as jmlir
from jax._src.lax import parallel
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import hlo
from jax.extend import core as jcore
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src import aot


def _abstract_eval(*avals, axes):
  out = [a.update(manual_axis_type=a.mat.update(varying=a.mat.varying - set(axes))) for a in avals]
  return out, {core.NamedAxisEffect(a) for a in axes}


def _lowering(ctx, *args, axes):
  groups = parallel._replica_groups_hlo(
    parallel._replica_groups(ctx.module_context.axis_context, list(axes), None)
  )
  op = hlo.AllReduceOp(
    [x.type for x in args],
    list(args),
    replica_groups=groups,
    channel_handle=hlo.ChannelHandle.get(jmlir.COLLECTIVE_CHANNEL_ID, jmlir.DEVICE_TO_DEVICE_TYPE),
    use_global_device_ids=ir.BoolAttr.get(True),
  )
  scalar = ir.RankedTensorType.get([], mlir.dtype_to_ir_type(ctx.avals_in[0].dtype))
  block = op.regions[0].blocks.append(scalar, scalar)
  with ir.InsertionPoint(block):
    hlo.return_([hlo.add(*block.arguments)])
  return list(op.results)


sum_many_p = jcore.Primitive("sum_many")
sum_many_p.multiple_results = True
sum_many_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(sum_many_p, _lowering)


def _gather_abstract_eval(*avals, axes):
  out = [a.update(shape=(a.shape[0] * 8, *a.shape[1:])) for a in avals]  # 8 devices
  return out, {core.NamedAxisEffect(a) for a in axes}


def _gather_lowering(ctx, *args, axes):
  groups = parallel._replica_groups_hlo(
    parallel._replica_groups(ctx.module_context.axis_context, list(axes), None)
  )
  op = hlo.AllGatherOp(
    [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out],
    list(args),
    all_gather_dim=mlir.i64_attr(0),
    replica_groups=groups,
    channel_handle=hlo.ChannelHandle.get(jmlir.COLLECTIVE_CHANNEL_ID, jmlir.DEVICE_TO_DEVICE_TYPE),
    use_global_device_ids=ir.UnitAttr.get(),
  )
  return list(op.results)


gather_many_p = jcore.Primitive("gather_many")
gather_many_p.multiple_results = True
gather_many_p.def_effectful_abstract_eval(_gather_abstract_eval)
mlir.register_lowering(gather_many_p, _gather_lowering)


def program(mesh, collective, out_spec):
  def f(a, b):
    return tuple(x * 2 for x in collective([a, b]))

  spec = NamedSharding(mesh, P("data"))
  args = [jax.ShapeDtypeStruct((8 * 64, 256), jnp.float32, sharding=spec)] * 2
  step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"),) * 2, out_specs=(out_spec,) * 2))
  return step, args


def check(name, mesh, collective, options=None, kind="all-reduce", out_spec=P()):
  step, args = program(mesh, collective, out_spec)
  try:
    text = step.lower(*args).compile(compiler_options=options).as_text()
  except Exception as e:  # noqa: BLE001 - the error is the result
    msg = " ".join(str(e).split())
    print(f"{name}: FAILS: {msg[:300]}")
    return
  lines = [ln.strip() for ln in text.splitlines() if re.search(kind + r"(-start)?\(", ln)]
  print(f"{name}: compiles, {len(lines)} {kind}(s):")
  for ln in lines:
    print("    " + ln[:200])


def main():
  cpu = jax.make_mesh((8,), ("data",))
  variadic = lambda xs: sum_many_p.bind(*xs, axes=("data",))
  check("variadic, CPU, Shardy", cpu, variadic)
  jax.config.update("jax_use_shardy_partitioner", False)
  check("variadic, CPU, GSPMD", cpu, variadic)
  jax.config.update("jax_use_shardy_partitioner", True)
  gpu = aot.gpu_mesh((8,), ("data",))
  check("variadic, 8 x H100 target", gpu, variadic)
  per_array = lambda xs: [jax.lax.psum(x, "data") for x in xs]
  combine = {"xla_gpu_all_reduce_combine_threshold_bytes": 2**30}
  check("psum per array + XLA:GPU combiner, 8 x H100 target", gpu, per_array, combine)
  gather = lambda xs: gather_many_p.bind(*xs, axes=("data",))
  ag = {"kind": "all-gather", "out_spec": P("data")}
  check("variadic all-gather, 8 x H100 target, Shardy", gpu, gather, **ag)
  jax.config.update("jax_use_shardy_partitioner", False)
  check("variadic all-gather, 8 x H100 target, GSPMD", gpu, gather, **ag)


if __name__ == "__main__":
  main()
