"""pace_core.vllm.check's verdicts (no vLLM needed; the checks themselves run engines and are measurements)."""

from pace_core.vllm import check


def test_a_near_tie_allows_the_rounding_of_the_log_probabilities():
    # as measured: a margin of one bf16 step (2^-4) against a change of margins that float32 rounding put
    # 1.2e-7 below it (data/bench/vllm_cpu_own.json, prompt 7)
    assert check.near_tie(0.0625, 0.06249988079071045)
    assert check.near_tie(0.0, 1.1548399925231934e-07) and check.near_tie(0.0, 0.0)
    # a margin a whole step above the change is not a tie, nor one beyond the slack
    assert not check.near_tie(0.125, 0.0625)
    assert not check.near_tie(0.0625 + 2 * check.TIE_SLACK, 0.0625)
    assert check.TIE_SLACK < 2.0**-4 / 100
