"""``megatron-mlp timeline TRACE.json -o FILE.png``: draw a recorded step timeline as lanes.

The trace comes from ``--mlp-offload-trace DIR`` (Megatron) or ``bench update --trace FILE``; the
picture has one lane per tier (per direction where a tier has a read and a write lane), one for
the Adam kernel and its waits, one per copy direction and one for the whole update, for people
without a trace viewer at hand (Perfetto opens the same file).
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_mlp.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-mlp timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", metavar="TRACE.json", help="a trace written by --mlp-offload-trace or bench update --trace")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png", help="the picture (.png, .svg or .pdf)")
    p.add_argument("--title", default="", help="title of the picture (default: the trace's steps)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_mlp.observe.plot import check_plot_target, load_trace, plot_timeline, trace_lanes
    try:
        out = check_plot_target(args.output, "-o")
        doc = load_trace(args.trace, "TRACE.json")
        if not trace_lanes(doc):
            raise ConfigError(f"TRACE.json: {args.trace} holds no complete spans (\"ph\": \"X\") to draw")
        other = doc.get("otherData", {})
        title = args.title or (f"MLP-Offload timeline, steps {other['steps']} ({os.path.basename(args.trace)})"
                               if "steps" in other else "")
        notes: list[str] = []
        plot_timeline(doc, out, title=title, flag="-o", notes=notes)
    except ConfigError as e:
        print(f"megatron-mlp timeline: error: {e}", file=sys.stderr)
        return 2
    print(out)
    for note in notes:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
