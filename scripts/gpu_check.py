"""The CUDA path on a lent GPU: parity with transformers, exactness of verify rows, greedy
speculation against plain decoding, speed, bad input.

Runs on the GPU machine (docs/gpu.md) over the artifacts built here into ``.gpu/`` by
scripts/gpu_build.sh (the real models' weights regenerated there from a seed), once per
attention, each run writing what it finds to a JSON file section by section, so that a run cut
short still reports; scripts/gpu_report.py lays the files out in docs/benchmarks-gpu.md.

    python scripts/gpu_check.py --attention tir --out $OUT/tir.json
    python scripts/gpu_check.py --attention flashinfer --out $OUT/flashinfer.json
    python scripts/gpu_check.py --device cpu ...   # a rehearsal here, over CPU artifacts
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch
import transformers
import tvm
from transformers_cache import cache_argument

from mlc_spec.errors import UserError
from mlc_spec.runtime.artifact import ArtifactError
from mlc_spec.runtime.cuda_kernels import cuda_device
from mlc_spec.runtime.llm import LLM
from mlc_spec.runtime.model import Model
from mlc_spec.runtime.params import SamplingParams

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
        settings = {"repeats": REPEATS, "context": CONTEXT, "speed_models": SPEED_MODELS}
        self.path, self.data = path, {"settings": settings, "sections": {}}
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


class Checks:
    """The checks over the artifacts chosen (by attention, by name), each a method returning
    what it found; ``models`` holds those that loaded."""

    def __init__(self, artifacts: Path, device: str, attention: str | None, names: list | None):
        if device == "cuda":
            cuda_device("")  # loads TVM's CUDA runtime
        self.artifacts, self.device, self.on_gpu = artifacts, device, device == "cuda"
        self.dev = tvm.device(device)
        self.models: dict[str, Model] = {}

        def chosen(path: Path) -> bool:
            config = json.loads((path / "mlc-spec-config.json").read_text())
            return (not attention or config["attention"] == attention) and (
                not names or path.name in names
            )

        self.chosen = sorted(
            p.name for p in artifacts.iterdir() if (p / "model.so").exists() and chosen(p)
        )

    # ---- helpers
    def median_ms(self, fn: Callable[[], Any], repeats: int = REPEATS) -> float:
        fn()
        self.dev.sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            self.dev.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(times), 3)

    @staticmethod
    def cache(model: Model, batch: int = 8, total: int = 8192, seqs: int = 0):
        """Room for ``total`` tokens, all of which one prefill may bring; ``seqs`` added."""
        kv = model.create_kv_cache(
            max_batch_size=batch, max_total_len=total, prefill_chunk_size=total
        )
        for i in range(seqs):
            kv.add_sequence(i)
        return kv

    def hf_logits(self, name: str, dtype: torch.dtype = torch.float32):
        """transformers on the checkpoint ``name``: a function from token ids to logits."""
        hf = transformers.AutoModelForCausalLM.from_pretrained(self.artifacts / name, dtype=dtype)
        hf = hf.to(self.device).eval()

        def logits(tokens) -> np.ndarray:
            with torch.no_grad():
                ids = torch.tensor(np.asarray(tokens)[None]).to(self.device)
                return hf(ids).logits[0].float().cpu().numpy()

        return logits

    def seeded(self, artifact: Path) -> None:
        """Weights of the artifact's shapes from a seed (the real ones are too big to carry);
        speed does not depend on their values."""
        config = json.loads((artifact / "mlc-spec-config.json").read_text())
        gen = torch.Generator(self.device).manual_seed(0)
        weights = {}
        for p in config["params"]:
            shape, dtype = p["shape"], np.dtype(p["dtype"])
            if dtype.kind == "u":  # a quantized weight's packed codes
                bits = torch.randint(0, 2**31, shape, generator=gen, device=self.device)
                weights[p["name"]] = bits.cpu().numpy().astype(dtype)
            elif p["name"].endswith("norm.weight"):
                weights[p["name"]] = np.ones(shape, dtype)
            else:  # float weights, and quantized ones' scales and offsets
                w = torch.randn(shape, generator=gen, device=self.device) * 0.02
                weights[p["name"]] = w.to(getattr(torch, p["dtype"])).cpu().numpy()
        safetensors.numpy.save_file(weights, str(artifact / "params.safetensors"))

    # ---- checks
    def machine(self) -> dict:
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
            "gpu": torch.cuda.get_device_name() if self.on_gpu else "cpu",
            "nvidia_smi": smi or "",
            "compute_version": self.dev.compute_version,
            "nvcc": nvcc.strip().splitlines()[-1],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tvm": tvm.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }

    def weights(self) -> dict:
        """The tiny artifacts share one set (cast for bfloat16); each real shape's float16
        artifacts share a seeded set, its GGUF one has its own."""
        tiny = self.artifacts / "tiny-llama-tir" / "params.safetensors"
        for name in self.chosen:
            target = self.artifacts / name / "params.safetensors"
            if target.exists():
                continue
            if name == "tiny-llama-tir-bf16":
                weights = safetensors.torch.load_file(str(tiny))
                cast = {k: v.to(torch.bfloat16) for k, v in weights.items()}
                safetensors.torch.save_file(cast, str(target))
            elif name.startswith("tiny-"):
                shutil.copy(tiny, target)
            elif "-gguf-" in name:
                self.seeded(target.parent)
            else:
                float16 = self.artifacts / f"{name.split('-')[0]}-tir" / "params.safetensors"
                if not float16.exists():
                    self.seeded(float16.parent)
                if float16 != target:
                    shutil.copy(float16, target)
        return {"artifacts": self.chosen}

    def load(self) -> dict:
        """First load compiles the TIR kernels with nvcc (runtime/cuda_kernels.py); the second
        reads them from the disk cache."""

        def loaded(path: Path) -> tuple[Model, float]:
            t0 = time.perf_counter()
            model = Model(path)
            kv = self.cache(model, 1, 64, seqs=1)
            model.prefill(kv, [0], [[1, 2, 3]])  # the kernels may compile at their first call
            self.dev.sync()
            return model, round(time.perf_counter() - t0, 1)

        times = {}
        for name in self.chosen:
            try:
                self.models[name], first = loaded(self.artifacts / name)
                times[name] = {"first_s": first, "cached_s": loaded(self.artifacts / name)[1]}
            except Exception as err:  # noqa: BLE001 - the other artifacts still load
                times[name] = {"error": f"{type(err).__name__}: {err}"[:1000]}
        return times

    def parity(self, artifact: str, hf_dir: str) -> dict:
        """Logits against transformers float32 on the same weights (and transformers' own
        float16 as the yardstick): prefill, decode across a page boundary, verify, a verify
        recomputed after popn, ragged prefill and batched decode."""
        model, ref_logits = self.models[artifact], self.hf_logits(hf_dir)
        vocab = model.model_config["vocab_size"]
        rng = np.random.default_rng(1)
        seq = rng.integers(3, vocab, 48)
        ref = ref_logits(seq)
        out = {"transformers float16": _compare(self.hf_logits(hf_dir, torch.float16)(seq), ref)}
        kv = self.cache(model, seqs=1)
        out["prefill 30"] = _compare(model.prefill(kv, [0], [seq[:30]]).numpy(), ref[29:30])
        decodes = np.stack([model.decode(kv, [0], [t]).numpy()[0] for t in seq[30:38]])
        out["decode x8 (page boundary at 32)"] = _compare(decodes, ref[30:38])
        verify = model.evaluate_multi_query(kv, [0], [seq[38:]]).numpy()
        out["verify 10"] = _compare(verify, ref[38:])
        kv.popn(0, 10)
        again = model.evaluate_multi_query(kv, [0], [seq[38:]]).numpy()
        out["popn 10 then verify again: same bits"] = bool(np.array_equal(again, verify))
        ragged = [rng.integers(3, vocab, n) for n in (5, 17, 33, 70)]
        ids = list(range(len(ragged)))
        kv = self.cache(model, seqs=len(ragged))
        last = model.prefill(kv, ids, [s[:-1] for s in ragged]).numpy()
        step = model.decode(kv, ids, [int(s[-1]) for s in ragged]).numpy()
        refs = [ref_logits(s) for s in ragged]
        out["ragged prefill x4"] = _compare(last, np.stack([r[-2] for r in refs]))
        out["batched decode x4"] = _compare(step, np.stack([r[-1] for r in refs]))
        return out

    def exactness(self, artifact: str) -> dict:
        """5 verify rows against the decode rows of the same tokens at the same positions,
        against the same verify beside another sequence, and against verifies of fewer."""
        model = self.models[artifact]
        vocab = model.model_config["vocab_size"]
        rng = np.random.default_rng(2)
        prompt, new = rng.integers(3, vocab, 40), rng.integers(3, vocab, 5)
        kv = self.cache(model, seqs=2)
        model.prefill(kv, [0, 1], [prompt, rng.integers(3, vocab, 23)])
        decoded = np.stack([model.decode(kv, [0], [t]).numpy()[0] for t in new])
        kv.popn(0, len(new))
        verified = model.evaluate_multi_query(kv, [0], [new]).numpy()
        kv.popn(0, len(new))
        beside = model.evaluate_multi_query(kv, [1, 0], [new[:3], new]).numpy()[3:]
        kv.popn(0, len(new))
        fewer = []
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

    def speculation(self, artifact: str) -> dict:
        """Greedy speculative output against plain decoding, token for token, on prompts of
        mixed lengths: the model as its own draft and prompt lookup, k = 1..5; suffix decoding
        and the automatic policy."""
        path = self.artifacts / artifact
        vocab = self.models[artifact].model_config["vocab_size"]
        rng = np.random.default_rng(3)
        prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in (4, 19, 37, 66)]
        prompts[1] = prompts[1] * 3  # something for prompt lookup to find
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

        def tokens(llm: LLM) -> list[list[int]]:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

        plain = tokens(LLM(path, speculative={"method": "ngram", "num_speculative_tokens": 0}))
        configs = {
            f"{method} k={k}": {"method": method, "num_speculative_tokens": k}
            for method in ("draft", "ngram")
            for k in range(1, 6)
        }
        configs["suffix k=4"] = {"method": "suffix", "num_speculative_tokens": 4}
        configs["auto"] = {"method": "auto", "num_speculative_tokens": "auto"}
        out = {}
        for label, speculative in configs.items():
            draft = path if speculative["method"] in ("draft", "auto") else None
            llm = LLM(path, draft, speculative)
            out[label] = {"identical": tokens(llm) == plain, **_drafts(llm)}
        return out

    def speed(self, name: str) -> dict:
        """Decode at each batch size, verify of K, prefill, from a context of CONTEXT tokens;
        the host work around a batch-1 step; logits copied to the host."""
        model = self.models[name]
        m = model.model_config
        tokens = np.random.default_rng(4).integers(3, m["vocab_size"], PREFILL)
        ms: dict[str, float] = {}
        for batch in BATCHES:
            kv, ids = self.cache(model, batch, batch * (CONTEXT + 64), batch), list(range(batch))
            model.prefill(kv, ids, [tokens[:CONTEXT]] * batch)
            ms[f"decode b{batch}"] = self.median_ms(
                lambda kv=kv, ids=ids: model.decode(kv, ids, [5] * len(ids))
            )
        kv = self.cache(model, 1, seqs=1)
        model.prefill(kv, [0], [tokens[:CONTEXT]])
        for k in VERIFY_K:
            ms[f"verify K={k}"] = self.median_ms(
                lambda k=k: (model.evaluate_multi_query(kv, [0], [tokens[:k]]), kv.popn(0, k))
            )

        def begin_end_forward() -> None:
            with kv.forward([0], [1]):
                pass
            kv.popn(0, 1)

        host = {
            "token ids to the GPU": self.median_ms(lambda: model._ids(np.array([5]), (1, 1))),
            "KV cache begin + end forward": self.median_ms(begin_end_forward),
        }
        kv = self.cache(model, 1, seqs=1)
        ms[f"prefill {PREFILL}"] = self.median_ms(
            lambda: (model.prefill(kv, [0], [tokens]), kv.popn(0, PREFILL)), 10
        )
        logits = {}
        for batch in BATCHES:
            rows = tvm.runtime.empty((batch, m["vocab_size"]), "float32", self.dev)
            logits[f"b{batch}"] = self.median_ms(rows.numpy)
        return {
            "ms": ms,
            "host_ms": host,
            "logits_to_host_ms": logits,
            "weight_bytes": int(
                sum(np.prod(p.shape) * np.dtype(p.dtype).itemsize for p in model.config["params"])
            ),
            "kv_bytes_per_token": 2
            * m["num_hidden_layers"]
            * m["num_key_value_heads"]
            * m["head_dim"]
            * 2,
        }

    def torch_eager(self, name: str) -> dict:
        """transformers eager, float16, random weights of the model's shapes: decode steps."""
        m = self.models[f"{name}-tir"].model_config
        cls = transformers.Qwen2Config if m["family"] == "qwen2" else transformers.LlamaConfig
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        keys += ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
        with torch.device(self.device):
            ref = transformers.AutoModelForCausalLM.from_config(
                cls(**{k: m[k] for k in keys}), dtype=torch.float16
            )
        ref.eval()
        ms = {}
        for batch in (1, 8):
            ids = torch.randint(3, m["vocab_size"], (batch, CONTEXT), device=self.device)
            with torch.no_grad():
                past = transformers.DynamicCache(config=ref.config)
                cache = cache_argument(ref, past)  # once: the timed step only runs the model
                ref(ids, use_cache=True, **cache)
                one = torch.full((batch, 1), 5, device=self.device)

                def step(one=one, past=past, cache=cache) -> None:
                    ref(one, use_cache=True, **cache)
                    past.crop(-1)  # drop the token just added
                    if self.on_gpu:
                        torch.cuda.synchronize()

                ms[f"decode b{batch}"] = self.median_ms(step)
        return {"ms": ms}

    def end_to_end(self) -> dict:
        """SmolLM2's shapes as their own draft (every draft accepted): tokens/s plain and
        speculating, one request of 256 tokens."""
        path = self.artifacts / "smollm2-flashinfer"
        vocab = self.models["smollm2-flashinfer"].model_config["vocab_size"]
        prompt = [int(t) for t in np.random.default_rng(5).integers(3, vocab, 32)]
        out = {}
        for label, k in (("plain", 0), ("draft k=4", 4), ("draft k=8", 8)):
            draft, method = (path, "draft") if k else (None, "ngram")
            llm = LLM(path, draft, {"method": method, "num_speculative_tokens": k})
            llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
            out[label] = {"tok_s": round(len(tokens) / (time.perf_counter() - t0), 1)}
            out[label] |= _drafts(llm)
        return out

    def wrong_arch(self) -> dict:
        """An artifact built for another GPU architecture (its config says sm_100)."""
        other = self.artifacts / "tiny-sm100"
        shutil.rmtree(other, ignore_errors=True)
        shutil.copytree(self.artifacts / "tiny-llama-tir", other)
        config = json.loads((other / "mlc-spec-config.json").read_text())
        config["target_spec"] = config["target_spec"].replace("sm_90", "sm_100")
        (other / "mlc-spec-config.json").write_text(json.dumps(config))
        try:
            Model(other)
        except ArtifactError as err:
            return {"error": str(err)}
        return {"error": None}

    def tree_on_cuda(self) -> dict:
        """A draft tree asked of a CUDA artifact (TVM's KV cache verifies chains only here)."""
        path = self.artifacts / "tiny-llama-tir"
        try:
            LLM(path, path, {"method": "draft", "num_speculative_tokens": 3, "draft_tree_width": 2})
        except UserError as err:
            return {"error": str(err)}
        return {"error": None}


def run(checks: Checks, results: Results) -> None:
    """Every check whose artifacts loaded, top to bottom."""

    def section(name: str, fn: Callable[[], Any], *needs: str) -> None:
        if all(n in checks.models for n in needs):
            results.section(name, fn)

    results.section("machine", checks.machine)
    results.section("weights", checks.weights)
    results.section("load", checks.load)
    for artifact, hf_dir in (
        ("tiny-llama-flashinfer", "tiny-llama-hf"),
        ("tiny-llama-tir", "tiny-llama-hf"),
        ("tiny-llama-tir-bf16", "tiny-llama-hf"),
        ("tiny-qwen2-tir", "tiny-qwen2-hf"),
    ):
        section(f"parity {artifact}", lambda a=artifact, h=hf_dir: checks.parity(a, h), artifact)
    for artifact in (
        "tiny-llama-flashinfer",
        "tiny-llama-tir",
        "smollm2-flashinfer",
        "smollm2-tir",
    ):
        section(f"exactness {artifact}", lambda a=artifact: checks.exactness(a), artifact)
    for artifact in ("tiny-llama-flashinfer", "tiny-llama-tir"):
        section(f"speculation {artifact}", lambda a=artifact: checks.speculation(a), artifact)
    for model in SPEED_MODELS:
        for variant in SPEED_VARIANTS:
            name = f"{model}-{variant}"
            section(f"speed {name}", lambda n=name: checks.speed(n), name)
    for model in SPEED_MODELS:
        section(f"torch eager {model}", lambda m=model: checks.torch_eager(m), f"{model}-tir")
    section("end to end smollm2-flashinfer", checks.end_to_end, "smollm2-flashinfer")
    section("bad input: another architecture", checks.wrong_arch, "tiny-llama-tir")
    section("bad input: a draft tree", checks.tree_on_cuda, "tiny-llama-tir")


def _compare(ours: np.ndarray, ref: np.ndarray) -> dict:
    err = float(np.abs(ours - ref).max() / np.abs(ref).max())
    return {
        "rel_err": float(f"{err:.2e}"),
        "argmax": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
    }


def _drafts(llm: LLM) -> dict:
    keep = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {k: v for k, v in llm.metrics().items() if k in keep}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", type=Path, default=Path(".gpu"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda", help="cpu: rehearse here over CPU artifacts")
    parser.add_argument("--attention", choices=("tir", "flashinfer"), help="only these artifacts")
    parser.add_argument("--names", nargs="+", help="only the artifacts of these names")
    args = parser.parse_args()
    checks = Checks(args.artifacts, args.device, args.attention, args.names)
    run(checks, Results(args.out))


if __name__ == "__main__":
    main()
