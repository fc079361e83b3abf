"""bench_speculative's split of our best configuration's time, which says which parts a
configuration meeting the speed goal would have to shrink."""

from __future__ import annotations

from bench_scripts import script

bench = script("bench_speculative")


def _result(name: str, seconds: list[float], phases: dict[str, float] | None = None):
    rounds = [bench.Run([], [], 64, s, phases=phases) for s in seconds]
    return bench.Result(bench.Config(name), rounds)


def _by_system(*results):
    return {s: [r for r in results if r.config.system == s] for s in ("ours", "llama", "hf")}


def test_the_median_round_of_our_best_is_split_and_the_goal_priced():
    phases = {"prefill": 1.0, "draft": 2.0, "verify": 1.5, "decode": 0.3}
    auto = _result("auto", [6.0, 5.0, 4.0], phases)  # median round: 5.0 s, 12.8 tok/s
    plain = _result("nospec", [8.0, 8.0, 8.0], {**phases, "draft": 0.0, "verify": 0.0})
    llama = _result("llama", [16.0, 16.0, 16.0])  # 4 tok/s: 2.5x is 10 tok/s, 6.4 s
    (line,) = bench.time_split(_by_system(auto, plain, llama))
    assert "its median round): target prefill 1.00 s (20%)" in line
    assert "draft passes with their catch-ups 2.00 s (40%)" in line
    assert "verify 1.50 s (30%), plain steps 0.30 s (6%)" in line
    assert "the rest (sampling, scheduling) 0.20 s (4%)" in line
    assert "2.5x llama.cpp's best allows 6.40 s of its 5.00 s (+28%)" in line


def test_nothing_to_split_without_our_timers():
    assert bench.time_split(_by_system(_result("llama", [16.0]))) == []
