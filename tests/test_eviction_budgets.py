"""Per-head and per-layer budgets and the scoring rules of eventkv.eviction.scorers, by hand."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from eventkv.errors import OptionError
from eventkv.eviction import LayerCapture, Policy, SnapKV, keep_mask, kept_count, policy_from_spec
from eventkv.eviction.budgets import AdaKV, ChunkKV, Composed, CriticalKV, DuoAttention, PerLayer, PerLayerRatio
from eventkv.eviction.policies import EventTopK, Knorm, UserPolicy, last_queries, top_rows, window_attention
from eventkv.eviction.scorers import KeyDiff, ObservedAttention, QFilter

KV, QH, D = 2, 4, 8


def capture(rows=12, window=None, seed=0, layer=0, n_layers=2):
    """Random keys and queries; ``window`` None: every row's query (positions 0, 2, 4, ...)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(rows) * 2
    w = rows if window is None else window
    return LayerCapture(
        layer=layer,
        keys=torch.randn(KV, rows, D, generator=g),
        values=torch.randn(KV, rows, D, generator=g),
        positions=pos,
        queries=torch.randn(QH, w, D, generator=g),
        query_positions=pos[-w:],
        n_layers=n_layers,
    )


def scored(s):
    """A policy whose scores are the fixed ``s [kv_heads, rows]``."""
    return UserPolicy(fn=lambda c: torch.as_tensor(s, dtype=torch.float64))


def kept(mask):
    return [np.flatnonzero(m.numpy()).tolist() for m in mask]


def test_top_rows_keeps_a_count_per_head_ties_to_the_later_position():
    s = torch.tensor([[3.0, 1.0, 1.0, 0.0], [0.0, 2.0, 5.0, 2.0]], dtype=torch.float64)
    pos = torch.tensor([0, 1, 2, 3])
    assert kept(top_rows(s, pos, 2)) == [[0, 2], [2, 3]]  # head 0: 1.0 at rows 1 and 2, the later kept
    assert kept(top_rows(s, pos, torch.tensor([1, 3]))) == [[0], [1, 2, 3]]
    assert kept(top_rows(s, pos, torch.tensor([0, 4]))) == [[], [0, 1, 2, 3]]
    # positions, not row order, break ties
    assert kept(top_rows(s, torch.tensor([0, 2, 1, 3]), 2)) == [[0, 1], [2, 3]]


def test_a_policy_budget_is_kept_count_in_every_head_by_default():
    c = capture()
    for ratio in (0.0, 0.3, 0.75):
        assert Knorm().budget(c, ratio).tolist() == [kept_count(12, ratio)] * KV
        assert keep_mask(Knorm(), c, ratio).sum(dim=1).tolist() == [kept_count(12, ratio)] * KV


def test_keydiff_keeps_the_keys_least_like_the_mean_unit_key():
    keys = torch.tensor([[[1.0, 0.0], [1.0, 0.1], [0.9, 0.0], [0.0, 2.0]]])  # one head, 4 rows
    c = LayerCapture(layer=0, keys=keys, values=keys.clone(), positions=torch.arange(4))
    unit = keys[0] / keys[0].norm(dim=-1, keepdim=True)
    anchor = unit.mean(dim=0)
    by_hand = [-float(k @ anchor / (k.norm() * anchor.norm())) for k in keys[0]]
    assert torch.allclose(KeyDiff().scores(c)[0], torch.tensor(by_hand, dtype=torch.float64), atol=1e-12)
    # rows 0 and 2 point the same way (cosine ties): the later one is kept
    assert kept(keep_mask(KeyDiff(), c, 0.5)) == [[2, 3]]
    assert kept(keep_mask(KeyDiff(), c, 0.75)) == [[3]]


def test_observed_attention_averages_every_query_over_those_that_see_the_row():
    c = capture(rows=6)
    s = ObservedAttention().scores(c)
    by_hand = np.zeros((KV, 6))
    for h in range(QH):
        for r in range(6):
            total, seen = 0.0, 0
            for w in range(6):
                if c.positions[r] > c.query_positions[w]:
                    continue
                logits = [
                    float(c.queries[h, w].double() @ c.keys[h // 2, j].double()) / math.sqrt(D)
                    if c.positions[j] <= c.query_positions[w]
                    else -np.inf
                    for j in range(6)
                ]
                e = np.exp(np.array(logits) - max(logits))
                total += e[r] / e.sum()
                seen += 1
            by_hand[h // 2, r] += total / seen / 2  # the GQA group's mean
    assert np.allclose(s.numpy(), by_hand, atol=1e-12)
    assert ObservedAttention().needs_all_queries and not Knorm().needs_all_queries
    with pytest.raises(OptionError, match="capture holds 4 of 6"):
        ObservedAttention().scores(capture(rows=6, window=4))
    assert last_queries(c, 4).queries.shape[1] == 4 and last_queries(c, 8) is c


def test_qfilter_projects_keys_on_the_direction_the_queries_share():
    g = torch.Generator().manual_seed(3)
    direction = torch.tensor([0.6, -0.8, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    q = 5 * direction + 0.1 * torch.randn(QH, 16, D, generator=g, dtype=torch.float64)  # queries along one line
    c = dataclasses.replace(capture(rows=10, window=16), queries=q.float())
    f = QFilter().filters(c)
    assert torch.allclose(f, direction.expand(KV, D), atol=0.01)  # signed: the queries project positively
    by_hand = torch.einsum("hrd,hd->hr", c.keys.double(), f)
    assert torch.allclose(QFilter().scores(c), by_hand)
    flipped = dataclasses.replace(c, queries=-c.queries)
    assert torch.allclose(QFilter().filters(flipped), -f)  # the sign follows the queries, not the SVD
    # the kept keys are those whose logit with the mean query is largest
    mean_q = q.reshape(KV, -1, D).mean(dim=1)
    logits = torch.einsum("hrd,hd->hr", c.keys.double(), mean_q)
    assert kept(keep_mask(QFilter(), c, 0.5)) == kept(top_rows(logits, c.positions, 5))


def test_adakv_shares_a_layer_budget_among_heads_with_a_safeguard():
    # head 0's scores are concentrated on two rows, head 1's spread evenly: head 1 gets most of the budget
    s = torch.tensor([[10.0, 9.0, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1], [5.0, 5.1, 5.2, 5.3, 5.4, 5.5, 5.6, 5.7]])
    c = LayerCapture(layer=0, keys=torch.zeros(2, 8, 4), values=torch.zeros(2, 8, 4), positions=torch.arange(8))
    n = kept_count(8, 0.5)  # 4 per head, 8 in the layer
    plain = AdaKV(inner=scored(s), alpha=0.0)
    assert kept(plain.mask(c, 0.5)) == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert plain.budget(c, 0.5).tolist() == [2, 6]
    # the safeguard: each head first keeps its best int(0.5 * 4) = 2 rows, the other 4 go by score
    safe = AdaKV(inner=scored(s), alpha=0.5)
    assert kept(safe.mask(c, 0.5)) == [[0, 1], [2, 3, 4, 5, 6, 7]]
    safe = AdaKV(inner=scored(s), alpha=1.0)  # every head its own kept_count: plain per-head top-k
    assert kept(safe.mask(c, 0.5)) == kept(keep_mask(scored(s), c, 0.5))
    for ratio in (0.1, 0.3, 0.6, 0.9):
        for alpha in (0.0, 0.2, 1.0):
            m = keep_mask(AdaKV(inner=scored(s), alpha=alpha), c, ratio)
            n = kept_count(8, ratio)
            assert int(m.sum()) == 2 * n
            assert all(int(x) >= int(n * alpha) for x in m.sum(dim=1))
    with pytest.raises(OptionError, match="^alpha 1.5"):
        AdaKV(alpha=1.5)
    with pytest.raises(OptionError, match="^inner 3"):
        AdaKV(inner=3)


def test_a_ratio_per_layer_and_a_policy_per_layer():
    c0, c1 = capture(layer=0), capture(layer=1, seed=1)
    p = PerLayerRatio(inner=Knorm(), ratios=(0.25, 0.75))
    assert p.budget(c0, 0.5).tolist() == [kept_count(12, 0.25)] * KV
    assert kept(keep_mask(p, c1, 0.0)) == kept(keep_mask(Knorm(), c1, 0.75))
    assert kept(keep_mask(PerLayerRatio(inner=Knorm()), c1, 0.5)) == kept(keep_mask(Knorm(), c1, 0.5))
    with pytest.raises(OptionError, match=r"give one entry per layer: layer 2 has none \(give 4, one per layer"):
        keep_mask(p, dataclasses.replace(c1, layer=2, n_layers=4), 0.5)
    # checked up front for a model of n layers: exactly one entry per layer
    with pytest.raises(OptionError, match="^ratios 2: per-layer-ratio takes one entry per layer and the model has 30"):
        p.check_layers(30)
    with pytest.raises(OptionError, match="^policies 2: per-layer takes one entry per layer and the model has 3 "):
        AdaKV(inner=PerLayer(policies=(Knorm(), Knorm()))).check_layers(3)
    p.check_layers(2)
    PerLayerRatio(inner=Knorm()).check_layers(7)  # no list: the audit's ratio in every layer
    with pytest.raises(OptionError, match="^pattern 1: duo takes one entry per layer"):
        DuoAttention(pattern=((1.0, 0.0),)).check_layers(2)
    with pytest.raises(OptionError, match="^ratio 1.0"):
        PerLayerRatio(ratios=(0.5, 1.0))
    both = PerLayer(policies=(Knorm(), SnapKV(window=4, kernel=1)))
    assert kept(keep_mask(both, c0, 0.5)) == kept(keep_mask(Knorm(), c0, 0.5))
    last = last_queries(c1, 4)
    assert kept(keep_mask(both, last, 0.5)) == kept(keep_mask(SnapKV(window=4, kernel=1), last, 0.5))
    assert PerLayer(policies=(Knorm(), ObservedAttention())).needs_all_queries
    with pytest.raises(OptionError, match="^policies"):
        PerLayer(policies=())


def test_specs_nest_policies_and_list_values():
    p = policy_from_spec("adakv(inner=snapkv(window=8,kernel=5,pooling=avg),alpha=0.3)")
    assert p == AdaKV(inner=SnapKV(window=8, kernel=5, pooling="avg"), alpha=0.3)
    assert policy_from_spec("per-layer-ratio(inner=knorm,ratios=0.25/0.75)") == PerLayerRatio(
        inner=Knorm(), ratios=(0.25, 0.75)
    )
    assert policy_from_spec("per-layer(policies=knorm/snapkv(window=8))") == PerLayer(
        policies=(Knorm(), SnapKV(window=8))
    )
    assert isinstance(policy_from_spec("adakv"), Policy)
    # a list inside a list item: the item's own parentheses hold its "/"
    assert policy_from_spec("composed(policies=per-layer-ratio(inner=knorm,ratios=0.25/0.75)/snapkv)") == Composed(
        policies=(PerLayerRatio(inner=Knorm(), ratios=(0.25, 0.75)), SnapKV())
    )
    for bad, says in [
        ("adakv(inner=snapkv(window=8)", "write settings as name(key=value"),
        ("adakv(inner=nope)", "policy 'adakv(inner=nope)': its inner: policy 'nope': use one of"),
        ("composed(policies=)", "policy 'composed(policies=)': its policies: policy '': use one of"),
        ("per-layer-ratio(ratios=0.25/x)", "ratios must be a number, not 'x'"),
        ("adakv(alpha=2)", "alpha 2"),
    ]:
        with pytest.raises(OptionError, match=re.escape(says)):
            policy_from_spec(bad)


def test_pyramid_budgets_shrink_from_the_bottom_layer_to_the_top():
    from eventkv.eviction.budgets import PyramidKV

    p = PyramidKV(window=8, kernel=5, pooling="avg", beta=20)
    c = capture(rows=61, window=8)
    # C = 8 + 61 * 0.7 = 50.7; top (42.7) / 20 = 2.135, bottom 85.4 - 2.135 clipped to 53, top then 32.4
    assert [p.budget(dataclasses.replace(c, layer=n), 0.3).tolist() for n in (0, 1)] == [[53, 53], [32, 32]]
    # at 0.75 the top (0.7625) falls below the window: round(15.25) = 15 in every layer
    assert [p.budget(dataclasses.replace(c, layer=n), 0.75).tolist() for n in (0, 1)] == [[15, 15], [15, 15]]
    four = [int(p.budget(dataclasses.replace(c, layer=n, n_layers=4), 0.3)[0]) for n in range(4)]
    assert four == [53, 46, 39, 32]  # an even step, layer by layer
    assert sum(keep_mask(p, dataclasses.replace(c, layer=1), 0.3)[0]) == 32
    with pytest.raises(OptionError, match="capture the model's layer count"):
        p.budget(dataclasses.replace(c, n_layers=None), 0.3)
    with pytest.raises(OptionError, match="^beta 0.5"):
        PyramidKV(beta=0.5)


def test_chunks_are_kept_whole_by_their_mean_summed_score():
    from eventkv.eviction.budgets import ChunkKV

    s = torch.tensor([[1.0, 1.0, 9.0, 0.0, 0.0, 5.0, 5.0], [1.0, 1.0, 0.0, 0.0, 3.0, 5.0, 0.0]])
    c = LayerCapture(layer=0, keys=torch.zeros(2, 7, 4), values=torch.zeros(2, 7, 4), positions=torch.arange(7))
    p = ChunkKV(inner=scored(s), chunk=2)
    # chunks [0,1] [2,3] [4,5] [6]: summed over heads 2,2 | 9,0 | 3,10 | 5: means 2, 4.5, 6.5, 5
    assert kept(keep_mask(p, c, 0.5)) == [[4, 5, 6]] * 2  # int(4 * 0.5) = 2 chunks: [4,5] and [6]
    assert kept(keep_mask(p, c, 0.3)) == [[4, 5, 6]] * 2  # int(4 * 0.7) = int(2.8): still 2 chunks
    assert kept(keep_mask(p, c, 0.2)) == [[2, 3, 4, 5, 6]] * 2  # int(4 * 0.8) = 3: [2,3] joins
    assert kept(keep_mask(ChunkKV(inner=scored(s), chunk=8), c, 0.5)) == kept(keep_mask(scored(s), c, 0.5))


def test_composed_policies_compound_and_critical_kv_needs_the_output_projection():
    from eventkv.eviction.budgets import CriticalKV

    c = capture(rows=20)
    m = keep_mask(Composed(policies=(Knorm(), KeyDiff())), c, 0.5)
    assert m.sum(dim=1).tolist() == [kept_count(kept_count(20, 0.5), 0.5)] * KV  # 20 -> 10 -> 5
    first = keep_mask(Knorm(), c, 0.5)
    assert bool((m <= first).all())  # the second keeps only rows the first kept
    with pytest.raises(OptionError, match="capture it"):
        keep_mask(CriticalKV(inner=Knorm()), c, 0.5)
    spec = "composed(policies=snapkv(window=4)/knorm)"
    assert policy_from_spec(spec) == Composed(policies=(SnapKV(window=4), Knorm()))


def test_duo_attention_streams_the_heads_that_retrieve_least():

    c = capture(rows=40, window=8)
    # a pattern: head 1 retrieves, head 0 streams; half the heads stream
    duo = DuoAttention(sinks=2, recent=6, streaming=0.5, pattern=((0.1, 0.9), (0.9, 0.1)))
    m = keep_mask(duo, c, 0.5)
    assert kept(m)[1] == list(range(40)) and kept(m)[0] == [0, 1] + list(range(34, 40))
    m1 = keep_mask(duo, dataclasses.replace(c, layer=1), 0.5)
    assert kept(m1)[0] == list(range(40)) and kept(m1)[1] == [0, 1] + list(range(34, 40))
    # without streaming=: the fewest streaming heads that reach the ratio's total (2 * 20 = 40 rows)
    auto = DuoAttention(sinks=2, recent=6, pattern=((0.1, 0.9), (0.9, 0.1)))
    assert auto.budget(c, 0.3).tolist() == [8, 40]  # 2 * 28 = 56 rows: one streaming head (48) fits
    assert auto.budget(c, 0.5).tolist() == [8, 8]  # 40 rows: one (48) does not, both (16) do
    # 3 * 2 rows (kept_count(40, 0.9) is 3: 40 * (1 - 0.9) is just under 4): each head its sinks and 1 recent row
    assert kept(keep_mask(auto, c, 0.9)) == [[0, 1, 39]] * 2
    # calibrated on the window: the share of attention outside the sinks and the recent rows
    calibrated = DuoAttention(sinks=2, recent=6).scores(c)[:, 0]
    att = window_attention(c, "duo").mean(dim=1).reshape(KV, QH // KV, -1).mean(dim=1)
    outside = [r for r in range(40) if 2 <= r < 34]
    assert torch.allclose(calibrated, att[:, outside].sum(dim=1))
    stream = int(torch.argmin(calibrated))
    assert kept(keep_mask(DuoAttention(sinks=2, recent=6, streaming=0.5), c, 0.5))[stream] == [0, 1, *range(34, 40)]
    assert policy_from_spec("duo(sinks=2,recent=6,streaming=0.5)") == DuoAttention(sinks=2, recent=6, streaming=0.5)
    with pytest.raises(OptionError, match="give one score per KV head"):
        keep_mask(DuoAttention(pattern=((0.1,), (0.2,))), c, 0.5)
    with pytest.raises(OptionError, match="^streaming 2"):
        DuoAttention(streaming=2)


def test_think_prunes_the_key_channels_of_least_query_key_weight():
    from eventkv.eviction.scorers import ThinK

    c = capture(rows=10, window=6)
    t = ThinK(window=4)
    q = c.queries[:, -4:].double()
    by_hand = q.pow(2).mean(dim=1).reshape(KV, QH // KV, D).mean(dim=1) * c.keys.double().pow(2).mean(dim=1)
    assert torch.allclose(t.channel_scores(c), by_hand)
    ch = t.key_channels(c, 0.3)  # int(8 * 0.3) = 2 channels pruned per head
    assert ch.sum(dim=1).tolist() == [D - 2] * KV
    for h in range(KV):
        pruned = sorted(torch.nonzero(~ch[h]).flatten().tolist())
        assert pruned == sorted(torch.argsort(by_hand[h])[:2].tolist())
    assert bool(keep_mask(t, c, 0.3).all())  # every row kept
    both = Composed(policies=(Knorm(), t))
    assert torch.equal(keep_mask(both, c, 0.3), keep_mask(Knorm(), c, 0.3)) and torch.equal(
        both.key_channels(c, 0.3), ch
    )
    assert Knorm().key_channels(c, 0.3) is None and Composed(policies=(Knorm(),)).key_channels(c, 0.3) is None
    # a wrapper keeping rows by its inner's scores refuses ThinK (its scores rank no rows: the wrapper would keep
    # the latest rows by its tie rule); ThinK after a row policy keeps pruning its channels inside any wrapper
    for wrap in (
        lambda p: AdaKV(inner=p),
        lambda p: ChunkKV(inner=p, chunk=4),
        lambda p: CriticalKV(inner=p),
        lambda p: PerLayerRatio(inner=p),
        lambda p: EventTopK(inner=p),
        lambda p: AdaKV(inner=Composed(policies=(p, Knorm()))),
        lambda p: AdaKV(inner=PerLayer(policies=(Knorm(), p))),
    ):
        with pytest.raises(OptionError, match="ranks no rows .* composed\\(policies=snapkv/think\\)"):
            wrap(t)
    for wrapped in (AdaKV(inner=both), ChunkKV(inner=both, chunk=4), PerLayerRatio(inner=both)):
        assert torch.equal(wrapped.key_channels(c, 0.3), ch)
    per_layer = PerLayer(policies=(t, Knorm()))  # a layer of ThinK: every row kept, its channels pruned
    assert torch.equal(per_layer.key_channels(c, 0.3), ch) and bool(keep_mask(per_layer, c, 0.3).all())
    assert per_layer.key_channels(dataclasses.replace(c, layer=1), 0.3) is None
    assert "key channels" in t.ratio_use() and "key channels" in per_layer.ratio_use()
    assert "knorm: the fraction of each KV head's rows evicted" in per_layer.ratio_use()  # the evicting layers too
    assert "compound" not in both.ratio_use() and "think: the fraction of key channels" in both.ratio_use()
    assert "row evictions compound" in Composed(policies=(Knorm(), SnapKV(window=4))).ratio_use()
    assert PerLayer(policies=(Knorm(), SnapKV())).ratio_use() == "" and Knorm().ratio_use() == ""


def test_simlayerkv_keeps_first_and_latest_rows_of_lazy_layers_only():
    from eventkv.eviction.budgets import SimLayerKV

    g = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, dim = 30, 4, 2, 8
    keys = torch.randn(kv_heads, rows, dim, generator=g)
    queries = torch.randn(heads, 1, dim, generator=g)
    c = LayerCapture(
        0, keys, torch.randn(kv_heads, rows, dim, generator=g), torch.arange(rows), queries, torch.tensor([rows - 1])
    )
    # the share by hand: the last query's softmax over every row, averaged over the heads, on rows 0-3 and 21-28
    k = keys.double().repeat_interleave(heads // kv_heads, dim=0)  # [heads, rows, dim]
    att = torch.softmax((queries.double() @ k.transpose(1, 2))[:, 0] / dim**0.5, dim=-1).mean(dim=0)
    share = float(att[:4].sum() + att[rows - 1 - 8 : rows - 1].sum())
    below, above = SimLayerKV(threshold=share - 1e-9, recent=8), SimLayerKV(threshold=share + 1e-9, recent=8)
    assert below.lazy(c) and not above.lazy(c)
    kept = [sorted(torch.nonzero(h).flatten().tolist()) for h in keep_mask(below, c, 0.5)]
    assert kept == [[0, 1, 2, 3, *range(rows - 7, rows)]] * kv_heads  # 4 initial + recent - last = 7 latest
    assert keep_mask(below, c, 0.75).equal(keep_mask(below, c, 0.5))  # the ratio is not read ...
    assert keep_mask(below, c, 0.0).all() and keep_mask(above, c, 0.5).all()  # ... but 0 keeps all; not lazy: all
    assert keep_mask(SimLayerKV(threshold=1.0, recent=8), c, 0.5).all()  # threshold 1: off, as kvpress
    assert keep_mask(SimLayerKV(threshold=0.0, recent=25), c, 0.5).all()  # 30 rows <= 4 + 25 + 1: too short
    bad_settings = (
        ({"threshold": 1.5}, "threshold 1.5"),
        ({"recent": 0}, "recent 0"),
        ({"last": 0}, "last 0"),
        ({"recent": 2, "last": 5}, "recent 2: keep more recent rows than last queries"),
    )
    for bad, match in bad_settings:
        with pytest.raises(OptionError, match=match):
            SimLayerKV(**bad)


def test_finch_weighs_each_window_query_by_the_rows_before_it_and_keeps_per_chunk():
    from eventkv.eviction.scorers import Finch

    c = capture(rows=24, window=6)  # positions 0, 2, ..., 46; the last 6 captured queries
    f = Finch(window=4)
    # by hand: the last 4 queries' softmax attention (causal by position), each times the rows before it,
    # averaged over the window and each GQA group; the window's 4 rows above every other
    q, k = c.queries[:, -4:].double(), c.keys.double().repeat_interleave(QH // KV, dim=0)
    logits = q @ k.transpose(1, 2) / D**0.5  # [QH, 4, 24]
    qrow = torch.arange(20, 24)  # the queries' rows: positions 40..46 are rows 20..23
    logits = logits.masked_fill(torch.arange(24)[None, None, :] > qrow[None, :, None], float("-inf"))
    att = torch.softmax(logits, dim=-1)[:, :, :20] * qrow.double()[None, :, None]  # 20, 21, 22, 23 rows before
    by_hand = att.mean(dim=1).reshape(KV, QH // KV, 20).mean(dim=1)
    s = f.scores(c)
    assert torch.allclose(s[:, :20], by_hand) and bool(torch.isinf(s[:, 20:]).all())
    assert torch.equal(keep_mask(f, c, 0.5), top_rows(s, c.positions, 12))
    # chunks of 10, 10 and 4 rows in position order: each keeps kept_count of its own (5, 5, 2 at 0.5)
    chunked = Finch(window=4, chunk=10)
    m = keep_mask(chunked, c, 0.5)
    for lo, hi, n in ((0, 10, 5), (10, 20, 5), (20, 24, 2)):
        assert m[:, lo:hi].sum(dim=1).tolist() == [n] * KV
        assert torch.equal(m[:, lo:hi], top_rows(s[:, lo:hi], c.positions[lo:hi], n))
    assert chunked.budget(c, 0.5).tolist() == [12] * KV and f.budget(c, 0.5).tolist() == [12] * KV
    assert kept(m)[0][-2:] == [22, 23]  # the last chunk keeps the latest 2 of the window's 4 equal rows
    with pytest.raises(OptionError, match=r"chunk 8: a chunk must hold more than window / \(1 - ratio\) = 8"):
        keep_mask(Finch(window=4, chunk=8), c, 0.5)
    with pytest.raises(OptionError, match="window 0"):
        Finch(window=0)
    with pytest.raises(OptionError, match="chunk 0"):
        Finch(chunk=0)
    with pytest.raises(OptionError, match="the capture holds 6 queries"):
        Finch(window=8).scores(c)
    assert policy_from_spec("finch(window=4,chunk=10)") == chunked
    assert policy_from_spec("finch(chunk=none)") == Finch()
