"""What the fused sampler may assume of vLLM: every sampling parameter outside the domain its
kernel defines (temperature NaN, infinite, < 0; top_p NaN or <= 0; min_p NaN or outside [0, 1];
repetition penalty NaN, infinite or <= 0; frequency / presence penalty not finite) is refused on
the host by vLLM's own `SamplingParams`, before a request exists. So through vLLM such a value
never reaches the kernel, whose answer for a direct caller (token -1, `nan_rows` -1,
tests/kernels/test_sampling.py) never reaches vLLM. Checked against the installed vLLM."""

from __future__ import annotations

import importlib
import math

import pytest

vllm = pytest.importorskip("vllm")
# What SamplingParams raises: vLLM 0.32's VLLMValidationError (not a ValueError), as the module
# that raises it names it; ValueError where a version has no such class.
_module = importlib.import_module("vllm.sampling_params")
REFUSED = (ValueError, getattr(_module, "VLLMValidationError", ValueError))

NAN, INF = math.nan, math.inf
OUT_OF_DOMAIN = [
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", -0.5),
    ("top_p", NAN),
    ("top_p", 0.0),
    ("top_p", -1.0),
    ("min_p", NAN),
    ("min_p", 2.0),
    ("min_p", -0.1),
    ("repetition_penalty", NAN),
    ("repetition_penalty", INF),
    ("repetition_penalty", 0.0),
    ("frequency_penalty", NAN),
    ("frequency_penalty", INF),
    ("presence_penalty", NAN),
    ("presence_penalty", -INF),
]


@pytest.mark.parametrize("name,value", OUT_OF_DOMAIN, ids=[f"{n}={v}" for n, v in OUT_OF_DOMAIN])
def test_vllm_refuses_what_the_kernel_calls_out_of_domain(name, value):
    with pytest.raises(REFUSED, match=name):
        vllm.SamplingParams(**{name: value})


def test_the_edges_of_the_domain_are_accepted():
    # The kernel's "off" values and the domain's closed ends stay valid requests.
    vllm.SamplingParams(temperature=0.0, top_p=1.0, min_p=0.0, top_k=0)
    vllm.SamplingParams(temperature=2.0, min_p=1.0, repetition_penalty=1e-3)
