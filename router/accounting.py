"""Usage and timings of one request, from the progress the router forwards: what the last gRPC message and the
OpenAI usage object report, and what the router's latency histograms observe."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.router.lifecycle import Progress


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from a prefix cache
    completion_tokens: int  # over every sample


@dataclass(frozen=True)
class Timings:
    """Seconds. ttft: arrival at the router to the first token; mean_itl: between later tokens. queue: waiting
    for a replica with room; prefill: the replica call to the first token, which in disaggregated mode includes
    transfer (the KV transfer's tail after the prefill replica sampled) and admission (the prefill replica's
    answer to the decode replica's first token: KV checks and joining its batch)."""

    ttft_s: float
    mean_itl_s: float
    e2e_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float = 0.0
    admission_s: float = 0.0


class Accounting:
    def __init__(self, arrival: float):
        self.arrival = arrival
        self.first = self.last = None
        self.completion_tokens = 0
        self.prompt_tokens = self.cached_tokens = 0
        self.queue_s = self.prefill_s = self.transfer_s = self.admission_s = 0.0
        self.prefill_queue_s = 0.0  # of prefill_s, the prefill replica's queue (disaggregated)
        self.prefill_route = ""  # where the prompt was prefilled (Progress.prefill_route), once known
        self.cut_by_length = False  # an output ended by max_tokens (or the model's length)

    def observe(self, progress: Progress, now: float) -> list[float]:
        """Takes one progress; returns the inter-token gaps it shows (seconds per token since the previous
        tokens, one entry per token after the first)."""
        if progress.prefill_route:  # the first progress of a request carries how long it queued and prefilled
            self.queue_s, self.prefill_s = progress.queue_s, progress.prefill_s
            self.transfer_s, self.admission_s = progress.transfer_s, progress.admission_s
            self.prefill_queue_s = progress.prefill_queue_s
            self.prefill_route = progress.prefill_route
        if progress.num_cached_tokens is not None:  # disaggregated: the prefill replica's cache hits
            self.cached_tokens = progress.num_cached_tokens
        count = 0
        for output in progress.outputs:
            if progress.num_cached_tokens is None:
                self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
            self.prompt_tokens = output.num_prompt_tokens
            self.cut_by_length |= output.finish_reason == "length"
            count += len(output.token_ids)
        if not count:
            return []
        # Tokens of one step arrive together: the time since the previous tokens is shared among them.
        gaps = [(now - self.last) / count] * count if self.last is not None else [0.0] * (count - 1)
        self.completion_tokens += count
        self.first = self.first if self.first is not None else now
        self.last = now
        return gaps

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached_tokens, self.completion_tokens)

    def timings(self, now: float) -> Timings:
        first = self.first if self.first is not None else now
        gaps = self.completion_tokens - 1
        itl = (self.last - self.first) / gaps if gaps > 0 and self.first is not None else 0.0
        return Timings(first - self.arrival, itl, now - self.arrival, self.queue_s, self.prefill_s, self.transfer_s,
                       self.admission_s)
