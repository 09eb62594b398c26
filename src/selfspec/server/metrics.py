"""Server metrics in Prometheus' text format (``GET /metrics``): requests, errors, queue, speed, acceptance."""

from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
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
        for name, kind, help_text, value in gauges:
            metric = f"selfspec_{name}"
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {value}"]
        return "\n".join(lines) + "\n"
