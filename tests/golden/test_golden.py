"""Stock vLLM and FUSELANE_KERNELS=all reproduce the committed golden outputs of the tiny model.

Both runs are the plugin tests' engines (`stock_run`, `fuselane_run`: fp32, vLLM's in-process
CPU engine, fuselane's kernels under Triton's interpreter), whose greedy pass is the golden one
(engine_runner.py `--golden`): engine_runner.GOLDEN_PROMPTS, 8 prompts of 1 to 405 tokens, 32
tokens each, top-5 logprobs. Tokens must match the file exactly and logprobs within
golden.LOGPROB_ATOL (why that value: there).
A file that no longer describes the set-up (vLLM's version, the model builder's output, the
prompts) fails every test here with the command that regenerates it.
"""

from __future__ import annotations

import pytest

from tests.plugin.engines import engine_dtype

from . import golden as g

MAX_SHOWN = 12


@pytest.fixture(scope="module")
def golden(tiny_model) -> dict:
    data = g.load()
    problems = g.stale(data, tiny_model)
    if problems:
        pytest.fail(g.stale_message(problems))
    return data


def test_file_has_the_promised_shape(golden):
    lens = [len(p["prompt_ids"]) for p in golden["prompts"]]
    assert len(lens) >= 8 and min(lens) == 1 and 300 <= max(lens) <= 450, lens
    assert all(len(p["token_ids"]) == golden["tokens"] == 32 for p in golden["prompts"])
    assert all(
        len(step) == golden["top_logprobs"] == 5
        for p in golden["prompts"]
        for step in p["top_logprobs"]
    )
    # Tokens are compared exactly: no greedy step of the file may be a near-tie.
    assert not g.near_ties(golden)


@pytest.mark.parametrize("arm", ["stock", "fuselane"])
def test_engine_reproduces_the_golden_file(arm, golden, request):
    assert engine_dtype() == "float32", "the golden outputs are float32"
    result, _ = request.getfixturevalue(f"{arm}_run")
    failures, worst = g.compare(golden, result["golden"])
    shown = "\n".join(failures[:MAX_SHOWN])
    assert not failures, (
        f"{arm}: {len(failures)} differences from {g.GOLDEN_FILE.name} (largest logprob "
        f"difference {worst:.2e}, tolerance {g.LOGPROB_ATOL:g}):\n{shown}\nIf the change is "
        f"intended, regenerate the file with `{g.REGEN_COMMAND}`."
    )


def test_a_stale_file_names_the_command(golden, tiny_model):
    older = {**golden, "vllm": "0.0.1"}
    problems = g.stale(older, tiny_model)
    assert problems == [f"vllm: file '0.0.1', running {golden['vllm']!r}"]
    assert g.REGEN_COMMAND in g.stale_message(problems)
    rebuilt = {**golden, "model_builder_hash": "0" * 64}
    assert [p.split(":")[0] for p in g.stale(rebuilt, tiny_model)] == ["model_builder_hash"]


def test_comparison_rule(golden):
    """Exact tokens; logprobs within the tolerance; an id may cross the top-5 cut only at a
    tie with the last one."""
    want = golden["prompts"][:1]
    same = [dict(p) for p in want]
    assert g.compare({"prompts": want}, same) == ([], 0.0)
    top = want[0]["top_logprobs"][0]
    moved = [[t, lp + 2 * g.LOGPROB_ATOL] if k == 0 else [t, lp] for k, (t, lp) in enumerate(top)]
    off = [{**same[0], "top_logprobs": [moved, *want[0]["top_logprobs"][1:]]}]
    failures, worst = g.compare({"prompts": want}, off)
    assert len(failures) == 1 and worst == pytest.approx(2 * g.LOGPROB_ATOL)
    swapped = [{**same[0], "token_ids": [*want[0]["token_ids"][:-1], -1]}]
    assert "tokens differ from step 31" in g.compare({"prompts": want}, swapped)[0][0]
    # the fifth replaced by another id: allowed only when the newcomer ties the cut
    cut = top[-1][1]
    tie = [{**same[0], "top_logprobs": [[*top[:-1], [-7, cut]], *want[0]["top_logprobs"][1:]]}]
    assert g.compare({"prompts": want}, tie)[0] == []
    far = [[*top[:-1], [-7, top[0][1]]]]
    far_run = [{**same[0], "top_logprobs": [*far, *want[0]["top_logprobs"][1:]]}]
    assert len(g.compare({"prompts": want}, far_run)[0]) == 1  # -7 was far above the cut
