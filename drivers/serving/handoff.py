"""Out-of-band state of a generation handed between replicas (issue 16, mid-stream failover).

A completion or chat request that reaches the reference server through the fleet ingress
(drivers/fleet/ingress.py, via :func:`calexec.drivers.fleet.edge.serve_relayed`) carries, in its
ASGI **scope** (never in a header or the body: an HTTP client cannot set scope keys, so a
direct client of the server has no way to inject any of this):

- :data:`PROGRESS`: a callable the generation loop reports to. It is given dicts that
  ``serve_relayed`` yields as ``{"type": PROGRESS_TYPE, ...}`` messages between the ASGI
  messages, consumed by the ingress and never forwarded to the client:
  ``{"seed", "id", "created", "prompt_tokens"}`` once the request is admitted (before its
  response starts); ``{"tokens": [id]}`` right before the SSE chunk that carries that token
  (the ingress counts the tokens as the client's once it forwarded that chunk); ``{"final":
  True}`` right before the chunk that ends the stream (last chunk, usage and ``[DONE]`` in
  one message); ``{"error": code, "retryable", "cause"}`` right before a stream's SSE error
  event; ``{"handoff": "drained"}`` when a draining replica ends the stream at a token
  boundary for a sibling. A request of several choices (``n`` > 1, a prompt list) reports
  ``{"seed", "id", "created", "prompt_tokens", "choices": count}`` once admitted and
  ``{"events": [k]}`` right before each SSE event of its choice ``k`` (not the usage chunk
  or ``[DONE]``, which follow ``{"final": True}`` in one message).
- :data:`RESUME`: what a sibling continues from (:class:`Resume`): the tokens the client
  already has text for, the sampling seed, the completion id and ``created``, whether a chat
  stream's opening chunk went out, and the time left until the request's deadline. The
  sibling re-prefills prompt + tokens (the same path as an in-process resume,
  drivers/serving/resume.py), rebuilds the detokenizer and stop-string state from the tokens
  and sends only what the client has not seen. A request of several choices is not
  re-prefilled (its ``tokens`` are empty): the sibling runs every choice again from its
  start with the same seed, id and ``created`` (each choice draws what it drew before: the
  same tokens, the same events) and sends, of choice ``k``, only the events after the first
  ``choices[k]`` (those the client has).
- :data:`HANDOFF`: a callable, True while a sibling that serves is known; a draining replica
  hands streams off at a token boundary only then (else it finishes them within its grace).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

#: scope keys (set only by drivers/fleet/edge.serve_relayed)
PROGRESS = "calexec.progress"
RESUME = "calexec.resume"
HANDOFF = "calexec.handoff"
#: the ``type`` of the progress messages on a relay stream
PROGRESS_TYPE = "calexec.progress"
#: most tokens a resume may carry (a request's max_tokens is far below it)
MAX_RESUME_TOKENS = 1 << 20


class ResumeError(ValueError):
    """A resume state that cannot be used: ``field`` names the bad field."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"resume.{field}={value!r:.80}: {why}")
        self.field = field


@attrs.frozen
class Resume:
    """Where a handed-over generation continues (see the module docstring)."""

    tokens: tuple[int, ...] = ()
    seed: int | None = None
    id: str | None = None
    created: int | None = None
    opened: bool = False
    timeout: float | None = None
    #: a request of several choices: the SSE events of each choice the client has
    choices: tuple[int, ...] = ()

    @classmethod
    def parse(cls, raw: Any) -> Resume:
        """The resume state in ``raw`` (a dict), or :class:`ResumeError` naming the field."""
        if not isinstance(raw, dict):
            raise ResumeError("", raw, "must be a dict")
        unknown = set(raw) - {f.name for f in attrs.fields(cls)}
        if unknown:
            first = min(unknown)
            raise ResumeError(first, raw[first], "unknown field")
        tokens = raw.get("tokens", ())
        if not isinstance(tokens, (list, tuple)) or len(tokens) > MAX_RESUME_TOKENS or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise ResumeError("tokens", tokens, "must be a list of token ids >= 0")
        seed = raw.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ResumeError("seed", seed, "must be an integer or null")
        for name in ("id",):
            if raw.get(name) is not None and not isinstance(raw[name], str):
                raise ResumeError(name, raw[name], "must be a string or null")
        created = raw.get("created")
        if created is not None and (not isinstance(created, int) or isinstance(created, bool)):
            raise ResumeError("created", created, "must be an integer or null")
        if not isinstance(raw.get("opened", False), bool):
            raise ResumeError("opened", raw["opened"], "must be a boolean")
        timeout = raw.get("timeout")
        if timeout is not None and not (isinstance(timeout, (int, float))
                                        and not isinstance(timeout, bool)
                                        and math.isfinite(timeout) and timeout > 0):
            raise ResumeError("timeout", timeout, "must be a number > 0 or null")
        choices = raw.get("choices", ())
        if not isinstance(choices, (list, tuple)) or len(choices) > MAX_RESUME_TOKENS or not all(
                isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in choices):
            raise ResumeError("choices", choices, "must be a list of event counts >= 0")
        return cls(tuple(tokens), seed, raw.get("id"), created, raw.get("opened", False),
                   None if timeout is None else float(timeout), tuple(choices))

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "seed": self.seed, "id": self.id,
                "created": self.created, "opened": self.opened, "timeout": self.timeout,
                "choices": list(self.choices)}
