"""Server metrics in Prometheus' text format (``GET /metrics``): requests, errors, queue, speed, acceptance,
queue wait and time to first token (summaries: sum and count), the prefix store's hits and reused tokens, and
the batches of concurrent requests' verification passes (passes, sequences and rows in them)."""

from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    def __init__(self, prefix_store=None, batcher=None) -> None:
        self._lock = threading.Lock()
        self.prefix_store = prefix_store  # a PrefixStore whose counters are reported (None: none)
        self.batcher = batcher  # a StepBatcher whose passes are reported (None: one request at a time)
        self.waits: list[float] = [0.0, 0]  # sum of seconds, count
        self.first_tokens: list[float] = [0.0, 0]
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status)
        self.queue_length = 0
        self.generations = 0
        self.new_tokens = 0
        self.drafted = 0
        self.accepted = 0
        self.forwards = 0
        self.decode_seconds = 0.0
        self.last_tokens_per_second = 0.0
        self.last_acceptance = 0.0
        self.last_mean_generated_length = 0.0

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def observe_wait(self, seconds: float) -> None:
        """A request left the queue after ``seconds``."""
        with self._lock:
            self.waits[0] += seconds
            self.waits[1] += 1

    def observe_first_token(self, seconds: float) -> None:
        """A request's first token came ``seconds`` after it arrived."""
        with self._lock:
            self.first_tokens[0] += seconds
            self.first_tokens[1] += 1

    def observe(self, stats) -> None:
        with self._lock:
            self.generations += 1
            self.new_tokens += stats.new_tokens
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            self.forwards += stats.forwards
            self.decode_seconds += stats.total_time
            self.last_tokens_per_second = stats.tokens_per_second
            self.last_acceptance = stats.acceptance_rate
            self.last_mean_generated_length = stats.mean_generated_length

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP selfspec_requests_total HTTP requests by endpoint and status code.",
                "# TYPE selfspec_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'selfspec_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            errors = sum(n for (_, status), n in self.requests.items() if status >= 400)
            M = self.new_tokens / self.forwards if self.forwards else 0.0
            gauges = [
                ("request_errors_total", "counter", "HTTP requests answered with a 4xx or 5xx status.", errors),
                ("queue_length", "gauge", "Requests waiting or being decoded.", self.queue_length),
                ("generations_total", "counter", "Completed generations.", self.generations),
                ("generated_tokens_total", "counter", "New tokens generated.", self.new_tokens),
                ("drafted_tokens_total", "counter", "Tokens drafted.", self.drafted),
                ("accepted_tokens_total", "counter", "Drafted tokens the full model kept.", self.accepted),
                ("decode_seconds_total", "counter", "Time spent generating.", self.decode_seconds),
                ("tokens_per_second", "gauge", "Tokens per second of the last generation.",
                 self.last_tokens_per_second),
                ("acceptance_rate", "gauge", "Accepted / drafted tokens of the last generation.", self.last_acceptance),
                ("mean_generated_length", "gauge", "M: new tokens per full-model forward, all generations.", M),
            ]  # fmt: skip
            for name, help_text, (total, count) in (
                ("queue_wait_seconds", "Time requests waited in the queue before decoding began.", self.waits),
                ("time_to_first_token_seconds", "Time from a request's arrival to its first token (queue wait, "
                 "prefill and the first token).", self.first_tokens),
            ):  # fmt: skip
                metric = f"selfspec_{name}"
                lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} summary", f"{metric}_sum {total}",
                          f"{metric}_count {count}"]  # fmt: skip
        store = self.prefix_store.stats() if self.prefix_store is not None else None
        if store is not None:
            gauges += [
                ("prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.", store.lookups),
                ("prefix_cache_hits_total", "counter", "Prompts whose prefix came from the prefix cache.", store.hits),
                ("prefix_cache_reused_tokens_total", "counter", "Prompt tokens whose keys and values came from the "
                 "prefix cache (not prefilled).", store.reused_tokens),
                ("prefix_cache_prefilled_tokens_total", "counter", "Prompt tokens prefilled after a lookup.",
                 store.prefilled_tokens),
                ("prefix_cache_entries", "gauge", "Sequences held in the prefix cache.", store.entries),
                ("prefix_cache_bytes", "gauge", "Memory held by the prefix cache.", store.bytes),
                ("prefix_cache_max_bytes", "gauge", "The prefix cache's memory bound.", store.max_bytes),
                ("prefix_cache_evictions_total", "counter", "Sequences evicted from the prefix cache.",
                 store.evictions),
            ]  # fmt: skip
        if self.batcher is not None:
            batches = self.batcher.stats
            gauges += [
                ("batch_passes_total", "counter", "Verification passes run for concurrent requests together.",
                 batches.passes),
                ("batch_sequences_total", "counter", "Requests' rounds in those passes (over passes: the mean "
                 "batch size).", batches.sequences),
                ("batch_rows_total", "counter", "Token rows verified in those passes.", batches.rows),
                ("batch_members", "gauge", "Requests decoding together now.", self.batcher.members),
            ]  # fmt: skip
        for name, kind, help_text, value in gauges:
            metric = f"selfspec_{name}"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {value}"]
        return "\n".join(lines) + "\n"
