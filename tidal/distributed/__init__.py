"""Work across processes and nodes: ZeRO stages through FSDP2, Ray placement of colocated roles
and CPU workers, and a cross-process GPU lease. Ray is imported only when used (extra
``tidal[ray]``)."""

from tidal.distributed.fsdp import (
    ZERO_STAGES,
    local_state_bytes,
    no_sync,
    reshard,
    shard_model,
    zero_stage_of,
)
from tidal.distributed.lease import (
    GPULease,
    LeaseConfig,
    LeaseError,
    LeaseExpiredError,
    LeaseGrant,
    LeaseServer,
    LeaseTable,
    LeaseTimeoutError,
    LeaseUsageError,
    start_lease_actor,
    timeshare_callbacks,
)
from tidal.distributed.placement import CPUWorker, GPURole, Placement, PlacementError, PlacementSpec, place

__all__ = [
    "ZERO_STAGES",
    "local_state_bytes",
    "no_sync",
    "reshard",
    "shard_model",
    "zero_stage_of",
    "CPUWorker",
    "GPULease",
    "GPURole",
    "LeaseConfig",
    "LeaseError",
    "LeaseExpiredError",
    "LeaseGrant",
    "LeaseServer",
    "LeaseTable",
    "LeaseTimeoutError",
    "LeaseUsageError",
    "Placement",
    "PlacementError",
    "PlacementSpec",
    "place",
    "start_lease_actor",
    "timeshare_callbacks",
]
