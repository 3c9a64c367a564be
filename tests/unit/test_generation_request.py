"""GenerationRequest / EngineOutput: field validation and canonical (tuple) token ids."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlix_plugins.errors import ProtocolError
from rlix_plugins.generation import EngineOutput, GenerationRequest


def test_prompt_is_stored_as_a_tuple_of_ints() -> None:
    # (a list never equals a tuple, so == also checks the type the router concatenates)
    assert GenerationRequest("r", [1, 2, 3], 4).prompt_token_ids == (1, 2, 3)  # type: ignore[arg-type]
    # Host prompts often come as tensors (NeMo RL's input_ids) or their scalars.
    from_tensor = GenerationRequest("r", torch.tensor([7, 8]), 4)  # type: ignore[arg-type]
    assert from_tensor.prompt_token_ids == (7, 8)
    assert all(type(t) is int for t in from_tensor.prompt_token_ids)
    # Empty is valid: NeMo RL's non-token prompts travel in the request's sampling payload.
    assert GenerationRequest("r", (), 1).prompt_token_ids == ()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_id": 7}, "request_id"),
        ({"request_id": ""}, "request_id"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids"),
        ({"prompt_token_ids": 5}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2.0]}, "prompt_token_ids"),
        ({"prompt_token_ids": [True]}, "prompt_token_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"sampling": [("temperature", 1.0)]}, "sampling"),
    ],
)
def test_bad_fields_raise_a_typed_error_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {"request_id": "r1", "prompt_token_ids": (1, 2), "max_tokens": 3}
    args.update(kwargs)
    with pytest.raises(ProtocolError, match=field) as info:
        GenerationRequest(**args)
    assert isinstance(info.value, ValueError)


def test_engine_output_tokens_are_tuples() -> None:
    # An engine handing back lists must not break the router's prefix + tokens concatenation.
    out = EngineOutput([4, 5], "abort", [-0.1, -0.2])  # type: ignore[arg-type]
    assert out.token_ids == (4, 5) and out.logprobs == (-0.1, -0.2)
