"""`fuselane bench kernels`, sampling: the fused sampler at each model's vocabulary.

Logits and parameters are bench_sampling's (sampling_workload.py: randn * 3 plus three strong
tokens per row; T=0.7, top-k 50, top-p 0.9, every row seeded as vLLM's V2 runner seeds it).
fuselane is timed as the plugin calls it (no logprobs), after bench_sampling's `compare` against
the torch reference on the same inputs (kept sets and drawn tokens; rounding ties counted apart,
not as failures).

Peers: FlashInfer's `top_k_top_p_sampling_from_logits` on logits already divided by T, and
`torch-sort (vLLM fallback)`: the reference's sort-based top-k/top-p, softmax and exponential
race (vLLM's `random_sample`).

Counted: the logits read once.
"""

from __future__ import annotations

import torch

from fuselane.benchmarks.kernels import sampling_workload as sw
from fuselane.benchmarks.kernels.grid import Case
from fuselane.benchmarks.kernels.impls import Context, Impl, Prepared, generator
from fuselane.kernels import sampling as smp


def warmups(case: Case) -> dict[str, dict[str, object]]:
    return {"sampling": {"kind": "sampling"}}


def prepare(ctx: Context, case: Case) -> Prepared:
    batch, vocab, dev = case.params["batch"], case.shape.vocab, ctx.device
    gen = generator(dev, case.seed, on_device=True)  # bench_sampling draws on the device
    x = sw.make_logits(batch, vocab, gen, dev)
    prm = sw.make_params(batch, vocab, gen, dev)
    ws = smp.SamplingWorkspace.allocate(batch, vocab, dev, max_logprobs=5, arith=sw.ARITH)

    def fuselane():
        def check() -> tuple[bool, str]:
            ok, summary, _ = sw.compare(x, prm, ws, num_logprobs=None)
            return ok, summary

        return lambda: smp.fused_sample(x, prm, workspace=ws, num_logprobs=None), check

    impls = [Impl("fuselane", "fuselane", fuselane)]
    temp = prm.temperature[:, None]
    if ctx.peers.torch:

        def torch_sort():
            z = smp.top_k_top_p_reference(x / temp, prm.top_k, prm.top_p)
            probs = z.softmax(dim=-1, dtype=torch.float32)
            return probs.div_(torch.empty_like(probs).exponential_()).argmax(dim=-1)

        impls.append(Impl("torch-sort (vLLM fallback)", "torch", lambda: (torch_sort, None)))
    if ctx.peers.flashinfer is not None:

        def flashinfer():
            import flashinfer.sampling as fis

            z = (x / temp).contiguous()
            return (
                lambda: fis.top_k_top_p_sampling_from_logits(
                    z, prm.top_k, prm.top_p, deterministic=True
                )
            ), None

        impls.append(
            Impl(
                "flashinfer top_k_top_p_sampling_from_logits",
                "flashinfer",
                flashinfer,
                warm="sampling",
            )
        )
    return Prepared(impls, nbytes=x.numel() * x.element_size(), extra={"vocab": vocab})
