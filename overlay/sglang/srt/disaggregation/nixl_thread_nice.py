"""SGLANG_DISAGGREGATION_NIXL_THREAD_NICE: NIXL's own threads at a lower CPU priority.

sglang's NIXL transfer engine creates its agent with NIXL's progress thread on, and NIXL's
Python API starts that thread with no delay between passes, so it polls its UCX workers
without pause: one core per engine, busy or idle. On a GPU host that is what one wants. On a
CPU rehearsal with a few cores (a laptop, CI), both engines' progress threads take cores from
the schedulers that compute, and a DSV4 prefill on two cores took about three times as long
as with those two threads at nice 19 (the threads still run and transfers still complete; they
only give way to the threads that have work).

With the variable set to N (0 to 19), patch 0020 takes a snapshot of this process's threads
before the NIXL agent is created and, once its backend exists, sets the nice value of every
thread started since that is not a Python thread (NIXL's and UCX's native threads) to N, and
logs which. Unset or empty: nothing changes. Any other value stops the engine with an error
naming the variable. Raising a priority (a negative N) is refused: it needs privileges a
rehearsal should not ask for.

Like SGLANG_CPU_SM120_PATH (patch 0016), it is for a CPU engine only (SGLANG_USE_CPU_ENGINE=1,
upstream's `is_cpu`): set on any other engine, where NIXL's busy progress thread is what the
transfers want, it stops the engine with an error naming the variable, rather than renicing
every native thread started while the agent was created.
"""

from __future__ import annotations

import logging
import os
import threading

ENV = "SGLANG_DISAGGREGATION_NIXL_THREAD_NICE"
logger = logging.getLogger(__name__)


def target_nice() -> int | None:
    """The nice value asked for, or None when the variable is unset or empty."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    try:
        nice = int(value)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"{ENV}={value!r}: expected an integer from 0 to 19, or unset")
    if not _cpu_engine():
        raise ValueError(
            f"{ENV}={value!r} is for a CPU engine (SGLANG_USE_CPU_ENGINE=1, --device cpu); on a "
            "GPU host NIXL's busy progress thread is what the transfers want: unset it"
        )
    return nice


def _cpu_engine() -> bool:
    """The test patch 0016 applies: upstream's is_cpu (SGLANG_USE_CPU_ENGINE=1 on a CPU host)."""
    from sglang.srt.utils import is_cpu

    return is_cpu()


def _native_threads() -> set[int]:
    """This process's thread ids that are not Python threads."""
    tids = {int(t) for t in os.listdir("/proc/self/task")}
    return tids - {t.native_id for t in threading.enumerate()}


def snapshot() -> set[int] | None:
    """Threads before the agent exists (None when the variable is unset: nothing to do)."""
    if target_nice() is None:
        return None
    return _native_threads()


def lower_started_since(before: set[int] | None) -> list[int]:
    """Set the nice value of the native threads started since `before`; return their ids."""
    nice = target_nice()
    if before is None or nice is None:
        return []
    started = sorted(_native_threads() - before)
    lowered = []
    for tid in started:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # ended in the meantime
            continue
        lowered.append(tid)
    logger.info(
        "%s=%d: %d NIXL native thread(s) at nice %d (thread ids %s)",
        ENV,
        nice,
        len(lowered),
        nice,
        ", ".join(map(str, lowered)) or "none",
    )
    return lowered
