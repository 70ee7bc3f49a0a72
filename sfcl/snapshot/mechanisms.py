"""Steering mechanism names, the parsing of a request's ``steer`` value, and which part of a
request is its document (for CAD's no-document distribution). Torch-free: the request records and
the HTTP layers import it. What the mechanisms do: ``sfcl.snapshot.steering``,
``sfcl.snapshot.grounding``."""

from __future__ import annotations

from sfcl.text import quote

MECHANISMS = ("cad", "knn", "source")  # the order a combination is applied in
DEFAULT_STEER = ("source",)  # what ``steer: true`` means: measured best on the calibration NDAs (docs/fidelity.md)


def parse_steer(value) -> tuple[str, ...]:
    """Normalise a request's ``steer`` value to a tuple of mechanisms in MECHANISMS order.

    Accepts True / False / None, "on" / "off" / "true" / "false", a mechanism name, a
    "+"-joined combination ("source+cad") or a list of names. Raises ValueError naming the
    accepted values for anything else, the empty string included (an empty ``x-sfcl-steer`` header
    is refused, as an empty ``x-sfcl-snapshot`` or ``x-sfcl-tag`` is, rather than read as "off")."""
    if value is None or value is False:
        return ()
    if value is True:
        return DEFAULT_STEER
    if isinstance(value, tuple) and all(v in MECHANISMS for v in value):
        return tuple(m for m in MECHANISMS if m in value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("off", "false", "0", "none"):
            return ()
        if v in ("on", "true", "1"):
            return DEFAULT_STEER
        parts = [p.strip() for p in v.split("+")]
    elif isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        parts = [p.strip().lower() for p in value]
    else:
        parts = None
    if not parts or any(p not in MECHANISMS for p in parts):
        raise ValueError(f"steer: invalid value {quote(value)}; expected true, false, one of "
                         f"{', '.join(repr(m) for m in MECHANISMS)} or a '+' combination such as 'source+cad'")
    return tuple(m for m in MECHANISMS if m in parts)


SHORT_SYSTEM_CHARS = 600  # a system prompt up to this long is an instruction and stays; longer: a document


def no_document_messages(messages: list[dict], system: str | None) -> tuple[list[dict], str | None] | None:
    """The request without its document, for CAD's second distribution.

    Rule: the document is everything but the last paragraph (after the last blank line) of the
    last user message, earlier turns, and a system prompt longer than ``SHORT_SYSTEM_CHARS``
    characters (RAG puts documents there). Returns (messages, system) of the remaining request -
    one user message with the question - or None when nothing would be removed (no document: CAD
    has nothing to contrast)."""
    sys_msgs = [str(m.get("content") or "") for m in messages if m.get("role") == "system"]
    system = "\n".join(([system] if system else []) + sys_msgs) or None
    messages = [m for m in messages if m.get("role") != "system"]
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        return None
    last = str(messages[users[-1]].get("content") or "")
    paras = [p for p in last.replace("\r\n", "\n").split("\n\n") if p.strip()]
    question = paras[-1].strip() if paras else last.strip()
    keep_system = system if system and len(system) <= SHORT_SYSTEM_CHARS else None
    if question == last.strip() and len(messages) == 1 and keep_system == system:
        return None
    return [{"role": "user", "content": question}], keep_system
