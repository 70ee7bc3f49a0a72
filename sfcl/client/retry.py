"""Retry policy on snapshots, and the results of ``create_message``.

``RetryPolicy(max_entropy=3.8, min_confidence=0.9, max_retries=1)`` asks for a regeneration
(a new request) whenever a snapshot has ``context_entropy > max_entropy`` **and**
``confidence < min_confidence``. The seed design's reading of the two numbers:

* ``context_entropy < 2.1`` bits with ``confidence > 0.93``: *stable* (``classify`` ->
  ``"stable"``);
* ``context_entropy > 3.8`` bits: regenerate even at a confidence of 0.89 (``"regenerate"``);
* anything else: ``"ok"`` (no action).

Mind the scale (see ``sfcl.client.events``): with the default 32-unit window the entropy is at most
5 bits, and varied prose reaches 4-5 bits once the window is full, while SFCL's confidences are
usually 0.05-0.4 (README, "Confidence") -- so with the default thresholds most long answers
are regenerated once. Tune both numbers to your deployment.

Regenerations send the same request again, with ``temperature = retry_temperature`` when that is
set (with greedy decoding, temperature 0, a regeneration gives the same text), and on the chat
route, when the request has a ``seed``, ``seed + n`` for regeneration ``n`` (the messages route has
no seed field). ``abort_early`` stops reading an attempt at its first violation when a
retry remains (the server then aborts that generation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sfcl.client.events import Error, Event, Snapshot, Stop, TextDelta

__all__ = ["RetryPolicy", "Attempt", "MessageResult"]


@dataclass(frozen=True)
class RetryPolicy:
    max_entropy: float = 3.8
    min_confidence: float = 0.9
    max_retries: int = 1
    retry_temperature: float | None = None
    abort_early: bool = False
    stable_entropy: float = 2.1
    stable_confidence: float = 0.93

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")

    def violates(self, snap: Snapshot) -> bool:
        """True when ``snap`` calls for a regeneration (entropy high and confidence low)."""
        conf = snap.confidence if snap.confidence is not None else 0.0
        return snap.context_entropy > self.max_entropy and conf < self.min_confidence

    def classify(self, snap: Snapshot) -> str:
        """``"regenerate"`` (violates), ``"stable"`` (low entropy, high confidence) or ``"ok"``."""
        if self.violates(snap):
            return "regenerate"
        conf = snap.confidence if snap.confidence is not None else 0.0
        if snap.context_entropy < self.stable_entropy and conf > self.stable_confidence:
            return "stable"
        return "ok"


@dataclass
class Attempt:
    """One request's outcome. ``aborted``: stopped early by the policy (``abort_early``), in which
    case ``stop_reason`` is None and the text is partial. ``violations``: the snapshots that
    violated the policy (empty without a policy)."""

    text: str = ""
    stop_reason: str | None = None
    usage: dict = field(default_factory=dict)
    snapshots: list[Snapshot] = field(default_factory=list, repr=False)
    snapshots_summary: dict | None = None
    stop_sequence: str | None = None
    error: Error | None = None
    violations: list[Snapshot] = field(default_factory=list, repr=False)
    temperature: float | None = None
    seed: int | None = None
    aborted: bool = False

    def add(self, ev: Event) -> None:
        if isinstance(ev, TextDelta):
            self.text += ev.text
        elif isinstance(ev, Snapshot):
            self.snapshots.append(ev)
        elif isinstance(ev, Stop):
            self.stop_reason, self.usage = ev.stop_reason, dict(ev.usage)
            self.snapshots_summary, self.stop_sequence = ev.snapshots_summary, ev.stop_sequence
        elif isinstance(ev, Error):
            self.error = ev


@dataclass
class MessageResult(Attempt):
    """The returned (last) attempt's fields, plus every attempt in order (``attempts[-1]`` is the
    returned one). ``policy_ok``: the returned attempt has no violation (True without a policy)."""

    attempts: list[Attempt] = field(default_factory=list, repr=False)
    policy_ok: bool = True

    @property
    def regenerated(self) -> bool:
        return len(self.attempts) > 1

    @classmethod
    def from_attempts(cls, attempts: list[Attempt]) -> "MessageResult":
        last = attempts[-1]
        fields = {k: getattr(last, k) for k in Attempt.__dataclass_fields__}
        return cls(**fields, attempts=list(attempts), policy_ok=not last.violations)
