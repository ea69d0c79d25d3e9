"""jaxdp beside the JAX releases it supports: XLA options passed by existence, and what an
older release cannot compile refused by name (jaxdp/_src/jaxprs.py's accessors have their
own tests in test_jaxprs.py)."""

import logging

import jax
import jax.numpy as jnp
import pytest

import jaxdp
from jaxdp._src import compiler
from jaxdp._src.config import OFFLOAD_MIN_JAXLIB, check_offload_supported, jaxlib_version


def test_an_option_this_xla_does_not_know_is_dropped_and_named(caplog):
  """XLA renames and removes flags (`xla_gpu_enable_pipelined_*` became
  `xla_gpu_pipeline_*` in its docs); a compile given an unknown one fails. Such an option
  is left out, with a warning naming it, and the rest are kept."""
  unknown = "xla_gpu_renamed_by_a_later_release"
  with caplog.at_level(logging.WARNING, logger="jaxdp._src.compiler"):
    kept = compiler.known_options({unknown: True, "xla_gpu_all_reduce_combine_threshold_bytes": 0})
  assert kept == {"xla_gpu_all_reduce_combine_threshold_bytes": 0}
  assert unknown in caplog.text and jax.lib.__version__ in caplog.text
  # what is kept compiles
  jax.jit(lambda x: x + 1, compiler_options=kept)(jnp.float32(1.0))


def test_every_option_jaxdp_passes_is_known_to_the_installed_xla():
  """The options jaxdp compiles with on each platform, all known here: none is dropped
  silently from what the tests measure."""
  for platform, scanned in [("cpu", False), ("cuda", False), ("cuda", True)]:
    options = compiler.compiler_options(platform, scanned)
    wanted = compiler.CPU_OPTIONS if platform == "cpu" else compiler.GPU_OPTIONS
    assert set(options) == set(wanted), platform
  # the reduce-scatter pipeliner, in one of its spellings
  assert compiler.first_known(compiler.REDUCE_SCATTER_PIPELINER)
  assert all(compiler.knows_option(k, v) for k, v in compiler.COST_MODEL_OPTIONS.items())


def test_an_option_spelled_two_ways_is_passed_as_this_xla_spells_it(caplog):
  """XLA renames options between releases: the first spelling the installed XLA knows is
  the one passed, and none known is dropped with a warning naming the newest."""
  newest, older = {"xla_no_such_new": 1}, {"xla_gpu_enable_latency_hiding_scheduler": True}
  assert compiler.first_known((newest, older)) == older
  assert compiler.first_known((older, newest)) == older
  with caplog.at_level("WARNING"):
    assert compiler.first_known((newest, {"xla_no_such_old": 1})) == {}
  assert "xla_no_such_new" in caplog.text and "xla_no_such_old" not in caplog.text


def test_host_offload_is_refused_on_a_jaxlib_that_cannot_compile_it():
  """jaxlib 0.10.0 and 0.10.1 stop in XLA's SPMD partitioner on host offload ("Side-effect
  HLO must have sharding"): the config refuses it there, naming the release it needs."""
  check_offload_supported(OFFLOAD_MIN_JAXLIB)
  with pytest.raises(
    NotImplementedError, match=r"needs jaxlib >= 0\.10\.2 \(installed: 0\.10\.1\)"
  ):
    check_offload_supported((0, 10, 1))
  if jaxlib_version() < OFFLOAD_MIN_JAXLIB:  # the oldest supported release, in CI
    with pytest.raises(NotImplementedError, match="optimizer_cpu_offload=True needs jaxlib"):
      jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", optimizer_cpu_offload=True)
  else:
    jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", optimizer_cpu_offload=True)
