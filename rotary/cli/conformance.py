"""``python -m rotary conformance``: run the conformance suite of ``rotary.conformance.cases`` here.

Every case is run on every available backend (or those named with ``--backend``) and compared
with the float64 complex-multiplication oracle; a case passes when
``|y - y_ref| <= atol + rtol * |y_ref|`` everywhere (tolerances from ``rotary.testing``).
Prints one table row per (backend, case) and a summary line. Exit status: 0 when every case
passed on every backend, 1 when any case failed, 2 when a named backend is unavailable here.

``--impl package.module:function`` runs the cases against another implementation instead
(``rotary.conformance.check``, docs/conformance.md): one row per case with its diagnosis; exit status
0 when no applicable case failed, 1 when one did, 2 when the implementation cannot be loaded.
"""

from __future__ import annotations

import argparse
import sys

from ..conformance import cases as _conformance
from ..conformance import kv_cases as _kv_conformance
from ..backends import available_backends, names

HELP = "run the cross-backend conformance suite against float64 oracles"
EPILOG = """examples:
  python -m rotary conformance --quick              # a representative subset on every available backend
  python -m rotary conformance --backend numba      # every case on one backend (exit 1 on a failure, 2 if unavailable)
  python -m rotary conformance --errors             # the bad-input catalogue: each case's error and message
  python -m rotary conformance --impl mypkg.rope:apply_rope --quick      # your f(x, positions, spec) -> y
  python -m rotary conformance --impl transformers.models.gpt_neox.modeling_gpt_neox:apply_rotary_pos_emb --signature hf"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``conformance`` options to ``parser`` (a subparser of ``python -m rotary``)."""
    parser.add_argument("--backend", "-b", action="extend", nargs="+", choices=names(), dest="backends", metavar="B",
                        help=f"backend(s) to test, from {', '.join(names())} (repeatable); default: every available one")
    parser.add_argument("--quick", action="store_true", help="a representative subset of cases (docs/benchmarks.md: its first run compiles Numba's kernels)")
    parser.add_argument("--failures-only", action="store_true", help="print only the failing rows")
    parser.add_argument("--errors", action="store_true",
                        help="run the bad-input catalogue instead (each case's exception and message, or exact value)")
    from ..conformance.adapters import ARRAYS, DTYPES, SIGNATURES

    impl = parser.add_argument_group("another implementation (rotary.conformance.check; docs/conformance.md)")
    impl.add_argument("--impl", metavar="MODULE:FUNCTION",
                      help="run the cases against this RoPE (package.module:function) instead of rotary's backends")
    impl.add_argument("--signature", choices=SIGNATURES, default="plain",
                      help="how --impl is called (default plain: f(x, positions, spec) -> y)")
    impl.add_argument("--arrays", choices=ARRAYS, help="array library of the inputs (default: the signature's)")
    impl.add_argument("--dtypes", default=",".join(DTYPES), metavar="D1,D2",
                      help=f"comma-separated dtypes (default {','.join(DTYPES)})")
    impl.add_argument("--cos-sin", metavar="MODULE:FUNCTION",
                      help="hf / flash_attn: the implementation's own cos/sin instead of rotary's")
    impl.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                      help="case names (fnmatch patterns) --impl does not implement: reported n/a (repeatable)")
    impl.add_argument("--strict", action="store_true", help="exact angles in every case (no float32-angle allowance)")
    impl.add_argument("--plot", metavar="PATH", help="save the error against position (matplotlib) to PATH")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``conformance`` on the subparsers of ``python -m rotary``."""
    parser = subparsers.add_parser("conformance", help=HELP, description=HELP, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run_cli)
    return parser


def format_table(results, failures_only: bool = False) -> str:
    """Rows ``backend | case | max error | tolerance | result | detail`` as aligned text."""
    header = ("backend", "case", "max error", "tolerance", "result", "detail")
    rows = [(r.backend, r.case, f"{r.max_error:.2e}", f"{r.tolerance:.0e}", "pass" if r.passed else "FAIL", r.detail)
            for r in results if not (failures_only and r.passed)]
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header) - 1)]
    lines = []
    for row in [header] + rows:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths)] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_cli(args: argparse.Namespace, stdout=None) -> int:
    """Run the suite for parsed ``args``; print the table and summary; return the exit status."""
    stdout = stdout or sys.stdout
    if getattr(args, "errors", False):
        return run_errors(args, stdout)
    if getattr(args, "impl", None):
        return run_impl(args, stdout)
    avail = available_backends()
    if args.backends:
        requested = list(dict.fromkeys(args.backends))
        missing = [b for b in requested if not avail[b][0]]
        for b in missing:
            print(f"backend {b!r} is unavailable: {avail[b][1]}", file=stdout)
        if missing:
            return 2
    else:
        requested = [b for b, (ok, _) in avail.items() if ok]
        for b, (ok, reason) in avail.items():
            if not ok:
                print(f"skipping backend {b!r}: {reason}", file=stdout)
    results = _conformance.run(requested, quick=args.quick) + _kv_conformance.run(requested, quick=args.quick)
    print(format_table(results, failures_only=args.failures_only), file=stdout)
    failed = [r for r in results if not r.passed]
    per_backend = ", ".join(f"{b} {sum(r.passed for r in results if r.backend == b)}/"
                            f"{sum(r.backend == b for r in results)}" for b in requested)
    verdict = "OK" if not failed else f"{len(failed)} FAILED"
    print(f"conformance ({'quick' if args.quick else 'full'}): {verdict}; cases passed per backend: {per_backend}",
          file=stdout)
    return 1 if failed else 0


def run_impl(args: argparse.Namespace, stdout) -> int:
    """``--impl``: rotary.conformance.check on the named implementation; the report, then exit 0 / 1 / 2."""
    from ..conformance.check import check, load_impl

    try:
        impl = load_impl(args.impl)
        cos_sin = load_impl(args.cos_sin) if args.cos_sin else None
    except (ImportError, AttributeError, ValueError) as exc:
        print(f"cannot load {args.impl!r}: {type(exc).__name__}: {exc}", file=stdout)
        return 2
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    try:
        report = check(impl, signature=args.signature, cases="quick" if args.quick else "full", dtypes=dtypes,
                       report=False, arrays=args.arrays, cos_sin=cos_sin, strict=args.strict, skip=args.skip,
                       name=args.impl)
    except (ImportError, ValueError) as exc:
        print(f"cannot run the check: {exc}", file=stdout)
        return 2
    print(report.format(failures_only=args.failures_only), file=stdout)
    if args.plot:
        report.plot(args.plot)
        print(f"error against position saved to {args.plot}", file=stdout)
    return 0 if report.passed else 1


def run_errors(args: argparse.Namespace, stdout) -> int:
    """``--errors``: one row per bad-input case of ``rotary.conformance.error_cases``; exit 1 if any fails."""
    from ..conformance import error_cases as _error_cases

    results = _error_cases.run()
    width = max(len(r.case) for r in results)
    for r in results:
        if args.failures_only and r.passed:
            continue
        print(f"{r.case.ljust(width)}  {'pass' if r.passed else 'FAIL'}  {r.detail[:160]}", file=stdout)
    failed = sum(not r.passed for r in results)
    print(f"errors catalogue: {'OK' if not failed else f'{failed} FAILED'}; {len(results) - failed}/{len(results)} "
          "cases as required", file=stdout)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rotary conformance", description=HELP, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
