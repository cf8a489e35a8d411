"""Tests of the n-gram / suffix drafting index (prompt lookup, SuffixDecoding-style cache, proposal trees)."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from specsplit.core import ngram as ng

FLAT = ng.Scoring(match_prior=(1.0,), backoff_weight=0.0)  # scores = plain frequencies


def ref_lookup(
    seqs: list[list[int]], context: list[int], min_n: int, max_n: int, depth: int, want: int, backoff: bool
) -> list[tuple[list[int], int]]:
    """Brute force: occurrences of the context's suffixes in ``seqs`` (oldest first), newest first."""
    out: list[tuple[list[int], int]] = []
    seen: set[tuple[int, int]] = set()
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        if len(out) >= want or (out and not backoff):
            break
        suffix = context[len(context) - n :]
        for s in range(len(seqs) - 1, -1, -1):
            seq = seqs[s]
            # An occurrence must have at least one token after it (for the session: before the end).
            for i in range(len(seq) - 2, n - 2, -1):
                if len(out) < want and seq[i - n + 1 : i + 1] == suffix and (s, i) not in seen:
                    seen.add((s, i))
                    out.append((seq[i + 1 : i + 1 + depth], n))
    return out


def as_pairs(conts: list[ng.Continuation]) -> list[tuple[list[int], int]]:
    return [(c.tokens, c.n) for c in conts]


def random_tree(rng: random.Random, size: int) -> ng.Proposal:
    """A random BFS-ordered tree whose scores come from a few values (many ties), child <= parent."""
    values = [1.0, 0.75, 0.5, 0.25, 0.125]
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    frontier = [-1]
    while len(parents) < size:
        nxt: list[int] = []
        for p in frontier + [rng.choice(frontier)] * (rng.random() < 0.3):
            for _ in range(rng.randint(1, 3)):
                if len(parents) < size and (rng.random() < 0.6 or not nxt):
                    parents.append(p)
                    depths.append(depths[p] + 1 if p >= 0 else 1)
                    scores.append(rng.choice([v for v in values if v <= (scores[p] if p >= 0 else 1.0)]))
                    nxt.append(len(parents) - 1)
        frontier = nxt
    return ng.Proposal(list(range(size)), parents, depths, scores)


# ---------------------------------------------------------------- prompt lookup basics


def test_repeated_phrase_proposes_its_continuation() -> None:
    idx = ng.NgramIndex(max_n=3, tokens=[1, 2, 3, 4, 5, 9, 1, 2, 3])
    prop = idx.propose(budget=16, max_depth=3)
    prop.validate()
    assert prop.token_ids == [4, 5, 9]
    assert prop.parents == [-1, 0, 1] and prop.depths == [1, 2, 3]
    assert prop.scores == [pytest.approx(ng.Scoring().prior(3))] * 3


def test_no_match_gives_empty_proposal() -> None:
    assert ng.NgramIndex(tokens=[1, 2, 3, 4]).propose() == ng.Proposal.empty()
    assert ng.NgramIndex().propose() == ng.Proposal.empty()
    assert ng.NgramIndex(tokens=[5]).lookup() == []


def test_min_n_and_max_n_are_respected() -> None:
    toks = [1, 7, 2, 3, 1]  # only a 1-token match
    assert ng.NgramIndex(min_n=1, tokens=toks).lookup() == [ng.Continuation([7, 2, 3, 1], 1)]
    assert ng.NgramIndex(min_n=2, tokens=toks).lookup() == []
    toks = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5]  # a 5-token match
    assert [c.n for c in ng.NgramIndex(max_n=3, tokens=toks).lookup(backoff=False)] == [3]
    assert [c.n for c in ng.NgramIndex(max_n=8, tokens=toks).lookup(backoff=False)] == [5]


def test_continuation_stops_at_the_end() -> None:
    assert as_pairs(ng.NgramIndex(tokens=[7, 8, 7]).lookup(max_depth=8)) == [([8, 7], 1)]
    # Overlapping repeats: "5 5 5" ended at position 2, followed only by the last token.
    conts = ng.NgramIndex(max_n=3, tokens=[5, 5, 5, 5]).lookup(max_depth=8, backoff=False)
    assert as_pairs(conts) == [([5], 3)]


def test_longest_match_wins() -> None:
    toks = [1, 2, 10, 0, 3, 2, 20, 0, 1, 2]  # "1 2" -> 10, "2" -> 20 (more recent, shorter)
    idx = ng.NgramIndex(max_n=4, tokens=toks)
    assert as_pairs(idx.lookup(max_depth=1, backoff=False)) == [([10], 2)]
    assert as_pairs(idx.lookup(max_depth=1)) == [([10], 2), ([20], 1)]
    prop = idx.propose(max_depth=1)
    assert prop.token_ids == [10, 20] and prop.scores[0] > prop.scores[1]
    assert idx.propose(max_depth=1, scoring=FLAT).token_ids == [10]


def test_max_matches_keeps_the_most_recent() -> None:
    toks = [9, 1, 9, 2, 9, 3, 9, 4, 9]
    conts = ng.NgramIndex(max_n=2, max_matches=2, tokens=toks).lookup(max_depth=1)
    assert as_pairs(conts) == [([4], 1), ([3], 1)]


# ---------------------------------------------------------------- trees


def test_branching_scores_are_frequencies() -> None:
    toks = [1, 2, 3, 5, 1, 2, 4, 6, 1, 2, 3, 7, 1, 2]
    prop = ng.NgramIndex(max_n=2, tokens=toks).propose(max_depth=2, scoring=FLAT)
    prop.validate()
    # [1 2] was followed by 3 7 (most recent), 4 6, 3 5: 3 twice, then 4; under 3: 7 (recent) then 5.
    assert prop.token_ids == [3, 4, 7, 5, 6]
    assert prop.parents == [-1, -1, 0, 0, 1]
    assert prop.depths == [1, 1, 2, 2, 2]
    assert prop.scores == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert prop.max_branch == 2 and prop.max_depth == 2 and prop.num_nodes == 5
    assert prop.expected_tokens(2) == pytest.approx(2.0)
    assert prop.top(1).token_ids == [3]
    assert prop.top(3).token_ids == [3, 4, 7]  # ties: shallower first, then lower index


def test_tree_scores_match_brute_force() -> None:
    rng = random.Random(1)
    sc = ng.Scoring(backoff_weight=0.5, depth_decay=0.9)
    for _ in range(200):
        toks = [rng.randrange(3) for _ in range(rng.randint(2, 60))]
        idx = ng.NgramIndex(max_n=4, tokens=toks)
        conts = idx.lookup(max_depth=4)
        prop = idx.propose(budget=1000, max_depth=4, scoring=sc)
        prop.validate()
        if not conts:
            assert prop.num_nodes == 0
            continue
        best = max(c.n for c in conts)
        ws = [sc.backoff_weight ** (best - c.n) for c in conts]
        paths: list[list[int]] = []
        for i, p in enumerate(prop.parents):
            paths.append((paths[p] if p >= 0 else []) + [prop.token_ids[i]])
            mass = sum(
                w * sc.prior(c.n)
                for c, w in zip(conts, ws, strict=True)
                if c.tokens[: len(paths[i])] == paths[i]
            )
            expect = mass / sum(ws) * sc.depth_decay ** (len(paths[i]) - 1)
            assert prop.scores[i] == pytest.approx(expect)
        # Every prefix of every continuation is a node, and nothing else.
        assert sorted(map(tuple, paths)) == sorted(
            {tuple(c.tokens[:d]) for c in conts for d in range(1, len(c.tokens) + 1)}
        )
        assert prop.num_nodes == len(set(map(tuple, paths)))
        small = idx.propose(budget=3, max_depth=4, scoring=sc)
        assert small == prop.top(3)


def test_top_k_on_random_trees() -> None:
    rng = random.Random(0)
    for _ in range(300):
        tree = random_tree(rng, rng.randint(1, 40))
        tree.validate()
        rank = sorted(range(tree.num_nodes), key=lambda i: (-tree.scores[i], tree.depths[i], i))
        for k in range(tree.num_nodes + 2):
            sub = tree.top(k)
            sub.validate()  # BFS order, parents earlier (closed under ancestors), monotone scores
            assert sub.token_ids == sorted(rank[:k])  # token_ids are the original indices
            assert sorted(sub.scores, reverse=True) == sorted(tree.scores, reverse=True)[:k]
            for i, p in enumerate(sub.parents):
                assert (p == -1) == (tree.parents[sub.token_ids[i]] == -1)
                if p >= 0:
                    assert sub.token_ids[p] == tree.parents[sub.token_ids[i]]
    assert ng.Proposal.empty().top(3) == ng.Proposal.empty()


def test_expected_curve_matches_expected_tokens() -> None:
    rng = random.Random(2)
    for _ in range(50):
        tree = random_tree(rng, rng.randint(1, 30))
        curve = tree.expected_curve()
        assert len(curve) == tree.num_nodes + 1 and curve[0] == 1.0
        for k in range(tree.num_nodes + 1):
            assert curve[k] == pytest.approx(tree.expected_tokens(k))
            assert curve[k] == pytest.approx(1.0 + sum(tree.top(k).scores))
    assert ng.Proposal.empty().expected_curve() == [1.0]


# ---------------------------------------------------------------- incremental index


@pytest.mark.parametrize("seed", range(6))
def test_incremental_equals_bulk_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(12):
        vocab, min_n, max_n = rng.randint(2, 6), rng.randint(1, 3), rng.randint(3, 6)
        toks = [rng.randrange(vocab) for _ in range(rng.randint(0, 400))]
        bulk = ng.NgramIndex(min_n, max_n, max_matches=rng.randint(1, 6), tokens=toks)
        inc = ng.NgramIndex(min_n, max_n, max_matches=bulk.max_matches)
        pos = 0
        while pos < len(toks):  # chunks below and above the numpy threshold
            step = rng.choice([1, 2, 5, rng.randint(1, 150)])
            inc.extend(toks[pos : pos + step])
            pos += step
            depth, backoff = rng.randint(1, 6), rng.random() < 0.7
            got = as_pairs(inc.lookup(depth, backoff=backoff))
            assert got == ref_lookup([toks[:pos]], toks[:pos], min_n, max_n, depth, inc.max_matches, backoff)
        assert inc._prevs == bulk._prevs and inc._lasts == bulk._lasts
        assert list(inc.tokens) == toks and len(inc) == len(toks)
        for depth in (1, 4):
            assert inc.propose(8, depth) == bulk.propose(8, depth)


def test_reset() -> None:
    idx = ng.NgramIndex(tokens=[1, 2, 3, 1, 2])
    assert idx.propose().num_nodes > 0
    idx.reset([4, 5, 6, 4])
    fresh = ng.NgramIndex(tokens=[4, 5, 6, 4])
    assert list(idx.tokens) == [4, 5, 6, 4] and idx._lasts == fresh._lasts and idx._prevs == fresh._prevs
    assert idx.propose() == fresh.propose()
    idx.reset()
    assert len(idx) == 0 and idx.propose() == ng.Proposal.empty()


def test_tokens_view_is_read_only() -> None:
    idx = ng.NgramIndex(tokens=[1, 2, 3])
    view = idx.tokens
    assert view[-2:] == [2, 3] and view[0] == 1 and len(view) == 3
    with pytest.raises(TypeError):
        view[0] = 5  # type: ignore[index]


def _genuine(seqs: list[list[int]], context: list[int], c: ng.Continuation) -> bool:
    suffix = context[len(context) - c.n :]
    return any(
        seq[i - c.n + 1 : i + 1] == suffix and seq[i + 1 : i + 1 + len(c.tokens)] == c.tokens
        for seq in seqs
        for i in range(c.n - 1, len(seq) - 1)
    )


def test_hash_collisions_never_give_wrong_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    # With multiplier 1 the hash is the sum of the tokens: collisions everywhere (both hash paths).
    monkeypatch.setattr(ng, "_B", 1)
    monkeypatch.setattr(ng, "_BN", np.uint64(1))
    rng = random.Random(6)
    for _ in range(100):
        toks = [rng.randrange(5) for _ in range(rng.randint(1, 200))]
        idx = ng.NgramIndex(max_n=5, tokens=toks[:100])
        idx.extend(toks[100:])
        conts = idx.lookup(max_depth=4)
        assert all(_genuine([toks], toks, c) for c in conts)
        assert len(conts) <= idx.max_matches
        cache = ng.SuffixCache(max_tokens=300, min_n=1, max_n=5, min_len=2)
        seqs = [[rng.randrange(5) for _ in range(rng.randint(2, 80))] for _ in range(3)]
        for seq in seqs:
            cache.add(seq)
        assert all(_genuine(seqs, toks, c) for c in cache.lookup(toks, max_depth=4))


def test_scoring_validation() -> None:
    with pytest.raises(ValueError):
        ng.Scoring(depth_decay=1.5)
    with pytest.raises(ValueError):
        ng.Scoring(match_prior=(0.0, 0.0))
    with pytest.raises(ValueError):
        ng.build_tree([([1], 1.0, 1.0)], 4, 4, depth_decay=0.0)
    with pytest.raises(ValueError):
        ng.NgramIndex(min_n=3, max_n=2)
    # Confidences above 1 count as 1; non-positive weights are skipped.
    prop = ng.build_tree([([1, 2], 1.0, 3.0), ([3], 0.0, 1.0)], 8, 8)
    assert prop.token_ids == [1, 2] and prop.scores == [1.0, 1.0]


# ---------------------------------------------------------------- SuffixCache


def test_cache_proposes_across_sequences() -> None:
    cache = ng.SuffixCache(min_len=2)
    cache.add([10, 11, 12, 13, 14, 15])
    idx = ng.NgramIndex(tokens=[99, 11, 12])
    assert idx.propose() == ng.Proposal.empty()
    prop = ng.propose_from(idx, cache, budget=8, max_depth=3)
    assert prop.token_ids == [13, 14, 15]
    conts = cache.lookup([99, 11, 12], max_depth=8)
    assert as_pairs(conts) == [([13, 14, 15], 2)] and conts[0].cached
    # The session's own match of the same length ranks ahead of the cache's.
    idx = ng.NgramIndex(tokens=[11, 12, 50, 11, 12])
    prop = ng.propose_from(idx, cache, budget=8, max_depth=1)
    assert prop.token_ids == [50, 13] and prop.scores[0] > prop.scores[1]


def test_cache_matches_brute_force_with_eviction() -> None:
    rng = random.Random(3)
    for _ in range(20):
        cache = ng.SuffixCache(max_tokens=rng.randint(20, 300), min_n=rng.randint(1, 2), max_n=5, min_len=2)
        live: list[list[int]] = []
        for _ in range(rng.randint(1, 25)):
            seq = [rng.randrange(4) for _ in range(rng.randint(0, 120))]
            cache.add(seq)
            seq = seq[-cache.max_tokens :]
            if len(seq) >= 2:
                live.append(seq)
                while sum(map(len, live)) > cache.max_tokens:
                    live.pop(0)
            ctx = [rng.randrange(4) for _ in range(rng.randint(0, 7))]
            depth, backoff = rng.randint(1, 5), rng.random() < 0.7
            got = as_pairs(cache.lookup(ctx, depth, backoff=backoff))
            assert got == ref_lookup(live, ctx, cache.min_n, 5, depth, cache.max_matches, backoff)
        assert len(cache) == sum(map(len, live)) and cache.num_sequences == len(live)


def _rebuilt_keys(cache: ng.SuffixCache) -> list[set[int]]:
    fresh = ng.SuffixCache(10**9, cache.min_n, cache.max_n, min_len=cache.min_len)
    for seq in cache._seqs.values():
        fresh.add(seq.tokens)
    return [set(d) for d in fresh._lasts]


def test_cache_eviction_bounds_memory_and_forgets() -> None:
    rng = random.Random(4)
    cache = ng.SuffixCache(max_tokens=2_000, min_n=2, max_n=6, min_len=4)
    marker = [1000, 1001, 1002, 1003, 1004, 1005]
    cache.add(marker)
    assert cache.lookup([1000, 1001])[0].tokens == [1002, 1003, 1004, 1005]
    levels = cache.max_n - cache.min_n + 1
    for _ in range(400):  # 50x max_tokens
        cache.add([rng.randrange(50) for _ in range(rng.randint(1, 500))])
        assert len(cache) <= cache.max_tokens
        assert cache.num_keys <= len(cache) * levels
    assert cache.lookup([1000, 1001]) == []  # evicted: no longer proposes
    assert [set(d) for d in cache._lasts] == _rebuilt_keys(cache)  # no leaked entries
    assert sum(len(s.tokens) for s in cache._seqs.values()) == len(cache)


def test_cache_thread_safety_smoke() -> None:
    cache = ng.SuffixCache(max_tokens=5_000, min_len=4)
    errors: list[Exception] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                cache.add([rng.randrange(30) for _ in range(rng.randint(4, 200))])
                for c in cache.lookup([rng.randrange(30) for _ in range(4)], max_depth=4):
                    assert 1 <= len(c.tokens) <= 4
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(cache) == sum(len(s.tokens) for s in cache._seqs.values()) <= cache.max_tokens
    assert [set(d) for d in cache._lasts] == _rebuilt_keys(cache)


# ---------------------------------------------------------------- performance report (never asserted)


def _best_us(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def _text(rng: random.Random, phrases: list[list[int]], n: int) -> list[int]:
    """Text-like tokens: a 32K vocabulary where half the pieces are recurring phrases."""
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(phrases) if rng.random() < 0.5 else [rng.randrange(32_000)]
    return out[:n]


def test_performance_report(capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(5)
    phrases = [[rng.randrange(32_000) for _ in range(rng.randint(3, 12))] for _ in range(60)]
    prompt, rest = _text(rng, phrases, 4096), _text(rng, phrases, 1500)
    build = _best_us(lambda: ng.NgramIndex(tokens=prompt), 5)
    build8 = _best_us(lambda: ng.NgramIndex(max_n=8, tokens=prompt), 5)
    idx = ng.NgramIndex(tokens=prompt)
    rounds: list[float] = []
    nodes = 0
    for r in range(300):
        t0 = time.perf_counter()
        idx.extend(rest[5 * r : 5 * r + 5])
        nodes += idx.propose(budget=16, max_depth=8).num_nodes
        rounds.append(time.perf_counter() - t0)
    cache = ng.SuffixCache(max_tokens=50_000)
    for _ in range(25):
        cache.add(_text(rng, phrases, 2000))
    cached: list[float] = []
    for _ in range(300):
        t0 = time.perf_counter()
        ng.propose_from(idx, cache, budget=16, max_depth=8)
        cached.append(time.perf_counter() - t0)
    add = _best_us(lambda: cache.add(_text(rng, phrases, 2000)), 5)  # each add evicts one sequence
    rounds.sort()
    cached.sort()
    with capsys.disabled():
        print(
            f"\n[ngram perf] NgramIndex build, 4096-token prompt: {build / 1e3:.2f} ms (levels "
            f"{idx.min_n}..{idx.max_n}), {build8 / 1e3:.2f} ms (levels 1..8); round extend(5)+propose(16): "
            f"median {rounds[150] * 1e6:.0f} us, p90 {rounds[270] * 1e6:.0f} us ({nodes / 300:.1f} nodes "
            f"avg); propose_from with a {len(cache)}-token SuffixCache: median {cached[150] * 1e6:.0f} us; "
            f"SuffixCache.add(2000 tokens) with eviction: {add / 1e3:.2f} ms"
        )
