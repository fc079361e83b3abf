"""docs/benchmarks-gpu.md from what `scripts/gpu_check.py` wrote on the GPU machine: the
runs' JSON files (one per attention) merged into one section.

    python scripts/gpu_report.py tir.json flashinfer.json --write docs/benchmarks-gpu.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchdoc import publish


def report(paths: list[Path], write: str | None) -> None:
    """One section from the runs' files, later files' sections replacing earlier ones'."""
    merged: dict[str, dict] = {}
    settings: dict = {}
    for path in paths:
        data = json.loads(path.read_text())
        settings |= data["settings"]
        for name, section in data["sections"].items():
            earlier = merged.get(name)
            if earlier and earlier["ok"] and section["ok"] and isinstance(section["result"], dict):
                section = {**section, "result": {**earlier["result"], **section["result"]}}
            merged[name] = section
    runs = [p.name for p in paths]
    publish(render({"settings": settings, "sections": merged, "runs": runs}), write, "gpu_check")


# HBM bandwidth by GPU, from NVIDIA's data sheets (SXM parts)
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


def render(data: dict) -> str:
    sections = data["sections"]
    ok = {k: v["result"] for k, v in sections.items() if v["ok"]}
    failed = {k: v["error"] for k, v in sections.items() if not v["ok"]}
    m = ok.get("machine", {})
    lines = [
        f"### {m.get('gpu', '?')} ({m.get('nvidia_smi', '')}), {m.get('date', '?')}",
        "",
        f"{m.get('nvcc', '')}; torch {m.get('torch')}, transformers {m.get('transformers')}, "
        f"TVM {m.get('tvm')} (runtime only). Built here by `scripts/gpu_build.sh`, run there by "
        "`python3 scripts/gpu_check.py` (docs/gpu.md; one process per attention, merged: "
        f"{', '.join(data['runs'])}, later files' sections replacing earlier ones'); "
        "the real shapes' weights are seeded.",
        "",
    ]
    lines += _parity_table(ok) + _exactness_table(ok) + _speculation_table(ok)
    lines += _speed_table(ok, m.get("gpu", ""), data["settings"]) + _end_to_end(ok) + _misc(ok)
    if failed:
        lines += ["**Sections that failed:**", ""]
        lines += [f"- {name}: `{error[:300]}`" for name, error in failed.items()]
    return "\n".join(lines).rstrip()


def _table(title: str, head: list[str], rows: list[list[str]]) -> list[str]:
    """A titled markdown table, one column per cell of ``head``, and a blank line after."""
    lines = [title, "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    return [*lines, *("| " + " | ".join(row) + " |" for row in rows), ""]


def _parity_table(ok: dict) -> list[str]:
    runs = _runs(ok, "parity")
    if not runs:
        return []
    first = next(iter(runs.values()))
    checks = [c for c, v in first.items() if not isinstance(v, bool)]
    rows = []
    for name, r in runs.items():
        same = next((v for v in r.values() if isinstance(v, bool)), None)
        cells = [f"{r[c]['rel_err']:.1e} ({r[c]['argmax']:.0%})" for c in checks]
        rows.append([name, *cells, _yes(same)])
    return _table(
        "**Parity with transformers** (float32 reference on the GPU, same weights): max error "
        "/ max |logit|, argmax agreement.",
        ["artifact", *checks, "popn, verify again: same bits"],
        rows,
    )


def _exactness_table(ok: dict) -> list[str]:
    runs = _runs(ok, "exactness")
    if not runs:
        return []
    columns = {  # heading: the run's key
        "verify == decode (bits)": "verify == decode (bits)",
        "same argmax": "argmax equal",
        "batched == alone (bits)": "batched verify == alone (bits)",
        "fewer rows == first rows (bits)": "verify 1, 3 == first rows of verify 5 (bits)",
    }
    rows = [
        [name, f"{r['verify vs decode max|diff|']:.2e}", *(_yes(r[k]) for k in columns.values())]
        for name, r in runs.items()
    ]
    return _table(
        "**Exactness**: 5 verify rows against the decode rows of the same tokens at the same "
        "positions; the same verify beside another sequence in the batch; verifies of 1 and 3 "
        "of the tokens against the first rows of the 5.",
        ["artifact", "max abs diff", *columns],
        rows,
    )


def _speculation_table(ok: dict) -> list[str]:
    runs = _runs(ok, "speculation")
    if not runs:
        return []
    cols = list(next(iter(runs.values())))
    rows = [
        [
            name,
            *(
                f"{_yes(r[c]['identical'])} {r[c].get('num_accepted_tokens', 0)}/"
                f"{r[c].get('num_draft_tokens', 0)}"
                for c in cols
            ),
        ]
        for name, r in runs.items()
    ]
    return _table(
        "**Greedy speculation against plain decoding**, 4 prompts of 4-66 tokens, 40 tokens "
        "each (the model as its own draft; prompt lookup; suffix decoding; the automatic policy "
        "over all three): identical token ids, and accepted / drafted tokens.",
        ["artifact", *cols],
        rows,
    )


def _speed_table(ok: dict, gpu: str, settings: dict) -> list[str]:
    runs = _runs(ok, "speed")
    if not runs:
        return []
    peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in gpu), None)
    first = next(iter(runs.values()))["ms"]
    rows = []
    for name, r in runs.items():
        ms = r["ms"]
        roof = "?"
        if peak:
            share = [
                (r["weight_bytes"] + b * settings["context"] * r["kv_bytes_per_token"])
                / peak
                * 1e3
                / ms[f"decode b{b}"]
                for b in (1, 32)
            ]
            roof = " / ".join(f"{x:.0%}" for x in share)
        ratio = ms["verify K=4"] / ms["decode b1"]
        rows.append([name, *(f"{v:.3g}" for v in ms.values()), roof, f"{ratio:.2f}x"])
    lines = _table(
        f"**Speed**, median ms of {settings['repeats']} after a warm-up, context "
        f"{settings['context']}; float16, or "
        "`gguf`: the GGUF's own 4/8-bit weights. Roofline: the weights and the batch's KV "
        f"read once per step at {peak / 1e12 if peak else '?'} TB/s, as a share of the "
        "measured step; verify K=4 as a multiple of a batch-1 decode step.",
        ["model, attention", *first, "roofline b1 / b32", "K=4 / decode"],
        rows,
    )
    for name in settings["speed_models"]:
        eager = ok.get(f"torch eager {name}")
        if eager:
            cells = ", ".join(f"{k} {v:.3g} ms" for k, v in eager["ms"].items())
            lines.append(f"transformers eager, float16, {name}'s shapes: {cells}.")
    for name, r in runs.items():
        if "host_ms" in r:
            cells = ", ".join(f"{k} {v:.3g} ms" for k, v in r["host_ms"].items())
            lines.append(f"Host work per batch-1 step, {name}: {cells}.")
    host = next(iter(runs.values()))["logits_to_host_ms"]
    lines += [
        "",
        "Logits to the host (float32, SmolLM2's vocabulary): "
        + ", ".join(f"{k} {v:.3g} ms" for k, v in host.items())
        + " per copy.",
        "",
    ]
    return lines


def _end_to_end(ok: dict) -> list[str]:
    r = ok.get("end to end smollm2-flashinfer")
    if not r:
        return []
    plain = r["plain"]["tok_s"]
    cells = ", ".join(f"{k} {v['tok_s']} tok/s ({v['tok_s'] / plain:.2f}x)" for k, v in r.items())
    return [
        "**End to end** (SmolLM2's shapes as their own draft, every draft accepted; one "
        f"request, 256 tokens): {cells}.",
        "",
    ]


def _misc(ok: dict) -> list[str]:
    lines = []
    load = ok.get("load")
    if load:
        cells = ", ".join(
            f"{k} {v['first_s']} s / {v['cached_s']} s" if "first_s" in v else f"{k} {v['error']}"
            for k, v in load.items()
        )
        lines += [f"**Loading** (first, nvcc compiling the TIR kernels / cached): {cells}.", ""]
    for section, title in (
        ("another architecture", "An artifact for sm_100 on this GPU"),
        ("a draft tree", "A draft tree asked of a CUDA artifact"),
    ):
        refused = ok.get(f"bad input: {section}")
        if refused:
            lines += [f"**{title}:** `{refused['error']}`", ""]
    return lines


def _runs(ok: dict, kind: str) -> dict:
    """The sections of one kind of check, by artifact: ``parity tiny-llama-tir`` -> ..."""
    return {k.removeprefix(f"{kind} "): v for k, v in ok.items() if k.startswith(f"{kind} ")}


def _yes(flag: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "?"}[flag]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="what each run wrote")
    parser.add_argument("--write", help="page to write the section into (docs/benchmarks-gpu.md)")
    args = parser.parse_args()
    report(args.results, args.write)


if __name__ == "__main__":
    main()
