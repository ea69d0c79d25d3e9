"""XLA options by existence: jaxdp passes only the options the installed XLA knows."""

import logging

import jax
import jax.numpy as jnp

from jaxdp._src import compiler


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
  assert compiler.knows_option("xla_gpu_enable_pipelined_reduce_scatter", True)
