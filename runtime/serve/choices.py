"""The choices of one completion or chat request: one :class:`GenerationJob` per prompt
and choice (``n``, or ``best_of`` of which the best ``n`` are answered), each its own
session on the same adapters, admitted together or not at all; and each choice's
logprobs object, echoed prompt and index.

Choice ``i`` of prompt ``p`` has index ``p * n + i``; with a ``seed``, run ``r`` of a
prompt samples with ``seed + r``, so that a request with a seed answers the same every
time (and its first choice is what ``n=1`` answers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from runtime.serve.catalog import AdapterNotFoundError
from runtime.serve.errors import ApiError, bad_request
from runtime.serve.generation import GenerationJob, GenerationRequest, Outcome
from runtime.serve.logprobs import chat_logprobs, completion_logprobs
from runtime.serve.protocol import Answer, ChatBody, CompletionBody, check_token_id
from runtime.serve.token_texts import TokenReader

_SEEDS = 2**64


class ChoiceJobs:
    """The admitted jobs of one request, in index order (runs of prompt 0, then of
    prompt 1...)."""

    def __init__(self, server, body: CompletionBody | ChatBody, jobs: list[GenerationJob]) -> None:
        self._server = server
        self._body = body
        self.jobs = jobs

    @classmethod
    def admit(cls, server, body: CompletionBody | ChatBody, weights: list[tuple[str, float]],
              prompts: Sequence[str | tuple[int, ...]], put: Callable[[object], None] | None, started: object,
              check: Callable[[object, list[tuple[str, float]]], None]) -> ChoiceJobs:
        """Builds and admits a job per prompt and run, each holding its own lease of the
        adapters; refuses the request (400, naming the field) when they would be more than
        ``--max-concurrent``, and releases everything if any is refused. ``put`` (for a
        stream) gets ``(index, text)`` as each job's text comes and ``(index, started)``
        at its first token; ``check(lease, weights)``: the blend's checks, once."""
        runs, limit = body.runs, server.settings.max_concurrent
        if len(prompts) * runs > limit:
            field = "best_of" if runs > body.choices else "n" if runs > 1 else "prompt"
            raise bad_request(f"{len(prompts)} prompt(s) x {runs} choice(s) = {len(prompts) * runs} generations, more "
                              f"than the server runs at once (--max-concurrent {limit})", param=field)
        engine = server.engine
        known = server.known_tokens
        if body.echo_prompt and not engine.spec.can_score and not server.settings.score_by_decode:
            raise bad_request(
                f"echo needs the logits at every prompt position, and model {server.settings.model_name!r} was "
                "exported without them: export it again with `runtime export --score-lengths 128,512` (or "
                "--prefill-logits), or start the server with --score-by-decode (one decode step per prompt "
                "token: slow on a real model)",
                param="echo", code="scoring_unavailable")
        stops = body.stop_strings()
        stop_tokens = body.stop_tokens(engine.tokenizer.stop_token_ids)
        for index, token in enumerate(body.stop_token_ids or ()):
            check_token_id(token, known, f"stop_token_ids.{index}")
        for p, prompt in enumerate(prompts):
            for token in prompt if isinstance(prompt, tuple) else ():
                check_token_id(token, known, body.prompt_param(p))
        logprobs = body.logprob_count
        if logprobs is None and runs > body.choices:
            logprobs = 0  # best_of ranks by the tokens' logprobs
        jobs: list[GenerationJob] = []
        try:
            for p, prompt in enumerate(prompts):
                for r in range(runs):
                    seed = None if body.seed is None else (body.seed + r) % _SEEDS
                    request = GenerationRequest(
                        prompt, body.token_limit, body.sampler_config(known, seed), stops, {}, stop_tokens,
                        body.min_tokens or 0, body.repetition_penalty or 1.0, echo=body.echo_prompt,
                        logprobs=logprobs, score_by_decode=server.settings.score_by_decode, prompt_index=p)
                    jobs.append(cls._admit_one(server, body, request, weights, len(jobs), put, started,
                                               check if not jobs else None))
        except BaseException:
            for job in jobs:
                job.close()  # before prepare: releases its lease and admission only
            raise
        return cls(server, body, jobs)

    @staticmethod
    def _admit_one(server, body: CompletionBody | ChatBody, request: GenerationRequest,
                   weights: list[tuple[str, float]], index: int, put: Callable[[object], None] | None,
                   started: object, check: Callable[[object, list[tuple[str, float]]], None] | None
                   ) -> GenerationJob:
        try:
            lease = server.catalog.lease(name for name, _ in weights)
        except AdapterNotFoundError as exc:
            raise ApiError.from_status(exc, code="model_not_found", param=body.adapter_param(exc.name)) from None
        holder: list[GenerationJob] = []

        def release() -> None:
            lease.release()
            server.admission.finish(holder[0])

        try:
            if check is not None:
                check(lease, weights)
            job = server.job_class(
                server.engine, _with_adapters(request, lease.adapters(weights)),
                on_text=(lambda text: put((index, text))) if put is not None else None,
                on_start=(lambda: put((index, started))) if put is not None else None,
                on_close=release)
            holder.append(job)
            server.admission.admit(job)
        except BaseException:
            lease.release()
            raise
        return job

    def cancel(self) -> None:
        """Stops every job before its next step (any thread)."""
        for job in self.jobs:
            job.cancel()

    def echo_text(self, index: int) -> str:
        """The prompt text job ``index`` echoes before its completion ('' without echo)."""
        job = self.jobs[index]
        if not job.request.echo:
            return ""
        prompt = job.request.prompt
        return prompt if isinstance(prompt, str) else self._server.engine.tokenizer.decode(prompt)

    def logprobs(self, index: int, outcome: Outcome) -> dict | None:
        """Job ``index``'s logprobs object, as the request asked for it (``None``: not)."""
        count = self._body.logprob_count
        if count is None:
            return None
        read = TokenReader(self._server.engine.tokenizer, [outcome.prompt, outcome.tokens])
        if isinstance(self._body, ChatBody):
            return chat_logprobs(outcome.logprobs, read, count)
        entries = [*outcome.prompt_logprobs, *outcome.logprobs]
        return completion_logprobs(entries, read, [*outcome.prompt, *outcome.tokens])

    def answers(self, outcomes: Sequence[Outcome]) -> tuple[list[Answer], list[Outcome]]:
        """The answered choices (per prompt the ``n`` of its runs with the highest sum of
        logprobs when ``best_of`` ran more, in run order otherwise) and every outcome (what
        usage counts)."""
        body, runs = self._body, self._body.runs
        answers = []
        for p in range(len(outcomes) // runs):
            mine = list(range(p * runs, (p + 1) * runs))
            if runs > body.choices:
                mine = sorted(sorted(mine, key=lambda i: -outcomes[i].cumulative_logprob)[: body.choices])
            for k, i in enumerate(mine):
                answers.append(Answer(p * body.choices + k, outcomes[i], self.logprobs(i, outcomes[i]),
                                      self.echo_text(i)))
        return answers, list(outcomes)


def _with_adapters(request: GenerationRequest, adapters) -> GenerationRequest:
    return replace(request, adapters=adapters)
