"""The evaluation commands: ``sfcl eval``, ``sfcl stress`` and ``sfcl anchors calibrate``. Each
``cmd_*`` turns the parsed flags into the domain's config record (``sfcl.eval.run.EvalConfig``,
``sfcl.eval.stress.StressConfig``, ``sfcl.eval.calibrate.CalibrateConfig``; all extend
``sfcl.eval.drive.EngineSpec``, the model + library + batch flags they share) and calls it."""

from __future__ import annotations

import argparse
from dataclasses import fields

from sfcl.cli.flags import FMT, add_model_flags
from sfcl.eval import calibrate, run, stress
from sfcl.eval.arms import DEFAULT_ARMS
from sfcl.snapshot.calibration import DEFAULT_TARGET


def add_engine_flags(p: argparse.ArgumentParser, with_anchors: bool = True) -> None:
    """Model (+ library) + batch flags shared by the evaluation commands."""
    add_model_flags(p)
    if with_anchors:
        p.add_argument("--anchors", default=None,
                       help="anchor library directory (default: the one built from the bundled sample corpus)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="largest decode batch (KV slots)")
    p.add_argument("--max-model-len", type=int, default=8192, help="context window cap in tokens")
    p.add_argument("--steer-lambda-max", type=float, default=0.5,
                   help="kNN-LM interpolation weight at snapshot confidence 1 for the knn arms")
    p.add_argument("--weight-quant", default="none", choices=["auto", "none", "fp16", "int8", "int4"],
                   help="weight format of the linear layers (see `sfcl serve --help`). Default none: `auto` picks "
                        "kernels by batch size (int4 for 1-32 rows on AVX2), so an item's greedy text would change "
                        "with how many other arms share its batch, and arms would differ for a reason that is not "
                        "the arm")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: eager decode instead of captured graphs (the lookback-ratio trigger reads attention "
                        "weights that the graphs do not return)")
    p.add_argument("--no-shared-prefix-attention", action="store_true",
                   help="decode each row's attention over its own KV even where rows share the document's "
                        "prefix-cache blocks (default: read once per group; for measuring what that saves)")


def add_eval_parser(sub) -> None:
    """``sfcl eval`` on the top-level subparsers."""
    p = sub.add_parser("eval", help="fidelity evaluation on ContractNLI NDAs: detection of unsupported entities and "
                                    "grounded steering per snapshot mode and mechanism", **FMT)
    p.add_argument("--data", nargs="+", default=[run.DEFAULT_DATA], help="ContractNLI .json (or any corpus read_corpus reads)")
    p.add_argument("--docs", default="0-30", help="documents to evaluate: indexes into the corpus, e.g. 0-30 or 0,4,9-12")
    p.add_argument("--calibrate-on", default="31-60",
                   help="documents to calibrate the triggers and train the lookback model on first (none: use the "
                        "library's calibration as it is)")
    p.add_argument("--target-rate", type=float, default=DEFAULT_TARGET, help="share of tokens the triggers should fire on")
    p.add_argument("--questions-per-doc", type=int, default=15, help="questions per document at most (plus one summary)")
    p.add_argument("--no-summary", action="store_true", help="skip the per-document summarisation task")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens at most per answer")
    p.add_argument("--summary-tokens", type=int, default=64, help="generated tokens at most per summary")
    p.add_argument("--max-doc-tokens", type=int, default=1500,
                   help="document tokens per prompt: the first N; questions are generated from that excerpt")
    p.add_argument("--arms", default=DEFAULT_ARMS,
                   help="comma-separated arms: off, triggered, always, MODE+MECHANISMS (triggered+source, always+cad, "
                        "triggered+source+cad, ...), random+MECHANISMS (random triggers at triggered's rate); "
                        "best = the default mechanism")
    p.add_argument("--speed-rounds", type=int, default=3,
                   help="rounds of the decode-speed measurement (each arm alone, one batch of --max-num-seqs "
                        "questions per round; 0: skip)")
    p.add_argument("--seed", type=int, default=0, help="question selection and bootstrap seed")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap replicates for the 95%% CIs")
    p.add_argument("--out", default="eval-out", help="output directory (eval.md, eval.json, eval.png, library/)")
    add_engine_flags(p)
    p.set_defaults(fn=cmd_eval)


def add_stress_parser(sub) -> None:
    """``sfcl stress`` on the top-level subparsers."""
    p = sub.add_parser("stress", help="anchor stress test: entity blanks, numeric jumps, mixed citations", **FMT)
    p.add_argument("--url", default=None, help="run against this server (default: in-process engine)")
    p.add_argument("--api-key", default=None, help="API key for --url")
    p.add_argument("--data", nargs="+", default=[run.DEFAULT_DATA], help="documents to build the prompts from")
    p.add_argument("--docs", type=int, default=8, help="use the first N documents (one prompt per family each)")
    p.add_argument("--max-tokens", type=int, default=96, help="generated tokens at most per prompt")
    p.add_argument("--excerpt-chars", type=int, default=1500, help="document characters shown with each prompt")
    p.add_argument("--band", default=f"{stress.SEED_BAND[0]},{stress.SEED_BAND[1]}", help="healthy band LO,HI (the seed: 1.8,2.2 per minute)")
    p.add_argument("--band-metric", default="per_minute", choices=["per_minute", "per_1k_tokens"],
                   help="which trigger rate the band applies to")
    p.add_argument("--strict", action="store_true", help="exit 1 when the overall rate is outside the band")
    p.add_argument("--steer", action="store_true", help="request the default steering (in-process mode)")
    p.add_argument("--seed", type=int, default=0, help="prompt generation seed")
    p.add_argument("--out", default=None, help="directory for stress.json and stress.md")
    add_engine_flags(p)
    p.set_defaults(fn=cmd_stress)


def add_calibrate_parser(asub) -> None:
    """``sfcl anchors calibrate`` on the ``anchors`` subparsers."""
    p = asub.add_parser("calibrate", help="train the lookback model and set trigger thresholds for a target share "
                                          "of triggering tokens", **FMT)
    p.add_argument("library", help="anchor library directory to calibrate (left unchanged)")
    p.add_argument("corpus", nargs="+", help="documents to generate questions from (ContractNLI .json, .txt, ...)")
    p.add_argument("--out", required=True, help="new library directory (copy of LIBRARY with the thresholds)")
    p.add_argument("--target-rate", type=float, default=DEFAULT_TARGET,
                   help="share of generated tokens that should trigger a lookup (1/16: the source design's ratio)")
    p.add_argument("--docs", type=int, default=8, help="use the first N documents of the corpus")
    p.add_argument("--questions-per-doc", type=int, default=4, help="questions per document (plus one summary)")
    p.add_argument("--max-tokens", type=int, default=96, help="generated tokens at most per answer")
    p.add_argument("--max-doc-tokens", type=int, default=6000, help="document tokens at most per prompt")
    p.add_argument("--sweep", default="0.015625,0.03125,0.0625,0.125,0.25",
                   help="target shares for the trade-off curve (empty: no sweep)")
    p.add_argument("--sweep-items", type=int, default=12, help="answers per sweep point")
    p.add_argument("--seed", type=int, default=0, help="question selection and bootstrap seed")
    add_engine_flags(p, with_anchors=False)
    p.set_defaults(fn=cmd_calibrate)


def _config(cls, a: argparse.Namespace, **given):
    """``cls`` (a dataclass whose fields are flag destinations) from the parsed flags ``a``;
    ``given`` fields are set directly."""
    return cls(**{f.name: getattr(a, f.name) for f in fields(cls) if f.name not in given}, **given)


def cmd_eval(a: argparse.Namespace) -> int:
    return run.run_eval(_config(run.EvalConfig, a))


def cmd_stress(a: argparse.Namespace) -> int:
    return stress.run_stress(_config(stress.StressConfig, a))


def cmd_calibrate(a: argparse.Namespace) -> int:
    return calibrate.run_calibrate(_config(calibrate.CalibrateConfig, a, anchors=a.library))
