"""``pagedllm serve --request-log``: one JSON line per finished request, in the trace format
that ``pagedllm plan`` replays (``planner/trace.py``).

Each line: ``arrival`` (seconds since the log was opened), ``prompt_tokens``,
``output_tokens`` (of the first sample) and, when the request found part of its prompt in the
prefix cache, ``prefix_id`` (a hash of those tokens) with ``prefix_tokens`` (their count), so
that requests which shared a cached prefix share it again in the replay. No text or token id
is written. Requests that generated nothing (aborted before their first token, refused) are
not logged. Written by the engine thread when it hands out the final output.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Optional, Union

from pagedllm.outputs import RequestOutput


def trace_line(arrival: float, num_prompt_tokens: int, output_tokens: int,
               prefix_id: Optional[str] = None, prefix_tokens: int = 0) -> str:
    """One line of the trace format (no newline); the prefix fields only with ``prefix_tokens``."""
    record: dict[str, Any] = {"arrival": round(arrival, 6), "prompt_tokens": num_prompt_tokens,
                              "output_tokens": output_tokens}
    if prefix_tokens:
        record["prefix_id"] = prefix_id
        record["prefix_tokens"] = prefix_tokens
    return json.dumps(record)


class RequestLog:
    """Appends finished requests to ``path`` (line-buffered, so a crash loses at most one).

    Args:
        path: the JSONL file (appended to; created if missing).

    Raises:
        ValueError: the file cannot be opened.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        try:
            self._file = open(path, "a", buffering=1, encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot open --request-log {path}: {exc.strerror or exc}") from None
        self._start = time.monotonic()
        self._arrivals: dict[str, float] = {}

    def added(self, request_id: str, arrival_time: float) -> None:
        """A request was accepted; ``arrival_time`` is ``time.monotonic()`` seconds."""
        self._arrivals[request_id] = arrival_time

    def finished(self, output: RequestOutput) -> None:
        """Write the line of a finished request (its id must have been ``added``)."""
        arrival = self._arrivals.pop(output.request_id, None)
        if arrival is None or not output.outputs or not output.outputs[0].token_ids:
            return
        cached = output.num_cached_tokens
        prefix_id = hashlib.blake2b(repr(output.prompt_token_ids[:cached]).encode(), digest_size=8).hexdigest() \
            if cached else None
        self._file.write(trace_line(max(0.0, arrival - self._start), len(output.prompt_token_ids),
                                    len(output.outputs[0].token_ids), prefix_id, cached) + "\n")

    def close(self) -> None:
        self._file.close()
