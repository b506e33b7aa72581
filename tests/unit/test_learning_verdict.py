"""The run's verdict on whether RL learned: more than one held-out prompt's worth of accuracy gained."""

from miles_core.tracking import learning_verdict


def test_a_gain_of_several_prompts_is_learning():
    learned, message = learning_verdict(0.5, 0.6, 256)  # +25.6 prompts
    assert learned and "10.0 points" in message


def test_no_gain_a_loss_or_one_flipped_prompt_is_not():
    for before, after in ((0.5, 0.5), (0.5, 0.4), (0.5, 0.5 + 1 / 256)):  # the last: exactly one more prompt right
        learned, message = learning_verdict(before, after, 256)
        assert not learned
        assert message.startswith("WARNING: RL did not learn") and "learned=false" in message
