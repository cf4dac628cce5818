"""Fixed glibc malloc thresholds for a training process.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with a fresh mapping, unmapped
when freed, and returns the free top of its heap to the kernel once it exceeds
``M_TRIM_THRESHOLD``; by default both thresholds adapt to the process's history. A training step
allocates and frees buffers of the same sizes every step (gradients, activations: about a
megabyte each for ``peer bench train``'s MLP), and the adaptive thresholds keep handing some of
them back to the kernel and faulting them in again: 30 to 100 page faults per step there, a
number that changes from run to run with the order of earlier frees. With two or more threads
each unmapping also interrupts the other cores (a TLB shootdown), which cost 4 to 13% of a
2-thread step on a 2-vCPU virtual machine, and nothing measurable with one thread.

Fixed thresholds keep that memory in the heap: no page faults in steady state, the same speed in
every run. The cost is up to ``trim_threshold_bytes`` of freed memory staying resident, on top
of the peak the process reached anyway. GPU tensors do not come from malloc and are unaffected.
"""

from __future__ import annotations

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)
# glibc's own ceiling for the adaptive mmap threshold on 64-bit systems
STEADY_MMAP_THRESHOLD_BYTES = 32 * 2**20
STEADY_TRIM_THRESHOLD_BYTES = 64 * 2**20
# the parameter numbers of mallopt, from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_allocator(
    *,
    mmap_threshold_bytes: int = STEADY_MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = STEADY_TRIM_THRESHOLD_BYTES,
) -> bool:
    """Fix this process's malloc thresholds (call it before the model is built).

    Returns:
        Whether they were set: False where the C library is not glibc (macOS, musl, Windows).
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    done = libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes) == 1
    done = libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes) == 1 and done
    if not done:
        logger.warning("mallopt refused the malloc thresholds; the allocator adapts as usual")
    return done
