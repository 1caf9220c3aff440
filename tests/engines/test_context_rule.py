"""The context rule, written once (engines.base.check_context) and used by generation,
classification, the server's max_tokens default and /bench."""

import pytest

from engines.base import ContextLengthExceeded, EngineError, check_context


@pytest.mark.parametrize("prompt, asked", [(100, 28), (128, 0), (0, 128), (127, 1)])
def test_exactly_filling_the_context_passes(prompt, asked):
    assert check_context(prompt, asked, 128) is None


@pytest.mark.parametrize("prompt, asked", [(100, 29), (129, 0), (0, 129), (128, 1)])
def test_one_token_more_fails_with_the_three_figures(prompt, asked):
    with pytest.raises(ContextLengthExceeded) as info:
        check_context(prompt, asked, 128)
    err = info.value
    assert isinstance(err, EngineError)
    assert (err.prompt_tokens, err.max_tokens, err.context_length) == (prompt, asked, 128)
    assert str(err) == (f"this model's context is 128 tokens; the prompt has {prompt} tokens "
                        f"and {asked} more were asked for")
