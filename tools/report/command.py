"""``attnstore report``: the tables of docs/RESULTS.md and the plots, from the eval harness's JSON files.

Reads every ``attnstore.eval/1`` file under ``--runs`` (one per ``attnstore eval
logs|sts|sst2|mmlu`` run; other JSON files are skipped) and the ``attnstore eval
oracle`` files named by ``--oracle``, writes two PNG plots per eval run and
rewrites the generated blocks of the results file: the lines between ``<!-- report:NAME -->`` and
``<!-- /report:NAME -->``. Prose outside the markers is kept byte for byte. A
block whose markers are missing is appended at the end under a heading, with
its markers, so the first run creates them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from attnstore.errors import ConfigError
from attnstore_tools.arguments import documented_parser
from attnstore_tools.report.oracle_tables import oracle_blocks
from attnstore_tools.report.plots import write_plots
from attnstore_tools.report.runs import KIND, load_runs
from attnstore_tools.report.tables import Block, run_block, splice_blocks, summary_block


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` subcommand."""
    parser = documented_parser(
        subparsers, "report", __doc__,
        summary="write the tables of docs/RESULTS.md and the plots from the eval runs' JSON files",
    )
    parser.add_argument("--runs", type=Path, default=Path("runs/eval"),
                        help="folder searched for the eval runs' JSON files (default: runs/eval)")
    parser.add_argument("--oracle", type=Path, nargs="*", default=[], metavar="JSON",
                        help="attnstore eval oracle files, one block oracle-NAMESPACE each (default: none)")
    parser.add_argument("--results", type=Path, default=Path("docs/RESULTS.md"),
                        help="results file whose generated blocks are rewritten (default: docs/RESULTS.md)")
    parser.add_argument("--plots", type=Path, default=Path("docs/plots"),
                        help="folder for the PNG plots (default: docs/plots)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the plots and the results file's blocks; print what was written; returns 0.

    Raises:
        ConfigError: neither an eval run file under ``--runs`` nor an ``--oracle`` file, an invalid one,
            or broken markers in the results file.
    """
    runs = load_runs(args.runs)
    oracles = oracle_blocks(args.oracle)
    if not runs and not oracles:
        raise ConfigError(f"no {KIND} files under {args.runs} and no --oracle file:"
                          " run attnstore eval logs|sts|sst2|mmlu --json first")
    plots = write_plots(runs, args.plots)
    blocks = [Block("summary", "Summary", summary_block(runs))] if runs else []
    blocks += [Block(r.name, r.title, run_block(r, plots[r.name], args.results.parent)) for r in runs]
    blocks += oracles
    text = args.results.read_bytes().decode("utf-8") if args.results.exists() else ""
    spliced = splice_blocks(text, blocks, args.results)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    staged = args.results.with_name(args.results.name + ".tmp")
    staged.write_bytes(spliced.text.encode("utf-8"))
    os.replace(staged, args.results)  # a crash mid-write never loses the hand-written prose
    print(f"{args.results}: replaced {', '.join(spliced.replaced) or 'no block'};"
          f" appended {', '.join(spliced.appended) or 'no block'}")
    if spliced.stale:
        print(f"{args.results}: left alone {', '.join(spliced.stale)} (no run file)")
    for plot in (p for r in runs for p in plots[r.name]):
        print(f"plot {plot.path}" if plot.skipped is None else f"plot skipped: {plot.path.name} ({plot.skipped})")
    return 0
