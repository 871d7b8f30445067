"""A small continuous-batching engine over :mod:`rotary.examples.decoder`, on one paged :class:`ModelCache`.

Each :meth:`Engine.step` is one forward of the model over every running sequence:

* **admission**: requests that have arrived (``Request.arrival`` <= the step) take a sequence slot with
  ``cache.add(tokens=prompt)`` while slots and pages allow, in arrival order; the others wait. A request is
  admitted only when the pages it can ever need (prompt + ``max_new_tokens``, for each of its ``n``
  continuations) fit beside those promised to the running requests, so a step never runs out of pages;
* **prefix reuse**: ``add(tokens=prompt)`` shares the full prompt pages that an earlier request left in the
  cache's prefix cache, and ``cache.lengths[slot]`` says how many prompt tokens need no prefill;
* **packed prefill + decode**: decoding sequences give one token each (plus draft tokens to verify), prefilling
  ones a chunk of their prompt within ``token_budget`` tokens a step; all of them go through the model in one
  packed forward (``cu_seqlens``): a *mixed* step;
* **greedy decoding and EOS**: the next token is the argmax of its logits (or sampled, ``temperature`` > 0); a
  continuation stops at ``eos_token_id`` or after ``max_new_tokens``, and its slot and pages go back;
* **parallel sampling by fork**: a request with ``n`` > 1 is prefilled once; its ``n - 1`` other continuations
  are ``cache.fork``-ed from it (the prompt's pages shared, a shared partial page copied on write);
* **speculative rollback**: with a ``draft`` (e.g. :func:`ngram_draft`), a decoding sequence feeds its last token
  and ``k`` proposed ones; one forward verifies them all, the tokens up to the first miss are kept (plus the
  model's own token there), and ``cache.truncate`` rolls the rejected ones back;
* **position-independent reuse**: :meth:`Engine.cache_document` prefills a document alone once and keeps its
  keys and values (``cache.export``); a :class:`Document` inside a request's prompt is then ``cache.insert``-ed
  at wherever it falls in that sequence (its keys re-rotated once, exactly) instead of being prefilled.

``python -m rotary.examples.engine`` runs a few requests of each kind on a random-weight Llama.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rotary import KVCacheFullError

from .decoder import Decoder


@dataclass(eq=False)
class Document:
    """A document's keys and values, computed once with nothing before it (positions 0 .. len(tokens) - 1):
    ``chunks`` holds one ``rotary.KVChunk`` per cache of the model (:meth:`Engine.cache_document`)."""

    tokens: list
    chunks: tuple


@dataclass(eq=False)
class Request:
    """A prompt to continue. ``prompt`` is token ids; a :class:`Document` among them stands for its tokens, whose
    keys and values are inserted from the document's cache (the prompt must end with a token id). ``n``
    continuations, each of up to ``max_new_tokens`` tokens; ``arrival``: the step it arrives at.

    The engine fills in ``outputs`` (``n`` token lists; ``tokens`` is the first), the steps it was
    ``admitted_at`` / ``finished_at``, and how its prompt got into the cache: ``cached_tokens`` from the prefix
    cache, ``prefilled_tokens`` through the model, ``inserted_tokens`` from documents."""

    prompt: list
    max_new_tokens: int
    n: int = 1
    arrival: int = 0
    outputs: list = field(default_factory=list)
    admitted_at: int | None = None
    finished_at: int | None = None
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    inserted_tokens: int = 0

    @property
    def tokens(self) -> list:
        return self.outputs[0]

    def segments(self) -> list:
        """The prompt as runs of token ids and documents, in order."""
        out = []
        for item in self.prompt:
            if isinstance(item, Document):
                out.append(item)
            elif out and isinstance(out[-1], list):
                out[-1].append(int(item))
            else:
                out.append([int(item)])
        return out

    def prompt_tokens(self) -> list:
        """Every prompt token id (documents' included)."""
        return [t for s in self.segments() for t in (s.tokens if isinstance(s, Document) else s)]


@dataclass(eq=False)
class _Sequence:
    """One continuation of a request in a cache slot: what of its prompt is still to go in (``todo``), every token
    id so far (``tokens``) and its output list. The cache holds ``tokens[:-1]`` between decode steps."""

    slot: int
    request: Request
    todo: list
    tokens: list
    out: list


def ngram_draft(tokens: list, k: int) -> list:
    """A toy draft model (prompt lookup): the ``k`` tokens that followed the last earlier occurrence of the last
    token, or nothing."""
    last = tokens[-1]
    for i in range(len(tokens) - 2, -1, -1):
        if tokens[i] == last:
            return tokens[i + 1:i + 1 + k]
    return []


class Engine:
    """Continuous batching over ``decoder`` on a paged cache of ``batch`` sequence slots and ``num_pages`` pages of
    ``page_size`` tokens (per kind of layer). Submit :class:`Request` objects and call :meth:`step` (or
    :meth:`run`). ``token_budget``: prompt tokens per step beyond the decode tokens; ``draft(tokens, k)`` proposes up
    to ``draft_tokens`` next tokens to verify (greedy only); ``temperature`` > 0 samples (``seed``).

    ``log`` holds each step's batch as ``(slot, "prefill" | "decode", tokens)``; ``accepted`` / ``rejected`` count
    the draft tokens verified."""

    def __init__(self, decoder: Decoder, *, batch: int, page_size: int, num_pages: int, token_budget: int = 32,
                 eos_token_id=None, draft=None, draft_tokens: int = 4, temperature: float = 0.0, seed: int = 0,
                 kv_dtype=None, backend="auto"):
        if draft is not None and temperature > 0:
            raise ValueError("speculative decoding here verifies greedy tokens: give temperature=0 with a draft")
        self.decoder = decoder
        self.cache = decoder.new_cache(batch, page_size=page_size, num_pages=num_pages, kv_dtype=kv_dtype,
                                       backend=backend)
        self.page_size, self.num_pages, self.batch = page_size, num_pages, batch
        self.token_budget, self.eos = token_budget, eos_token_id
        self.draft, self.draft_tokens = draft, draft_tokens
        self.temperature, self.rng = temperature, np.random.default_rng(seed)
        self.waiting: list = []      # submitted, not admitted, by arrival
        self.running: list = []      # the _Sequence of every slot in use
        self.clock = 0               # steps run
        self.log: list = []
        self.accepted = self.rejected = 0
        self._promised = {}          # request -> (pages, slots) it may hold at most
        self._live = {}              # request -> its continuations still running

    # -- requests ------------------------------------------------------------------------------------------------
    def _needs(self, req: Request):
        """Pages and slots a request may hold at most: its prompt's pages, and for each continuation the pages of
        its new tokens plus a copy of a shared partial page."""
        ps = self.page_size
        prompt = len(req.prompt_tokens())
        return -(-prompt // ps) + req.n * (-(-req.max_new_tokens // ps) + 1), req.n

    def submit(self, request: Request) -> Request:
        """Queue ``request`` (admitted at a step on or after its ``arrival``)."""
        segments = request.segments()
        if not segments or not isinstance(segments[-1], list):
            raise ValueError("a request's prompt must end with a token id (a document is followed by its question)")
        if request.n < 1 or request.max_new_tokens < 1:
            raise ValueError("n and max_new_tokens must be >= 1")
        pages, slots = self._needs(request)
        if pages > self.num_pages or slots > self.batch:
            raise ValueError(f"the request needs up to {pages} pages and {slots} slots; the cache has "
                             f"{self.num_pages} and {self.batch}")
        request.outputs = [[] for _ in range(request.n)]
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.arrival)   # stable: submission order within a step
        return request

    def _admit(self):
        """Admit arrived requests, first come first served, while their pages and slots fit."""
        while self.waiting and self.waiting[0].arrival <= self.clock:
            req = self.waiting[0]
            pages, slots = self._needs(req)
            held = np.sum(list(self._promised.values()), axis=0) if self._promised else (0, 0)
            if held[0] + pages > self.num_pages or held[1] + slots > self.batch:
                return                                     # it waits (and so do the ones behind it)
            self.waiting.pop(0)
            todo = req.segments()
            lead = todo[0] if isinstance(todo[0], list) else None
            slot = self.cache.add(tokens=lead)             # prefix reuse: full pages kept from earlier prompts
            req.cached_tokens = cached = int(self.cache.lengths[slot])
            if cached:
                todo[0] = lead[cached:]
            req.admitted_at = self.clock
            self._promised[req], self._live[req] = (pages, slots), 1
            self.running.append(_Sequence(slot, req, todo, req.prompt_tokens(), req.outputs[0]))

    def cache_document(self, tokens) -> Document:
        """Prefill ``tokens`` alone (positions 0 ..) in a free slot, keep their keys and values, free the slot."""
        held = np.sum(list(self._promised.values()), axis=0) if self._promised else (0, 0)
        if -(-len(tokens) // self.page_size) > self.num_pages - held[0] or held[1] >= self.batch:
            raise KVCacheFullError("no room to prefill the document beside the running requests")
        slot = self.cache.add()
        self.decoder.forward([list(tokens)], self.cache, [slot])
        chunks = self.cache.export(slot)
        self.cache.free([slot])
        return Document(list(tokens), chunks)

    # -- a step ----------------------------------------------------------------------------------------------------
    def step(self) -> list:
        """Admit, run one packed forward over every running sequence, pick tokens; returns the requests that
        finished in this step."""
        self._admit()
        batch, budget = [], self.token_budget
        for seq in self.running:                           # decode tokens first: the last token (+ a draft)
            if not seq.todo:
                draft = self._propose(seq)
                batch.append((seq, [seq.tokens[-1]] + draft, draft))
        for seq in self.running:                           # then prompt chunks, within the token budget
            if seq.todo:
                while seq.todo and isinstance(seq.todo[0], Document):
                    doc = seq.todo.pop(0)                  # position-independent reuse: re-rotated, not prefilled
                    self.cache.insert(seq.slot, doc.chunks)
                    seq.request.inserted_tokens += len(doc.tokens)
                if budget > 0:
                    chunk = seq.todo[0][:budget]
                    seq.todo[0] = seq.todo[0][len(chunk):]
                    if not seq.todo[0]:
                        seq.todo.pop(0)
                    budget -= len(chunk)
                    batch.append((seq, chunk, None))
        finished = []
        if batch:
            self.log.append([(seq.slot, "prefill" if draft is None else "decode", len(feed))
                             for seq, feed, draft in batch])
            logits = self.decoder.forward([feed for _, feed, _ in batch], self.cache, [s.slot for s, _, _ in batch],
                                          all_logits=True)
            start = 0
            for seq, feed, draft in batch:
                rows, start = logits[start:start + len(feed)], start + len(feed)
                if draft is None:
                    seq.request.prefilled_tokens += len(feed)
                    if not seq.todo:                       # the prompt is in: its continuations' first tokens
                        self._first_tokens(seq, rows[-1], finished)
                else:
                    self._verify(seq, draft, rows, finished)
        self.clock += 1
        return finished

    def run(self, requests=()) -> list:
        """Submit ``requests`` and step until every request has finished; returns them."""
        requests = [self.submit(r) for r in requests]
        while self.waiting or self.running:
            self.step()
        return requests

    # -- tokens --------------------------------------------------------------------------------------------------
    def _pick(self, row) -> int:
        if self.temperature <= 0:
            return int(np.argmax(row))
        p = np.exp((row - row.max()) / self.temperature)
        return int(self.rng.choice(row.size, p=p / p.sum()))

    def _first_tokens(self, seq: _Sequence, row, finished: list):
        """Fork the other n - 1 continuations from the prefilled sequence (pages shared), then give each its first
        token from the last prompt token's logits."""
        req, family = seq.request, [seq]
        for j in range(1, req.n):
            twin = _Sequence(self.cache.fork(seq.slot), req, [], list(seq.tokens), req.outputs[j])
            self.running.append(twin)
            family.append(twin)
        self._live[req] = req.n
        for s in family:
            self._emit(s, self._pick(row), finished)

    def _propose(self, seq: _Sequence) -> list:
        """Draft tokens to verify (never more than the continuation may still emit, less one)."""
        k = min(self.draft_tokens, seq.request.max_new_tokens - len(seq.out) - 1)
        if self.draft is None or k <= 0:
            return []
        return [int(t) for t in self.draft(seq.tokens, k)][:k]

    def _verify(self, seq: _Sequence, draft: list, rows, finished: list):
        """Keep the draft up to its first token the model disagrees with, emit the model's tokens, and roll the
        cache back over the rejected draft tokens (``truncate``)."""
        for j, row in enumerate(rows):
            token = self._pick(row)
            if not self._emit(seq, token, finished):
                return                                     # finished: its slot and pages are gone already
            if j == len(draft) or token != draft[j]:
                break
            self.accepted += 1
        self.rejected += len(draft) - j
        keep = len(seq.tokens) - 1                         # every token but the newest one is in the cache
        if self.cache.lengths[seq.slot] > keep:
            self.cache.truncate([seq.slot], keep)

    def _emit(self, seq: _Sequence, token: int, finished: list) -> bool:
        """Append ``token``; a continuation that ends (EOS, max_new_tokens) frees its slot. True while it runs."""
        seq.tokens.append(token)
        seq.out.append(token)
        if token != self.eos and len(seq.out) < seq.request.max_new_tokens:
            return True
        self.cache.free([seq.slot])
        self.running.remove(seq)
        req = seq.request
        self._live[req] -= 1
        if not self._live[req]:                            # the request's last continuation: its promise is over
            del self._live[req], self._promised[req]
            req.finished_at = self.clock
            finished.append(req)
        return False


def main():
    """A few requests on a random-weight Llama: arrivals, waiting, fork, prefix reuse, a draft, a document."""
    from .decoder import Config, hf_config, random_weights

    cfg = Config.from_hf(hf_config("llama"))
    decoder = Decoder(cfg, random_weights(cfg, seed=1, dtype=np.float64))
    engine = Engine(decoder, batch=4, page_size=4, num_pages=24, token_budget=8, draft=ngram_draft)
    doc = engine.cache_document([40, 41, 42, 43, 44, 45])
    system = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    requests = engine.run([Request(system + [10, 11], 6), Request(system + [12], 6, arrival=2),
                           Request([7, 8, 9], 5, n=3, arrival=1), Request([1, 2, doc, 50, 51], 6, arrival=3)])
    for r in requests:
        print(f"arrived {r.arrival}, admitted {r.admitted_at}, finished {r.finished_at}: prompt tokens cached "
              f"{r.cached_tokens}, prefilled {r.prefilled_tokens}, inserted {r.inserted_tokens} -> {r.outputs}")
    print(f"{engine.clock} steps; draft tokens accepted {engine.accepted}, rejected {engine.rejected}")


if __name__ == "__main__":
    main()
