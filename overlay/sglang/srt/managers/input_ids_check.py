"""Prompt token ids and logprob arguments checked before a request reaches a scheduler.

sglang 0.5.23 checks ``token_ids_logprob`` and ``logit_bias`` against the vocabulary
(``TokenizerManager._validate_token_ids_logprob``, ``SamplingParams.verify``) but not the prompt
itself. A prompt given as token ids (``/generate``'s ``input_ids``, an OpenAI completion whose
prompt is a list of ids, either in a batch) goes to the scheduler as sent. There the embedding
lookup indexes its table with each id:

- an id at or past the table's rows raises in the scheduler (``IndexError: index out of range
  in self`` on a CPU, a device-side assert on a GPU), and sglang ends the whole engine;
- an id between the vocabulary and the table's padded size reads a row no token owns, and the
  request is answered from it;
- a negative id raises like one past the end;
- an empty prompt (a text that tokenizes to no token: ``"text": ""`` with a tokenizer that adds
  no BOS) reaches the model as a batch of zero tokens, and the forward pass raises.

Two logprob arguments also reached the scheduler unchecked, and each ended the engine on
env/cpu (sglang 0.5.23, tiny-llama): ``top_logprobs_num`` above the vocabulary size (a top-k
of more entries than the logits have) and a ``logprob_start_len`` below -1 (-1 means "none").
Other fields a request carries were sent to the same engine and answered 400 or served
(``logit_bias``, ``token_ids_logprob``, ``stop_token_ids``, ``top_k``, ``min_new_tokens``,
``max_new_tokens``, ``logprob_start_len`` past the prompt, ``data_parallel_rank``, ``regex``,
``json_schema``, ``lora_path``, ``input_embeds``, ``priority``, ``sampling_seed``).

``check_request`` runs where the tokenizer manager validates a request (one request, or each
request of a batch after the batch is split), so a bad id is answered 400 with the id, its
position and the range, and the scheduler never sees it. A multimodal request is left to its
processor: some processors put placeholder ids outside the text vocabulary into the prompt and
replace them before the embedding lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# A prompt shown in an error is cut to this many characters.
SHOWN_CHARS = 40


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def check_prompt_ids(input_ids: Sequence[Any], vocab_size: int) -> None:
    """Raise ValueError (the tokenizer manager answers it 400) unless the prompt has at least
    one token and every entry is an integer token id in [0, vocab_size). The common case, all
    valid, costs one pass for the types and one for min/max."""
    if len(input_ids) == 0:
        raise ValueError("The prompt has no tokens (an empty text tokenizes to none here).")
    # bool is an int to Python, never a token id a client meant.
    if not all(type(token) is int for token in input_ids):
        position, token = next((i, t) for i, t in enumerate(input_ids) if type(t) is not int)
        raise ValueError(
            f"input_ids[{position}] is {_shown(token)} ({type(token).__name__}), not a token "
            f"id: token ids are integers in [0, {vocab_size})."
        )
    if min(input_ids) >= 0 and max(input_ids) < vocab_size:
        return
    position, token = next((i, t) for i, t in enumerate(input_ids) if not 0 <= t < vocab_size)
    raise ValueError(
        f"input_ids contains out-of-vocabulary token id {token} at position {position}; "
        f"valid range is [0, {vocab_size})."
    )


def is_multimodal(obj: Any) -> bool:
    """Whether the request carries images, video or audio for a processor."""
    return any(
        getattr(obj, name, None) is not None for name in ("image_data", "video_data", "audio_data")
    )


def check_logprob_args(obj: Any, vocab_size: int) -> None:
    """Raise ValueError for logprob arguments the scheduler cannot serve. Read only when the
    request asks for logprobs: otherwise the scheduler ignores both."""
    if not getattr(obj, "return_logprob", False):
        return
    top = getattr(obj, "top_logprobs_num", None)
    if isinstance(top, int) and top > vocab_size:
        raise ValueError(
            f"top_logprobs_num is {top}, more than the vocabulary's {vocab_size} tokens."
        )
    start = getattr(obj, "logprob_start_len", None)
    if isinstance(start, int) and start < -1:
        raise ValueError(
            f"logprob_start_len must be -1 (no input logprobs) or at least 0, got {start}."
        )


def check_request(obj: Any, input_ids: Sequence[Any] | None, vocab_size: int) -> None:
    """The hook ``TokenizerManager._validate_one_request`` calls for each request (each
    request of a batch, after the batch is split)."""
    check_logprob_args(obj, vocab_size)
    if input_ids is None or is_multimodal(obj):
        return
    check_prompt_ids(input_ids, vocab_size)
