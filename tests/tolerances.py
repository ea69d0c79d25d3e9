"""Tolerances for comparing a data-parallel run with the single-device program, derived
from the arithmetic rather than observed on one machine.

Two correct float32 programs that sum the same terms in another order (a `psum` of
per-device partial sums against one device's sum, another XLA:CPU kernel or vector width)
differ by rounding only. What that rounding can do:

* n roundings accumulate like a random walk: a sum of n float32 terms, summed in another
  order, moves by about sqrt(n) * eps32 of the terms' size (Higham, Accuracy and
  Stability of Numerical Algorithms, sec. 2.8; the worst case n * eps32 needs every
  rounding to go the same way). `rtol_sum(n)` is GRAD_TERMS = 4 times that. A mean loss
  over n tokens (cross-entropy >= 0, so the terms are the size of the mean) and a sum of
  squares (a norm) are such sums.
* A gradient element is a sum over the n tokens (or examples) of the global batch of
  terms of both signs, which are about sqrt(n) times their mean where they point in
  unrelated directions; so we bound a gradient's rounding by
  sqrt(n) * rtol_sum(n) = 4 * n * eps32 times the largest gradient of its leaf at that
  step. Where the gradient cancels to almost nothing (an attention key bias, whose exact
  gradient is 0 because softmax ignores a constant per row; a weight two examples push in
  opposite directions) the computed gradient is rounding noise whose sign either program
  may get.
* Adam divides by the root mean square of the gradient history: its update
  u = m_hat / (sqrt(v_hat) + eps) has |u| <= c_t (`adam_ratio_bound`, about 1 for the
  first steps), and a perturbation delta of every gradient in the history moves it by at
  most (1 + c_t) * delta / (sqrt(v_hat) + eps) (m_hat is a weighted mean and sqrt(v_hat)
  a weighted RMS, each 1-Lipschitz in the history). So per step an element's update
  differs by at most lr * min(2 c_t, (1 + c_t) delta / (sqrt(v_hat) + eps)): tight where
  the gradient stands well above its rounding, up to 2 lr per step where it does not.
  Summed over the steps this is `AdamBound`: a bound per element, computed from the
  reference run's own gradients, plus the float32 rounding of the params themselves.
  First order: the grads of later steps are taken at params that differ by the bound,
  whose effect (curvature times that difference) is below the rounding term for these
  small models; the factor GRAD_TERMS leaves room for it.
"""

import jax
import jax.numpy as jnp
import numpy as np

PyTree = object
EPS32 = float(np.finfo(np.float32).eps)  # 2**-23
# Safety factor on the random-walk estimates (module docstring): 4 standard deviations.
# For gradients the leaf's largest gradient, not the element's own, sets the scale, which
# leaves a wide margin on all but a leaf's largest elements.
GRAD_TERMS = 4.0


def rtol_sum(n: int) -> float:
  """Relative difference of two orders of summing n float32 terms of one sign."""
  return GRAD_TERMS * float(np.sqrt(n)) * EPS32


def adam_ratio_bound(t: int, b1: float = 0.9, b2: float = 0.999) -> float:
  """max |m_hat_t / sqrt(v_hat_t)| over all gradient histories of length t.

  m_hat = sum_k a_k g_k, v_hat = sum_k w_k g_k^2; by Cauchy-Schwarz the ratio is at most
  sqrt(sum_k a_k^2 / w_k), reached by g_k proportional to a_k / w_k. 1 at t = 1; 1.01 at
  t = 5; 1.08 at t = 10.
  """
  a = [(1 - b1) * b1 ** (t - k) / (1 - b1**t) for k in range(1, t + 1)]
  w = [(1 - b2) * b2 ** (t - k) / (1 - b2**t) for k in range(1, t + 1)]
  return float(np.sqrt(sum(x * x / y for x, y in zip(a, w))))


class AdamBound:
  """Per-element bound on |p_a - p_b| for two float32 runs of Adam(W) on the same problem
  whose gradients differ by rounding only.

  Feed it the reference run's gradients step by step (`add`, before clipping; with `clip`
  it scales them as `optax.clip_by_global_norm(clip)` does), then `check(got, want)`.

  Args:
    lr: the learning rate, or an optax schedule (called with the step count 0, 1, ...).
    n_terms: how many terms are summed into one gradient element (tokens or examples in
      the global batch).
    params: the initial params (their magnitude sets the rounding of p - lr * u).
    clip: the max global norm of a `clip_by_global_norm` before Adam, if any.
    b1, b2, eps: Adam's.
    grad_rtol: how far the two runs' gradients may differ, relative to a leaf's largest
      gradient; by default float32's `sqrt(n_terms) * rtol_sum(n_terms)`, and
      `bf16_grad_rtol` for two bfloat16 programs; a tree like `params` gives each leaf its
      own (a tree of float32 and bfloat16 leaves).
  """

  def __init__(self, lr, n_terms, params, clip=None, b1=0.9, b2=0.999, eps=1e-8, grad_rtol=None):
    self.clip = clip
    self.lr = lr if callable(lr) else (lambda count: lr)
    # How far the two runs' gradients differ, relative to a leaf's largest gradient.
    rho = float(np.sqrt(n_terms)) * rtol_sum(n_terms) if grad_rtol is None else grad_rtol
    self.rho = rho if not np.isscalar(rho) else jax.tree.map(lambda p: rho, params)
    self.b1, self.b2, self.eps = b1, b2, eps
    self.t, self.v, self.delta, self.moved = 0, None, None, 0.0
    self.bound = jax.tree.map(lambda p: np.zeros(np.shape(p), np.float64), params)
    self.scale = jax.tree.map(
      lambda p: float(np.max(np.abs(np.asarray(p, np.float64)), initial=0.0)), params
    )

  def add(self, grads, exact=False, delta=None):
    """Account for one more Adam step whose (unclipped) reference gradients are `grads`;
    `exact`: both runs take this step bit for bit alike (they restored the same state),
    so it adds nothing to the bound, only to Adam's history. `delta`: per leaf, how far
    this step's gradients of the two runs may differ, where `grad_rtol` of the largest
    gradient does not say it (see `bf16_partials_delta`)."""
    grads = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
    if self.clip is not None:
      norm = float(np.sqrt(sum(np.sum(g * g) for g in jax.tree.leaves(grads))))
      grads = jax.tree.map(lambda g: g * min(1.0, self.clip / max(norm, 1e-30)), grads)
    self.t += 1
    t, b1, b2 = self.t, self.b1, self.b2
    lr = float(self.lr(t - 1))
    c = adam_ratio_bound(t, b1, b2)
    self.moved += lr * c  # how far a param can have moved from its start
    if self.v is None:
      self.v = jax.tree.map(np.zeros_like, grads)
      self.delta = jax.tree.map(lambda g: 0.0, grads)
    self.v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, self.v, grads)
    # The largest rounding error of any gradient so far, per leaf.
    if delta is None:
      delta = jax.tree.map(lambda g, r: r * float(np.max(np.abs(g), initial=0.0)), grads, self.rho)
    self.delta = jax.tree.map(max, self.delta, delta)

    if exact:
      self.delta = jax.tree.map(lambda d: 0.0, self.delta)
      return

    def step(bound, v, delta):
      denom = np.sqrt(v / (1 - b2**t)) + self.eps
      return bound + lr * np.minimum(2 * c, (1 + c) * delta / denom)

    self.bound = jax.tree.map(step, self.bound, self.v, self.delta)

  def check(self, got, want, what=""):
    """Asserts |got - want| <= bound + the params' own rounding, leaf by leaf; reports the
    worst element and how much of the bound it used."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    bounds, scales = jax.tree.leaves(self.bound), jax.tree.leaves(self.scale)
    for (path, x), y, b, s in zip(
      jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), bounds, scales
    ):
      x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
      # p - lr * u rounds once per step in each run, by eps32 / 2 of the param's size.
      tol = b + self.t * EPS32 * (s + self.moved)
      diff = np.abs(x - y)
      bad = diff > tol
      if bad.any():
        i = np.unravel_index(np.argmax(diff - tol), diff.shape)
        raise AssertionError(
          f"{what}{jax.tree_util.keystr(path)}: {int(bad.sum())} of {diff.size} elements "
          f"differ by more than the Adam rounding bound; worst at {i}: |{x[i]} - {y[i]}| "
          f"= {diff[i]:.3g} > {tol[i]:.3g}"
        )

  def tight_fraction(self, atol):
    """The fraction of elements whose bound is at most `atol`. A bug in what an element's
    update sees (a wrong shard, a missing or doubled gradient) moves Adam's update by
    O(1), the param by O(lr) per step: a bound well below lr catches it."""
    leaves = jax.tree.leaves(self.bound)
    return sum(int((b <= atol).sum()) for b in leaves) / sum(b.size for b in leaves)


class SGDBound(AdamBound):
  """Per-element bound on |p_a - p_b| for two float32 runs of SGD with (heavy-ball) momentum
  whose gradients differ by rounding only.

  The update is linear in the gradients: the momentum after t steps is sum_k m^(t-k) g_k,
  so a difference delta_k in each gradient moves the step-t update by at most
  lr * sum_k m^(t-k) delta_k, and the params by the sum of that over the steps; delta_k is
  the rounding bound of step k's gradients (`grad_rtol` of the leaf's largest gradient, as
  for Adam). Same first-order caveat and the same `check` as `AdamBound`.
  """

  def __init__(self, lr, params, momentum=0.0, grad_rtol=None, n_terms=1):
    super().__init__(lr, n_terms, params, grad_rtol=grad_rtol)
    self.momentum = momentum
    self.carried = jax.tree.map(lambda p: 0.0, params)  # sum_k m^(t-k) delta_k

  def add(self, grads, exact=False, delta=None):
    grads = jax.tree.map(lambda g: np.asarray(g, np.float64), grads)
    self.t += 1
    lr = float(self.lr(self.t - 1))
    largest = jax.tree.map(lambda g: float(np.max(np.abs(g), initial=0.0)), grads)
    self.moved += lr * sum(jax.tree.leaves(largest)) / (1 - self.momentum)
    if delta is None:
      delta = jax.tree.map(lambda g, r: r * g, largest, self.rho)
    delta = jax.tree.map(lambda d: 0.0 if exact else d, delta)
    self.carried = jax.tree.map(lambda c, d: self.momentum * c + d, self.carried, delta)
    self.bound = jax.tree.map(lambda b, c: b + lr * c, self.bound, self.carried)


EPS_BF16 = float(jnp.finfo(jnp.bfloat16).eps)  # 2**-7: 8 significant bits, 7 stored


def bf16_grad_rtol(roundings: int) -> float:
  """How far two bfloat16 programs' gradients may differ, relative to a leaf's largest
  gradient, where a gradient element is rounded to bfloat16 up to `roundings` times on
  its way back from the loss (once per op whose output is bfloat16).

  Each rounding moves a value by at most eps_bf16 / 2 = 2**-8 relative (round to nearest,
  8 significant bits). Two programs that XLA fuses differently (one keeps an intermediate
  in float32 where the other rounds it) round at different ops, so their gradients differ
  by up to 2 * roundings such roundings: like the float32 sums above, a random walk,
  GRAD_TERMS * sqrt(2 * roundings) * eps_bf16 / 2 (the worst case, every rounding the
  same way, is sqrt(2 * roundings / GRAD_TERMS**2) times that). The float32 accumulation
  inside the matmuls adds only float32 rounding, far below this.
  """
  return GRAD_TERMS * float(np.sqrt(2 * roundings)) * EPS_BF16 / 2


def bf16_partials_delta(example_grads, grads, n_terms) -> PyTree:
  """Per leaf: how far a data-parallel run's gradient of a bfloat16 leaf may differ from one
  device's, where each device (micro-batch) rounds its partial gradient to bfloat16 before
  the float32 sum and one device rounds the whole sum once.

  Each rounding moves a partial by at most eps_bf16 / 2 of itself, and a partial is a sum of
  some examples' gradients, so all of them together move the sum by at most eps_bf16 / 2
  times the sum of the examples' |gradients| (`example_grads`: one leading row per example,
  already divided by the batch size as the mean loss weighs them); the reference's own
  rounding adds eps_bf16 / 2 of |grad|, float32's sums `grad_atol`. Where partial gradients
  cancel, this is far above the largest gradient: a relative bound of that would not hold.
  """
  half = EPS_BF16 / 2
  return jax.tree.map(
    lambda e, g: (
      float(
        np.max(half * np.sum(np.abs(np.asarray(e, np.float64)), axis=0), initial=0.0)
        + half * np.max(np.abs(np.asarray(g, np.float64)), initial=0.0)
      )
      + float(np.sqrt(n_terms))
      * rtol_sum(n_terms)
      * float(np.max(np.abs(np.asarray(g)), initial=0.0))
    ),
    example_grads,
    grads,
  )


def step_tolerances(params, n_terms, per_term, lr, clip=None, **adam):
  """(loss rtol, grad-norm rtol, AdamBound) for a training run on `params`.

  Args:
    n_terms: terms the loss averages and each gradient sums: tokens of the global batch
      (GPT), or examples times outputs (the MLPs' squared errors).
    per_term: products summed into one term: d_model + vocab for a GPT (a row of logits
      and its logsumexp), layers times width for an MLP.
    lr: Adam's learning rate or schedule.
    clip: the max norm of a `clip_by_global_norm` before Adam, if any.

  The loss is a mean of n_terms terms of one sign, each a sum of per_term products. The
  grad norm sums the squares of every gradient, each a sum over n_terms terms: its
  relative rounding is that of the largest gradients (which set the norm) plus that of a
  sum of as many squares as there are params.
  """
  n_params = sum(int(np.size(x)) for x in jax.tree.leaves(params))
  loss_rtol = rtol_sum(n_terms) + rtol_sum(per_term)
  norm_rtol = rtol_sum(n_terms) + rtol_sum(n_params)
  return loss_rtol, norm_rtol, AdamBound(lr, n_terms, params, clip=clip, **adam)


def grad_atol(grads, n_terms):
  """Per leaf: how far two float32 programs' gradients of `n_terms` summed terms may
  differ (the rounding bound AdamBound uses: sqrt(n) * rtol_sum(n) of the leaf's largest
  gradient)."""
  return jax.tree.map(
    lambda g: (
      float(np.sqrt(n_terms))
      * rtol_sum(n_terms)
      * float(np.max(np.abs(np.asarray(g, np.float64)), initial=0.0))
    ),
    grads,
  )


def assert_grads_close(got, want, n_terms):
  """Gradients of two float32 programs agree to `grad_atol`, leaf by leaf."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, x), y, atol in zip(
    jax.tree_util.tree_leaves_with_path(got),
    jax.tree.leaves(want),
    jax.tree.leaves(grad_atol(want, n_terms)),
  ):
    np.testing.assert_allclose(
      np.asarray(x, np.float64),
      np.asarray(y, np.float64),
      rtol=0,
      atol=atol,
      err_msg=jax.tree_util.keystr(path),
    )


def assert_trees_close(a, b, atol, rtol=0.0):
  """Every leaf of `a` within `atol + rtol * |b|` of `b`'s, in float32, naming the leaf."""
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(
      np.asarray(x, np.float32),
      np.asarray(y, np.float32),
      atol=atol,
      rtol=rtol,
      err_msg=jax.tree_util.keystr(path),
    )
