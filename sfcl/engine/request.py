"""Request records shared by the scheduler, the engine and the HTTP layer (no torch here)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from sfcl.config import SNAPSHOT_MODES
from sfcl.snapshot.mechanisms import parse_steer

TAG_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")

# Stop sequences per request: the detokenizer (sfcl.engine.detokenizer) checks every one of them,
# and holds back up to the longest one's length, on the engine thread for every generated token,
# so an unbounded list slows every stream in the batch. OpenAI's API allows 4 stops.
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 256


def check_stop(stop: list[str]) -> None:
    """Raises ValueError (its message names no field) unless ``stop`` is at most
    ``MAX_STOP_SEQUENCES`` non-empty strings of at most ``MAX_STOP_CHARS`` characters each."""
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or s == "":
            raise ValueError("stop sequences must be non-empty strings")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop sequence {i} has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings.

    temperature == 0 means greedy (argmax). top_p in (0, 1]. max_tokens >= 1 counts generated
    tokens. stop: strings that end generation; they never appear in the output (``check_stop``).
    Raises ValueError on out-of-range values.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    snapshot_mode: str = "triggered"  # off | triggered | always
    steer: tuple[str, ...] = ()  # steering mechanisms when a trigger fires (sfcl.snapshot.mechanisms.parse_steer:
    # True, "source", "cad", "knn", "source+cad", ... are normalised to a tuple); () observes only
    cad_prompt_ids: list[int] | None = None  # the prompt without its document (cad's second distribution)
    random_trigger: float = 0.0  # evaluation control: a Bernoulli(rate) draw per token replaces the triggers
    tag: str | None = None  # business tag (header x-sfcl-tag, e.g. "high-risk"): metrics label, priority
    ignore_eos: bool = False  # keep generating past end-of-turn tokens up to max_tokens (benchmarks; vLLM's field)

    def __post_init__(self) -> None:
        self.steer = parse_steer(self.steer)  # ValueError "steer: ..." on an unknown value
        if not 0.0 <= float(self.random_trigger) <= 1.0:
            raise ValueError("random_trigger must be in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError("max_tokens must be an integer >= 1")
        if not (0.0 <= float(self.temperature) <= 2.0):
            raise ValueError("temperature must be in [0, 2]")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if self.snapshot_mode not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot mode must be one of {', '.join(SNAPSHOT_MODES)}")
        check_stop(self.stop)
        if self.tag is not None and not TAG_RE.fullmatch(self.tag):
            raise ValueError("tag must be 1-64 characters of letters, digits, '_', '-', '.', ':'")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
