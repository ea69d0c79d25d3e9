"""Where every gradient lives: buffers, buckets, shards and padding, from shapes alone.

`make_layout` computes the static layout a train step uses (a frozen, hashable `Layout` of
`BufferLayout`s cut into `Bucket`s of `ParamSpec`s, and a `Leaf` record of every leaf;
`print(layout.summary())` shows it); `ravel` / `unravel` turn a param tree into one flat
array per buffer and back. A training loop never needs these: they are for reading what
`jaxdp.init_state` builds, as notebook 01 does.
"""

from jaxdp._src.buffer import ravel as ravel
from jaxdp._src.buffer import unravel as unravel
from jaxdp._src.layout import Bucket as Bucket
from jaxdp._src.layout import BufferLayout as BufferLayout
from jaxdp._src.layout import Layout as Layout
from jaxdp._src.layout import Leaf as Leaf
from jaxdp._src.layout import ParamSpec as ParamSpec
from jaxdp._src.layout import default_bucket_size as default_bucket_size
from jaxdp._src.layout import make_layout as make_layout

__all__ = [
  "Bucket",
  "BufferLayout",
  "Layout",
  "Leaf",
  "ParamSpec",
  "default_bucket_size",
  "make_layout",
  "ravel",
  "unravel",
]
