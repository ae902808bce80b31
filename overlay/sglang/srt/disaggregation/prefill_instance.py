"""Which prefill process answers at a bootstrap address: an id per process, so that decode can
tell a restarted prefill from the one its rooms were sent to.

sglang 0.5.23 gives a prefill no identity. Decode's heartbeat asks the bootstrap server's
`/health` every SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL seconds and declares the prefill lost
after SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE misses in a row; any 200 resets the count.
The bootstrap server answers 200 from a new process before its model loads, so a restart
that keeps the port closed for less than about two intervals is never a loss, and a room the
old process was sent stays held by decode waiting for an ABORT_ACK that the new process
cannot give (it never knew the room).

Here every response of the bootstrap server carries INSTANCE_HEADER, a random id made when
that server starts. Decode records the id from the `/route` answer that gave it the address's
parallel info (what it sends every room's metadata with), and its heartbeat compares each
200's id with it: a different id means the process its rooms went to has exited, and the
heartbeat handles it as it handles a lost prefill (`_handle_node_failure`: the address's
cached connection info dropped, its rooms failed, the quarantine told). A prefill that serves
no id (an unpatched build) is judged by the heartbeat alone, as upstream does.

Why a changed id proves the old process gone: the id lives in the HTTP process that hosts the
bootstrap server; a new id at the same host and port means another process bound that port,
which the old one held until it exited. Its schedulers (the NIXL senders) die with it:
sglang's subprocesses are killed when their parent dies. Rooms decode sent metadata to after
the change went to the old process's cached ranks (which no longer exist) or, once the info is
fetched again, to the new one, which then owns them.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

logger = logging.getLogger(__name__)

INSTANCE_HEADER = "X-SM120PD-Prefill-Instance"
# On a decode-mode CommonKVManager: bootstrap address -> the id its parallel info came from.
KNOWN_ATTR = "sm120pd_prefill_instance"
# On a decode-mode CommonKVManager: addresses whose heartbeat saw another id since.
RESTARTED_ATTR = "sm120pd_prefill_restarted"


def serve_instance_id(app: Any) -> str:
    """Every response of the bootstrap server `app` (aiohttp) names this process's id."""
    instance = uuid.uuid4().hex

    async def name_instance(request, response) -> None:
        response.headers[INSTANCE_HEADER] = instance

    app.on_response_prepare.append(name_instance)
    return instance


def note_route_answer(kv_mgr: Any, bootstrap_addr: str, response: Any) -> None:
    """Decode fetched the address's parallel info: its rooms go to the process that answered."""
    known = getattr(kv_mgr, KNOWN_ATTR, None)
    if known is None:
        known = {}
        setattr(kv_mgr, KNOWN_ATTR, known)
    known[bootstrap_addr] = response.headers.get(INSTANCE_HEADER)


def same_process(kv_mgr: Any, bootstrap_addr: str, response: Any) -> bool:
    """Whether a `/route` answer for one of the address's ranks came from the process its
    parallel info came from. If not, the prefill restarted in between: the answer is not used
    (the room fails before any metadata leaves decode), and the next heartbeat handles the
    address as a lost prefill."""
    if _changed(kv_mgr, bootstrap_addr, response) is None:
        return True
    _flag(kv_mgr, bootstrap_addr)
    return False


def restarted(kv_mgr: Any, bootstrap_addr: str, response: Any) -> bool:
    """Whether a heartbeat's 200 from `bootstrap_addr` came from another process than the one
    decode's rooms were sent to (or a rank's `/route` answer already showed that). The caller
    then handles the address as a lost prefill."""
    if _changed(kv_mgr, bootstrap_addr, response) is not None:
        _flag(kv_mgr, bootstrap_addr)
    return bootstrap_addr in getattr(kv_mgr, RESTARTED_ATTR, ())


def take_restarted(kv_mgr: Any, bootstrap_addr: str) -> bool:
    """Whether the loss being handled for `bootstrap_addr` is a restart (seen by its id)."""
    flagged = getattr(kv_mgr, RESTARTED_ATTR, set())
    if bootstrap_addr in flagged:
        flagged.discard(bootstrap_addr)
        return True
    return False


def _changed(kv_mgr: Any, bootstrap_addr: str, response: Any) -> str | None:
    """The id that answered, where it is not the known one (None when they match, or when
    either is unknown)."""
    was = getattr(kv_mgr, KNOWN_ATTR, {}).get(bootstrap_addr)
    now = response.headers.get(INSTANCE_HEADER)
    if was is None or now is None or now == was:
        return None
    logger.warning(
        "Prefill at %s restarted (instance %s, was %s): the rooms sent to the old process are "
        "failed and their KV released, as for a lost prefill",
        bootstrap_addr,
        now,
        was,
    )
    return now


def _flag(kv_mgr: Any, bootstrap_addr: str) -> None:
    flagged = getattr(kv_mgr, RESTARTED_ATTR, None)
    if flagged is None:
        flagged = set()
        setattr(kv_mgr, RESTARTED_ATTR, flagged)
    flagged.add(bootstrap_addr)
