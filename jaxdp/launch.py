"""`python -m jaxdp.launch --num-processes P --devices-per-process D -- SCRIPT ARGS...`

Starts P local processes of SCRIPT as one JAX job (CPU devices, gloo collectives on
127.0.0.1); each joins the job with `jaxdp.initialize()`. Output is streamed with a
`[pI]` prefix; if one process fails, the others are stopped and the launcher exits
non-zero naming it. See `jaxdp._src.launch.launch` for the details.
"""

import sys

from jaxdp._src.launch import main

if __name__ == "__main__":
  sys.exit(main())
