"""Work across processes and nodes: DDP's gradient buckets freed between steps, ZeRO stages through FSDP2, DeepSpeed engines as timeshare
roles, Ray placement of colocated roles and CPU workers, and a cross-process GPU lease. Ray and
DeepSpeed are imported only when used (extras ``tidal[ray]``, ``tidal[deepspeed]``)."""

from tidal.distributed.ddp import GradientBuckets
from tidal.distributed.deepspeed import (  # deepspeed itself is imported on first use
    DeepSpeedOffload,
    add_deepspeed_role,
    deepspeed_state_bytes,
    describe_deepspeed_state,
)
from tidal.distributed.fsdp import (
    ZERO_STAGES,
    gathered,
    gathered_bytes,
    hooks_off_while_gathered,
    local_state_bytes,
    no_sync,
    reshard,
    reshard_after_no_grad_forward,
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
from tidal.distributed.placement import (
    CPUWorker,
    GPURole,
    Placement,
    PlacementError,
    PlacementSpec,
    place,
)

__all__ = [
    "ZERO_STAGES",
    "CPUWorker",
    "DeepSpeedOffload",
    "GPULease",
    "GradientBuckets",
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
    "add_deepspeed_role",
    "deepspeed_state_bytes",
    "describe_deepspeed_state",
    "gathered",
    "gathered_bytes",
    "hooks_off_while_gathered",
    "local_state_bytes",
    "no_sync",
    "place",
    "reshard",
    "reshard_after_no_grad_forward",
    "shard_model",
    "start_lease_actor",
    "timeshare_callbacks",
    "zero_stage_of",
]
