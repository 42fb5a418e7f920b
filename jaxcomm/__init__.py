"""jaxcomm: compressed, coalesced collectives for distributed training in JAX."""

from jaxcomm.backend import CommBackend, CommConfig, ReduceOp
from jaxcomm.collectives import (
    ReduceState,
    ScatterState,
    compressed_all_gather,
    compressed_pmean,
    compressed_pmean_scatter,
    compressed_psum,
    compressed_psum_scatter,
    init_state,
    shard_shapes,
)
from jaxcomm.compressors import (
    Cast,
    Compressor,
    NoCompression,
    OneBit,
    OneBitScatterState,
    OneBitState,
    Quantize,
    QuantizeScatterState,
    QuantizeState,
    TwoStageScatterState,
    TwoStageState,
)
from jaxcomm.distributed import DistributedInfo, init_distributed
from jaxcomm.hlo import CommsReport, comms_report
from jaxcomm.overlap import xla_flags

__version__ = "0.1.0"

__all__ = [
    "CommBackend",
    "CommConfig",
    "ReduceOp",
    "Compressor",
    "NoCompression",
    "OneBit",
    "OneBitScatterState",
    "OneBitState",
    "Quantize",
    "QuantizeScatterState",
    "QuantizeState",
    "Cast",
    "TwoStageScatterState",
    "TwoStageState",
    "DistributedInfo",
    "ReduceState",
    "ScatterState",
    "compressed_all_gather",
    "compressed_pmean",
    "compressed_pmean_scatter",
    "compressed_psum",
    "compressed_psum_scatter",
    "init_distributed",
    "init_state",
    "shard_shapes",
    # tooling
    "CommsReport",
    "comms_report",
    "xla_flags",
]
