"""Write docs/configuration.md: every ``sfcl`` subcommand's flags, read from the argparse parsers.

    python scripts/gen_config_reference.py            # rewrites docs/configuration.md
    python scripts/gen_config_reference.py --check    # exit 1 when the file is out of date

The page is generated, never edited by hand: ``sfcl.cli.build_parser()`` is walked recursively
(``sfcl anchors build`` and the other nested subcommands included) and each command gets a table of
flag, default and help text, in the order the parser defines them. The environment variables SFCL
reads come after; ``ENV_VARS`` below lists them (found with ``grep -rn "os.environ" sfcl``).
``tests/test_docs.py`` fails when a flag is missing from the committed page.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "configuration.md"

# (name, read by, meaning). Keep in step with `grep -rn "os.environ" sfcl`.
ENV_VARS = (
    ("SFCL_API_KEY", "`sfcl serve` (server and Ray Serve ingress)",
     "API key required as `x-api-key` or `Authorization: Bearer` when `--api-key` is not given."),
    ("SFCL_CACHE_DIR", "`sfcl.config.default_cache_dir`",
     "Cache of converted weights and built anchor libraries (default `~/.cache/sfcl`); "
     "`--cache-dir` overrides it."),
    ("SFCL_DECODE_KERNEL", "`sfcl.model.decode_kernel.load`",
     "`0`: never build or load SFCL's native CPU kernels (decode attention and layers, as `--attention-kernel "
     "torch`; the int8 GEMV, torch's instead; the anchor search's IVF pass, in torch operators)."),
    ("SFCL_INT4_KERNEL", "`sfcl.model.quant.int4_kernel`",
     "Which GEMV int4 weights run on: `auto` (default; SFCL's int4 x int8 kernel where SFCL's kernels load, "
     "except where torch runs AVX-512 code on a CPU with AMX: torch's there), `sfcl`, or `torch` (any case; "
     "another value stops `sfcl serve` before the model loads)."),
    ("SFCL_INT8_KERNEL", "`sfcl.model.quant.int8_kernel`",
     "Which GEMV int8 weights (the default formats' `lm_head`) run on: `auto` (default; `q8`, SFCL's int8 x "
     "int8 kernel on activations quantised per block of 32, by `SFCL_INT4_KERNEL`'s `auto` rule, else `bf16`), "
     "`q8`, or `bf16` (bf16 activations; SFCL's int8 GEMV once its kernels load, else torch's). Read as "
     "`SFCL_INT4_KERNEL` is."),
    ("SFCL_KERNEL_CACHE", "`sfcl.model.decode_kernel.cache_root`",
     "Where the kernel is compiled and cached (default `<cache dir>/kernels`, one folder per source, "
     "flags, torch version and CPU-flags hash)."),
    ("SFCL_KERNEL_MARCH", "`sfcl.model.decode_kernel` (its `CFLAGS`)",
     "The `-march=` the kernels are compiled for (default `native`, this CPU's every instruction; e.g. "
     "`x86-64-v3` for a library that also runs on AVX2-only x86 CPUs, or `haswell` to time the AVX2 code "
     "paths on an AVX-512 CPU). Part of the build's name, so each value builds its own."),
    ("SFCL_DATA_DIR", "`sfcl.config.contractnli_path` (bench long-document workload, `sfcl eval`, scripts, tests)",
     "Folder holding `contractnli/dev.json`; default: `../shared/data` beside the checkout."),
    ("SFCL_LLAMA_SERVER", "`sfcl llama-server`, `sfcl bench --systems ...,llama-server`",
     "Path of a llama.cpp `llama-server` binary to use instead of finding or building one."),
    ("SFCL_MALLOC_TUNING", "`sfcl serve` (`sfcl.engine.host_memory`)",
     "`0` keeps glibc's malloc thresholds; otherwise the mmap threshold is fixed at 32 MiB and the "
     "trim threshold at 1 GiB."),
    ("GOMP_SPINCOUNT", "GNU OpenMP (torch's intra-op threads); `sfcl` sets it to 10000 unless set "
     "(`sfcl.engine.openmp_env`)",
     "Spins of an idle OpenMP worker before it sleeps. 10,000 keeps a server usable when other processes "
     "share its cores (libgomp's default 300,000 gave ~1 s gaps between tokens there) without waking a "
     "sleeping worker at every parallel region (1,000 spins cost one stream 15-45% on an idle Intel Xeon); "
     "300000 can be a little faster on a machine that runs nothing else. Programs `sfcl bench` starts "
     "(llama-server) get the value the user had."),
    ("SFCL_GC_FREEZE", "`sfcl serve`, Ray Serve replicas (`sfcl.engine.host_memory`)",
     "`0` leaves Python's garbage collector as it is; otherwise the objects alive once the server has "
     "loaded are frozen (`gc.freeze`), so no later collection walks them."),
    ("SFCL_TEST_CACHE", "tests",
     "Cache of the test suite's converted weights and built libraries (default `<repo>/.cache/test`)."),
    ("SFCL_FUZZ_EXAMPLES", "`tests/test_fuzz_openapi.py`", "Schemathesis cases per operation."),
    ("SFCL_DASHBOARD_PNG", "`tests/test_dashboard.py`", "Where to write the dashboard screenshot."),
)


def _cell(text: object) -> str:
    """One markdown table cell: no newlines, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    text = argparse.HelpFormatter(parser.prog)._expand_help(action)  # %(default)s etc. as --help
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        text = (text.rstrip(". ") + ". " if text else "") + "Choices: " + ", ".join(f"`{c}`" for c in action.choices) + "."
    return text


def _default(action: argparse.Action) -> str:
    if action.option_strings == [] or action.default in (None, argparse.SUPPRESS):
        return ""
    if action.nargs == 0 and isinstance(action.default, bool):  # store_true / store_false
        return "not given"
    return f"`{action.default}`"


def commands(parser: argparse.ArgumentParser, prefix: str = "sfcl"):
    """Yield (command, parser, help) for every leaf and group under ``parser``, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {ch.dest: ch.help or "" for ch in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub, helps.get(name, "")
                yield from commands(sub, f"{prefix} {name}")


def flags(parser: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """(flag, default, help) rows of one parser, without -h and subcommand dispatch."""
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.help == argparse.SUPPRESS:
            continue
        name = ", ".join(action.option_strings) or action.dest.upper()
        if action.option_strings and action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            name += " " + (" ".join(metavar) if isinstance(metavar, tuple) else metavar)
        rows.append((name, _default(action), _help(parser, action)))
    return rows


def render() -> str:
    from sfcl.cli import build_parser

    out = ["# Configuration reference", "",
           "Generated from the command-line parsers by `python scripts/gen_config_reference.py`; "
           "do not edit by hand. `sfcl COMMAND --help` prints the same.", ""]
    for name, parser, help_text in commands(build_parser()):
        rows = flags(parser)
        out += [f"## `{name}`", ""]
        if help_text:
            out += [_cell(help_text), ""]
        if not rows:
            out += ["Subcommands only (below).", ""]
            continue
        out += ["| flag | default | help |", "|---|---|---|"]
        out += [f"| `{_cell(f)}` | {_cell(d)} | {_cell(h)} |" for f, d, h in rows]
        out.append("")
    out += ["## Environment variables", "", "| variable | read by | meaning |", "|---|---|---|"]
    out += [f"| `{n}` | {_cell(r)} | {_cell(m)} |" for n, r, m in ENV_VARS]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date: run python scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
