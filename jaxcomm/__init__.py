"""jaxcomm: compressed, coalesced collectives for distributed training in JAX."""

from jaxcomm.comm.all_reduce import compressed_pmean, compressed_pmean_or_fallback, compressed_psum
from jaxcomm.comm.backend import CommBackend, CommConfig, ReduceOp
from jaxcomm.comm.hierarchical import (
    hierarchical_pmean,
    hierarchical_psum,
    init_hierarchical_state,
)
from jaxcomm.comm.packed import PackedMean
from jaxcomm.comm.scatter_gather import (
    compressed_all_gather,
    compressed_pmean_scatter,
    compressed_psum_scatter,
    shard_shapes,
)
from jaxcomm.comm.state import ReduceState, ScatterState, init_state, register_per_device_type
from jaxcomm.compressors import (
    Cast,
    Compressor,
    NoCompression,
    OneBit,
    OneBitScatterState,
    OneBitState,
    PowerSGD,
    PowerSGDState,
    Quantize,
    QuantizeScatterState,
    QuantizeState,
    SparseLoCo,
    SparseLoCoState,
    StagedCodec,
    TopK,
    TopKState,
    TwoStageScatterState,
    TwoStageState,
)
from jaxcomm.elastic.diloco import resize_diloco_state
from jaxcomm.elastic.reshard import reshard_train_state, train_state_template
from jaxcomm.elastic.resize import resize_state
from jaxcomm.guard import SkipCounters
from jaxcomm.inspect import CommsReport, comms_report, wire_bytes_by_axes
from jaxcomm.optim.compressed_mean import CompressedMeanState, compressed_mean
from jaxcomm.optim.demo import DemoLocal, DemoState, demo, scale_by_demo
from jaxcomm.optim.diloco import diloco
from jaxcomm.optim.diloco.state import DiLoCoLocal, DiLoCoState, diloco_params
from jaxcomm.optim.onebit_adam import OneBitAdamState, onebit_adam, scale_by_onebit_adam
from jaxcomm.optim.onebit_lamb import OneBitLambState, onebit_lamb, scale_by_onebit_lamb
from jaxcomm.optim.schedule import phase, phase_cond, phase_switch
from jaxcomm.optim.sharded import ShardedState, sharded
from jaxcomm.optim.zero_one_adam import (
    LocalState,
    ZeroOneAdamState,
    scale_by_zero_one_adam,
    zero_one_adam,
)
from jaxcomm.runtime import DistributedInfo, configure_host_allocator, init_distributed, xla_flags
from jaxcomm.runtime.host_allocator import apply_default as _apply_host_allocator_default
from jaxcomm.runtime.host_links import SyncError
from jaxcomm.train.layout import (
    TrainState,
    from_pmap_layout,
    global_view,
    init_opt_state,
    local_view,
    params_of,
    stack_per_device,
    state_partition_specs,
    to_pmap_layout,
    train_state_specs,
)
from jaxcomm.train.phased import PhasedStep
from jaxcomm.train.step import init_train_state, make_pmap_train_step, make_train_step

__version__ = "0.1.0"

# On a CPU backend, glibc keeps XLA:CPU step buffers mapped (opt out: JAXCOMM_HOST_ALLOCATOR=0).
_apply_host_allocator_default()

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
    "StagedCodec",
    "TwoStageScatterState",
    "TwoStageState",
    "PowerSGD",
    "PowerSGDState",
    "TopK",
    "TopKState",
    "SparseLoCo",
    "SparseLoCoState",
    "hierarchical_pmean",
    "hierarchical_psum",
    "init_hierarchical_state",
    "wire_bytes_by_axes",
    "DistributedInfo",
    "PackedMean",
    "ReduceState",
    "ScatterState",
    "compressed_all_gather",
    "compressed_pmean",
    "compressed_pmean_or_fallback",
    "compressed_pmean_scatter",
    "compressed_psum",
    "compressed_psum_scatter",
    "init_distributed",
    "configure_host_allocator",
    "init_state",
    "resize_state",
    "reshard_train_state",
    "train_state_template",
    "shard_shapes",
    # tooling
    "CommsReport",
    "comms_report",
    "xla_flags",
    # optimizers
    "CompressedMeanState",
    "DemoLocal",
    "DemoState",
    "LocalState",
    "OneBitAdamState",
    "OneBitLambState",
    "SkipCounters",
    "ZeroOneAdamState",
    "compressed_mean",
    "demo",
    "onebit_adam",
    "onebit_lamb",
    "scale_by_demo",
    "scale_by_onebit_adam",
    "scale_by_onebit_lamb",
    "scale_by_zero_one_adam",
    "zero_one_adam",
    # data parallel (the per-device registry lives in jaxcomm.comm.state)
    "TrainState",
    "from_pmap_layout",
    "global_view",
    "init_opt_state",
    "init_train_state",
    "local_view",
    "make_pmap_train_step",
    "make_train_step",
    "PhasedStep",
    "phase",
    "phase_cond",
    "phase_switch",
    "params_of",
    "register_per_device_type",
    "stack_per_device",
    "state_partition_specs",
    "to_pmap_layout",
    "train_state_specs",
    # sharded data parallel (ZeRO 1-2)
    "ShardedState",
    "sharded",
    # DiLoCo, Streaming DiLoCo (local steps, compressed outer gradients)
    "DiLoCoLocal",
    "DiLoCoState",
    "diloco",
    "diloco_params",
    "SyncError",
    "resize_diloco_state",
]
