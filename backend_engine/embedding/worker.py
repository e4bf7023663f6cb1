"""An encoder's batches, run for asyncio callers on one thread of its own: off the event loop and beside the chat
model's engine thread. One batch at a time: requests take turns batch by batch, and a request whose client left
stops after the batch in hand."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from backend_engine.embedding.bert import Array
from backend_engine.embedding.encoder import SentenceEncoder


class EncoderWorker:
    def __init__(self, encoder: SentenceEncoder) -> None:
        self.encoder = encoder
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder")

    async def embed(self, inputs: list[list[int]]) -> list[Array]:
        """Each input's embedding, in order (cancelling drops the batches not yet run)."""
        vectors: dict[int, Array] = {}
        for batch in self.encoder.batches(inputs):
            done = self._thread.submit(self.encoder.embed_batch, [inputs[i] for i in batch])
            batch_vectors: list[Array] = await asyncio.wrap_future(done)
            vectors.update(zip(batch, batch_vectors, strict=True))
        return [vectors[i] for i in range(len(inputs))]

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
