"""What a compiled program communicates: collectives and bytes on the wire, from its HLO.

``hlo`` (the one counter: every collective of compiled HLO text, its payload, device groups
and wire bytes under the ring/pairwise model; which entry parameters each depends on),
``comms_report`` (:func:`comms_report`: what the program asked for against what XLA compiled,
widened payloads flagged) and ``measure`` (:func:`wire_bytes_by_axes`: bytes split by the mesh
axes crossed; :func:`mean_wire_bytes`: bytes of one compressed mean of a tree). Measure bytes
with these, never estimate them.
"""

from jaxcomm.inspect.comms_report import CommsReport as CommsReport
from jaxcomm.inspect.comms_report import CommsRow as CommsRow
from jaxcomm.inspect.comms_report import comms_report as comms_report
from jaxcomm.inspect.comms_report import report_from_hlo as report_from_hlo
from jaxcomm.inspect.comms_report import requested_collectives as requested_collectives
from jaxcomm.inspect.hlo import DTYPE_BYTES as DTYPE_BYTES
from jaxcomm.inspect.hlo import CollectiveOp as CollectiveOp
from jaxcomm.inspect.hlo import collective_dependencies as collective_dependencies
from jaxcomm.inspect.hlo import collectives_in_hlo as collectives_in_hlo
from jaxcomm.inspect.hlo import compiled_text as compiled_text
from jaxcomm.inspect.hlo import num_devices as num_devices
from jaxcomm.inspect.hlo import replica_groups as replica_groups
from jaxcomm.inspect.hlo import wire_bytes as wire_bytes
from jaxcomm.inspect.measure import mean_wire_bytes as mean_wire_bytes
from jaxcomm.inspect.measure import wire_bytes_by_axes as wire_bytes_by_axes
