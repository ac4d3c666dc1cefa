"""A `GenRequest` as a vLLM request and a finished vLLM output as a `GenResult` (the vLLM
engine's request bookkeeping: roles/rollout_vllm.py `add` / `step` / `abort`).

Every request is its own vLLM request with `SamplingParams(seed=GenRequest.seed)`, so its tokens
depend on (weights, prompt, seed, target length), not on what else the engine runs; only the
tokens come back as they are made (`DELTA`) with the log-prob of each sampled token, so the
engine knows every running request's progress (partial rollout moves it with its prefix). Imports vLLM
inside the functions that need it.
"""

from __future__ import annotations

from typing import Any

from dynaresize.roles.base import GenRequest, GenResult, check_request, target_len


def check_fits(r: GenRequest, max_model_len: int) -> None:
    """ValueError naming the sample and the field when `r` cannot run in this engine."""
    check_request(r)
    if len(r.prompt_ids) + target_len(r) > max_model_len:
        raise ValueError(f"sample {r.sample_id}: prompt {len(r.prompt_ids)} + response {target_len(r)} tokens "
                         f"exceed max_model_len {max_model_len} (rollout.vllm_max_model_len)")


def vllm_request(r: GenRequest, temperature: float) -> tuple[Any, Any]:
    """(prompt, sampling params) of `r`: plain sampling at `temperature` (no top-p/k), its own
    seed, EOS ignored under a forced length, the sampled token's log-prob."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=int(r.seed),
                            max_tokens=target_len(r), ignore_eos=r.forced_length is not None, logprobs=0,
                            detokenize=False, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)
    return TokensPrompt(prompt_token_ids=list(map(int, r.prompt_ids))), params


def extend(req: GenRequest, out: Any, tokens: list[int], logprobs: list[float]) -> None:
    """Append a `DELTA` output's new tokens and their log-probs to the request's so far."""
    comp = out.outputs[0]
    new = [int(t) for t in comp.token_ids]
    lps = [float(entry[tok].logprob) for tok, entry in zip(new, comp.logprobs or [])]
    if len(lps) != len(new):
        raise RuntimeError(f"sample {req.sample_id}: {len(lps)} log-probs for {len(new)} tokens")
    tokens.extend(new)
    logprobs.extend(lps)


def result_of(req: GenRequest, tokens: list[int], logprobs: list[float], version: int,
              duration_s: float) -> GenResult:
    """The `GenResult` of a finished request (its tokens and each one's log-prob)."""
    return GenResult(sample_id=tuple(req.sample_id), response_ids=list(tokens), logprobs=list(logprobs),
                     version=version, duration_s=float(duration_s))


def empty_result(r: GenRequest, version: int) -> GenResult:
    """The result of a request for zero tokens (vLLM is never asked)."""
    return GenResult(sample_id=tuple(r.sample_id), response_ids=[], logprobs=[], version=version, duration_s=0.0)


def warm_up(llm: Any, temperature: float) -> None:
    """Two tokens with log-probs, the path every rollout takes (one-off costs fall in `start`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=[0])],
                 SamplingParams(max_tokens=2, seed=0, temperature=temperature, logprobs=0,
                                ignore_eos=True, detokenize=False), use_tqdm=False)
