"""Pictures of what jaxdp computes: buffer layouts, collective schedules, memory.

Each function draws one kind of library data with plain matplotlib, so that notebooks and
scripts hold no drawing code:

- `plot_layout`: every buffer of a `Layout` as a strip of elements: which param sits where,
  bucket boundaries, the `dp` shards of every bucket, padding.
- `plot_bucket`: one bucket as the `dp x shard_size` grid it is in memory (shard-major:
  row `d` is what device `d` owns after a reduce-scatter).
- `plot_timeline`: a compiled program's `Schedule` (`jaxdp.inspect.schedule`) as lanes:
  the compute kernels (GEMMs dark), then one lane per collective from its start to its
  done, exposed ones called out.
- `plot_predicted_timeline`: a `StepPrediction` (`jaxdp.inspect.predict_step`) on a time
  axis, the exposed communication shaded.
- `plot_memory`: bytes per device as stacked bars (a `MemoryLedger` or any
  `{kind: bytes}`), with measured or compiled numbers as markers on top.

matplotlib is imported on first use; every function draws on `ax` (a new figure when
None) and returns the axes.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Sequence

from jaxdp._src.layout import Layout

# A path's first key (`['blocks']`, or an attribute `.blocks`) and, if one follows, its first
# list index (`['blocks'][3]`): the group `param_group` colours by.
_GROUP = re.compile(r"^((?:\[[^\]]*\]|\.\w+)(?:\[\d+\])?)")
_LAYER = re.compile(r"\[(\d+)\]$")  # a group label that ends in a list index: a layer
_PAD_COLOR = "0.85"
_GREYS = ("0.25", "0.5", "0.68")  # the groups that are no layer (embeddings, final norm)
_MIN_LABELLED = 0.03  # the least share of its strip a bucket needs for its label ("b13")
_KIND_COLOR = {
  "all-reduce": "tab:green",
  "reduce-scatter": "tab:orange",
  "all-gather": "tab:purple",
  "all-to-all": "tab:brown",
  "collective-permute": "tab:pink",
}
_EXPOSED = "tab:red"
# copies between host and device memory (`optimizer_cpu_offload`), by direction
_COPY_COLOR = {"host-to-device": "tab:cyan", "device-to-host": "tab:olive"}
MEMORY_KINDS = ("params", "grads", "master", "opt_state")
"""What a `MemoryLedger` counts, bottom to top in `plot_memory`'s bars."""


def param_group(path: str) -> str:
  """The layer a param belongs to, for colouring: its path up to the first list index.

  Args:
    path: a leaf path as `jax.tree_util.keystr` writes it (`ParamSpec.path`).

  Returns:
    `"['blocks'][3]"` for `"['blocks'][3]['attn']['c_attn']['kernel']"`, else the
    top-level key (`"['wte']"`).

  Examples:
    >>> param_group("['blocks'][3]['attn']['c_attn']['kernel']")
    "['blocks'][3]"
    >>> param_group("['wte']")
    "['wte']"
  """
  m = _GROUP.match(path)
  return m.group(1) if m else path


def _axes(ax, figsize):
  if ax is not None:
    return ax
  import matplotlib.pyplot as plt  # noqa: PLC0415 - optional, imported on use

  return plt.subplots(figsize=figsize, layout="constrained")[1]


def _colors(labels: Sequence[str], model: Sequence[str]) -> dict[str, Any]:
  """A colour per label of `labels`, the same in every figure of one model: a layer
  (`['blocks'][3]`) takes tab10's colour of its index, the other groups (`['wte']`, `['ln_f']`)
  greys from dark to light, then light tints, in the order they come in `model` (every group
  of the layout, the figure's or not). In the order the labels come."""
  import matplotlib  # noqa: PLC0415

  layers = matplotlib.colormaps["tab10"].colors
  # the groups that are no layer, in the model's order: their index picks their grey, so
  # that a group keeps its colour in a figure that shows only some of them
  others = [label for label in dict.fromkeys(model) if not _LAYER.search(label)]
  tints = matplotlib.colormaps["tab20"].colors[1::2]
  colors = {}
  for label in dict.fromkeys(labels):
    layer = _LAYER.search(label)
    if layer:
      colors[label] = layers[int(layer[1]) % len(layers)]
    else:
      k = others.index(label) if label in others else len(others)
      colors[label] = _GREYS[k] if k < len(_GREYS) else tints[(k - len(_GREYS)) % len(tints)]
  return colors


def _fmt(n: float) -> str:
  for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(n) >= size:
      return f"{n / size:.3g}{unit}"
  return f"{n:.0f}"


def _fmt_bytes(n: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.3g} {unit}"
  return f"{n:.0f} B"


def _real_elements(spec, dp: int, d: int) -> int:
  """Elements of `spec`'s shard `d` that are real rows (the rest is row padding)."""
  # The padded rows split evenly over the shards, padding at the end: shard d holds rows
  # `[d * rows_per_shard, (d + 1) * rows_per_shard)`, of which those below the real count
  # `n` are real; each row is `shard_size / rows_per_shard` elements.
  rows_per_shard = spec.rows // dp
  n = (spec.shape or (1,))[spec.axis]
  real_rows = min(max(n - d * rows_per_shard, 0), rows_per_shard)
  return spec.shard_size(dp) // rows_per_shard * real_rows if rows_per_shard else 0


def _legend(ax, colors: Mapping[str, Any], padding: bool, max_entries: int = 16):
  from matplotlib.patches import Patch  # noqa: PLC0415

  handles = [Patch(color=c, label=label) for label, c in list(colors.items())[:max_entries]]
  if len(colors) > max_entries:
    handles.append(Patch(color="white", label=f"... {len(colors) - max_entries} more"))
  if padding:
    handles.append(Patch(facecolor=_PAD_COLOR, hatch="///", edgecolor="0.5", label="padding"))
  ax.legend(
    handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False
  )


def plot_layout(
  layout: Layout, axes=None, *, group: Callable[[str], str] = param_group, legend: bool = True
):
  """Draws every buffer of a layout as a strip of elements, one axes per buffer.

  Each param is coloured by `group(path)`: a layer by its index (the same colour in every
  figure), the other groups in greys; in every bucket it appears `dp` times, once per shard
  (the bucket is shard-major). Thick black lines are bucket boundaries (labelled `b0`, `b1`, ... in
  backprop order, where the bucket is wide enough for its label), thin white lines shard
  boundaries, grey hatching padding (leading dims padded to a multiple of dp, bucket
  ends padded to `lcm(dp, 128)`).

  Args:
    layout: from `jaxdp.layout.make_layout` (or `TrainState.layout`).
    axes: one matplotlib axes per buffer; None: a new figure with a row per buffer.
    group: path -> label that picks the colour; default `param_group`.
    legend: draw the legend of groups (right of the first axes).

  Returns:
    The list of axes, one per buffer; the first one's title sums the layout up.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"layers": [{"w": jnp.zeros((300, 4))}, {"w": jnp.zeros((3,))}]}
    >>> axes = plot_layout(jaxdp.layout.make_layout(params, dp=8, bucket_size=3))
    >>> axes[0].get_title()
    'dp=8: 1 buffer, 2 buckets, 1,203 param elements + 205 padding'
  """
  n = len(layout.buffers)
  if axes is None:
    import matplotlib.pyplot as plt  # noqa: PLC0415 - optional, imported on use

    axes = plt.subplots(n, 1, figsize=(11, 0.4 + 1.1 * n), layout="constrained", squeeze=False)[1][
      :, 0
    ]
  axes = list(axes)
  if len(axes) != n:
    raise ValueError(f"plot_layout: {len(axes)} axes for {n} buffers; pass one per buffer")
  dp = layout.dp
  groups = [group(p.path) for p in layout.params]
  colors = _colors(groups, groups)
  pad_total = 0
  for ax, buf in zip(axes, layout.buffers):
    # (offset, length) runs of each group's elements and of padding, for `broken_barh`
    spans: dict[str, list[tuple[int, int]]] = {}
    pads: list[tuple[int, int]] = []
    for b in buf.buckets:
      # A bucket is shard-major: shard d of every param in it, then shard d + 1. Within a
      # shard a param's real elements come first, its row padding after; the bucket's end
      # padding follows its last param.
      for d in range(dp):
        start = b.offset + d * b.shard_size
        used = 0
        for p in b.params:
          size, real = p.shard_size(dp), _real_elements(p, dp, d)
          if real:
            spans.setdefault(group(p.path), []).append((start + p.offset, real))
          if size > real:
            pads.append((start + p.offset + real, size - real))
          used = max(used, p.offset + size)
        if b.shard_size > used:
          pads.append((start + used, b.shard_size - used))
    for label, xs in spans.items():
      ax.broken_barh(xs, (0.1, 0.8), facecolors=colors[label], linewidth=0)
    if pads:
      ax.broken_barh(
        pads, (0.1, 0.8), facecolors=_PAD_COLOR, edgecolor="0.5", hatch="///", linewidth=0
      )
    for b in buf.buckets:
      for d in range(1, dp):
        x = b.offset + d * b.shard_size
        ax.plot([x, x], [0.1, 0.9], color="white", linewidth=0.4)
      ax.plot([b.offset, b.offset], [0, 1], color="black", linewidth=1.5)
      if b.shard_size * dp >= _MIN_LABELLED * buf.size:  # a narrower one's label would not fit
        ax.text(
          b.offset + b.shard_size * dp / 2,
          0.93,
          f"b{b.index}",
          ha="center",
          va="bottom",
          fontsize="small",
        )
    ax.plot([buf.size, buf.size], [0, 1], color="black", linewidth=1.5)
    pad = buf.size - buf.numel
    pad_total += pad
    ax.set_yticks([0.5], [buf.name])
    ax.set_ylim(0, 1.25)
    ax.set_xlim(0, buf.size * 1.005)
    ax.set_xlabel(
      f"element offset in buffer {buf.name} ({buf.size:,} elements, {pad:,} padding)",
      fontsize="small",
    )
  nb = len(layout.buffers)
  axes[0].set_title(
    f"dp={dp}: {nb} buffer{'s' * (nb != 1)}, {layout.num_buckets} "
    f"bucket{'s' * (layout.num_buckets != 1)}, "
    f"{sum(buf.numel for buf in layout.buffers):,} param elements + "
    f"{pad_total:,} padding"
  )
  if legend:
    _legend(axes[0], colors, pad_total > 0)
  return axes


def plot_bucket(
  layout: Layout,
  buffer: int | str = 0,
  bucket: int = 0,
  ax=None,
  *,
  group: Callable[[str], str] = param_group,
  labels: bool = True,
):
  """Draws one bucket as its `dp x shard_size` grid: row `d` is shard `d`.

  After the bucket's reduce-scatter, device `d` holds row `d`: the same `1/dp` of the
  rows of every param of the bucket (which is why a sharded optimizer sees ordinary
  param-shaped leaves). Hatched cells are padding: rows added to make a leading dim
  divide by dp (they fall in the last shards) and the shard-end padding that makes the
  bucket a multiple of `lcm(dp, 128)`.

  Args:
    layout: the layout.
    buffer: index or name of the buffer.
    bucket: index of the bucket in that buffer.
    ax: matplotlib axes; None: a new figure.
    group: path -> colour label; default `param_group`.
    labels: write each param's last path key on it (where it fits).

  Returns:
    The axes.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> layout = jaxdp.layout.make_layout({"w": jnp.zeros((10, 4)), "b": jnp.zeros((4,))}, dp=4)
    >>> plot_bucket(layout).get_title()
    "float32 bucket 0: 4 shards x 32 elements (44 params' elements, 84 padding)"
  """
  if isinstance(buffer, str):
    names = [buf.name for buf in layout.buffers]
    if buffer not in names:
      raise ValueError(f"plot_bucket: no buffer {buffer!r}; the layout has {names}")
    buffer = names.index(buffer)
  buf = layout.buffers[buffer]
  b = buf.buckets[bucket]
  dp = layout.dp
  ax = _axes(ax, (11, 0.6 + 0.28 * dp))
  colors = _colors([group(p.path) for p in b.params], [group(p.path) for p in layout.params])
  for d in range(dp):
    used = 0
    for p in b.params:
      n, real = p.shard_size(dp), _real_elements(p, dp, d)
      if real:
        ax.broken_barh(
          [(p.offset, real)],
          (d - 0.45, 0.9),
          facecolors=colors[group(p.path)],
          edgecolor="white",
          linewidth=0.5,
        )
      if n > real:
        ax.broken_barh(
          [(p.offset + real, n - real)],
          (d - 0.45, 0.9),
          facecolors=_PAD_COLOR,
          edgecolor="0.5",
          hatch="///",
          linewidth=0,
        )
      used = max(used, p.offset + n)
    if b.shard_size > used:
      ax.broken_barh(
        [(used, b.shard_size - used)],
        (d - 0.45, 0.9),
        facecolors=_PAD_COLOR,
        edgecolor="0.5",
        hatch="///",
        linewidth=0,
      )
  if labels:
    for p in b.params:
      n = p.shard_size(dp)
      if n >= 0.06 * b.shard_size:
        name = re.findall(r"\[([^\]]*)\]|\.(\w+)", p.path)
        short = "".join(name[-1]).strip("'") if name else p.path
        ax.text(
          p.offset + n / 2,
          -0.6,
          f"{short}\n{p.shape}",
          ha="center",
          va="bottom",
          fontsize="x-small",
        )
  ax.set_yticks(range(dp), [f"shard {d}" for d in range(dp)])
  ax.set_ylim(dp - 0.5, -1.6 if labels else -0.5)
  ax.set_xlim(0, b.shard_size)
  ax.set_xlabel("element offset in the shard")
  ax.set_title(
    f"{buf.name} bucket {b.index}: {dp} shards x {b.shard_size:,} elements "
    f"({b.numel:,} params' elements, {b.shard_size * dp - b.numel:,} padding)"
  )
  _legend(ax, colors, b.shard_size * dp > b.numel)
  return ax


def plot_timeline(schedule, ax=None, *, title: str | None = None, legend: bool = True):
  """Draws a compiled program's schedule: compute kernels, then one lane per collective.

  The x axis is the position in XLA's schedule, counting only kernels and collective
  starts/dones (no times: the program was not run). The top lane holds the compute
  kernels, GEMMs dark. Below, each collective, in the order it starts, is a bar from its
  start to its done, coloured by kind; its label gives its bytes per device and how many
  GEMMs run while it is in flight. Red (hatched) bars are *exposed*: synchronous, or
  nothing scheduled under them (`Collective.exposed`); an async collective with no GEMM
  under it is drawn with a red edge (only elementwise work hides it).
  Ops inside a loop body are drawn once (a label says `x trips`).

  Args:
    schedule: a `jaxdp.inspect.Schedule` (or anything `jaxdp.inspect.schedule` takes).
    ax: matplotlib axes; None: a new figure.
    title: axes title; default: module name, collective and exposure counts.
    legend: draw the legend.

  Returns:
    The axes.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxdp import inspect
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(jnp.sin(x), "data"), mesh=mesh,
    ...                   in_specs=P(), out_specs=P())
    >>> ax = plot_timeline(inspect.schedule(f, jnp.zeros((256,))))
    >>> ax.get_title()
    'jit__lambda: 1 collective, 1 exposed (0 hidden behind a GEMM)'
  """
  from jaxdp._src.inspect import schedule as parse  # noqa: PLC0415

  from matplotlib.patches import Patch  # noqa: PLC0415

  s = parse(schedule)
  keep = [
    op
    for op in s.ops
    if op.category in ("gemm", "compute", "collective", "collective-start", "collective-done")
  ]
  # The x axis is an op's place among the kept ops, not time: a text schedule has no times.
  pos = {op.index: x for x, op in enumerate(keep)}
  # Row 0 is the compute stream; each collective gets a row of its own, in issue order,
  # spanning its start to its done.
  colls = sorted(s.collectives, key=lambda c: c.start_index)
  ax = _axes(ax, (11, 1.2 + 0.32 * (len(colls) + 1)))
  gemms = [(pos[op.index], 1) for op in keep if op.category == "gemm"]
  other = [(pos[op.index], 1) for op in keep if op.category == "compute"]
  ax.broken_barh(other, (-0.4, 0.8), facecolors="lightsteelblue", linewidth=0)
  ax.broken_barh(gemms, (-0.4, 0.8), facecolors="navy", linewidth=0)
  hidden = 0
  for y, c in enumerate(colls, start=1):
    x0, x1 = pos[c.start_index], pos[c.done_index] + 1
    color = _KIND_COLOR.get(c.kind, "tab:gray")
    # exposed (nothing runs under it): hatched red; some compute under it but no GEMM: its
    # kind's colour in a red frame; a GEMM under it: its kind's colour alone
    if c.exposed:
      ax.broken_barh(
        [(x0, x1 - x0)],
        (y - 0.4, 0.8),
        facecolors=_EXPOSED,
        edgecolor="white",
        hatch="xx",
        linewidth=0,
      )
    else:
      ax.broken_barh(
        [(x0, x1 - x0)],
        (y - 0.4, 0.8),
        facecolors=color,
        edgecolor=color if c.overlaps_gemm else _EXPOSED,
        linewidth=0 if c.overlaps_gemm else 2,
      )
    hidden += c.overlaps_gemm
    what = (
      "EXPOSED"
      if c.exposed
      else f"{len(c.overlapped_gemms)} GEMM{'s' * (len(c.overlapped_gemms) != 1)} under it"
    )
    trips = f", x{c.trip_count} trips" if c.trip_count > 1 else ""
    ax.text(
      x1 + 0.5, y, f"{_fmt_bytes(c.operand_bytes)}  {what}{trips}", va="center", fontsize="x-small"
    )
  ax.set_yticks(
    range(len(colls) + 1),
    ["compute"] + [f"{c.kind} #{i}" for i, c in enumerate(colls)],
    fontsize="small",
  )
  ax.set_ylim(len(colls) + 0.6, -0.6)
  ax.set_xlim(0, max(len(keep), 1) * 1.18)
  ax.set_xlabel("position in the schedule (kernels and collective start/done, not time)")
  n_exposed = sum(c.exposed for c in colls)
  ax.set_title(
    title
    or f"{s.module}: {len(colls)} collective{'s' * (len(colls) != 1)}, "
    f"{n_exposed} exposed ({hidden} hidden behind a GEMM)"
  )
  if legend:
    kinds = dict.fromkeys(c.kind for c in colls)
    handles = [
      Patch(color="navy", label="GEMM"),
      Patch(color="lightsteelblue", label="other kernel"),
    ]
    handles += [Patch(color=_KIND_COLOR.get(k, "tab:gray"), label=k) for k in kinds]
    handles += [
      Patch(facecolor="white", edgecolor=_EXPOSED, linewidth=2, label="no GEMM under it"),
      Patch(facecolor=_EXPOSED, hatch="xx", edgecolor="white", label="exposed"),
    ]
    ax.legend(
      handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False
    )
  return ax


def plot_predicted_timeline(
  prediction, ax=None, *, title: str | None = None, legend: bool = True, unit: str = "us"
):
  """Draws a `StepPrediction` on a time axis: the compute stream above, collectives below.

  The top lane holds the kernels back to back (GEMMs dark); the lane below it the
  collectives, each a bar from when the communication stream starts it to when it ends,
  coloured by kind; a program with host memory (`optimizer_cpu_offload`) gets a third lane,
  its copies between host and device memory by direction. Red spans cross the lanes
  wherever the kernels wait for a collective or a copy: that is the exposed communication;
  a bar outside them is hidden under compute. Loops are drawn trip by trip.

  Args:
    prediction: a `jaxdp.inspect.StepPrediction` (or anything `predict_step` takes).
    ax: matplotlib axes; None: a new figure.
    title: axes title; default: module, step time, exposed and hidden communication.
    legend: draw the legend.
    unit: `"us"` or `"ms"` for the time axis.

  Returns:
    The axes.

  Examples:
    >>> from jaxdp.inspect import Interval, StepPrediction
    >>> p = StepPrediction(  # a GEMM, an all-reduce under it, then a kernel that waits for it
    ...   "demo", step_us=10.0, compute_us=8.0,
    ...   comm_us={"all-reduce": 5.0, "total": 5.0}, exposed_us={"all-reduce": 2.0, "total": 2.0},
    ...   timeline=(Interval("dot", "gemm", "compute", 0.0, 6.0, "main"),
    ...             Interval("all-reduce-start", "all-reduce", "comm", 3.0, 8.0, "main", 2.0),
    ...             Interval("add", "compute", "compute", 8.0, 10.0, "main")))
    >>> ax = plot_predicted_timeline(p)
    >>> ax.get_title()
    'demo: 10 us, exposed communication 2 us (60% hidden)'

    With a copy from host memory the kernel after it waits for:

    >>> p = StepPrediction(
    ...   "offload", step_us=10.0, compute_us=6.0, comm_us={"total": 0.0},
    ...   exposed_us={"total": 0.0}, host_us={"host-to-device": 8.0, "total": 8.0},
    ...   host_exposed_us={"host-to-device": 4.0, "total": 4.0},
    ...   timeline=(Interval("dot", "gemm", "compute", 0.0, 4.0, "main"),
    ...             Interval("copy-start", "host-to-device", "host", 0.0, 8.0, "main", 4.0),
    ...             Interval("add", "compute", "compute", 8.0, 10.0, "main")))
    >>> ax = plot_predicted_timeline(p)
    >>> [t.get_text() for t in ax.get_yticklabels()], ax.get_title()
    (['compute', 'collectives', 'host copies'], 'offload: 10 us, exposed communication 0 us (100% hidden), host copies 8 us (4 us exposed)')
  """
  from jaxdp._src.inspect import predict_step  # noqa: PLC0415

  from matplotlib.patches import Patch  # noqa: PLC0415

  if unit not in ("us", "ms"):
    raise ValueError(f"plot_predicted_timeline: unit={unit!r}; use 'us' or 'ms'")
  p = predict_step(prediction)
  scale = 1e-3 if unit == "ms" else 1.0
  copies = [i for i in p.timeline if i.lane == "host"]
  ax = _axes(ax, (11, 2.9 if copies else 2.2))
  kernels = [i for i in p.timeline if i.lane == "compute"]
  for kind, color in (("compute", "lightsteelblue"), ("gemm", "navy")):
    spans = [(i.start_us * scale, (i.end_us - i.start_us) * scale) for i in kernels]
    spans = [s for s, i in zip(spans, kernels) if i.kind == kind]
    ax.broken_barh(spans, (-0.4, 0.8), facecolors=color, linewidth=0)
  colls = [i for i in p.timeline if i.lane == "comm"]
  for kind in dict.fromkeys(i.kind for i in colls):
    spans = [(i.start_us * scale, (i.end_us - i.start_us) * scale) for i in colls if i.kind == kind]
    ax.broken_barh(
      spans,
      (0.6, 0.8),
      facecolors=_KIND_COLOR.get(kind, "tab:gray"),
      edgecolor="white",
      linewidth=0.3,
    )
  for kind in dict.fromkeys(i.kind for i in copies):
    spans = [
      (i.start_us * scale, (i.end_us - i.start_us) * scale) for i in copies if i.kind == kind
    ]
    ax.broken_barh(
      spans, (1.6, 0.8), facecolors=_COPY_COLOR[kind], edgecolor="white", linewidth=0.3
    )
  # The compute stream waits only for collectives and copies: its gaps are what is exposed.
  waits, t = [], 0.0
  for i in kernels:
    if i.start_us > t:
      waits.append((t * scale, (i.start_us - t) * scale))
    t = max(t, i.end_us)
  if p.step_us > t:
    waits.append((t * scale, (p.step_us - t) * scale))
  lanes = ["compute", "collectives"] + (["host copies"] if copies else [])
  ax.broken_barh(waits, (-0.5, len(lanes)), facecolors=_EXPOSED, alpha=0.3, linewidth=0)
  ax.set_yticks(range(len(lanes)), lanes, fontsize="small")
  ax.set_ylim(len(lanes) - 0.4, -0.6)
  ax.set_xlim(0, max(p.step_us, 1e-9) * scale)
  ax.set_xlabel(f"predicted time ({unit}), from XLA's cost model")
  ax.set_title(
    title
    or f"{p.module}: {p.step_us * scale:,.3g} {unit}, exposed communication "
    f"{p.exposed_us['total'] * scale:,.3g} {unit} ({100 * p.hidden_fraction:.0f}% hidden)"
    + (
      f", host copies {p.host_us['total'] * scale:,.3g} {unit} "
      f"({p.host_exposed_us['total'] * scale:,.3g} {unit} exposed)"
      if p.host_us
      else ""
    ),
    fontsize="medium",
  )
  if legend:
    handles = [
      Patch(color="navy", label="GEMM"),
      Patch(color="lightsteelblue", label="other kernel"),
    ]
    handles += [
      Patch(color=_KIND_COLOR.get(k, "tab:gray"), label=k)
      for k in dict.fromkeys(i.kind for i in colls)
    ]
    handles += [Patch(color=_COPY_COLOR[k], label=k) for k in dict.fromkeys(i.kind for i in copies)]
    handles.append(Patch(color=_EXPOSED, alpha=0.3, label="exposed (kernels wait)"))
    ax.legend(
      handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False
    )
  return ax


def _as_bytes(row: Any) -> dict[str, float]:
  if isinstance(row, Mapping):
    return {k: float(v) for k, v in row.items()}
  return {k: float(getattr(row, k)) for k in MEMORY_KINDS if hasattr(row, k)}


def plot_memory(
  bars: Mapping[str, Any],
  ax=None,
  *,
  markers: Mapping[str, Mapping[str, float]] | None = None,
  unit: str | int = "MiB",
  title: str | None = None,
  legend: bool = True,
):
  """Draws bytes per device as stacked bars, one per label, with markers on top.

  Args:
    bars: label -> a `MemoryLedger` (stacks `params`, `grads`, `master`, `opt_state`) or
      any `{kind: bytes}` mapping (stacks its entries in order).
    ax: matplotlib axes; None: a new figure.
    markers: name -> {label: bytes}: one marker per bar (e.g. `{"compiled peak": ...,
      "measured": ...}`); labels missing from a marker are skipped.
    unit: "B", "KiB", "MiB", "GiB", or a divisor (e.g. the param count, to plot bytes
      per param).
    title: axes title.
    legend: draw the legend.

  Returns:
    The axes.

  Examples:
    >>> ax = plot_memory({"a": {"params": 2**20, "grads": 2**21}, "b": {"params": 2**20}},
    ...                  markers={"peak": {"a": 2**22}})
    >>> [float(r.get_height()) for r in ax.patches]
    [1.0, 1.0, 2.0, 0.0]
  """
  divisors = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
  if isinstance(unit, str):
    if unit not in divisors:
      raise ValueError(f"plot_memory: unit={unit!r}; use one of {list(divisors)} or a number")
    div, ylabel = divisors[unit], f"{unit} per device"
  else:
    div, ylabel = float(unit), "bytes per device / " + _fmt(unit)
  ax = _axes(ax, (1.6 + 1.1 * len(bars), 3.6))
  rows = {label: _as_bytes(row) for label, row in bars.items()}
  kinds = list(dict.fromkeys(k for row in rows.values() for k in row))
  labels = list(rows)
  xs = range(len(labels))
  bottom = [0.0] * len(labels)
  colors = {
    "params": "tab:blue",
    "grads": "tab:orange",
    "master": "tab:green",
    "opt_state": "tab:red",
  }
  extra = iter(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
  for k in kinds:
    heights = [rows[label].get(k, 0.0) / div for label in labels]
    ax.bar(xs, heights, 0.6, bottom=bottom, label=k, color=colors.get(k) or next(extra, "tab:gray"))
    bottom = [b + h for b, h in zip(bottom, heights)]
  for x, total in zip(xs, bottom):
    ax.text(x, total, f"{total:.3g}", ha="center", va="bottom", fontsize="x-small")
  styles = iter([("k", "_", 28), ("tab:red", "x", 9), ("tab:purple", "o", 6), ("tab:cyan", "^", 7)])
  for name, values in (markers or {}).items():
    color, marker, size = next(styles, ("0.3", "s", 6))
    pts = [(labels.index(label), v / div) for label, v in values.items() if label in rows]
    if pts:
      ax.plot(
        [p[0] for p in pts],
        [p[1] for p in pts],
        linestyle="none",
        marker=marker,
        markersize=size,
        markeredgewidth=2,
        color=color,
        label=name,
      )
  ax.set_xticks(list(xs), labels)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  if legend:
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
  return ax
