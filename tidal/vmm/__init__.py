"""Address-stable residency: device memory released to the driver and restored at the same
addresses, through CUDA virtual memory management (no native code to build)."""

from tidal.vmm.driver import CudaDriver, VmmDriver, VmmUnavailableError, cuda_driver
from tidal.vmm.region import Policy, Region, RegionMove, RegionTag

__all__ = [
    "CudaDriver",
    "Policy",
    "Region",
    "RegionMove",
    "RegionTag",
    "VmmDriver",
    "VmmUnavailableError",
    "cuda_driver",
]
