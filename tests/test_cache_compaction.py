"""The tree forward and KV compaction, over many random trees (hypothesis), against plain forwards.

For a random prefix, anchor, tree and accepted root-to-node path:
  - every tree row's logits equal a fresh forward over prefix + anchor + that node's root path;
  - after compact(), the next token's logits from the cache equal a fresh forward over the committed text.
Also the tree helpers: ancestor_matrix, DraftTree.dedup, DraftTree.truncate_depth.
"""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treegen.engine.cache as cache_module
import treegen.engine.tree as tree_module
from treegen.engine.cache import cache_length, compact, new_cache
from treegen.engine.tree import DraftTree, ancestor_matrix, node_depths, verification_inputs

VOCAB = 64
ATOL = 1e-4
MODELS = {"qwen3": tiny_qwen3(vocab=VOCAB), "llama": tiny_llama(vocab=VOCAB)}
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def first_capacity():
    """Tests here may start the cache's buffers small; every other test gets the default back."""
    saved = cache_module.MIN_CAPACITY
    yield
    cache_module.MIN_CAPACITY = saved


@st.composite
def trees(draw, max_nodes: int = 14, vocab: int = VOCAB, allow_empty: bool = True):
    """A random tree: parents[i] in [-1, i), tokens from a small range so duplicate siblings happen."""
    n = draw(st.integers(0 if allow_empty else 1, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def root_path(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the anchor's child down to node (empty for node -1)."""
    parents, path = tree.parents.tolist(), []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("capacity", [256, 4], ids=["one-buffer", "grown"])
@pytest.mark.parametrize("name", list(MODELS))
@SETTINGS
@given(data=st.data())
def test_tree_rows_and_compacted_cache_match_fresh_forward(name, capacity, data):
    cache_module.MIN_CAPACITY, model = capacity, MODELS[name]   # put back after the test (fixture below)
    prefix = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12), "prefix")
    anchor = data.draw(st.integers(0, VOCAB - 1), "anchor")
    tree = data.draw(trees(), "tree")
    end = data.draw(st.integers(-1, len(tree) - 1), "accepted leaf")  # -1: no draft accepted
    bonus = data.draw(st.integers(0, VOCAB - 1), "bonus")
    past = len(prefix)

    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
        ids, pos, mask = verification_inputs(anchor, tree, past, model.dtype)
        tree_logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache,
                            use_cache=True).logits[0]
    assert cache_length(cache) == past + len(tree) + 1

    for node in range(-1, len(tree)):  # each row sees exactly its own root path
        path_tokens = tree.tokens[root_path(tree, node)].tolist()
        expected = fresh_logits(model, prefix + [anchor] + path_tokens)[-1]
        torch.testing.assert_close(tree_logits[node + 1], expected, atol=ATOL, rtol=0)

    path = root_path(tree, end)
    compact(cache, past, [0] + [i + 1 for i in path])
    committed = prefix + [anchor] + tree.tokens[path].tolist()
    assert cache_length(cache) == len(committed)
    with torch.no_grad():
        nxt = model(input_ids=torch.tensor([[bonus]]), position_ids=torch.tensor([[len(committed)]]),
                    cache=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(nxt, fresh_logits(model, committed + [bonus])[-1], atol=ATOL, rtol=0)


def test_two_rounds_of_compaction_in_a_row():
    """Compaction leaves a cache that the next tree round builds on (rows past the first round)."""
    model = MODELS["qwen3"]
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 1, 2, 0]))
    cache, committed = new_cache(model), [1, 2, 3]
    with torch.no_grad():
        model(input_ids=torch.tensor([committed[:-1]]), cache=cache, use_cache=True)
        for leaf in (3, 4, -1, 2):
            past = len(committed) - 1
            ids, pos, mask = verification_inputs(committed[-1], tree, past, model.dtype)
            model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True)
            path = root_path(tree, leaf)
            compact(cache, past, [0] + [i + 1 for i in path])
            committed += tree.tokens[path].tolist() + [11]   # accepted drafts, then a bonus token
        out = model(input_ids=torch.tensor([[committed[-1]]]), position_ids=torch.tensor([[len(committed) - 1]]),
                    cache=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(out, fresh_logits(model, committed)[-1], atol=ATOL, rtol=0)


# --- tree helpers ------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(tree=trees(max_nodes=20))
def test_ancestor_matrix_is_the_ancestor_relation(tree):
    """Both forms: the list walk small host trees take and the tensor walk of the others."""
    n = len(tree)
    for allowed in (ancestor_matrix(tree), tree_module._ancestors_on_device(tree)):
        assert allowed.shape == (n + 1, n + 1) and allowed.dtype == torch.bool
        for row in range(n + 1):
            ancestors = {0} | {i + 1 for i in root_path(tree, row - 1)}
            assert set(allowed[row].nonzero().flatten().tolist()) == ancestors


@settings(max_examples=300, deadline=None)
@given(tree=trees(max_nodes=20, vocab=3))
def test_dedup_is_a_trie_of_the_same_paths(tree):
    out = tree.dedup()
    parents, tokens = out.parents.tolist(), out.tokens.tolist()
    assert all(p < i for i, p in enumerate(parents))
    assert out.depth.tolist() == node_depths(parents).tolist()
    assert len(set(zip(parents, tokens))) == len(out), "duplicate siblings remain"

    def path(t: DraftTree, i: int) -> tuple[int, ...]:
        return tuple(t.tokens[root_path(t, i)].tolist())
    # the spec: every root path of the input once (a twin's subtree moves under the first), in the order
    # each path first appears
    first_seen: list[tuple[int, ...]] = []
    for i in range(len(tree)):
        if path(tree, i) not in first_seen:
            first_seen.append(path(tree, i))
    assert [path(out, i) for i in range(len(out))] == first_seen
    if len(set(zip(tree.parents.tolist(), tree.tokens.tolist()))) == len(tree):
        assert out is tree  # nothing to merge: the tree itself comes back


@settings(max_examples=300, deadline=None)
@given(tree=trees(max_nodes=20), max_depth=st.integers(0, 6))
def test_truncate_depth_keeps_the_shallow_part(tree, max_depth):
    out = tree.truncate_depth(max_depth)
    keep = [i for i in range(len(tree)) if int(tree.depth[i]) <= max_depth]
    assert out.tokens.tolist() == tree.tokens[keep].tolist()
    assert all(p < i for i, p in enumerate(out.parents.tolist()))
    assert out.depth.tolist() == node_depths(out.parents.tolist()).tolist()
    for new, old in enumerate(keep):  # same root paths, token for token
        assert out.tokens[root_path(out, new)].tolist() == tree.tokens[root_path(tree, old)].tolist()


def test_chain_and_empty_trees():
    chain = DraftTree.chain(torch.tensor([4, 4, 4]))
    assert chain.parents.tolist() == [-1, 0, 1] and chain.depth.tolist() == [1, 2, 3]
    assert chain.dedup() is chain  # equal tokens at different depths are not siblings
    assert torch.equal(ancestor_matrix(chain), torch.ones(4, 4, dtype=torch.bool).tril())
    empty = DraftTree.empty()
    assert len(empty) == 0 and ancestor_matrix(empty).tolist() == [[True]]
    ids, pos, mask = verification_inputs(7, empty, 5, torch.float32)
    assert ids.tolist() == [[7]] and pos.tolist() == [[5]] and mask.shape == (1, 1, 1, 6) and not mask.any()
    with pytest.raises(ValueError, match="one length"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1]))
    for bad in ([1, -1], [-1, 1], [-2, 0]):
        with pytest.raises(ValueError, match="parents must come before children"):
            DraftTree(torch.tensor([1, 2]), torch.tensor(bad))


def test_the_cache_grows_in_place_and_keeps_every_row(monkeypatch):
    """Buffers that start at 4 positions and double: prefill, then steps of several causal rows of which a
    prefix is kept (the rest cropped); every step's logits equal a fresh forward over the committed text.
    (Trees, whose kept rows move, are the test above; with these buffers too, below.)"""
    monkeypatch.setattr(cache_module, "MIN_CAPACITY", 4)
    model = MODELS["qwen3"]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(VOCAB, (3,), generator=gen).tolist()
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        for step in range(12):
            rows = torch.randint(VOCAB, (1 + step % 4,), generator=gen).tolist()
            got = model(input_ids=torch.tensor([rows]), past_key_values=cache, use_cache=True).logits[0]
            torch.testing.assert_close(got[-1], fresh_logits(model, ids + rows)[-1], atol=ATOL, rtol=ATOL)
            keep = list(range(1 + step % len(rows)))
            compact(cache, len(ids), keep)
            ids += [rows[k] for k in keep]
            assert cache_length(cache) == len(ids)
    assert cache.layers[0]._keys.shape[-2] >= len(ids) > 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_compaction_moves_the_rows_torch_moves(dtype, monkeypatch):
    """compact()'s one compiled call over every layer's buffers against its per-layer tensor ops."""
    gen = torch.Generator().manual_seed(0)
    model = MODELS["qwen3"]
    past, rows, keep = 9, 7, [0, 2, 3, 6]
    caches = []
    for _ in range(2):
        cache = new_cache(model)
        for layer in cache.layers:
            layer.update(torch.randn(1, 2, past + rows, 8, generator=gen).to(dtype),
                         torch.randn(1, 2, past + rows, 8, generator=gen).to(dtype))
        caches.append(cache)
    for a, b in zip(caches[0].layers, caches[1].layers):   # the same contents in both
        b.keys.copy_(a.keys)
        b.values.copy_(a.values)
    if not cache_module.compact_compiled(caches[0], past, keep):
        pytest.skip("no compiled row ops here")
    for layer in caches[0].layers:
        layer.crop(len(keep) - rows)
    monkeypatch.setattr(cache_module, "compact_compiled", lambda *args: False)   # the per-layer tensor ops
    compact(caches[1], past, keep)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_step_buffers_are_the_layers_buffers_with_room(monkeypatch):
    """A compiled forward's buffers (cache.step_buffers): each layer's own, read without a call per layer while
    they have room, grown (keeping the rows) when a step passes their capacity; None for other layers."""
    monkeypatch.setattr(cache_module, "MIN_CAPACITY", 4)
    cache = new_cache(MODELS["qwen3"])
    like = torch.zeros(1, 2, 0, 8)
    first = cache_module.step_buffers(cache.layers, 3, like)
    assert first is not None and all(k.shape[-2] == 4 for k in first[0] + first[1])
    for layer in cache.layers:
        layer._keys[..., :3, :] = 1.0
        layer.advance(3)
    again = cache_module.step_buffers(cache.layers, 4, like)
    assert all(a is b for a, b in zip(again[0] + again[1], first[0] + first[1]))   # room: the same buffers
    grown = cache_module.step_buffers(cache.layers, 5, like)
    assert all(k.shape[-2] == 8 and bool((k[..., :3, :] == 1).all()) for k in grown[0])
    assert all(layer._keys is k for layer, k in zip(cache.layers, grown[0]))
    assert cache_module.step_buffers([object()], 1, like) is None


def test_kept_rows_are_the_accepted_rows():
    from treegen.engine.generate import kept_rows
    feats = torch.arange(24.0).view(6, 4)
    for rows in ([0], [0, 1], [0, 1, 2, 3], [0, 2], [0, 1, 4], [0, 3, 5]):
        assert torch.equal(kept_rows(feats, rows), feats[rows])
