"""DiLoCo and Streaming DiLoCo, one module per concept.

``transform`` (:func:`diloco`, the optax transformation), ``state`` (:class:`DiLoCoState`, its
checks and lookups), ``steps`` (the inner step on one device's copy, the outer step at a merge,
the sync schedule), and the background sync: ``background`` (the host driver beside the train
step) and ``programs`` (its device programs: the compressor's stages around host exchanges,
whose TCP links are :mod:`jaxcomm.runtime.host_links`). Public names are exported from
:mod:`jaxcomm`.
"""

from jaxcomm.optim.diloco.state import DiLoCoLocal as DiLoCoLocal
from jaxcomm.optim.diloco.state import DiLoCoState as DiLoCoState
from jaxcomm.optim.diloco.state import diloco_params as diloco_params
from jaxcomm.optim.diloco.transform import diloco as diloco
