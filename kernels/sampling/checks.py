"""Argument checks of the fused sampler: host-side, never reading device data."""

from __future__ import annotations

import torch

from .._checks import check_choice, check_kernel_device, check_tensor
from .._launch import cdiv
from .params import SamplingParamsTensors
from .penalties import GROUP
from .plan import LOGPROBS_MODES, MAX_LOGPROBS


def _validate(logits: torch.Tensor, prm: SamplingParamsTensors, num_logprobs, logprobs_mode):
    check_tensor(
        "logits",
        logits,
        ndim=2,
        dtypes=(torch.float32, torch.bfloat16, torch.float16),
        last_dim_contiguous=True,
    )
    check_kernel_device("logits", logits)
    B, V = logits.shape
    dev = logits.device
    if B < 1 or V < 1:
        raise ValueError(f"logits: expected a non-empty [B, V] tensor, got {list(logits.shape)}")
    check_choice("logprobs_mode", logprobs_mode, LOGPROBS_MODES)
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise ValueError(
            f"num_logprobs: expected None or a value in [0, {MAX_LOGPROBS}], got {num_logprobs}"
        )
    if num_logprobs is not None and num_logprobs > V:
        raise ValueError(
            f"num_logprobs: expected at most the vocabulary size {V}, got {num_logprobs}"
        )
    fl, ints = (torch.float32,), (torch.int32, torch.int64)
    per_row = {
        "temperature": fl,
        "top_p": fl,
        "min_p": fl,
        "repetition_penalty": fl,
        "frequency_penalty": fl,
        "presence_penalty": fl,
        "top_k": ints,
        "state_slots": ints,
        "seeds": (torch.int64,),
        "has_seed": (torch.bool,),
        "seed_offsets": (torch.int64,),
    }
    for name, dts in per_row.items():
        t = getattr(prm, name)
        if t is not None:
            check_tensor(f"params.{name}", t, shape=(B,), dtypes=dts, device=dev, contiguous=True)
    if prm.has_seed is not None and prm.seeds is None:
        raise ValueError("params.has_seed: given without params.seeds")
    words = cdiv(V, GROUP)
    if prm.has_penalties:
        for name in ("prompt_bin_mask", "output_bin_counts"):
            if getattr(prm, name) is None:
                raise ValueError(f"params.{name}: required when a penalty is given, got None")
        check_tensor(
            "params.prompt_bin_mask",
            prm.prompt_bin_mask,
            ndim=2,
            dtypes=(torch.int32,),
            device=dev,
            last_dim_contiguous=True,
        )
        S = prm.prompt_bin_mask.shape[0]
        check_tensor("params.prompt_bin_mask", prm.prompt_bin_mask, shape=(S, words))
        check_tensor(
            "params.output_bin_counts",
            prm.output_bin_counts,
            shape=(S, V),
            dtypes=(torch.int32,),
            device=dev,
            last_dim_contiguous=True,
        )
        if prm.output_bin_mask is not None:
            check_tensor(
                "params.output_bin_mask",
                prm.output_bin_mask,
                shape=(S, words),
                dtypes=(torch.int32,),
                device=dev,
                last_dim_contiguous=True,
            )
    if prm.has_bias:
        check_tensor(
            "params.logit_bias_counts",
            prm.logit_bias_counts,
            ndim=1,
            dtypes=(torch.int32,),
            device=dev,
            contiguous=True,
        )
        S = prm.logit_bias_counts.shape[0]
        for name, dts in (
            ("logit_bias_token_ids", (torch.int32,)),
            ("logit_bias_values", (torch.float32,)),
        ):
            t = getattr(prm, name)
            if t is None:
                raise ValueError(f"params.{name}: required with params.logit_bias_counts, got None")
            # contiguous: the kernels address both lists with one row stride, the width
            check_tensor(
                f"params.{name}",
                t,
                shape=(S, None),
                dtypes=dts,
                device=dev,
                contiguous=True,
            )
        if prm.logit_bias_values.shape != prm.logit_bias_token_ids.shape:
            raise ValueError(
                f"params.logit_bias_values: expected shape {list(prm.logit_bias_token_ids.shape)}, "
                f"got {list(prm.logit_bias_values.shape)}"
            )
    elif prm.logit_bias_token_ids is not None or prm.logit_bias_values is not None:
        raise ValueError(
            "params.logit_bias_counts: required with logit_bias_token_ids/values, got None"
        )
