"""Compressors: how one bucket is reduced across a mesh axis, one family per module.

``_base`` (the :class:`Compressor` interface), ``staged`` (the staged codec: its stages,
written once, and the in-program transport), ``exact`` (:class:`NoCompression`), ``onebit``
(its wire and stage arithmetic in ``signs``), ``quantize``, ``cast``, ``powersgd``, ``topk``,
``sparseloco`` (its chunking and wire codes in ``chunks``).
Public names are exported from :mod:`jaxcomm`.
"""

from jaxcomm.compressors._base import Compressor as Compressor
from jaxcomm.compressors._base import mean_leaves as mean_leaves
from jaxcomm.compressors._base import mean_or_fallback as mean_or_fallback
from jaxcomm.compressors.cast import Cast as Cast
from jaxcomm.compressors.exact import ExactCodec as ExactCodec
from jaxcomm.compressors.exact import NoCompression as NoCompression
from jaxcomm.compressors.onebit import OneBit as OneBit
from jaxcomm.compressors.onebit import OneBitScatterState as OneBitScatterState
from jaxcomm.compressors.onebit import OneBitState as OneBitState
from jaxcomm.compressors.powersgd import PowerSGD as PowerSGD
from jaxcomm.compressors.powersgd import PowerSGDState as PowerSGDState
from jaxcomm.compressors.quantize import Quantize as Quantize
from jaxcomm.compressors.quantize import QuantizeScatterState as QuantizeScatterState
from jaxcomm.compressors.quantize import QuantizeState as QuantizeState
from jaxcomm.compressors.quantize import block_layout as block_layout
from jaxcomm.compressors.quantize import pack_int4 as pack_int4
from jaxcomm.compressors.quantize import quantize_blocks as quantize_blocks
from jaxcomm.compressors.quantize import unpack_int4 as unpack_int4
from jaxcomm.compressors.signs import pack_signs as pack_signs
from jaxcomm.compressors.signs import unpack_signs as unpack_signs
from jaxcomm.compressors.sparseloco import SparseLoCo as SparseLoCo
from jaxcomm.compressors.sparseloco import SparseLoCoState as SparseLoCoState
from jaxcomm.compressors.staged import AxisTransport as AxisTransport
from jaxcomm.compressors.staged import StagedCodec as StagedCodec
from jaxcomm.compressors.staged import TwoStageScatterState as TwoStageScatterState
from jaxcomm.compressors.staged import TwoStageState as TwoStageState
from jaxcomm.compressors.staged import finish_stage as finish_stage
from jaxcomm.compressors.staged import guarded_finish as guarded_finish
from jaxcomm.compressors.staged import server_stage as server_stage
from jaxcomm.compressors.staged import worker_stage as worker_stage
from jaxcomm.compressors.topk import TopK as TopK
from jaxcomm.compressors.topk import TopKState as TopKState
