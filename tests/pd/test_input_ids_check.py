"""Patch 0031: the tokenizer manager refuses a prompt's bad token ids and logprob arguments.

sglang's own `TokenizerManager._validate_one_request` runs here, unbound, on a stand-in for the
few attributes it reads (the model's vocabulary size, the context length), with requests built
and normalized by sglang's own `GenerateReqInput`. The reference for which ids must be refused
is torch's embedding lookup on a table of exactly the vocabulary's rows (what the model's
embedding does with an id, without the padding rows no token owns): an id torch refuses is
refused with a ValueError naming it and the range, an id torch takes passes. The real engines'
routes (the router, OpenAI completions, streaming, batches) are in
tests/engine/test_cpu_engines.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pd_harness  # noqa: F401  (publishes the process config sglang's validation reads)
import pytest
import torch
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager

VOCAB = 421  # tools/make_tiny_model.py's tiny-llama, the env/cpu model


def manager(vocab: int = VOCAB) -> SimpleNamespace:
    tm = SimpleNamespace(
        model_config=SimpleNamespace(vocab_size=vocab, hidden_size=128),
        context_len=4096,
        num_reserved_tokens=0,
        allow_auto_truncate=False,
        validate_total_tokens=True,
        is_generation=True,
    )
    tm._validate_joint_schema_request = lambda obj, ids: None
    tm._validate_token_ids_logprob = lambda obj: TokenizerManager._validate_token_ids_logprob(
        tm, obj
    )
    return tm


def validate(body: dict, vocab: int = VOCAB) -> None:
    """Each request of the body through sglang's validation, as the tokenizer manager does it:
    a batch split into its requests first."""
    obj = GenerateReqInput(**body)
    obj.normalize_batch_and_arguments()
    requests = [obj[i] for i in range(obj.batch_size)] if not obj.is_single else [obj]
    for one in requests:
        TokenizerManager._validate_one_request(manager(vocab), one, one.input_ids)


def torch_refuses(token: int, vocab: int = VOCAB) -> bool:
    table = torch.zeros(vocab, 4)
    try:
        torch.nn.functional.embedding(torch.tensor([token]), table)
    except (IndexError, RuntimeError):
        return True
    return False


@pytest.mark.parametrize("token", [-3, -1, 0, 1, VOCAB - 1, VOCAB, VOCAB + 7, 899, 2**40])
def test_an_id_is_refused_exactly_when_the_embedding_lookup_refuses_it(token):
    body = {"input_ids": [5, 6, token, 7], "sampling_params": {"max_new_tokens": 2}}
    if torch_refuses(token):
        with pytest.raises(ValueError) as refused:
            validate(body)
        assert f"token id {token} at position 2" in str(refused.value)
        assert f"[0, {VOCAB})" in str(refused.value)
    else:
        validate(body)


def test_a_batch_is_refused_on_its_one_bad_request():
    body = {"input_ids": [[5, 6], [7, 900]], "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(ValueError, match=r"token id 900 at position 1; valid range is \[0, 421\)"):
        validate(body)
    validate({"input_ids": [[5, 6], [7, 420]], "sampling_params": {"max_new_tokens": 2}})


@pytest.mark.parametrize("entry", [True, 3.0, "7"])
def test_an_entry_that_is_not_an_integer_is_refused(entry):
    with pytest.raises(ValueError, match=r"input_ids\[1\] is .* not a token id"):
        validate({"input_ids": [5, entry], "sampling_params": {"max_new_tokens": 2}})


def test_an_empty_prompt_after_tokenization_is_refused():
    obj = GenerateReqInput(text="", sampling_params={"max_new_tokens": 2})
    obj.normalize_batch_and_arguments()
    with pytest.raises(ValueError, match="The prompt has no tokens"):
        TokenizerManager._validate_one_request(manager(), obj, [])


def test_a_multimodal_prompt_is_left_to_its_processor():
    obj = GenerateReqInput(
        input_ids=[5, VOCAB + 100], image_data="x.png", sampling_params={"max_new_tokens": 2}
    )
    obj.normalize_batch_and_arguments()
    TokenizerManager._validate_one_request(manager(), obj, obj.input_ids)


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        ({"top_logprobs_num": VOCAB + 1}, f"top_logprobs_num is {VOCAB + 1}, more than"),
        ({"top_logprobs_num": VOCAB}, None),
        ({"logprob_start_len": -2}, "logprob_start_len must be -1"),
        ({"logprob_start_len": -1}, None),
        ({"logprob_start_len": 0}, None),
    ],
)
def test_logprob_arguments_the_scheduler_cannot_serve_are_refused(args, refused):
    body = {"input_ids": [5, 6], "return_logprob": True, "sampling_params": {}, **args}
    if refused:
        with pytest.raises(ValueError, match=refused):
            validate(body)
    else:
        validate(body)
    # Without return_logprob the scheduler ignores both, and so does the check.
    validate({**body, "return_logprob": False})


def test_the_range_is_the_models_vocabulary():
    validate({"input_ids": [0, 127], "sampling_params": {}}, vocab=128)
    with pytest.raises(ValueError, match=r"token id 128 at position 1; valid range is \[0, 128\)"):
        validate({"input_ids": [0, 128], "sampling_params": {}}, vocab=128)
