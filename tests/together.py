"""Requests sent one after another, then all at once from threads (so they share batch steps)."""
from __future__ import annotations

import threading

PROMPTS = [[{"role": "user", "content": f"Write a short sentence about the number {n}."}] for n in (3, 7, 11, 42)]


def serial_and_together(engine, prompts=PROMPTS, max_new_tokens: int = 12) -> tuple[list, list]:
    """(token ids of each prompt's reply alone, token ids when all run at once)."""
    serial = [engine.chat(p, max_new_tokens=max_new_tokens).token_ids for p in prompts]
    together = [None] * len(prompts)

    def work(i):
        together[i] = engine.chat(prompts[i], max_new_tokens=max_new_tokens).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return serial, together
