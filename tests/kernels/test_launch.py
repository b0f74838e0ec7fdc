"""Host-side launch helpers (kernels/_launch.py)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fuselane.kernels import _launch, attention
from fuselane.kernels._launch import cdiv, next_pow2
from tests.device import DEVICE


def test_host_helpers_agree_with_triton():
    # The launchers size tiles and grids with these instead of Triton's JIT-callable versions.
    assert [next_pow2(n) for n in range(4100)] == [triton.next_power_of_2(n) for n in range(4100)]
    assert [cdiv(a, b) for a in range(300) for b in range(1, 70)] == [
        triton.cdiv(a, b) for a in range(300) for b in range(1, 70)
    ]


# ----------------------------------------------------------------------------------------------
# The start-up check of direct launches
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, s, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=ok) * s, mask=ok)


def _scale_args(n: int = 50) -> list:
    x = torch.randn(n, device=DEVICE)
    out = torch.full((n,), float("nan"), device=DEVICE)
    return [x, out, n, 3.0]


def _triton_launch(args: list) -> None:
    _scale_kernel[(cdiv(args[2], 16),)](*args, BLOCK=16)


def test_compare_launches_accepts_the_same_launch_and_leaves_the_arguments_alone():
    args = _scale_args()
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    assert _launch.compare_launches(args, _triton_launch, _triton_launch) is None
    torch.testing.assert_close(args[0], before[0])
    assert torch.isnan(args[1]).all()  # the checks wrote copies, not the caller's tensors


@pytest.mark.parametrize("launcher", ["swapped arguments", "raises", "launches nothing"])
def test_compare_launches_names_an_unknown_launcher(launcher):
    """A launcher with another argument convention than the one fuselane calls: it writes the
    wrong tensor, fails, or does nothing; each is found."""

    def unknown(args: list) -> None:
        if launcher == "swapped arguments":
            _triton_launch([args[1], args[0], *args[2:]])
        elif launcher == "raises":
            raise TypeError("run() takes 12 positional arguments but 15 were given")

    reason = _launch.compare_launches(_scale_args(), _triton_launch, unknown)
    assert reason is not None
    want = "raised TypeError" if launcher == "raises" else "different values into argument"
    assert want in reason


def test_copies_keep_strides_and_alignment_and_share_big_tensors(monkeypatch):
    base = torch.randn(10, 8, device=DEVICE)
    view = base[:, 2:5]  # strided, 8-byte offset
    copies, copied = _launch._copies([view, 7])
    c = copies[0]
    assert copied == [0] and c.data_ptr() != view.data_ptr()
    assert c.stride() == view.stride() and c.data_ptr() % 256 == view.data_ptr() % 256
    assert torch.equal(c, view)
    monkeypatch.setattr(_launch, "CHECK_COPY_MAX_BYTES", 64)
    shared, copied = _launch._copies([base, base.expand(3, 10, 8)])
    assert copied == [] and shared[0] is base


@pytest.mark.skipif(DEVICE.type != "cuda", reason="direct launches exist only on a GPU")
def test_an_unknown_launcher_switches_the_kernel_to_triton(monkeypatch):
    """The real path: a launcher taking its arguments in another order fails the start-up check;
    the kernel is named in the fallbacks, later launches go through Triton and stay correct,
    and a recording of it replays through Triton too."""
    real = _launch._run_direct

    def other_convention(kernel, grid, stream, args):
        args = list(args)
        args[0], args[1] = args[1], args[0]
        real(kernel, grid, stream, args)

    monkeypatch.setattr(_launch, "_run_direct", other_convention)
    _launch._BY_FN.pop(id(_scale_kernel), None)
    before = len(_launch.direct_launch_fallbacks())
    args = _scale_args()
    _launch.launch(_scale_kernel, (4,), *args, BLOCK=16)  # compiles, launched by Triton
    with _launch.checking_direct_launches():
        _launch.launch(_scale_kernel, (4,), *args, BLOCK=16)
    fallbacks = _launch.direct_launch_fallbacks()[before:]
    assert [name for name, _ in fallbacks] == ["_scale_kernel"]
    x, out = args[0], torch.full_like(args[0], float("nan"))
    _launch.launch(_scale_kernel, (4,), x, out, 50, 3.0, BLOCK=16)
    torch.testing.assert_close(out, x * 3.0)
    _launch._BY_FN.pop(id(_scale_kernel), None)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="direct launches exist only on a GPU")
def test_the_known_launcher_passes_the_check():
    _launch._BY_FN.pop(id(_scale_kernel), None)
    before = len(_launch.direct_launch_fallbacks())
    args = _scale_args()
    with _launch.checking_direct_launches():
        _launch.launch(_scale_kernel, (4,), *args, BLOCK=16)
        _launch.launch(_scale_kernel, (4,), *args, BLOCK=16)
    assert _launch.direct_launch_fallbacks()[before:] == []
    assert _launch._BY_FN[id(_scale_kernel)].checked
    torch.testing.assert_close(args[1], args[0] * 3.0)
    _launch._BY_FN.pop(id(_scale_kernel), None)


# ----------------------------------------------------------------------------------------------
# Variants first launched after the start-up warm-up
# ----------------------------------------------------------------------------------------------


def test_variant_difference_names_the_arguments_against_the_closest_known_variant():
    spec = (("*fp32", "D"), ("*fp32", "D"), ("i32", "D"), ("fp32",), ("constexpr", 16))
    known = [
        (0, spec, (("num_warps", 4),)),
        (0, (("*bf16", ""), *spec[1:]), (("num_warps", 8),)),
    ]
    new = (0, (*spec[:2], ("i32", ""), *spec[3:]), (("num_warps", 4),))
    assert _launch.variant_difference(_scale_kernel, new, known) == (
        "n: ('i32', '') (known had ('i32', 'D'))"
    )
    wider = (0, spec, (("num_warps", 8),))
    assert _launch.variant_difference(_scale_kernel, wider, known) == ("num_warps: 8 (known had 4)")
    assert _launch.variant_difference(_scale_kernel, new, []) == "no variant known"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="direct launches exist only on a GPU")
def test_a_variant_first_launched_after_the_warm_up_is_reported():
    _launch._BY_FN.pop(id(_scale_kernel), None)
    seen: list[tuple[str, str]] = []
    args = _scale_args(48)
    with _launch.checking_direct_launches():  # the warm-up: nothing reported
        _launch.launch(_scale_kernel, (3,), *args, BLOCK=16)
    _launch.report_late_variants(lambda name, diff: seen.append((name, diff)))
    try:
        _launch.launch(_scale_kernel, (3,), *args, BLOCK=16)  # warmed: nothing
        assert seen == []
        args = _scale_args(50)  # n no longer a multiple of 16: another variant
        _launch.launch(_scale_kernel, (4,), *args, BLOCK=16)
        _launch.launch(_scale_kernel, (4,), *args, BLOCK=16)
    finally:
        _launch.report_late_variants(None)
        _launch._BY_FN.pop(id(_scale_kernel), None)
    # one report, naming the argument (Triton's specialization strings vary by release)
    assert [name for name, _ in seen] == ["_scale_kernel"]
    assert seen[0][1].startswith("n: ") and ";" not in seen[0][1]
    torch.testing.assert_close(args[1], args[0] * 3.0)


# ----------------------------------------------------------------------------------------------
# A CPU tensor where Triton compiles for a GPU
# ----------------------------------------------------------------------------------------------


def test_cpu_tensors_get_fuselanes_error_where_triton_compiles_for_a_gpu(monkeypatch):
    from fuselane.kernels import kv_cache, sampling
    from tests.kernels.test_attention import make_batch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    batch = make_batch([1], [20], num_q_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                       q_dtype=torch.float16, kv_dtype=None, seed=1)  # fmt: skip
    batch.pop("num_rows")
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got a CPU tensor"):
        attention.paged_attention(out=torch.empty_like(cpu["q"]), **cpu)
    key = torch.zeros(3, 2, 64, dtype=torch.float16)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="key: expected a CUDA tensor"):
        kv_cache.kv_cache_update(key, key, cache, cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits: expected a CUDA tensor"):
        sampling.fused_sample(torch.zeros(2, 40), sampling.SamplingParamsTensors())
