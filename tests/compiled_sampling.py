"""The compiled sampler behind the numpy oracle's signatures (``sampling_oracle``), so that one
test body checks both: the sampling functions compiled alone for the CPU, exactly as every
artifact carries them (``attach_sampler`` lowered by ``relax_pipeline``)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.runtime.vm import VirtualMachine

from mlc_spec.compiler.pipeline import relax_pipeline
from mlc_spec.compiler.sampler import attach_sampler
from mlc_spec.compiler.targets import make_target
from mlc_spec.runtime.artifact import CPU_SAMPLER_FUNCTIONS, SAMPLER_FUNCTIONS
from mlc_spec.runtime.params import SamplingParams
from mlc_spec.runtime.sampler import DraftProbs, Sampler


def compile_sampler(target: str = "llvm", vocab_size: int | None = None) -> tvm.runtime.Executable:
    tvm_target = make_target(target)
    return tvm.compile(
        attach_sampler(tvm.IRModule(), vocab_size, cpu=target == "llvm"),
        target=tvm_target,
        relax_pipeline=relax_pipeline(tvm_target, "float32", unroll=False),
    )


def cpu_sampler(vocab_size: int | None = None) -> Sampler:
    vm = VirtualMachine(compile_sampler("llvm", vocab_size), tvm.cpu())
    names = (*SAMPLER_FUNCTIONS, *CPU_SAMPLER_FUNCTIONS)
    return Sampler({name: vm[name] for name in names}, tvm.cpu())


class CompiledSampling:
    """``probs_from_logits``, ``sample_from_probs`` and ``rejection_sample`` as in the oracle,
    computed on the device (float32 inside, float64/int64 out)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def _tensor(self, array: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.asarray(array, dtype=np.float32), self.sampler.device)

    def probs_from_logits(self, logits, temperature, top_k, top_p) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float32)
        n = x.shape[0]
        params = [
            SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p))
            for t, k, p in zip(
                np.broadcast_to(temperature, (n,)),
                np.broadcast_to(top_k, (n,)),
                np.broadcast_to(top_p, (n,)),
                strict=True,
            )
        ]
        return self.sampler.probs(self._tensor(x), params).numpy().astype(np.float64)

    def sample_from_probs(self, probs, uniforms) -> np.ndarray:
        return self.sampler.sample(self._tensor(probs), np.asarray(uniforms))

    def rejection_sample(
        self, draft_tokens, num_draft, draft_probs, target_probs, accept_uniforms, sample_uniforms
    ) -> tuple[np.ndarray, np.ndarray]:
        num_draft = np.asarray(num_draft)
        split = np.cumsum(num_draft)[:-1]
        drafts = np.split(np.asarray(draft_tokens, dtype=np.int64), split)
        probs = None
        if draft_probs is not None:
            probs = DraftProbs(
                self._tensor(draft_probs), np.split(np.arange(num_draft.sum()), split)
            )
        return self.sampler.verify_probs(
            self._tensor(target_probs),
            drafts,
            probs,
            np.asarray(accept_uniforms),
            np.asarray(sample_uniforms),
        )
