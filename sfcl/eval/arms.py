"""Evaluation arms (snapshot mode x steering mechanism) and running them through the engine.

An arm is ``off``, ``triggered`` or ``always`` (observe-only), ``<mode>+<mechanisms>`` (for example
``triggered+source``, ``always+cad``, ``triggered+source+cad``; mechanisms as in
``sfcl.snapshot.mechanisms``), or ``random+<mechanisms>``: random triggers - one Bernoulli draw per
token at the rate ``triggered`` fired on the same documents (``SamplingParams.random_trigger``) -
with that steering, the control that shows whether the triggers pick the right tokens.
``best`` stands for the default mechanism (``DEFAULT_STEER``).

``run_arms`` answers every item under every arm greedily through the real engine, in one stream
ordered by document, all arms' requests about a document next to each other (full batches; the
prefix cache serves the document to every arm, and the next document's requests fill the batch
while the previous one's last answers finish); random arms run in a second pass, once the rate
they must match is known.
``time_arms`` measures each arm's decode speed on its own (arms that share batches share their
steps): a few rounds, one batch per arm per round, in an order rotated per round so that load
changes on a shared machine spread over the arms. Torch-free; the engine is any
``AsyncEngine``-like object (``sfcl.server.testing.FakeEngine`` in tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from tqdm.auto import tqdm

from sfcl.eval.drive import Item, Record, TokenRecorder, run_items
from sfcl.snapshot.mechanisms import DEFAULT_STEER, MECHANISMS, parse_steer

DEFAULT_ARMS = ("off,always,triggered+source,triggered+cad,triggered+knn,triggered+source+cad,"
                "always+source,always+cad,always+knn,random+best")


@dataclass(frozen=True, slots=True)
class Arm:
    name: str  # as given, with "best" spelled out
    mode: str  # off | triggered | always
    steer: tuple[str, ...]  # mechanisms (MECHANISMS order); () observes only
    random: bool = False  # random triggers at the matched rate instead of the triggers

    @property
    def mechanism(self) -> str:
        return "+".join(self.steer)


def parse_arms(text: str) -> list[Arm]:
    """"off,triggered+source,random+best" -> arms. Raises ValueError naming a bad arm."""
    arms = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        mode, _, mech = name.partition("+")
        if mode not in ("off", "triggered", "always", "random"):
            raise ValueError(f"arm {name!r}: mode must be off, triggered, always or random")
        steer = DEFAULT_STEER if mech == "best" else parse_steer(mech.split("+")) if mech else ()
        if mode == "off" and steer:
            raise ValueError(f"arm {name!r}: steering needs snapshots")
        if mode == "random" and not steer:
            raise ValueError(f"arm {name!r}: a random arm names its steering (random+source, random+best)")
        label = mode + ("+" + "+".join(steer) if steer else "")
        arms.append(Arm(label, "triggered" if mode == "random" else mode, steer, mode == "random"))
    names = [a.name for a in arms]
    if not arms or len(set(names)) != len(names):
        raise ValueError(f"--arms must name distinct arms, got {text!r} (mechanisms: {', '.join(MECHANISMS)})")
    return arms


def by_document(items: list[Item]) -> list[list[Item]]:
    """Consecutive items of one document, in order."""
    groups: list[list[Item]] = []
    for it in items:
        if groups and groups[-1][0].meta["question"].doc_id == it.meta["question"].doc_id:
            groups[-1].append(it)
        else:
            groups.append([it])
    return groups


def _interleave(groups: list[list]) -> list:
    """[[a1, a2], [b1, b2]] -> [a1, b1, a2, b2]: the engine's batches mix the arms."""
    out = []
    for k in range(max((len(g) for g in groups), default=0)):
        out.extend(g[k] for g in groups if k < len(g))
    return out


def run_arms(eng, items: list[Item], arms: list[Arm], matched_rate, max_in_flight: int = 32,
             record: bool = True) -> dict[str, list[Record]]:
    """Answer every item under every arm. One stream of requests in document order, every arm's
    requests about a document next to each other (interleaved), at most ``max_in_flight`` at a
    time, so the engine's batches stay full and the prefix cache serves the document to all of
    them; random arms run afterwards, once ``matched_rate(records
    so far)`` can say what rate they must match. record: keep every token's ids, signals and
    trigger inputs (``TokenRecorder``; needs a real engine). Decode speed is measured apart
    (``time_arms``): arms that share batches share their steps. Returns records per arm, in
    item order."""
    from sfcl.eval.drive import run_requests

    recs: dict[str, list[Record]] = {a.name: [] for a in arms}
    runner = getattr(getattr(eng, "engine", None), "runner", None)
    rec = TokenRecorder(runner) if record and runner is not None else None
    bar = tqdm(total=len(items) * len(arms), desc="eval", unit="req")
    try:
        if rec is not None:
            rec.__enter__()
        for phase in (False, True):
            todo = [a for a in arms if a.random == phase]
            if not todo:
                continue
            rate = matched_rate(recs) if phase else 0.0
            # one stream in document order: the next document's requests join while the last
            # answers of the previous one finish, so batches stay full (its prefix is computed
            # once and restored for the rest: sfcl.engine.scheduler)
            jobs = [j for grp in (by_document(items) if not phase else [items])
                    for j in _interleave([[(a, it) for it in grp] for a in todo])]
            bar.set_postfix_str("random arms" if phase else f"{len(by_document(items))} documents")
            got = run_requests(eng, [(it, a.mode, a.steer, rate if a.random else 0.0) for a, it in jobs],
                               max_in_flight=max_in_flight, on_done=lambda: bar.update(1))
            if rec is not None:
                rec.fill(got)
            for a in todo:
                recs[a.name].extend(r for (a_, _), r in zip(jobs, got) if a_ is a)
    finally:
        bar.close()
        if rec is not None:
            rec.__exit__(None, None, None)
    return recs


def time_arms(eng, items: list[Item], arms: list[Arm], rate: float, rounds: int = 3,
              max_in_flight: int = 16) -> dict[str, list[float]]:
    """Decode tokens/s of each arm on its own: ``rounds`` rounds, in each every arm answers
    ``items`` (one batch of ``max_in_flight`` streams) in an order rotated per round. Returns the
    per-round decode tokens/s per arm (tokens after the first / time after the first token, summed
    over the batch's requests). A discarded first pass warms the shapes."""
    out: dict[str, list[float]] = {a.name: [] for a in arms}
    run_items(eng, items, snapshot_mode="off", max_in_flight=max_in_flight, progress=False)
    bar = tqdm(total=rounds * len(arms), desc="eval: decode speed", unit="batch")
    try:
        for r in range(rounds):
            k = r % len(arms)
            for a in arms[k:] + arms[:k]:
                rs, _ = run_items(eng, items, snapshot_mode=a.mode, steer=a.steer, max_in_flight=max_in_flight,
                                  progress=False, random_trigger=rate if a.random else 0.0)
                toks = sum(max(0, x.completion_tokens - 1) for x in rs)
                secs = sum(x.decode_s for x in rs)
                out[a.name].append(toks / secs if secs > 0 else float("nan"))
                bar.update(1)
    finally:
        bar.close()
    return out
