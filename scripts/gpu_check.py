"""The CUDA path on a lent GPU: parity with transformers, exactness of verify rows, speed.

Two halves (docs/gpu.md): ``run`` on the GPU machine, over the artifacts built here into
``.gpu/`` (weights of the real models' shapes regenerated there from a seed), once per
attention, each writing what it finds to a JSON file section by section, so that a run cut
short still reports; ``report`` here, laying the files out in docs/benchmarks-gpu.md.

    # on the GPU machine
    python scripts/gpu_check.py run --attention tir --out $OUT/tir.json
    python scripts/gpu_check.py run --attention flashinfer --out $OUT/flashinfer.json
    # here
    python scripts/gpu_check.py report tir.json flashinfer.json --write docs/benchmarks-gpu.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPEATS = 20
CONTEXT = 128  # tokens already in the cache when decode and verify are timed
# Real models' shapes (weights from a seed there); decode at these batch sizes.
SPEED_MODELS = ("smollm2", "qwen1.5b")
# float16 with either attention, and the GGUF's own 4/8-bit weights with FlashInfer's
SPEED_VARIANTS = ("flashinfer", "tir", "gguf-flashinfer")
BATCHES = (1, 8, 32)
VERIFY_K = (2, 4, 8)
PREFILL = 512


class Results:
    """What the run found, rewritten to ``path`` after each section."""

    def __init__(self, path: Path):
        self.path, self.data = path, {"sections": {}}
        self.t0 = time.perf_counter()

    def section(self, name: str, fn: Callable[[], Any]) -> None:
        start = time.perf_counter()
        print(f"[{start - self.t0:6.1f}s] {name} ...", flush=True)
        try:
            self.data["sections"][name] = {"ok": True, "result": fn()}
        except Exception as err:  # noqa: BLE001 - a failed section is a finding, not a stop
            traceback.print_exc()
            self.data["sections"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        self.data["sections"][name]["seconds"] = round(time.perf_counter() - start, 1)
        print(f"  -> {json.dumps(self.data['sections'][name])[:2000]}", flush=True)
        self.path.write_text(json.dumps(self.data, indent=1))


# ---- on the GPU machine ----------------------------------------------------------------------
def run(
    artifacts: Path, out: Path, device: str, attention: str | None, names: list[str] | None
) -> None:
    """Every check whose artifacts load; ``attention``: only artifacts with that attention
    (one process per kind: a failing kernel can leave the CUDA context unusable for the rest of
    the process). ``device`` cpu: a rehearsal here, over CPU artifacts of the same names."""
    import numpy as np
    import torch
    import transformers
    import tvm

    from mlc_spec.runtime.llm import LLM
    from mlc_spec.runtime.model import Model
    from mlc_spec.runtime.params import SamplingParams

    results = Results(out)
    if device == "cuda":
        from mlc_spec.runtime.cuda_kernels import cuda_device

        cuda_device("")  # loads TVM's CUDA runtime
    dev = tvm.device(device)
    on_gpu = device == "cuda"
    models: dict[str, Model] = {}

    def section(name: str, fn: Callable[[], Any], *needs: str) -> None:
        """Run ``fn`` as section ``name`` where the artifacts it ``needs`` loaded."""
        if all(n in models for n in needs):
            results.section(name, fn)

    def sync() -> None:
        dev.sync()

    def median_ms(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(times), 3)

    def cache(model: Model, batch: int = 8, total: int = 8192):
        """Room for ``total`` tokens, all of which one prefill may bring."""
        return model.create_kv_cache(
            max_batch_size=batch, max_total_len=total, prefill_chunk_size=total
        )

    def machine() -> dict:
        smi = (
            shutil.which("nvidia-smi")
            and subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.max.memory",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
        nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
        return {
            "gpu": torch.cuda.get_device_name() if on_gpu else "cpu",
            "nvidia_smi": smi or "",
            "compute_version": dev.compute_version,
            "nvcc": nvcc.strip().splitlines()[-1],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tvm": tvm.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }

    results.section("machine", machine)

    # Weights: the tiny artifacts share one set per model and dtype; the real shapes get theirs
    # from a seed (too big to carry). Speed does not depend on their values.
    def seeded(artifact: Path) -> None:
        import safetensors.numpy

        config = json.loads((artifact / "mlc-spec-config.json").read_text())
        gen = torch.Generator(device).manual_seed(0)
        weights = {}
        for p in config["params"]:
            shape, dtype = p["shape"], np.dtype(p["dtype"])
            if dtype.kind == "u":  # a quantized weight's packed codes
                bits = torch.randint(0, 2**31, shape, generator=gen, device=device)
                weights[p["name"]] = bits.cpu().numpy().astype(dtype)
            elif p["name"].endswith("norm.weight"):
                weights[p["name"]] = np.ones(shape, dtype)
            else:  # float weights, and quantized ones' scales and offsets
                w = torch.randn(shape, generator=gen, device=device) * 0.02
                weights[p["name"]] = w.to(getattr(torch, p["dtype"])).cpu().numpy()
        safetensors.numpy.save_file(weights, str(artifact / "params.safetensors"))

    def selected(name: str) -> bool:
        config = json.loads((artifacts / name / "mlc-spec-config.json").read_text())
        return (not attention or config["attention"] == attention) and (not names or name in names)

    chosen = sorted(
        p.name for p in artifacts.iterdir() if (p / "model.so").exists() and selected(p.name)
    )

    def weights() -> dict:
        """The tiny artifacts share one set (cast for bfloat16); each real shape's float16
        artifacts share a seeded set, its GGUF one has its own."""
        import safetensors.torch

        tiny = artifacts / "tiny-llama-tir" / "params.safetensors"
        for name in chosen:
            target = artifacts / name / "params.safetensors"
            if target.exists():
                continue
            if name == "tiny-llama-tir-bf16":
                cast = {
                    k: v.to(torch.bfloat16)
                    for k, v in safetensors.torch.load_file(str(tiny)).items()
                }
                safetensors.torch.save_file(cast, str(target))
            elif name.startswith("tiny-"):
                shutil.copy(tiny, target)
            elif "-gguf-" in name:
                seeded(target.parent)
            else:
                float16 = artifacts / f"{name.split('-')[0]}-tir" / "params.safetensors"
                if not float16.exists():
                    seeded(float16.parent)
                if float16 != target:
                    shutil.copy(float16, target)
        return {"artifacts": chosen}

    results.section("weights", weights)

    def load_times() -> dict:
        """First load compiles the TIR kernels with nvcc (runtime/cuda_kernels.py); the second
        reads them from the disk cache."""

        def loaded(path: Path) -> tuple[Model, float]:
            t0 = time.perf_counter()
            model = Model(path)
            kv = cache(model, 1, 64)
            kv.add_sequence(0)
            model.prefill(kv, [0], [[1, 2, 3]])  # the kernels may compile at their first call
            sync()
            return model, round(time.perf_counter() - t0, 1)

        times = {}
        for name in chosen:
            try:
                models[name], first = loaded(artifacts / name)
                times[name] = {"first_s": first, "cached_s": loaded(artifacts / name)[1]}
            except Exception as err:  # noqa: BLE001 - the other artifacts still load
                times[name] = {"error": f"{type(err).__name__}: {err}"[:1000]}
        return times

    results.section("load", load_times)

    def hf_reference(name: str, dtype: torch.dtype = torch.float32):
        hf = transformers.AutoModelForCausalLM.from_pretrained(artifacts / name, dtype=dtype)
        hf = hf.to(device).eval()

        def logits(tokens) -> np.ndarray:
            with torch.no_grad():
                ids = torch.tensor(np.asarray(tokens)[None]).to(device)
                return hf(ids).logits[0].float().cpu().numpy()

        return hf, logits

    def compare(ours: np.ndarray, ref: np.ndarray) -> dict:
        err = float(np.abs(ours - ref).max() / np.abs(ref).max())
        return {
            "rel_err": float(f"{err:.2e}"),
            "argmax": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
        }

    def parity(artifact: str, hf_dir: str) -> Callable[[], dict]:
        def check() -> dict:
            model = models[artifact]
            hf, ref_logits = hf_reference(hf_dir)
            vocab = hf.config.vocab_size
            rng = np.random.default_rng(1)
            seq = rng.integers(3, vocab, 48)
            ref = ref_logits(seq)
            out = {}
            kv = cache(model)
            kv.add_sequence(0)
            out["transformers float16"] = compare(hf_reference(hf_dir, torch.float16)[1](seq), ref)
            out["prefill 30"] = compare(model.prefill(kv, [0], [seq[:30]]).numpy(), ref[29:30])
            decodes = np.stack([model.decode(kv, [0], [t]).numpy()[0] for t in seq[30:38]])
            out["decode x8 (page boundary at 32)"] = compare(decodes, ref[30:38])
            verify = model.evaluate_multi_query(kv, [0], [seq[38:]]).numpy()
            out["verify 10"] = compare(verify, ref[38:])
            kv.popn(0, 10)
            again = model.evaluate_multi_query(kv, [0], [seq[38:]]).numpy()
            out["popn 10 then verify again: same bits"] = bool(np.array_equal(again, verify))
            ragged = [rng.integers(3, vocab, n) for n in (5, 17, 33, 70)]
            kv = cache(model)
            ids = list(range(len(ragged)))
            for i in ids:
                kv.add_sequence(i)
            last = model.prefill(kv, ids, [s[:-1] for s in ragged]).numpy()
            step = model.decode(kv, ids, [int(s[-1]) for s in ragged]).numpy()
            refs = [ref_logits(s) for s in ragged]
            out["ragged prefill x4"] = compare(last, np.stack([r[-2] for r in refs]))
            out["batched decode x4"] = compare(step, np.stack([r[-1] for r in refs]))
            return out

        return check

    for artifact, hf_dir in (
        ("tiny-llama-flashinfer", "tiny-llama-hf"),
        ("tiny-llama-tir", "tiny-llama-hf"),
        ("tiny-llama-tir-bf16", "tiny-llama-hf"),
        ("tiny-qwen2-tir", "tiny-qwen2-hf"),
    ):
        section(f"parity {artifact}", parity(artifact, hf_dir), artifact)

    def exactness(artifact: str) -> Callable[[], dict]:
        """A verify row against the decode row of the same token at the same position, and
        against the same rows verified in a batch beside other sequences."""

        def check() -> dict:
            model = models[artifact]
            vocab = model.model_config["vocab_size"]
            rng = np.random.default_rng(2)
            prompt, new = rng.integers(3, vocab, 40), rng.integers(3, vocab, 5)
            kv = cache(model)
            kv.add_sequence(0)
            model.prefill(kv, [0], [prompt])
            decoded = np.stack([model.decode(kv, [0], [t]).numpy()[0] for t in new])
            kv.popn(0, len(new))
            verified = model.evaluate_multi_query(kv, [0], [new]).numpy()
            kv.popn(0, len(new))
            kv.add_sequence(1)
            model.prefill(kv, [1], [rng.integers(3, vocab, 23)])
            beside = model.evaluate_multi_query(kv, [1, 0], [new[:3], new]).numpy()[3:]
            kv.popn(0, len(new))
            kv.popn(1, 3)
            fewer = []  # a verify of fewer tokens: the same first rows?
            for n in (1, 3):
                fewer.append(model.evaluate_multi_query(kv, [0], [new[:n]]).numpy())
                kv.popn(0, n)
            return {
                "verify 1, 3 == first rows of verify 5 (bits)": all(
                    np.array_equal(f, verified[: len(f)]) for f in fewer
                ),
                "verify vs decode max|diff|": float(np.abs(verified - decoded).max()),
                "verify == decode (bits)": bool(np.array_equal(verified, decoded)),
                "argmax equal": bool((verified.argmax(-1) == decoded.argmax(-1)).all()),
                "batched verify == alone (bits)": bool(np.array_equal(beside, verified)),
            }

        return check

    for artifact in (
        "tiny-llama-flashinfer",
        "tiny-llama-tir",
        "smollm2-flashinfer",
        "smollm2-tir",
    ):
        section(f"exactness {artifact}", exactness(artifact), artifact)

    def speculation(artifact: str) -> Callable[[], dict]:
        """Greedy speculative output against plain decoding, token for token, on a batch of
        prompts of mixed lengths: the model as its own draft, and prompt lookup, k = 1..5."""

        def check() -> dict:
            path = artifacts / artifact
            vocab = models[artifact].model_config["vocab_size"]
            rng = np.random.default_rng(3)
            prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in (4, 19, 37, 66)]
            prompts[1] = prompts[1] * 3  # something for prompt lookup to find
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

            def tokens(llm) -> list[list[int]]:
                return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

            plain = tokens(LLM(path, speculative={"method": "ngram", "num_speculative_tokens": 0}))
            out = {}
            for method in ("draft", "ngram"):
                draft = path if method == "draft" else None
                for k in range(1, 6):
                    llm = LLM(path, draft, {"method": method, "num_speculative_tokens": k})
                    same = tokens(llm) == plain
                    out[f"{method} k={k}"] = {"identical": same, **_short(llm.metrics())}
            return out

        return check

    for artifact in ("tiny-llama-flashinfer", "tiny-llama-tir"):
        section(f"speculation {artifact}", speculation(artifact), artifact)

    def speed(name: str) -> Callable[[], dict]:
        def check() -> dict:
            model = models[name]
            m = model.model_config
            tokens = np.random.default_rng(4).integers(3, m["vocab_size"], PREFILL)
            row: dict[str, Any] = {}
            for batch in BATCHES:
                kv, ids = cache(model, batch, batch * (CONTEXT + 64)), list(range(batch))
                for i in ids:
                    kv.add_sequence(i)
                model.prefill(kv, ids, [tokens[:CONTEXT]] * batch)
                row[f"decode b{batch}"] = median_ms(
                    lambda kv=kv, ids=ids: model.decode(kv, ids, [5] * len(ids))
                )
            kv = cache(model, 1)
            kv.add_sequence(0)
            model.prefill(kv, [0], [tokens[:CONTEXT]])
            for k in VERIFY_K:
                row[f"verify K={k}"] = median_ms(
                    lambda k=k: (model.evaluate_multi_query(kv, [0], [tokens[:k]]), kv.popn(0, k))
                )
            kv = cache(model, 1)
            kv.add_sequence(0)
            model.prefill(kv, [0], [tokens[:CONTEXT]])

            def begin_end_forward() -> None:
                with kv.forward([0], [1]):
                    pass
                kv.popn(0, 1)

            host = {  # what a batch-1 decode step spends besides the model's kernels
                "token ids to the GPU": median_ms(lambda: model._ids(np.array([5]), (1, 1))),
                "KV cache begin + end forward": median_ms(begin_end_forward),
            }
            kv = cache(model, 1)
            kv.add_sequence(0)
            row[f"prefill {PREFILL}"] = median_ms(
                lambda: (model.prefill(kv, [0], [tokens]), kv.popn(0, PREFILL)), 10
            )
            logits = {}
            for batch in BATCHES:
                big = tvm.runtime.empty((batch, m["vocab_size"]), "float32", dev)
                logits[f"b{batch}"] = median_ms(big.numpy)
            kv_bytes = 2 * m["num_hidden_layers"] * m["num_key_value_heads"] * m["head_dim"] * 2
            return {
                "ms": row,
                "host_ms": host,
                "logits_to_host_ms": logits,
                "weight_bytes": _weight_bytes(model),
                "kv_bytes_per_token": kv_bytes,
            }

        return check

    for model in SPEED_MODELS:
        for variant in SPEED_VARIANTS:
            name = f"{model}-{variant}"
            section(f"speed {name}", speed(name), name)

    def torch_baseline(name: str) -> Callable[[], dict]:
        def check() -> dict:
            m = models[f"{name}-tir"].model_config
            cls = transformers.Qwen2Config if m["family"] == "qwen2" else transformers.LlamaConfig
            config = cls(
                vocab_size=m["vocab_size"],
                hidden_size=m["hidden_size"],
                intermediate_size=m["intermediate_size"],
                num_hidden_layers=m["num_hidden_layers"],
                num_attention_heads=m["num_attention_heads"],
                num_key_value_heads=m["num_key_value_heads"],
                tie_word_embeddings=m["tie_word_embeddings"],
            )
            with torch.device(device):
                ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float16)
            ref.eval()
            row = {}
            for batch in (1, 8):
                ids = torch.randint(3, m["vocab_size"], (batch, CONTEXT), device=device)
                with torch.no_grad():
                    past = ref(ids, use_cache=True).past_key_values
                    one = torch.full((batch, 1), 5, device=device)

                    def step(one=one, past=past):
                        ref(one, past_key_values=past, use_cache=True)
                        past.crop(-1)  # drop the token just added
                        if on_gpu:
                            torch.cuda.synchronize()

                    row[f"decode b{batch}"] = median_ms(step)
            return {"ms": row}

        return check

    for model in SPEED_MODELS:
        section(f"torch eager {model}", torch_baseline(model), f"{model}-tir")

    def end_to_end() -> dict:
        """SmolLM2's shapes as their own draft (every draft accepted): tokens/s plain and
        speculating, one request of 256 tokens."""
        path = artifacts / "smollm2-flashinfer"
        vocab = models["smollm2-flashinfer"].model_config["vocab_size"]
        prompt = [int(t) for t in np.random.default_rng(5).integers(3, vocab, 32)]
        out = {}
        for label, draft, k in (("plain", None, 0), ("draft k=4", path, 4), ("draft k=8", path, 8)):
            llm = LLM(
                path, draft, {"method": "draft" if draft else "ngram", "num_speculative_tokens": k}
            )
            params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
            llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
            seconds = time.perf_counter() - t0
            out[label] = {"tok_s": round(len(tokens) / seconds, 1), **_short(llm.metrics())}
        return out

    section("end to end smollm2-flashinfer", end_to_end, "smollm2-flashinfer")

    def wrong_arch() -> dict:
        """An artifact built for another GPU architecture (its config says sm_100)."""
        from mlc_spec.runtime.artifact import ArtifactError

        other = artifacts / "tiny-sm100"
        shutil.rmtree(other, ignore_errors=True)
        shutil.copytree(artifacts / "tiny-llama-tir", other)
        config = json.loads((other / "mlc-spec-config.json").read_text())
        config["target_spec"] = config["target_spec"].replace("sm_90", "sm_100")
        (other / "mlc-spec-config.json").write_text(json.dumps(config))
        try:
            Model(other)
        except ArtifactError as err:
            return {"error": str(err)}
        return {"error": None}

    section("bad input: another architecture", wrong_arch, "tiny-llama-tir")


def _short(metrics: dict) -> dict:
    keep = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {k: v for k, v in metrics.items() if k in keep}


def _weight_bytes(model) -> int:
    import numpy as np

    return int(sum(np.prod(p.shape) * np.dtype(p.dtype).itemsize for p in model.config["params"]))


# ---- here: the report ------------------------------------------------------------------------
def report(paths: list[Path], write: str | None) -> None:
    """One section from the runs' files (one per attention), their sections merged."""
    from benchdoc import publish

    merged: dict[str, dict] = {}
    for path in paths:
        for name, section in json.loads(path.read_text())["sections"].items():
            earlier = merged.get(name)
            if earlier and earlier["ok"] and section["ok"] and isinstance(section["result"], dict):
                section = {**section, "result": {**earlier["result"], **section["result"]}}
            merged[name] = section
    publish(render({"sections": merged, "runs": [p.name for p in paths]}), write, "gpu_check")


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
        "`python3 scripts/gpu_check.py run` (docs/gpu.md; one process per attention, merged: "
        f"{', '.join(data.get('runs', []))}, later files' sections replacing earlier ones'); "
        "the real shapes' weights are seeded.",
        "",
    ]
    lines += _parity_table(ok) + _exactness_table(ok) + _speculation_table(ok)
    lines += _speed_table(ok, m.get("gpu", "")) + _end_to_end(ok) + _misc(ok)
    if failed:
        lines += ["**Sections that failed:**", ""]
        lines += [f"- {name}: `{error[:300]}`" for name, error in failed.items()]
    return "\n".join(lines).rstrip()


def _parity_table(ok: dict) -> list[str]:
    runs = {k.removeprefix("parity "): v for k, v in ok.items() if k.startswith("parity ")}
    if not runs:
        return []
    checks = [
        c for c in next(iter(runs.values())) if not isinstance(next(iter(runs.values()))[c], bool)
    ]
    lines = [
        "**Parity with transformers** (float32 reference on the GPU, same weights): max error "
        "/ max |logit|, argmax agreement.",
        "",
        "| artifact | " + " | ".join(checks) + " | popn, verify again: same bits |",
        "|---" * (len(checks) + 2) + "|",
    ]
    for name, r in runs.items():
        cells = [f"{r[c]['rel_err']:.1e} ({r[c]['argmax']:.0%})" for c in checks]
        same = next((v for v in r.values() if isinstance(v, bool)), None)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_yes(same)} |")
    return [*lines, ""]


def _exactness_table(ok: dict) -> list[str]:
    runs = {k.removeprefix("exactness "): v for k, v in ok.items() if k.startswith("exactness ")}
    if not runs:
        return []
    lines = [
        "**Exactness**: 5 verify rows against the decode rows of the same tokens at the same "
        "positions; the same verify beside another sequence in the batch; verifies of 1 and 3 "
        "of the tokens against the first rows of the 5.",
        "",
        "| artifact | max abs diff | verify == decode (bits) | same argmax "
        "| batched == alone (bits) | fewer rows == first rows (bits) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['verify vs decode max|diff|']:.2e} | "
            f"{_yes(r['verify == decode (bits)'])} | {_yes(r['argmax equal'])} | "
            f"{_yes(r['batched verify == alone (bits)'])} | "
            f"{_yes(r['verify 1, 3 == first rows of verify 5 (bits)'])} |"
        )
    return [*lines, ""]


def _speculation_table(ok: dict) -> list[str]:
    runs = {
        k.removeprefix("speculation "): v for k, v in ok.items() if k.startswith("speculation ")
    }
    if not runs:
        return []
    cols = list(next(iter(runs.values())))
    lines = [
        "**Greedy speculation against plain decoding**, 4 prompts of 4-66 tokens, 40 tokens "
        "each (the model as its own draft; prompt lookup): identical token ids, and accepted / "
        "drafted tokens.",
        "",
        "| artifact | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for name, r in runs.items():
        cells = [
            f"{_yes(r[c]['identical'])} {r[c].get('num_accepted_tokens', 0)}/"
            f"{r[c].get('num_draft_tokens', 0)}"
            for c in cols
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _speed_table(ok: dict, gpu: str) -> list[str]:
    runs = {k.removeprefix("speed "): v for k, v in ok.items() if k.startswith("speed ")}
    if not runs:
        return []
    peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in gpu), None)
    first = next(iter(runs.values()))["ms"]
    lines = [
        f"**Speed**, median ms of {REPEATS} after a warm-up, context {CONTEXT}; float16, or "
        "`gguf`: the GGUF's own 4/8-bit weights. Roofline: the weights and the batch's KV "
        f"read once per step at {peak / 1e12 if peak else '?'} TB/s, as a share of the "
        "measured step; verify K=4 as a multiple of a batch-1 decode step.",
        "",
        "| model, attention | " + " | ".join(first) + " | roofline b1 / b32 | K=4 / decode |",
        "|---" * (len(first) + 3) + "|",
    ]
    for name, r in runs.items():
        ms = r["ms"]
        roof = "?"
        if peak:
            share = [
                (r["weight_bytes"] + b * CONTEXT * r["kv_bytes_per_token"])
                / peak
                * 1e3
                / ms[f"decode b{b}"]
                for b in (1, 32)
            ]
            roof = " / ".join(f"{x:.0%}" for x in share)
        ratio = ms["verify K=4"] / ms["decode b1"]
        cells = [f"{v:.3g}" for v in ms.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {roof} | {ratio:.2f}x |")
    lines.append("")
    for name in SPEED_MODELS:
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
    arch = ok.get("bad input: another architecture")
    if arch:
        lines += [f"**An artifact for sm_100 on this GPU:** `{arch['error']}`", ""]
    return lines


def _yes(flag: bool | None) -> str:
    return {True: "yes", False: "**no**", None: "?"}[flag]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--artifacts", type=Path, default=Path(".gpu"))
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--device", default="cuda", help="cpu: rehearse here over CPU artifacts")
    r.add_argument("--attention", choices=("tir", "flashinfer"), help="only these artifacts")
    r.add_argument("--names", nargs="+", help="only the artifacts of these names")
    p = sub.add_parser("report")
    p.add_argument("results", type=Path, nargs="+", help="what each run wrote")
    p.add_argument("--write", help="page to write the section into (docs/benchmarks-gpu.md)")
    args = parser.parse_args()
    if args.command == "run":
        run(args.artifacts, args.out, args.device, args.attention, args.names)
    else:
        report(args.results, args.write)


if __name__ == "__main__":
    main()
