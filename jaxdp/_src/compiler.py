"""The XLA options jaxdp compiles with, so that buckets stay buckets.

jaxdp decides its buckets itself, so XLA must not merge bucket collectives back
into one (its *collective combiners* do exactly that) and must be free to run
them asynchronously under backward compute. `compiler_options` gives the
options that say so, per platform; the train step passes them to `jax.jit`.

Facts checked with jax/jaxlib 0.10.2 (see tests/test_inspect.py):

- CPU has one collective combiner pass, `cpu-all-reduce-combiner`; XLA:CPU in
  this version has no reduce-scatter or all-gather combiner (independent
  `psum_scatter`/`all_gather` stay separate without any option).
- GPU combines all-reduce, reduce-scatter and all-gather below
  `xla_gpu_*_combine_threshold_bytes`; 0 turns each combiner off.
- GPU collectives are asynchronous (`*-start`/`*-done`) unless listed in
  `xla_gpu_disable_async_collectives`; jaxdp sets it to `""` so that an
  `XLA_FLAGS` setting cannot silently make bucket collectives synchronous.
  (`xla_gpu_enable_async_collectives` no longer exists.)
- Options given to `jax.jit(f, compiler_options=...)` and to
  `.lower(...).compile(compiler_options=...)` are merged.
- On the H100 target the latency hiding scheduler's default estimator is XLA's analytical
  speed-of-light one (`SolLatencyEstimator`; `xla_gpu_enable_analytical_sol_latency_estimator`
  false falls back to fixed "T-shirt" costs). `xla_gpu_collect_cost_model_stats` writes its
  estimate of every instruction, loop bodies included, into the compiled HLO's
  `backend_config` (`"reification_cost":[{"name":"sol","exec_time_us":...}]`; an async
  collective's start holds the collective's time) without changing the schedule.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

_log = logging.getLogger(__name__)

CPU_COMBINER_PASSES = ("cpu-all-reduce-combiner",)
"""Collective combiner passes of XLA:CPU (jaxlib 0.10.2). There is no reduce-scatter or
all-gather combiner on CPU."""

CPU_OPTIONS = {"xla_disable_hlo_passes": ",".join(CPU_COMBINER_PASSES)}

GPU_OPTIONS = {
  # Bucket collectives stay buckets: 0 bytes turns each combiner off.
  "xla_gpu_all_reduce_combine_threshold_bytes": 0,
  "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
  "xla_gpu_all_gather_combine_threshold_bytes": 0,
  # Overlap: schedule for latency hiding, and no collective kind forced
  # synchronous (overrides a --xla_gpu_disable_async_collectives in XLA_FLAGS).
  "xla_gpu_enable_latency_hiding_scheduler": True,
  "xla_gpu_disable_async_collectives": "",
}

GPU_PLATFORMS = ("cuda", "gpu", "rocm")

COST_MODEL_OPTIONS = {
  "xla_gpu_collect_cost_model_stats": True,
  # After scheduling, XLA makes a collective with nothing between its start and its done
  # synchronous. jaxlib 0.10's XLA marks the pair so (`"is_sync":true`); jaxlib 0.12's
  # rewrites it as a plain collective, without its estimate. Kept as the pair, it is the
  # same schedule with its time readable.
  "xla_disable_hlo_passes": "gpu-convert-async-collectives-to-sync",
}
"""XLA:GPU options that keep the scheduler's cost estimate of every instruction in the
compiled HLO, for `jaxdp.inspect.predict_step`. The schedule is the same with or without
them; a collective XLA would make synchronous stays its start/done pair."""

REDUCE_SCATTER_PIPELINER = (
  # jaxlib 0.12's XLA: a mode, the boolean's replacement
  {"xla_gpu_pipeline_reduce_scatter": "COLLECTIVE_PIPELINING_MODE_ON"},
  {"xla_gpu_enable_pipelined_reduce_scatter": True},  # jaxlib 0.10's
)
"""XLA:GPU's collective pipeliner for reduce-scatters in loops, one spelling per XLA
release, newest first (`first_known` picks the installed one)."""


LAYER_GATHER_COMBINE_BYTES = 1 << 32
"""The all-gather combine threshold of a step with scanned layers: above one layer of any
model trained so, 4 GiB (a Llama-3-70B layer is 1.7 GB in bf16)."""


def compiler_options(platform: str, scanned: bool = False) -> dict[str, str | int | bool]:
  """XLA options jaxdp compiles with on `platform`, so buckets stay buckets.

  Pass them to `jax.jit(f, compiler_options=...)` (or to
  `.lower(...).compile(compiler_options=...)`). On CPU they disable the
  all-reduce combiner; on GPU they set every combine threshold to 0 and keep
  collectives asynchronous under the latency hiding scheduler. An FSDP step
  with scanned units (`FSDPConfig(stacked=)`) gathers each layer's params one
  iteration ahead, one all-gather per param: on GPU XLA's all-gather combiner
  then moves them as one collective (one latency per layer, not one per
  param: most of their time across hosts, and the scheduler overlaps one
  collective at a time).

  Args:
    platform: `"cpu"`, or `"cuda"`/`"gpu"`/`"rocm"` (e.g.
      `jax.default_backend()` or `device.platform`).
    scanned: the step gathers scanned layers' params one iteration ahead.

  Returns:
    A new dict of option name to value; empty for another platform (e.g.
    `"tpu"`), where jaxdp has not verified which passes merge collectives
    (there XLA may merge buckets: check with `jaxdp.inspect`).

  Examples:
    >>> compiler_options("cpu")
    {'xla_disable_hlo_passes': 'cpu-all-reduce-combiner'}
    >>> compiler_options("cuda")["xla_gpu_all_reduce_combine_threshold_bytes"]
    0
    >>> compiler_options("tpu")
    {}
  """
  if platform == "cpu":
    return known_options(CPU_OPTIONS)
  if platform in GPU_PLATFORMS:
    options = dict(GPU_OPTIONS)
    if scanned:
      options["xla_gpu_all_gather_combine_threshold_bytes"] = LAYER_GATHER_COMBINE_BYTES
    return known_options(options)
  return {}


def known_options(options: dict) -> dict:
  """`options` less those the installed XLA does not know, each dropped with a warning that
  names it: XLA renames and removes its flags between releases, and a compile given an
  unknown one fails ("No such compile option"), which must not break a user's step.

  Examples:
    >>> known_options({"xla_gpu_enable_latency_hiding_scheduler": True, "xla_no_such": 1})
    {'xla_gpu_enable_latency_hiding_scheduler': True}
  """
  return {name: value for name, value in options.items() if knows_option(name, value)}


def first_known(spellings: tuple[dict, ...]) -> dict:
  """The first of `spellings` (one option as XLA releases spell it, newest first) that the
  installed XLA knows; `{}`, with a warning naming the newest spelling, if none.

  Examples:
    >>> first_known(({"xla_no_such": 1}, {"xla_gpu_enable_latency_hiding_scheduler": True}))
    {'xla_gpu_enable_latency_hiding_scheduler': True}
  """
  for options in spellings:
    if all(_accepts(name, value) for name, value in options.items()):
      return dict(options)
  return known_options(spellings[0])


@functools.cache
def knows_option(name: str, value) -> bool:
  """Does the installed XLA accept option `name` (with `value`)? Warns, naming it, once per
  process, if not."""
  if _accepts(name, value):
    return True
  _log.warning(
    "this XLA (jaxlib %s) has no compile option %r: jaxdp compiles without it",
    jax.lib.__version__,
    name,
  )
  return False


@functools.cache
def _accepts(name: str, value) -> bool:
  """Once per process and option: a compile of an identity on the CPU, whose XLA reads every
  backend's options (they are one `DebugOptions`)."""
  cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  one = jax.ShapeDtypeStruct((), jnp.float32, sharding=cpu)
  try:
    jax.jit(lambda x: x, compiler_options={name: value}).lower(one).compile()
  except jax.errors.JaxRuntimeError as e:
    if "No such compile option" not in str(e):
      raise
    return False
  return True
