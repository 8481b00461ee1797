"""From sampled tokens to what a client sees: text deltas, stop strings, logprobs, finish reasons.

One stream per sample. Text is produced by the incremental detokenizer, then passed through the stop-string
matcher, which holds back text that might still become a stop string. A sample whose text hits a stop string
is reported here and finished by the engine; its output ends just before the stop string.

A resumed request (engine/core/resume.py) starts with a primed stream: its delivered output tokens were run through
the detokenizer and the matcher without being emitted (they reached the client from the replica that first
served it), so the stream holds back exactly what that replica's held back, and the next delta is the one it
would have emitted next.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from tandem.engine.core.scheduler import SeqUpdate
from tandem.engine.core.stop_strings import StopStringMatcher
from tandem.engine.request import RequestStatus, Sequence
from tandem.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of a generated token under the model's raw distribution, and the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sample of a request.

    token_ids/text/logprobs are new since the previous output of this sample (text may lag token ids while a
    character or a possible stop string is incomplete). finish_reason ("stop" | "length" | "abort") is set on
    the sample's last output; finished is True once every sample of the request has finished.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool
    # On the output carrying the sample's first token: when it was first scheduled (the engine process's
    # time.monotonic(); request traces split the queue from the prefill with it). None on the others.
    scheduled_at: float | None = None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and the same sample's next one as one (a step that emitted several tokens)."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (*(self.logprobs or ()), *(later.logprobs or ()))
        return replace(later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
                       logprobs=logprobs, scheduled_at=later.scheduled_at if self.scheduled_at is None else
                       self.scheduled_at)


class SampleStream:
    """The text state of one sample: its incremental detokenizer and its stop-string matcher."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]):
        self.detokenizer = tokenizer.detokenizer()
        self.matcher = StopStringMatcher(stops)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._streams: dict[str, SampleStream] = {}  # by seq id, made at a sample's first token unless primed
        self._samples_left: dict[str, int] = {}  # request id -> samples not finished yet

    def add_request(self, request_id: str, n: int, *, primed: Mapping[str, SampleStream] | None = None) -> None:
        """Expects the outputs of a request of n samples. primed: seq id -> the primed stream of a resumed
        sample (primed()); the caller has made sure the request id is new."""
        self._samples_left[request_id] = n
        self._streams.update(primed or {})

    def primed(self, seq: Sequence) -> SampleStream:
        """A stream that has seen seq's output tokens (a resumed request, engine/core/resume.py) without emitting
        them: the next delta continues the text the client already has. Registers nothing (add_request does).
        Raises ValueError when those tokens already complete a stop string (the request had finished)."""
        stream = SampleStream(self.tokenizer, seq.params.stop)
        for token_id in seq.output_token_ids:
            if stream.matcher.feed(stream.detokenizer.step(token_id)).stopped:
                raise ValueError("the delivered tokens already contain a stop string: the request had finished")
        return stream

    def process(self, update: SeqUpdate) -> tuple[RequestOutput, bool]:
        """The output of one sequence's new token. The flag is True when the text hit a stop string: the engine
        must then finish the sequence as FINISHED_STOPPED (the output already says "stop")."""
        seq, sampled = update.seq, update.sampled
        stream = self._streams.get(seq.seq_id)
        if stream is None:
            stream = self._streams[seq.seq_id] = SampleStream(self.tokenizer, seq.params.stop)
        check = stream.matcher.feed(stream.detokenizer.step(sampled.token_id))
        text, status = check.text, update.status
        if check.stopped:
            status = RequestStatus.FINISHED_STOPPED
        elif status is not None:
            text += stream.matcher.flush()
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = (TokenLogprob(sampled.token_id, sampled.logprob, sampled.top_logprobs),)
        return self._output(seq, (sampled.token_id,), text, logprobs, status), check.stopped

    def aborted(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The last outputs of an aborted request's unfinished samples; the last one says the request finished
        (samples not forked yet never produce output)."""
        outputs = [self._output(seq, (), "", None, RequestStatus.FINISHED_ABORTED) for seq in seqs]
        if outputs:
            self._samples_left.pop(seqs[0].request_id, None)
            outputs[-1] = replace(outputs[-1], finished=True)
        return outputs

    def _output(self, seq: Sequence, token_ids, text, logprobs, status: RequestStatus | None) -> RequestOutput:
        finished = False
        if status is not None:
            self._streams.pop(seq.seq_id, None)
            left = self._samples_left.get(seq.request_id, 1) - 1
            finished = left <= 0
            if finished:
                self._samples_left.pop(seq.request_id, None)
            else:
                self._samples_left[seq.request_id] = left
        first = bool(token_ids) and len(seq.output_token_ids) == len(token_ids)
        return RequestOutput(seq.request_id, seq.index, token_ids, text, logprobs,
                             status.finish_reason if status else None, seq.num_prompt_tokens,
                             seq.num_cached_tokens, finished, seq.scheduled_at if first else None)
