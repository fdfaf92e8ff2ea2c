"""Images (a model with a vision projector): the encoder thread and the reading of its rows.

An image is encoded only if the slot does not already hold it, on the encoder thread (the
vision encoder is the slow part: others go on decoding meanwhile); its rows are then read
like a prompt's tokens, a bounded piece per step beside generating sequences, in a decode of
their own (a batch holds tokens or embeddings, not both). Embeddings are kept after their
sequence, by content hash, so an image sent again is not encoded again.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from llmrun.engine.llama import ImageChunk
from llmrun.engine.sampling import Sampling
from llmrun.engine.sequence import Event, Sequence

log = logging.getLogger(__name__)

# Image embeddings kept after their sequence (by content hash, least recently used out), so
# an image sent again is not encoded again even when no slot holds it any more.
IMAGE_CACHE_BYTES = 128 * 1024 * 1024


class Encoder(Sampling):
    """The vision encoder's thread, the embeddings it made, and the image rows a step reads."""

    def _encode_loop(self) -> None:
        """The encoder thread: runs the vision encoder on the images a placed sequence
        needs, while the engine thread goes on decoding the others."""
        assert self.projector is not None
        while (job := self._to_encode.get()) is not None:
            seq, chunks = job
            try:
                t0 = time.perf_counter()
                rows = {chunk.digest: self.projector.encode(chunk) for chunk in chunks}
                log.info("request %s: %d image chunks (%d positions) encoded in %.2f s", seq.id,
                         len(chunks), sum(c.n_tokens for c in chunks), time.perf_counter() - t0)
                self._inbox.put(("encoded", (seq, rows)))
            except Exception as exc:
                self._inbox.put(("encoded", (seq, exc)))

    def _encoded(self, seq: Sequence, rows: dict[str, np.ndarray] | Exception) -> None:
        if seq.slot is None or seq.slot.seq is not seq:
            return  # cancelled meanwhile
        seq.encoding = False
        if isinstance(rows, Exception):
            events: list[Event] = []
            self._fail(seq, rows, events)
            self.emit(events)
            return
        seq.embeds.update(rows)
        for digest, value in rows.items():
            self._image_rows.pop(digest, None)
            self._image_rows[digest] = value
        total = sum(v.nbytes for v in self._image_rows.values())
        while total > IMAGE_CACHE_BYTES and len(self._image_rows) > 1:
            total -= self._image_rows.pop(next(iter(self._image_rows))).nbytes

    def _need_images(self, seq: Sequence, n: int) -> None:
        """The embeddings of the images `seq` reads beyond the `n` positions its slot holds:
        from the cache, else from the encoder thread (the sequence waits; others go on)."""
        missing: dict[str, ImageChunk] = {}
        slot = seq.slot
        assert slot is not None
        for start, chunk in seq.params.images:
            slot.images[start] = chunk.digest  # (its positions join slot.tokens as read)
            if start + chunk.n_tokens <= n or chunk.digest in seq.embeds:
                continue
            rows = self._image_rows.get(chunk.digest)
            if rows is not None:
                seq.embeds[chunk.digest] = rows
            else:
                missing[chunk.digest] = chunk  # (once, if it comes twice)
        if missing:
            seq.encoding = True
            if self._encoder is None:
                self._encoder = threading.Thread(target=self._encode_loop, daemon=True,
                                                 name="llmrun-vision")
                self._encoder.start()
            self._to_encode.put((seq, list(missing.values())))

    def _image_piece(self, seq: Sequence, budget: int, mixed: bool) -> int:
        """How many rows of the image `seq` reads next go in this step: what the budget
        allows (at least image_min_chunk beside others), or the whole image
        for a projector whose rows attend both ways (one decode, up to a batch)."""
        assert seq.slot is not None and self.projector is not None
        start, chunk = self._image_at(seq, len(seq.slot.tokens))
        left = start + chunk.n_tokens - len(seq.slot.tokens)
        if self.projector.non_causal:
            return left
        piece = max(budget, self.image_min_chunk) if mixed else budget
        return min(left, piece, self.embd_batch.capacity if self.embd_batch else 0)

    def _image_at(self, seq: Sequence, pos: int) -> tuple[int, ImageChunk]:
        for start, chunk in seq.params.images:
            if start <= pos < start + chunk.n_tokens:
                return start, chunk
        raise AssertionError(f"no image at position {pos}")

    def _read_image(self, seq: Sequence, n: int) -> int:
        """Decode the next `n` rows of the image `seq` is reading (their own decode: a batch
        holds tokens or embeddings). Returns llama_decode's code."""
        slot, batch, projector = seq.slot, self.embd_batch, self.projector
        assert slot is not None and batch is not None and projector is not None
        base = len(slot.tokens)
        start, chunk = self._image_at(seq, base)
        rows = seq.embeds[chunk.digest]
        batch.fill(rows[base - start: base - start + n], base, slot.seq_id)
        rc = self.ctx.decode(batch, causal=not projector.non_causal)
        if rc == 0:
            slot.tokens.extend(seq.pending[:n])
            del seq.pending[:n]
        return rc
