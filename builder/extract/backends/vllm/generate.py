"""Regeneration through a vLLM server in one pass (`init --regenerate`, issue 43): the request that generates a
response and stages the states of the prompt and of the generated tokens, and what its answer must say.

One `POST /v1/completions` per request: the prompt as token ids, the build's sampling settings (every sampling
parameter sent, so nothing comes from the model's generation config but its stop ids, which vLLM adds to the
request's as `generate` would), `return_token_ids` (the generated ids, never text decoded and tokenized again),
and `kv_transfer_params.include_output_tokens`: vLLM's hidden-states connector then stages the states of every
token the engine fed through the model, i.e. the prompt and the generated tokens but the last one (that one is an
output, never an input: no pass computed its state). The states come from the generation itself; no second
prefill.

So that a response cut at the token limit keeps all its tokens with their states, the server is asked for
`max_new_tokens + 1` tokens: when it gives more than `max_new_tokens`, the response is the first `max_new_tokens`
(what a request for that many would have given: a token does not depend on the tokens after it), its finish
reason `length`, and the extra token (the only one without a state) is dropped. A response that stopped (a stop id,
the model's eos) ends with its stop token, whose state no pass computed: it is stored up to the token before it
(`stored_output` = its length - 1). A response cut by the server's context (`--max-model-len`) likewise.

Greedy only: vLLM's sampling on this path is wrong (SAMPLING_DEFECT); init refuses a temperature above 0
(`generation_problem`), and the backend refuses such a request (the run stops) should a build get one anyway.

An earlier turn of `--turns all` (`capture` False) needs only its tokens: its request asks hsbuild's connector to
stage nothing (SKIP_STATES); a server whose connector does not know that stages a file anyway, which is removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from builder.extract.backends.vllm.states import SKIP_STATES

if TYPE_CHECKING:
    from builder.extract.backends.base import Generation

FINISH_REASONS = ("stop", "length")
# why a regeneration through vLLM is greedy only (measured with vLLM 0.32.0, CPU build, tests/engines/
# test_vllm_regen.py): with the extract_hidden_states method, a request at temperature > 0 gets tokens that
# transformers' forward of the same model gives a log-probability near -190 (a server without the method: -3 at
# worst, on the same prompt and seed), and the same seed gives other tokens on each request; greedy tokens are exact
SAMPLING_DEFECT = ("vLLM's extract_hidden_states method (the one pass that generates and captures states) samples "
                   "wrong tokens above temperature 0 (vLLM 0.32: tokens of log-probability near -190, a seed that "
                   "does not repeat); its greedy tokens are exact")


def generation_problem(settings: Mapping[str, object]) -> str | None:
    """Why a vLLM server cannot regenerate with these settings (hsbuild.toml's), one line; None: it can."""
    temperature = float(settings.get("temperature") or 0.0)  # type: ignore[arg-type]
    if temperature > 0:
        return (f"--temperature {temperature:g}: {SAMPLING_DEFECT}; regenerate through vLLM with --temperature 0 "
                "(greedy), or sample with --backend inprocess")
    return None


def request_body(model: str, ids: list[int], gen: Generation, path: str) -> dict:
    """The completion request for a generation whose states (when `gen.capture`) go to `path`."""
    params: dict[str, object] = {"hidden_states_path": path}
    params.update({"include_output_tokens": True} if gen.capture else {SKIP_STATES: True})
    return {"model": model, "prompt": ids,
            "max_tokens": gen.max_new_tokens + 1 if gen.capture else gen.max_new_tokens,
            "temperature": float(gen.temperature), "top_p": float(gen.top_p), "seed": int(gen.seed),
            # neutral values, not the model's generation config (vLLM's defaults for what a request leaves out)
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "stop_token_ids": [int(t) for t in gen.stop_ids], "return_token_ids": True, "kv_transfer_params": params}


@dataclass(frozen=True)
class Response:
    output_ids: list[int]  # the generated tokens (cut to max_new_tokens), exactly as the server returned them
    finish_reason: str  # stop | length
    stored_output: int  # how many of output_ids the staged states cover

    def staged_ids(self, prompt: list[int]) -> list[int]:
        """The token ids the staged file must hold: the prompt and the stored part of the response."""
        return prompt + self.output_ids[:self.stored_output]


class BadAnswer(ValueError):
    """The answer cannot be a response to this request. `reason`: a Failure's reason (token_mismatch, bad_states,
    error); `server`: every answer of this server would be so (it does not return token ids): the run stops."""

    def __init__(self, reason: str, message: str, server: bool = False):
        super().__init__(message)
        self.reason = reason
        self.server = server


def read_response(doc: dict, prompt: list[int], gen: Generation) -> Response:
    """The response an answer gives (raises BadAnswer)."""
    choices = doc.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        raise BadAnswer("error", "the server's answer holds no choice")
    choice = choices[0]
    out = choice.get("token_ids")
    if out is None:
        raise BadAnswer("error", "the server's answer holds no token_ids: this vLLM does not honour "
                        "return_token_ids, which regeneration needs (the generated ids, never text tokenized "
                        "again); serve the model with a vLLM that does", server=True)
    if not isinstance(out, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
        raise BadAnswer("error", f"the server's token_ids are not a list of token ids: {str(out)[:80]}")
    echoed = choice.get("prompt_token_ids")
    if echoed is not None and echoed != prompt:
        raise BadAnswer("token_mismatch", f"the server's prompt ({len(echoed)} token ids) differs from the "
                        f"request's ({len(prompt)}) from position {first_diff(echoed, prompt)}")
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise BadAnswer("error", f"the server ended the response with finish_reason {finish!r}, neither stop nor "
                        "length")
    if not out:
        raise BadAnswer("error", "the server generated no token")
    if len(out) > gen.max_new_tokens:  # (the extra token asked for: its predecessor's state is staged)
        return Response(out[:gen.max_new_tokens], "length", gen.max_new_tokens if gen.capture else 0)
    return Response(out, finish, len(out) - 1 if gen.capture else 0)


def first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
