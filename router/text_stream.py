"""A request's text as the client sees it: tokens detokenized incrementally, stop strings cut.
Pure (no grpc, asyncio or clock): the relay feeds it each engine update's new tokens."""

from __future__ import annotations

from dualpace.model.detokenizer import IncrementalDetokenizer


class StopStringMatcher:
    """Holds back text that might be the start of a stop string; cuts at a full match."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit)."""
        self.pending += text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out, False
        cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending = self.pending[:cut], ""
            return out, True
        safe = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:safe], self.pending[safe:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def pass_through(self, text: str) -> str:
        """Emit `text` (after anything held) without looking for stop strings."""
        return self.flush() + text


class TextStream:
    """Detokenizer plus stop strings for one request (skip_special_tokens, as the router answers).
    As in vLLM, stop strings are not looked for before min_tokens tokens."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...], min_tokens: int = 0):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=True)
        self.stops = StopStringMatcher(stop)
        self.min_tokens = min_tokens
        self.num_tokens = 0

    def push(self, token_ids: list[int]) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit) after `token_ids`."""
        self.num_tokens += len(token_ids)
        text = self.detokenizer.push(token_ids)
        if self.num_tokens < self.min_tokens:
            return self.stops.pass_through(text), False
        return self.stops.feed(text)

    def finish(self) -> str:
        """The rest of the text once the request ended without a stop string."""
        return self.stops.feed(self.detokenizer.flush())[0] + self.stops.flush()
