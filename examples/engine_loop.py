"""An engine loop on hostkv: a real transformer, real KV in shared host pages, real reuse.

Several worker processes attach one segment. Each runs a continuous-batching loop over
seeded traffic (long shared system prompts; multi-turn chats whose later turns resend the
earlier ones, answers included): allocate the batch with prefix reuse -> prefill only the
tokens not reused (the model reads the reused KV straight from the host pages) -> greedy
decode, appending tokens -> commit the pages whose KV is written -> release. A system prompt
one process computed is reused by the others.

Then the same requests run again without reuse, and the generated tokens must be identical,
bit for bit; the program exits 1 if any differs. Identical, not merely close: every
forward pass runs over whole page-aligned chunks of page_size rows, so a token's KV is
computed with the same shapes, hence the same floating-point operations, whether its page
was prefilled, decoded, or reused from another process.

With ``--remote URL`` (a Redis/Valkey server or cluster: ``redis://host:6379/0``,
``redis+cluster://h1:p1,h2:p2``), the reuse run spreads the chats over ``--hosts`` hosts
(default 2), one after another: each host is a segment of its own with its own workers, as
separate machines would be, and they share pages only through the remote tier. Before each
batch a worker asks the tier for the pages its local cache lacks; its commits are written
behind. The generated tokens must still match the no-reuse run exactly.

``--write-policy evict`` writes pages to the tier just before eviction instead of at commit
(see docs/remote.md); ``--pages N`` sizes each segment (default: half the
traffic's tokens, at least 512 pages), so a small N puts the hosts under eviction pressure.

    python examples/engine_loop.py [--workers 2] [--requests 48] [--seed 0] [--no-reuse]
                                   [--remote URL [--hosts 2] [--write-policy through|evict]]
                                   [--pages N]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import queue
import sys
import time
import uuid
from typing import Dict, List, Optional, Tuple

import numpy as np

try:
    import torch
except ImportError:  # pragma: no cover - the message is the point
    sys.exit("engine_loop.py needs torch: pip install torch==2.13.0 (the CPU build)")

import hostkv
import hostkv.remote          # needs redis-py only when --remote is used
from hostkv._progress import Progress

PAGE_SIZE = 16
VOCAB = 32_000
WIDTH = 256
HEADS = 8
HEAD_DIM = WIDTH // HEADS
LAYERS = 4
MLP = 4 * WIDTH
MAX_POSITIONS = 8192
BATCH = 4                   # sequences a worker allocates together


# -- the model --------------------------------------------------------------------------------

class TinyDecoder:
    """A decoder-only transformer (pre-norm, learned positions) with seeded random weights.

    Its KV cache is the hostkv page pool: a tensor [num_pages, LAYERS, 2, PAGE_SIZE, HEADS,
    HEAD_DIM] viewing the shared segment without a copy.
    """

    def __init__(self, seed: int, kv: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(seed)

        def weight(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * scale

        self.embed = weight(VOCAB, WIDTH, scale=1.0)
        self.positions = weight(MAX_POSITIONS, WIDTH, scale=0.1)
        self.layers = [
            {
                "qkv": weight(WIDTH, 3 * WIDTH, scale=1 / math.sqrt(WIDTH)),
                "out": weight(WIDTH, WIDTH, scale=1 / math.sqrt(WIDTH)),
                "up": weight(WIDTH, MLP, scale=1 / math.sqrt(WIDTH)),
                "down": weight(MLP, WIDTH, scale=1 / math.sqrt(MLP)),
            }
            for _ in range(LAYERS)
        ]
        self.head = weight(WIDTH, VOCAB, scale=1 / math.sqrt(WIDTH))
        self.kv = kv

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward_page(self, seq: "SequenceKV", tokens: np.ndarray, page_index: int,
                     valid: int) -> torch.Tensor:
        """Runs the PAGE_SIZE positions of page `page_index` of a sequence.

        tokens: the sequence's token ids (at least page_index * PAGE_SIZE + valid of them).
        Rows past `valid` are padding: computed, written, masked, and overwritten once real
        tokens arrive. Writes the page's K and V into the host page (and the sequence's
        working copy) and returns the final hidden states [PAGE_SIZE, WIDTH].
        """
        start = page_index * PAGE_SIZE
        seq.load(self.kv, page_index)
        chunk = np.zeros(PAGE_SIZE, dtype=np.int64)
        chunk[:valid] = tokens[start:start + valid]
        x = self.embed[torch.from_numpy(chunk)] + self.positions[start:start + PAGE_SIZE]
        keys = start + PAGE_SIZE
        mask = torch.arange(keys)[None, :] > torch.arange(start, start + PAGE_SIZE)[:, None]
        page = int(seq.pages[page_index])
        for layer_index, layer in enumerate(self.layers):
            h = self._norm(x)
            q, k, v = (h @ layer["qkv"]).view(PAGE_SIZE, 3, HEADS, HEAD_DIM).unbind(1)
            self.kv[page, layer_index, 0] = k
            self.kv[page, layer_index, 1] = v
            seq.local[layer_index, 0, page_index] = k
            seq.local[layer_index, 1, page_index] = v
            k_all = seq.local[layer_index, 0, :page_index + 1].reshape(keys, HEADS, HEAD_DIM)
            v_all = seq.local[layer_index, 1, :page_index + 1].reshape(keys, HEADS, HEAD_DIM)
            scores = torch.einsum("qhd,khd->hqk", q, k_all) / math.sqrt(HEAD_DIM)
            scores = scores.masked_fill(mask[None], float("-inf"))
            attention = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v_all)
            x = x + attention.reshape(PAGE_SIZE, WIDTH) @ layer["out"]
            x = x + torch.relu(self._norm(x) @ layer["up"]) @ layer["down"]
        seq.loaded = max(seq.loaded, page_index)
        return self._norm(x)

    def next_token(self, hidden_row: torch.Tensor) -> int:
        return int(torch.argmax(hidden_row[None] @ self.head, dim=-1))


class SequenceKV:
    """A sequence's working copy of its KV, [LAYERS, 2, pages, PAGE_SIZE, HEADS, HEAD_DIM],
    as an engine keeps it on its device: pages reused from the cache are copied in from the
    host pages once; pages this process computes are written to both."""

    def __init__(self, max_pages: int) -> None:
        self.local = torch.empty(LAYERS, 2, max_pages, PAGE_SIZE, HEADS, HEAD_DIM)
        self.pages = np.empty(0, dtype=np.int32)
        self.loaded = 0            # pages [0, loaded) are in self.local

    def load(self, kv: torch.Tensor, page_index: int) -> None:
        """Copies the host pages before page_index that are not in the working copy yet."""
        if self.loaded < page_index:
            wanted = torch.from_numpy(self.pages[self.loaded:page_index].astype(np.int64))
            host = kv.index_select(0, wanted)            # [n, LAYERS, 2, PAGE_SIZE, ...]
            self.local[:, :, self.loaded:page_index] = host.permute(1, 2, 0, 3, 4, 5)
            self.loaded = page_index


# -- traffic ------------------------------------------------------------------------------------

def make_chats(seed: int, num_requests: int) -> List[Dict]:
    """Seeded chats: each has a system prompt (one of a few, shared by many chats) and user
    turns; a turn's prompt is the whole conversation so far. Every turn is one request."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, int(rng.integers(1200, 2000)), dtype=np.int32) for _ in range(3)]
    chats = []
    requests = 0
    while requests < num_requests:
        turns = int(min(rng.integers(1, 5), num_requests - requests))
        chats.append({
            "chat_id": len(chats),
            "system": systems[len(chats) % len(systems)],
            "user_turns": [rng.integers(0, VOCAB, int(rng.integers(20, 60)), dtype=np.int32)
                           for _ in range(turns)],
            "answer_tokens": [int(rng.integers(4, 10)) for _ in range(turns)],
        })
        requests += turns
    return chats


# -- a worker process -----------------------------------------------------------------------------

def run_worker(name: str, worker_id: int, num_workers: int, chats: List[Dict], seed: int,
               events, remote: Optional[Tuple[str, str, str]] = None) -> None:
    """One engine worker: its share of the chats, BATCH conversations at a time, turn by turn.

    remote: (URL, key prefix, write policy) of the remote tier, or None for the host tier
    alone.
    """
    torch.set_num_threads(1)
    cache = hostkv.HostKVCache.attach(name)
    view = hostkv.WorkerView(cache)
    tier = None
    if remote is not None:
        tier = hostkv.remote.RemoteTier(
            cache, hostkv.remote.RemoteConfig(remote[0], key_prefix=remote[1],
                                              write_policy=remote[2]))
    model = TinyDecoder(seed, cache.pages_tensor())
    mine = [chat for index, chat in enumerate(chats) if index % num_workers == worker_id]
    outputs: Dict[Tuple[int, int], List[int]] = {}
    figures = {"requests": 0, "prompt_tokens": 0, "reused_tokens": 0, "prefill_tokens": 0,
               "remote_pages": 0, "tier_call_s": 0.0}
    start = time.perf_counter()
    for first in range(0, len(mine), BATCH):
        group = mine[first:first + BATCH]
        history = {chat["chat_id"]: chat["system"] for chat in group}
        for turn in range(max(len(chat["user_turns"]) for chat in group)):
            active = [chat for chat in group if turn < len(chat["user_turns"])]
            prompts = {chat["chat_id"]: np.concatenate([history[chat["chat_id"]],
                                                        chat["user_turns"][turn]])
                       for chat in active}
            seq_ids = [chat["chat_id"] * 100 + turn for chat in active]
            if tier is not None:
                # One round trip for the batch; an engine that can defer a request would
                # poll lookup.done() and schedule others meanwhile instead of waiting.
                lookups = tier.lookup_many([prompts[chat["chat_id"]] for chat in active])
                figures["remote_pages"] += sum(look.wait(30.0) for look in lookups)
            allocations = view.allocate_pages_for_sequences_with_prefix([
                hostkv.SequenceRequest(seq_id, prompts[chat["chat_id"]])
                for seq_id, chat in zip(seq_ids, active)])
            hidden = {}
            working = {}
            for seq_id, chat, alloc in zip(seq_ids, active, allocations):
                prompt = prompts[chat["chat_id"]]
                seq = working[seq_id] = SequenceKV(
                    len(prompt) // PAGE_SIZE + chat["answer_tokens"][turn] // PAGE_SIZE + 2)
                seq.pages = alloc.page_table
                first_page = alloc.reused_tokens // PAGE_SIZE      # shared pages are read-only
                last_page = (len(prompt) - 1) // PAGE_SIZE
                for page_index in range(first_page, last_page + 1):
                    valid = min(PAGE_SIZE, len(prompt) - page_index * PAGE_SIZE)
                    out = model.forward_page(seq, prompt, page_index, valid)
                hidden[seq_id] = out[(len(prompt) - 1) % PAGE_SIZE]
                figures["requests"] += 1
                figures["prompt_tokens"] += len(prompt)
                figures["reused_tokens"] += alloc.reused_tokens
                figures["prefill_tokens"] += len(prompt) - alloc.reused_tokens
            prompt_lengths = [len(prompts[c["chat_id"]]) for c in active]
            if tier is not None:        # commit, and write the new pages behind
                called = time.perf_counter()
                tier.commit(view, seq_ids, num_tokens=prompt_lengths)
                figures["tier_call_s"] += time.perf_counter() - called
            else:
                view.commit(seq_ids, num_tokens=prompt_lengths)
            answers = {seq_id: [] for seq_id in seq_ids}
            for step in range(max(chat["answer_tokens"][turn] for chat in active)):
                decoding = [(seq_id, chat) for seq_id, chat in zip(seq_ids, active)
                            if step < chat["answer_tokens"][turn]]
                tokens = [model.next_token(hidden[seq_id]) for seq_id, _ in decoding]
                view.append_tokens([seq_id for seq_id, _ in decoding], tokens)
                for (seq_id, _), token in zip(decoding, tokens):
                    answers[seq_id].append(token)
                    state = view.state(seq_id)
                    position = state.num_tokens - 1
                    working[seq_id].pages = state.pages
                    out = model.forward_page(working[seq_id], state.tokens, position // PAGE_SIZE,
                                             position % PAGE_SIZE + 1)
                    hidden[seq_id] = out[position % PAGE_SIZE]
                # Every appended token's KV is written now: publish what filled a page.
                if tier is not None:
                    called = time.perf_counter()
                    tier.commit(view, [seq_id for seq_id, _ in decoding])
                    figures["tier_call_s"] += time.perf_counter() - called
                else:
                    view.commit([seq_id for seq_id, _ in decoding])
            if tier is not None:
                called = time.perf_counter()
                tier.release(view, seq_ids)
                figures["tier_call_s"] += time.perf_counter() - called
            else:
                view.release(seq_ids)
            working.clear()
            for seq_id, chat in zip(seq_ids, active):
                outputs[(chat["chat_id"], turn)] = answers[seq_id]
                history[chat["chat_id"]] = np.concatenate(
                    [prompts[chat["chat_id"]], np.array(answers[seq_id], dtype=np.int32)])
                events.put(("progress", 1))
    figures["seconds"] = time.perf_counter() - start
    if tier is not None:
        tier.flush(60.0)              # the next host finds every page this one computed
        stats = tier.stats()
        figures["remote_written"] = stats.written_pages
        figures["remote_bytes_up"] = stats.bytes_up
        tier.close()
    del model
    view.close()
    cache.close()
    events.put(("done", worker_id, outputs, figures))


def run(chats: List[Dict], num_requests: int, workers: int, seed: int, reuse: bool, name: str,
        label: str, remote: Optional[Tuple[str, str, str]] = None, hosts: int = 1,
        pages: int = 0) -> Tuple[Dict, List[Dict], hostkv.CacheStats, float]:
    """Runs every chat on `workers` processes over a fresh segment; returns the outputs.

    With hosts > 1, host h runs the chats with chat_id % hosts == h on a segment of its
    own (`workers` processes each), the hosts one after another, sharing the remote tier."""
    if hosts > 1:
        outputs: Dict = {}
        per_worker: List[Dict] = []
        elapsed = 0.0
        for host in range(hosts):
            mine = [chat for chat in chats if chat["chat_id"] % hosts == host]
            count = sum(len(chat["user_turns"]) for chat in mine)
            host_out, host_workers, stats, host_elapsed = run(
                mine, count, workers, seed, reuse, f"{name}-h{host}", f"{label} h{host}", remote,
                pages=pages)
            outputs.update(host_out)
            per_worker += [{**w, "worker": f"h{host}.{w['worker']}", "host": host,
                            "host_evicted": stats.evicted_pages} for w in host_workers]
            elapsed += host_elapsed
        return outputs, per_worker, stats, elapsed
    total_tokens = sum(len(c["system"]) + sum(map(len, c["user_turns"])) + sum(c["answer_tokens"])
                       for c in chats)
    config = hostkv.HostKVConfig(
        num_pages=pages or max(512, total_tokens // PAGE_SIZE // 2), page_size=PAGE_SIZE,
        kv_layout=hostkv.KVLayout(LAYERS, HEADS, HEAD_DIM, "float32"),
        enable_prefix_reuse=reuse)
    cache = hostkv.HostKVCache.create(name, config)
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    processes = [context.Process(target=run_worker,
                                 args=(name, w, workers, chats, seed, events, remote))
                 for w in range(workers)]
    outputs = {}
    per_worker = []
    start = time.perf_counter()
    bar = Progress(label, num_requests)
    try:
        for p in processes:
            p.start()
        done = 0
        finished = 0
        while finished < workers:
            try:
                event = events.get(timeout=1.0)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in processes):
                    raise RuntimeError("a worker process failed")
                continue
            if event[0] == "progress":
                done += event[1]
                bar.update(done)
            else:
                _, worker_id, worker_outputs, figures = event
                outputs.update(worker_outputs)
                per_worker.append({"worker": worker_id, **figures})
                finished += 1
        for p in processes:
            p.join(timeout=60)
        elapsed = time.perf_counter() - start
        cache.check()
        stats = cache.stats()
    finally:
        bar.close()
        for p in processes:
            if p.is_alive():
                p.kill()
        cache.close()
        hostkv.HostKVCache.unlink_segment(name)
    return outputs, sorted(per_worker, key=lambda f: f["worker"]), stats, elapsed


def print_report(reuse_run, baseline_run, identical: Optional[bool]) -> None:
    rows = [("with reuse", reuse_run), ("no reuse", baseline_run)]
    print(f"{'run':<11} {'requests':>8} {'prompt tok':>11} {'reused':>8} {'hit rate':>8} "
          f"{'prefilled':>10} {'wall s':>7}")
    for label, run_result in rows:
        if run_result is None:
            continue
        _, per_worker, _, elapsed = run_result
        requests = sum(w["requests"] for w in per_worker)
        prompt = sum(w["prompt_tokens"] for w in per_worker)
        reused = sum(w["reused_tokens"] for w in per_worker)
        prefill = sum(w["prefill_tokens"] for w in per_worker)
        print(f"{label:<11} {requests:>8} {prompt:>11} {reused:>8} {reused / prompt:>8.1%} "
              f"{prefill:>10} {elapsed:>7.1f}")
    print()
    print(f"{'process':<11} {'requests':>8} {'prompt tok':>11} {'reused':>8} {'hit rate':>8} "
          f"{'prefilled':>10} {'busy s':>7}")
    for label, run_result in rows:
        if run_result is None:
            continue
        for w in run_result[1]:
            print(f"{label[:6] + ' ' + str(w['worker']):<11} {w['requests']:>8} "
                  f"{w['prompt_tokens']:>11} {w['reused_tokens']:>8} "
                  f"{w['reused_tokens'] / max(w['prompt_tokens'], 1):>8.1%} "
                  f"{w['prefill_tokens']:>10} {w['seconds']:>7.1f}")
    first = reuse_run or baseline_run
    stats = first[2]
    print(f"\ncache ({'with reuse' if reuse_run else 'no reuse'}): {stats.lookups} lookups, "
          f"{stats.hit_tokens} hit tokens, {stats.cached_pages} pages cached, "
          f"{stats.evicted_pages} evicted, {stats.free_pages} free at the end")
    if reuse_run is not None and any("remote_written" in w for w in reuse_run[1]):
        fetched = sum(w["remote_pages"] for w in reuse_run[1])
        written = sum(w.get("remote_written", 0) for w in reuse_run[1])
        bytes_up = sum(w.get("remote_bytes_up", 0) for w in reuse_run[1])
        tier_s = sum(w.get("tier_call_s", 0.0) for w in reuse_run[1])
        busy_s = sum(w["seconds"] for w in reuse_run[1])
        evicted = {w["host"]: w["host_evicted"] for w in reuse_run[1] if "host" in w}
        print(f"remote tier: {fetched} pages fetched ({fetched * PAGE_SIZE} tokens), "
              f"{written} pages written ({bytes_up / 2**20:.1f} MiB)")
        for host in sorted(evicted):
            host_fetched = sum(w["remote_pages"] for w in reuse_run[1] if w.get("host") == host)
            host_written = sum(w.get("remote_written", 0) for w in reuse_run[1]
                               if w.get("host") == host)
            print(f"  host {host}: {host_written} pages written, {host_fetched} fetched, "
                  f"{evicted[host]} evicted")
        print(f"  engine threads' time in tier.commit/release: {tier_s:.3f} s of {busy_s:.1f} s "
              "busy")
    if identical is not None:
        print("generated tokens identical with and without reuse: "
              + ("yes" if identical else "NO - outputs differ"))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--requests", type=int, default=48, help="requests in all (default 48)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-reuse", action="store_true",
                        help="only run without prefix reuse (no comparison)")
    parser.add_argument("--segment-name", default=f"hostkv-engine-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    parser.add_argument("--remote", metavar="URL",
                        help="share pages between hosts through a Redis/Valkey remote tier")
    parser.add_argument("--hosts", type=int, default=2,
                        help="hosts (segments) of the reuse run with --remote (default 2)")
    parser.add_argument("--write-policy", choices=("through", "evict"), default="through",
                        help="when the remote tier writes pages (default through)")
    parser.add_argument("--pages", type=int, default=0,
                        help="pages per segment (default: half the traffic, at least 512)")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.requests < 1 or args.hosts < 1 or args.pages < 0:
        parser.error("--workers, --requests and --hosts must be at least 1, --pages >= 0")
    remote = None
    if args.remote:
        try:
            hostkv.remote.RemoteConfig(args.remote, write_policy=args.write_policy)
        except hostkv.ConfigError as exc:
            parser.error(str(exc))
        # A fresh key prefix per run: the pages of another run (other weights) never match.
        remote = (args.remote, f"hostkv-engine-{uuid.uuid4().hex[:12]}", args.write_policy)
    chats = make_chats(args.seed, args.requests)
    try:
        reuse_run = None
        if not args.no_reuse:
            reuse_run = run(chats, args.requests, args.workers, args.seed, True,
                            args.segment_name, "reuse", remote,
                            args.hosts if remote else 1, pages=args.pages)
        baseline_run = run(chats, args.requests, args.workers, args.seed, False,
                           args.segment_name + "-base", "no reuse")
    except KeyboardInterrupt:
        print("interrupted; segments unlinked", file=sys.stderr)   # (run() ended the bar's line)
        return 130
    identical = None
    if reuse_run is not None:
        identical = reuse_run[0] == baseline_run[0]
    print_report(reuse_run, baseline_run, identical)
    return 0 if identical in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
