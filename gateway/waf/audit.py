"""The WAF audit log: one JSON line per request the WAF blocked, would have blocked (mode monitor), or on which a
`monitor` rule fired. Scores below the threshold, tags and redactions stay on the request's span.

Records go to the `portcullis.audit` logger (JSON lines on stderr with everything else; route that logger to a
file or collector to keep it apart). Matched text is never logged whole: a few leading characters and the length.
"""

from __future__ import annotations

import logging
import time

from gateway.waf.engine import CompiledWaf
from gateway.waf.verdict import Verdict

AUDIT_LOGGER = "portcullis.audit"
log = logging.getLogger(AUDIT_LOGGER)


def mask(text: str, keep: int = 3) -> str:
    """'uni…[14 chars]': enough to recognise a payload family, never a secret."""
    text = text.replace("\n", " ")
    if len(text) <= keep:
        return "*" * len(text)
    return f"{text[:keep]}…[{len(text)} chars]"


def record(verdict: Verdict, waf: CompiledWaf, **request: object) -> dict[str, object]:
    return {
        "type": "waf",
        "ts": time.time(),
        "action": verdict.action,
        "policy_version": waf.version,
        "score": verdict.score,
        "threshold": waf.threshold,
        "mode": waf.mode,
        "blocking_rule": verdict.blocking_rule.id if verdict.blocking_rule else None,
        "rules": [
            {
                "id": m.rule.id,
                "severity": m.rule.severity,
                "action": m.rule.action,
                "points": m.points,
                "part": m.hit.part,
                "operator": m.hit.operator,
                "match": mask(m.hit.matched),
            }
            for m in verdict.matches
        ],
        "tags": verdict.tags,
        **request,
    }


def emit(entry: dict[str, object]) -> None:
    # The JSON-lines formatter prints an `access` payload verbatim.
    log.warning("", extra={"access": entry}) if entry["action"] in ("block", "monitor") else log.info(
        "", extra={"access": entry}
    )
