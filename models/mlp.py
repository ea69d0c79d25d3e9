"""A tiny multi-layer perceptron in Flax NNX, used by the tests.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> model = MLP(4, 16, 2, n_layers=3, rngs=nnx.Rngs(0))
    >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))}
    >>> model(batch["x"]).shape
    (8, 2)
    >>> float(mlp_loss(model, batch)) >= 0.0
    True
"""

import jax
import jax.numpy as jnp
from flax import nnx


class MLP(nnx.Module):
  """`n_layers` dense layers with GELU between them.

  Args:
      din: input features.
      dhidden: hidden features.
      dout: output features.
      n_layers: number of `nnx.Linear` layers (>= 1); param paths are
          `['layers'][i]['kernel' | 'bias']`.
      rngs: the NNX random streams used to initialise the weights.
      param_dtype: dtype of every parameter (compute runs in that dtype too).
  """

  def __init__(
    self,
    din: int,
    dhidden: int,
    dout: int,
    n_layers: int = 2,
    *,
    rngs: nnx.Rngs,
    param_dtype=jnp.float32,
  ):
    if n_layers < 1:
      raise ValueError(f"n_layers={n_layers}; an MLP needs at least one layer")
    sizes = [din] + [dhidden] * (n_layers - 1) + [dout]
    self.layers = nnx.List(
      [
        nnx.Linear(a, b, rngs=rngs, param_dtype=param_dtype, dtype=param_dtype)
        for a, b in zip(sizes[:-1], sizes[1:])
      ]
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    for i, layer in enumerate(self.layers):
      x = layer(x)
      if i < len(self.layers) - 1:
        x = jax.nn.gelu(x)
    return x


def mlp_loss(model: MLP, batch: dict) -> jax.Array:
  """Mean squared error of `model(batch["x"])` against `batch["y"]` (f32 scalar)."""
  pred = model(batch["x"]).astype(jnp.float32)
  return jnp.mean((pred - batch["y"].astype(jnp.float32)) ** 2)
