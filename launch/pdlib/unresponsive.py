"""An engine that does not answer, said the same way by every tool that reads engines.

bench/triage, bench/multiround's automatic triage and `launch/pd probe` read the engines over
HTTP. An engine whose /metrics or /health gets no answer at all (the request timed out, or
nothing accepted the connection) while another part of the stack answers is a finding in
itself: the engine is frozen, overloaded past answering, or gone. An engine that answers with
an error status, or with text that is not Prometheus's format, did answer; that is not this.
"""

from __future__ import annotations

from dataclasses import dataclass

UNRESPONSIVE = "engine unresponsive"
# When no engine answered and the router did not either, the silence points nowhere.
NOTHING_ANSWERED = "nothing in the stack answered, the router included"


def no_answer(path: str, error: str, timeout_s: float) -> str:
    """One endpoint's silence in words: '/metrics: no answer within 10 s'."""
    lowered = error.lower()
    if "timeout" in lowered or "timed out" in lowered:
        why = f"no answer within {timeout_s:g} s"
    elif "refused" in lowered:
        why = "connection refused (nothing listens on the port)"
    else:
        why = f"no answer ({error})" if error else "no answer"
    return f"{path}: {why}"


@dataclass(frozen=True)
class Silent:
    name: str  # the instance, as launch/pd names it: decode, or decode/2 of several
    url: str
    failures: tuple[str, ...]  # no_answer() lines

    def describe(self) -> str:
        return f"{self.name} ({self.url}) did not answer: " + "; ".join(self.failures)


def router_view(worker: dict | None) -> str:
    """How the router's GET /workers lists one engine."""
    if worker is None:
        return "not in its worker list"
    healthy = worker.get("is_healthy")
    state = "healthy" if healthy is True else "unhealthy" if healthy is False else "health unknown"
    return f"listed {state}, status {worker.get('status', '?')}"


def reason(silent: list[Silent], answering: list[str]) -> str:
    """The verdict's 'because': who did not answer, and who did."""
    text = "; ".join(s.describe() for s in silent)
    if answering:
        text += f"; {', '.join(answering)} answered"
    return text
