"""The load of ``attnstore bench node``: N clients of the official ``openai`` package, each in a closed loop.

Every client is its own ``AsyncOpenAI`` (its own connections) with retries off,
so a failed request counts as an error instead of being sent again. Clients take
the next request from one shared list until it is empty, so every server
answers the same requests whatever its speed. Each answer's vectors are kept,
by request, for the fidelity the bench reports beside the speed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

_TIMEOUT_S = 300.0


async def warm_up(url: str, model: str, texts: list[str], requests: int = 8) -> None:
    """Send ``requests`` requests of a few of ``texts``, one after another (untimed)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=_TIMEOUT_S)
    try:
        for k in range(requests):
            batch = texts[k * 8 : k * 8 + 8] or texts[:8]
            await client.embeddings.create(model=model, input=batch)
    finally:
        await client.close()


async def run_load(url: str, model: str, requests: list[list[str]], clients: int) -> dict[str, Any]:
    """Send ``requests`` through ``clients`` concurrent clients; rows/s, latency percentiles, errors, and under
    ``vectors`` each request's answer, ``(len(request), dim)`` float32 (None where it failed)."""
    from openai import AsyncOpenAI

    pending = list(reversed(list(enumerate(requests))))
    answers: list[list[list[float]] | None] = [None] * len(requests)  # made arrays after the clock stops
    latencies: list[float] = []
    errors: list[str] = []
    rows = 0

    async def client_loop() -> None:
        nonlocal rows
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=_TIMEOUT_S)
        try:
            while pending:
                index, texts = pending.pop()
                started = time.perf_counter()
                try:
                    answer = await client.embeddings.create(model=model, input=texts)
                    if len(answer.data) != len(texts):
                        raise ValueError(f"{len(answer.data)} embeddings for {len(texts)} inputs")
                except Exception as exc:  # every failure is counted, whatever it is
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                latencies.append(time.perf_counter() - started)
                rows += len(texts)
                answers[index] = [item.embedding for item in answer.data]
        finally:
            await client.close()

    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(clients)))
    wall = time.perf_counter() - started
    client_cpu = time.process_time() - cpu
    vectors = [None if answer is None else np.array(answer, dtype=np.float32) for answer in answers]
    ms = np.array(latencies) * 1000.0 if latencies else np.array([float("nan")])
    return {
        "wall_s": wall, "rows": rows, "requests": len(latencies), "errors": len(errors), "error_samples": errors[:5],
        "rows_per_s": rows / wall, "requests_per_s": len(latencies) / wall,
        "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()), "client_cpu_s": client_cpu, "vectors": vectors,
    }
