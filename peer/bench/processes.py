"""The processes a benchmark starts: the memory of their process trees, stopping their groups."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil

# Seconds a peer gets to leave the swarm after SIGTERM before it is killed.
STOP_GRACE_S = 20.0
# Seconds between two samples of the peers' resident memory (RSS: cheap to read).
MEMORY_SAMPLE_S = 1.0
# PSS is read less often, from a few seconds after the peers start (past their imports):
# reading it walks the process's page tables (smaps_rollup), and a read every second slowed
# a 2-thread peer on 2 cores by about 2.5%.
PSS_FIRST_S = 5.0
PSS_SAMPLE_S = 10.0


def tree_memory_bytes(process: psutil.Process, *, pss: bool = True) -> tuple[int, int]:
    """Resident and proportional (PSS) bytes of ``process`` and all its descendants.

    RSS counts the pages forked processes share once per process; PSS splits each shared page
    among its sharers, so the PSS of a process tree is what it really occupies. Processes that
    are gone, or whose PSS cannot be read, count 0 (PSS falls back to RSS). ``pss=False`` reads
    RSS alone (cheap; the PSS returned is 0): PSS walks the process's page tables.
    """
    rss = proportional = 0
    try:
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0, 0
    for member in members:
        try:
            info = member.memory_full_info() if pss else member.memory_info()
        except psutil.Error:
            continue
        rss += info.rss
        proportional += getattr(info, "pss", info.rss) if pss else 0
    return rss, proportional


async def sample_memory(processes: list, peaks: list[list[int]]) -> None:
    """Each peer's process tree (hivemind's processes and p2pd included): the peak RSS, read
    every ``MEMORY_SAMPLE_S``, and the peak PSS, read every ``PSS_SAMPLE_S`` from
    ``PSS_FIRST_S`` on, go into ``peaks``."""
    trees = [psutil.Process(p.pid) for p in processes]
    start_s = time.monotonic()
    next_pss_s = start_s + PSS_FIRST_S
    while True:
        with_pss = time.monotonic() >= next_pss_s
        if with_pss:
            next_pss_s += PSS_SAMPLE_S
        for tree, peak in zip(trees, peaks, strict=True):
            rss, pss = await asyncio.to_thread(tree_memory_bytes, tree, pss=with_pss)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
        await asyncio.sleep(MEMORY_SAMPLE_S)


async def stop_process_group(process: asyncio.subprocess.Process) -> None:
    """Stop ``process`` (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) and whatever it left
    behind in its process group (hivemind's forked processes and p2pd daemons)."""
    if process.returncode is None:
        try:  # a stopped process handles SIGTERM only once continued
            os.killpg(process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        process.terminate()
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is empty: everything exited
