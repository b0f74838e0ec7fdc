"""The sampling kernels' top-n variants pass Triton's GPU front end (AST -> TTIR for sm_90).

The interpreter the other tests run under does not go through it: `tl.topk(x, 1)` runs there
but fails to build for a GPU, so a request for one logprob would have stopped a GPU engine.
Runs in a subprocess with the interpreter off (no GPU needed: the front end only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from fuselane.kernels import sampling as smp

    fn = smp.combine._sample_combine_kernel
    # pointer element types as fused_sample passes them
    PTR = {"logits_ptr": "*fp32", "temp_ptr": "*fp32", "topk_ptr": "*i32", "topp_ptr": "*fp32",
           "minp_ptr": "*fp32", "rep_ptr": "*fp32", "freq_ptr": "*fp32", "pres_ptr": "*fp32",
           "slots_ptr": "*i64", "pmask_ptr": "*i32", "counts_ptr": "*i32", "omask_ptr": "*i32",
           "bcount_ptr": "*i32", "btok_ptr": "*i32", "bval_ptr": "*fp32", "seeds_ptr": "*i64",
           "has_seed_ptr": "*i1", "rseeds_ptr": "*i64", "offsets_ptr": "*i64", "stf_ptr": "*fp32",
           "sti_ptr": "*i32", "cand_ptr": "*i64", "rcand_ptr": "*i64", "out_tok_ptr": "*i64",
           "out_lp_ptr": "*fp32", "out_ids_ptr": "*i64", "out_tlp_ptr": "*fp32",
           "out_nan_ptr": "*i32", "out_thr_ptr": "*fp32", "out_kept_ptr": "*i32",
           "out_fb_ptr": "*i32", "scratch_ptr": "*i64"}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 4})
    flags = dict(NC_PAD=32, CAP=64, MODE=1, TOPN=True, HAS_TEMP=True, HAS_TOPK=True,
                 HAS_TOPP=True, HAS_MINP=False, HAS_REP=False, HAS_FREQ=False, HAS_PRES=False,
                 HAS_SLOTS=False, HAS_PEN=False, HAS_OUT_MASK=False, HAS_BIAS=False, SEED_MODE=1,
                 HAS_OFFSETS=True, RAW_CANDS=False, BIAS_BLOCK=16, NP=16, FB_TILE=256, KC=64)
    for n in map(int, sys.argv[1:]):
        consts = dict(flags, TP=smp.plan._topn_width(n))
        sig = {}
        for name, p in zip(fn.arg_names, fn.params):
            if p.is_constexpr:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = PTR[name]
            else:
                sig[name] = "i32"
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        ASTSource(fn, sig, consts).make_ir(
            target, options, backend.get_codegen_implementation(options),
            backend.get_module_map(), context,
        )
        print("built", n, consts["TP"])
    """
)


def test_topn_widths_build_for_the_gpu():
    env = dict(os.environ, TRITON_INTERPRET="0")
    ns = ["1", "9", "33"]  # one count per width of TOPN_WIDTHS
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, *ns],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    built = [line.split()[1:] for line in res.stdout.splitlines() if line.startswith("built")]
    assert [b[0] for b in built] == ns
    assert [int(tp) for _, tp in built] == [8, 32, 128]  # tl.topk(x, 1) would not build
