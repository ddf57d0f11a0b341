"""SpecGate: speculation on or off per batch size, by measured output tokens per second.
Steps are simulated: each mode produces tokens at a set rate (seconds per step fixed,
tokens per step the rate's share), so every decision is deterministic."""

from __future__ import annotations

import pytest

from nvllm.leader.spec_gate import SpecGate


def drive(gate: SpecGate, steps: int, rates: dict[bool, float], num_running: int = 16,
          step_s: float = 0.05) -> dict[bool, int]:
    """Run `steps` steps at these output rates (tokens/s per mode); count the steps each
    mode ran."""
    ran = {True: 0, False: 0}
    for _ in range(steps):
        mode = gate.allow(num_running)
        ran[mode] += 1
        gate.record(num_running, mode, round(rates[mode] * step_s), step_s)
    return ran


def test_speculation_turns_off_where_it_is_slower_and_the_tries_get_rarer():
    gate = SpecGate()
    ran = drive(gate, 4000, {True: 160, False: 200})
    assert gate.modes() == {4: False}
    # After the first windows only tries run speculating, each wait twice the last.
    assert ran[True] < 0.05 * 4000
    assert gate.num_switches == 1


def test_speculation_stays_on_where_it_pays():
    gate = SpecGate()
    ran = drive(gate, 4000, {True: 64, False: 25}, num_running=1)
    assert gate.modes() == {0: True}
    assert ran[False] < 0.05 * 4000 and gate.num_switches == 0


def test_each_batch_size_decides_for_itself():
    gate = SpecGate()
    for _ in range(50):  # interleaved, as batches grow and shrink
        drive(gate, 20, {True: 64, False: 25}, num_running=1)
        drive(gate, 20, {True: 160, False: 200}, num_running=16)
        drive(gate, 20, {True: 100, False: 120}, num_running=40)
    assert gate.modes() == {0: True, 4: False, 5: False}


def test_a_new_batch_size_starts_as_its_decided_neighbour():
    """As a batch of 16 finishes, 8..15 run for a while (the next class down): it starts
    off, as its neighbour decided, and tries on only after the usual wait; a class with
    no decided neighbour starts on."""
    gate = SpecGate(window=2)
    drive(gate, 200, {True: 100, False: 200})
    assert gate.modes() == {4: False}
    ran = drive(gate, 2 * 4, {True: 100, False: 200}, num_running=8)
    assert ran == {True: 0, False: 8} and gate.modes() == {3: False, 4: False}
    assert gate.allow(2) is True  # class 1: neighbours 0 and 2 unknown


def test_a_change_of_workload_is_followed_within_the_longest_wait():
    gate = SpecGate(window=4, max_interval=16)
    drive(gate, 2000, {True: 160, False: 200})
    assert gate.modes() == {4: False}
    # Users start asking for edits of their own text: drafts are accepted now.
    drive(gate, 4 * (16 + 2), {True: 300, False: 200})
    assert gate.modes() == {4: True}


def test_a_lucky_window_does_not_keep_the_worse_mode():
    gate = SpecGate(window=2)
    drive(gate, 200, {True: 100, False: 200})
    assert gate.modes() == {4: False}
    # One try of speculation lands on a burst of accepted drafts and wins the switch ...
    while not gate.allow(16):
        gate.record(16, False, 10, 0.05)
    gate.record(16, True, 100, 0.05)
    gate.record(16, True, 100, 0.05)
    assert gate.modes() == {4: True}
    # ... and the next window, at its true rate, hands the class back at once.
    drive(gate, 2, {True: 100, False: 200})
    assert gate.modes() == {4: False}


def test_paused_steps_count_in_the_on_window():
    """Allowed to speculate but every sequence paused for low acceptance in some steps:
    those steps count in the on-window (pauses are part of what speculating delivers),
    so the window fills and reaches a verdict."""
    gate = SpecGate(window=4)
    assert gate.allow(16) is True
    for active in (True, False, False, True):
        gate.record(16, True, 5, 0.05, speculated=active)
    assert gate._classes[4].rate == {True: pytest.approx(100.0)}
    assert gate.modes() == {4: True}


def test_a_window_with_every_sequence_paused_turns_the_class_off():
    """Drafts pay at first (on measured at 200 tok/s, off tried at 100), then the draft
    stops agreeing and its sequences are paused nearly always. A whole on-window in which
    nobody could propose is a verdict for off, which the older on figure does not undo,
    and the tries of on that follow (paused again) lose, each wait twice the last."""
    gate = SpecGate(window=2)
    for mode, tokens in ((True, 10), (True, 10), (False, 5), (False, 5)):
        assert gate.allow(16) is mode
        gate.record(16, mode, tokens, 0.05)
    assert gate.modes() == {4: True} and gate.num_switches == 0
    ran = {True: 0, False: 0}
    for _ in range(2000):
        mode = gate.allow(16)
        ran[mode] += 1
        gate.record(16, mode, 5, 0.05, speculated=False)
    assert gate.modes() == {4: False} and gate.num_switches == 1
    assert ran[True] < 0.02 * 2000


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="min_interval"):
        SpecGate(min_interval=8, max_interval=4)
