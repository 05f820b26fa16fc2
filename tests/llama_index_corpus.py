"""Offline fixtures for the LlamaIndex tests: a hashing bag-of-words embedding, a small corpus
whose retrieval order each question controls, and a recorder of LLM events."""
from __future__ import annotations

import math
import re
import zlib

from llama_index.core.embeddings import BaseEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMChatStartEvent


class HashEmbedding(BaseEmbedding):
    """Bag of words hashed into `dim` buckets (crc32: the same in every process), L2-normalised."""

    dim: int = 512

    @classmethod
    def class_name(cls) -> str:
        return "HashEmbedding"

    def _vector(self, text: str) -> list[float]:
        vec = [0.0] * self.dim
        for word in re.findall(r"[a-z]{4,}", text.lower()):
            vec[zlib.crc32(word.encode()) % self.dim] += 1.0
        norm = math.sqrt(sum(v * v for v in vec)) or 1.0
        return [v / norm for v in vec]

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)


# Each topic word occurs in one document only, so a question's word counts set the ranking.
CORPUS = {
    "apples": (
        "Apples grow in the northern orchard, where the apples are picked by hand in late September. "
        "The orchard keeps twelve old apples varieties, and the cider press runs every weekend in October. "
        "Frost in spring can ruin the apples blossom, so the growers light small heaters between the rows."
    ),
    "honey": (
        "The honey comes from forty hives on the eastern meadow. Each hive gives about twenty kilograms "
        "of honey a year, and the honey is spun in a small shed beside the meadow. Beekeepers check the "
        "hives every week in summer and feed the colonies sugar syrup before winter."
    ),
    "copper": (
        "The copper mine closed in 1962 after ninety years of work. Its copper ore was carried by rail "
        "to the smelter on the river, and the copper tunnels now hold a museum. Visitors walk two "
        "hundred metres underground with a guide who worked in the copper mine as a young man."
    ),
    "dolphins": (
        "Dolphins visit the bay in July when the sardines arrive. Boat trips leave the harbour at dawn "
        "so that visitors can watch the dolphins feed, and a research team counts the dolphins from the "
        "lighthouse. Last summer they counted more than sixty dolphins in a single morning."
    ),
    "glacier": (
        "The glacier above the valley has lost a third of its length since 1900. Scientists measure the "
        "glacier each autumn with stakes drilled into the glacier ice, and a webcam on the ridge "
        "photographs the glacier snout every hour of the year."
    ),
}

# Questions whose top-3 nodes are the same or overlapping sets in different orders.
QUESTIONS = [
    "apples apples apples honey honey copper: what is grown and made here?",
    "copper copper copper apples apples honey: what happened to the mine?",
    "honey honey honey copper copper apples: how much does a hive give?",
    "dolphins dolphins dolphins apples apples copper: when do dolphins come?",
]


class LLMRecorder(BaseEventHandler):
    """Records the messages and the final raw of every LLM chat call (instrumentation events)."""

    calls: list = []

    @classmethod
    def class_name(cls) -> str:
        return "LLMRecorder"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatStartEvent):
            self.calls.append({"messages": event.messages, "raw": None})
        elif isinstance(event, LLMChatEndEvent) and self.calls and event.response is not None:
            self.calls[-1]["raw"] = event.response.raw

    def __enter__(self):
        self.calls = []
        get_dispatcher().add_event_handler(self)
        return self

    def __exit__(self, *exc) -> None:
        get_dispatcher().event_handlers.remove(self)
