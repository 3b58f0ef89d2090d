"""What the console says of a router (pretrain.report.expert_load.RouterVerdicts), replayed
over whole runs of loads: the early transient of a run that trains well says nothing, an
imbalance that persists past warm-up is said once and its recovery is said, a collapse that
never recovers is said once and never taken back, and a window whose steps disagree says
nothing."""

from __future__ import annotations

import pytest

from pretrain.report.expert_load import (
    BlockLoad,
    Health,
    RouterVerdicts,
    balancing_advice,
    health,
    window_steps,
)

E, K, TOKENS, BLOCKS = 8, 2, 1000, 6
ROUTED = TOKENS * K
EVEN = (260, 240, 250, 250, 255, 245, 250, 250)  # max/mean 1.04
IMBALANCED = (700, 300, 200, 200, 150, 150, 150, 150)  # busiest: 70% of tokens, load 2.8
COLLAPSED = (950, 950, 20, 20, 20, 20, 10, 10)  # top two: 95% of assignments


def _loads(received: tuple[int, ...]) -> list[BlockLoad]:
    return [BlockLoad(block, received, ROUTED) for block in range(BLOCKS)]


def _replay(levels: dict[range, tuple[int, ...]], steps: int = 300, warmup: int = 20,
            log_interval: int = 1, aux: float = 1e-2) -> dict[int, list[tuple[Health, str]]]:
    """Every logged step's loads through one RouterVerdicts; {step: what it said}."""
    verdicts = RouterVerdicts(E, K, warmup, log_interval, aux)
    said = {}
    for step in range(log_interval, steps + 1, log_interval):
        received = next((r for span, r in levels.items() if step in span), EVEN)
        if lines := verdicts.observe(step, _loads(received)):
            said[step] = lines
    return said


def test_each_level_of_one_step():
    assert [health(BlockLoad(0, r, ROUTED), E, K) for r in (EVEN, IMBALANCED, COLLAPSED)] == [
        Health.EVEN, Health.IMBALANCED, Health.COLLAPSED]


def test_the_early_transient_of_a_run_that_trains_well_says_nothing():
    """The newcomer's run: every block above the imbalance level at steps 19-38, around the
    end of a 20-step warm-up, and even from then on. Nothing is said, neither a warning nor a
    recovery of something never said."""
    assert _replay({range(19, 39): COLLAPSED}) == {}
    assert _replay({range(1, 60): IMBALANCED}) == {}  # 39 steps past warm-up: under a window


def test_a_persistent_imbalance_is_said_once_and_its_recovery_too():
    """Imbalanced from step 1 to 120: the window of steps 21-70, the first wholly after
    warm-up, says it for every block; the first window wholly even, 121-170, says the
    recovery. Nothing else."""
    said = _replay({range(1, 121): IMBALANCED})
    assert sorted(said) == [70, 170]
    assert [h for h, _ in said[70]] == [Health.IMBALANCED] * BLOCKS
    assert [h for h, _ in said[170]] == [Health.EVEN] * BLOCKS
    assert said[70][0][1] == (
        "step 70: the router of block 0 is imbalanced: its busiest expert's max/mean load "
        "stayed above 2.50, halfway between an even load, 1, and every token on the same 2 of 8 "
        "experts, 4 (2.80-2.80) at every logged step of steps 21-70; if it persists, resume "
        "with a stronger balancing loss, --model.moe_aux_loss_coeff=0.02; a recovery will be "
        "said")
    assert said[170][5][1] == (
        "step 170: the router of block 5 has recovered: its busiest expert's max/mean load "
        "stayed at or below 2.50 (1.04 at most) at every logged step of steps 121-170; it was "
        "imbalanced from step 70")


def test_a_collapse_that_persists_is_said_once_and_never_taken_back():
    said = _replay({range(10, 301): COLLAPSED})
    assert sorted(said) == [70]
    health_, line = said[70][3]
    assert health_ is Health.COLLAPSED
    assert line.startswith("step 70: the router of block 3 has collapsed: its 2 busiest of 8 "
                           "experts received at least 90% of its assignments (now 95%; 25% "
                           "when even) at every logged step of steps 21-70;")


def test_a_window_whose_steps_disagree_says_nothing():
    """Even and imbalanced steps taking turns: no window agrees, nothing is said."""
    verdicts = RouterVerdicts(E, K, 0, 1, 1e-2)
    for step in range(1, 301):
        assert verdicts.observe(step, _loads(IMBALANCED if step % 2 else EVEN)) == []


def test_the_window_spans_three_logged_steps_at_least():
    assert window_steps(1) == window_steps(10) == 50
    assert window_steps(25) == 75
    said = _replay({range(1, 301): IMBALANCED}, log_interval=25)
    assert sorted(said) == [100]  # logged 25, 50, ...: 25 is in warm-up, 50-100 a window


def test_a_resumed_process_judges_only_a_window_of_its_own():
    verdicts = RouterVerdicts(E, K, 20, 1, 1e-2)
    assert [s for s in range(200, 260) if verdicts.observe(s, _loads(IMBALANCED))] == [249]


def test_a_router_choosing_every_expert_is_never_judged():
    verdicts = RouterVerdicts(4, 4, 0, 1, 1e-2)
    assert all(verdicts.observe(s, [BlockLoad(0, (400, 0, 0, 0), 1600)]) == []
               for s in range(1, 120))


@pytest.mark.parametrize(("aux", "advice"), [(1e-2, "--model.moe_aux_loss_coeff=0.02"),
                                             (0.0, "--model.moe_aux_loss_coeff=0.01")])
def test_the_advice_raises_the_balancing_loss(aux, advice):
    assert balancing_advice(aux) == advice
    said = _replay({range(1, 301): COLLAPSED}, aux=aux)
    assert advice in said[70][0][1]
